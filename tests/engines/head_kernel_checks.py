"""Checks of the chunked head's Triton kernels under Triton's interpreter, run by
``tests/engines/test_head_kernels.py`` in a process of their own (``TRITON_INTERPRET=1`` must be set before
triton is first imported). Each check raises on a mismatch; the script prints one line per check."""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from relayrl.engines.training import head, head_kernels  # noqa: E402
from relayrl.engines.training.head import _chunk_grad, _chunk_stats  # noqa: E402

from head_compare import fused_matches_eager  # noqa: E402  (beside this script)


def kernels_match_the_eager_steps() -> None:
    """Rows of a vocabulary that is not a multiple of the block (three blocks of 64, the last partial), targets
    at both ends, a temperature; float32 and float16 (no bfloat16 in the interpreter). The gradient also for a
    vocabulary slice that holds only some targets, and written in place."""
    head_kernels.BLOCK_V = 64
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(0)
        n, vocab = 6, 150
        logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
        targets = torch.tensor([0, 149, 63, 64, 100, 5])
        grad = torch.randn(n, generator=g)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
        for temperature in (1.0, 0.7):
            for with_entropy in (True, False):
                want = _chunk_stats(logits, targets, temperature, with_entropy)
                got = head_kernels.chunk_stats(logits, targets, temperature, with_entropy)
                for a, b in zip(got, want):
                    assert a.dtype == torch.float32 and a.shape == b.shape, (a.dtype, a.shape, b.shape)
                    torch.testing.assert_close(a, b, **tol)
            lse = want[0]
            torch.testing.assert_close(head_kernels.chunk_grad(logits, lse, grad, targets, temperature).float(),
                                       _chunk_grad(logits, lse, grad, targets, temperature).float(), **tol)
            part = logits[:, 40:110].contiguous()  # a slice of the vocabulary: targets 63, 64 and 100 inside
            local = targets - 40
            want_part = _chunk_grad(part, lse, grad, local, temperature)
            head_kernels.chunk_grad(part, lse, grad, local, temperature, out=part)
            torch.testing.assert_close(part.float(), want_part.float(), **tol)
    print("kernels: ok")


def the_head_gives_the_compiled_heads_numbers() -> None:
    """chunked_token_logprobs with head.FUSED="triton": log-probs, entropy and both gradients as the eager
    chunks give them, in each backward order."""
    head_kernels.BLOCK_V = 32
    g = torch.Generator().manual_seed(1)
    h = torch.randn(23, 16, generator=g, requires_grad=True)
    w = torch.randn(90, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 90, (23,), generator=g)
    up = torch.randn(23, generator=g)
    head.FUSED = "triton"
    for order in ("positions", "vocab", "stored"):
        fused_matches_eager(h, w, t, up, chunk=8, temperature=0.7, grad_by=order)
    print("head: ok")


if __name__ == "__main__":
    kernels_match_the_eager_steps()
    the_head_gives_the_compiled_heads_numbers()
