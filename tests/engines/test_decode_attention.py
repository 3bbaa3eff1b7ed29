"""The decode step's attention as one Triton kernel (relayrl.engines.generation.decode_attention), checked on
the CPU under Triton's interpreter against the two matrix products it replaces (decode_attention_checks.py,
in a process of its own); on CUDA, ``tests/engines/test_cuda.py`` runs it compiled and graphed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.engines.generation.static import StaticDecoder

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
CHECKS = Path(__file__).with_name("decode_attention_checks.py")


def _checks(*args: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(CHECKS), *args], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    return res.stdout


@pytest.mark.slow  # (a process of its own and the interpreter: about 8 s; the full `make test` runs it)
def test_the_kernel_attends_each_rows_own_positions_as_the_matmul_path_does():
    assert _checks() == "kernel: ok\n"


@pytest.mark.slow  # (a process of its own and the interpreter: about 20 s; the full `make test` runs it)
def test_the_triton_decode_step_samples_the_matmul_steps_tokens(tiny_dir):
    assert _checks(str(tiny_dir)) == "kernel: ok\ndecode step: ok\n"


def test_the_triton_attention_is_refused_where_it_cannot_run(tiny_model, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention 'triton': it runs on CUDA .*cpu.*TRITON_INTERPRET=1"):
        StaticDecoder(tiny_model, 4, graphs=False, attention="triton")
