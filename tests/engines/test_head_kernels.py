"""The chunked head's Triton kernels (relayrl.engines.training.head_kernels), checked on the CPU under Triton's
interpreter against the eager steps they replace (head_kernel_checks.py, in a process of its own); on CUDA,
``benchmarks/gpu.py``'s ``tritonhead`` variant times them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relayrl.engines.training import head

CHECKS = Path(__file__).with_name("head_kernel_checks.py")


@pytest.mark.slow  # (a process of its own and the interpreter: about 10 s; the full `make test` runs it)
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_kernels_give_the_eager_steps_numbers_in_every_backward_order():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(CHECKS)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert res.stdout == "kernels: ok\nhead: ok\n"


def test_an_unknown_fusion_is_refused(monkeypatch):
    monkeypatch.setattr(head, "FUSED", "cuda")
    with pytest.raises(ValueError, match="head.FUSED='cuda' must be 'compile' or 'triton'"):
        head.chunked_token_logprobs(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2), chunk=1, fused=True)
