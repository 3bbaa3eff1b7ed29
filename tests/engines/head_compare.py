"""One comparison shared by the head's tests (test_head.py) and its Triton checks (head_kernel_checks.py, a
script of its own): the fused head against the eager chunks."""

from __future__ import annotations

import torch

from relayrl.engines.training.head import chunked_token_logprobs


def fused_matches_eager(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, up: torch.Tensor, *, chunk: int,
                        temperature: float, grad_by: str, softcap: float | None = None) -> None:
    """``chunked_token_logprobs`` with ``fused`` off and on give the same log-probs, entropy and gradients of
    ``(logp * up).sum()`` for ``h`` and ``w`` (leaves that require grad), and the same ``sum_v p_v^2`` in a
    no-grad pass (``with_sum_sq``: compiled beside the fused stats, eager beside the Triton kernels); ``softcap``:
    the logits capped as Gemma's are."""
    with torch.no_grad():
        sq = [chunked_token_logprobs(h, w, t, temperature=temperature, chunk=chunk, with_sum_sq=True,
                                     fused=fused, softcap=softcap)[2] for fused in (False, True)]
    torch.testing.assert_close(sq[0], sq[1], atol=1e-5, rtol=1e-5)
    out = []
    for fused in (False, True):
        lp, ent = chunked_token_logprobs(h, w, t, temperature=temperature, chunk=chunk, with_entropy=True,
                                         fused=fused, grad_by=grad_by, softcap=softcap)
        (lp * up).sum().backward()
        out.append((lp.detach(), ent, h.grad.clone(), w.grad.clone()))
        h.grad = w.grad = None
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
