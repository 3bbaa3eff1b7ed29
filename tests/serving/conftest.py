"""Fixtures of the serving tests: a ``relayrl serve`` subprocess on a free loopback port (killed after); the
in-process tests run torch on one thread (the machine is shared)."""

from __future__ import annotations

import pytest

from serve_proc import start_server


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Every test here runs torch on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    s = start_server(tiny_dir, tmp_path_factory.mktemp("serve") / "serve.log", "--name", "tiny")
    yield s
    s.stop()
