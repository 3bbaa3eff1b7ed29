"""Fixtures of the serving tests: a ``relayrl serve`` subprocess on a free loopback port (killed after); the
in-process tests run torch on one thread (the machine is shared)."""

from __future__ import annotations

import pytest
import torch

from serve_proc import start_server


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    s = start_server(tiny_dir, tmp_path_factory.mktemp("serve") / "serve.log", "--name", "tiny")
    yield s
    s.stop()
