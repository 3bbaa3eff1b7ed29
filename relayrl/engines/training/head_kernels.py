"""The chunked head's two float32 steps as Triton kernels (``engine.fused_head`` with ``head.FUSED = "triton"``).

Why: on an H100 (2026-11-27, the 0.5B shape's update, 24.6k response positions of a 152k vocabulary) the
compiled versions of these steps took 7.3 ms (log-sum-exp, target, entropy) and 12.5 ms (softmax gradient)
of an update, about 3x and 2.5x what reading their ``[positions, vocab]`` bf16 logits once (and writing the
gradient once) takes at the card's bandwidth. These kernels make one pass each:

- :func:`chunk_stats`: one program per position walks its row of logits a block at a time with an online
  softmax (a running max ``m``, ``s = sum exp(x - m)`` and ``t = sum exp(x - m) x``, both rescaled when ``m``
  grows), so the log-sum-exp ``m + log s`` and the entropy ``lse - t / s`` come out of the same read; the
  target's logit is one load.
- :func:`chunk_grad`: one program per (position, block of the vocabulary) writes
  ``grad * (onehot(target) - exp(x - lse)) / T`` in the logits' dtype, in place when asked (the stored-logits
  backward).

Same formulas as :func:`relayrl.engines.training.head._chunk_stats` and ``_chunk_grad`` (float32 inside,
``x = logits / T``). They run where Triton runs: CUDA, or Triton's interpreter on the CPU (``TRITON_INTERPRET=1``
set before triton is imported; the tests check them that way, in float32 and float16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chunk_stats", "chunk_grad"]

BLOCK_V = 4096  # vocabulary entries a program reads per iteration (stats) or in all (gradient)


@triton.jit
def _stats_kernel(X, TGT, LSE, LOGP, ENT, stride, V, inv_t, BLOCK: tl.constexpr, WITH_ENT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * stride
    cols = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    t = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        c = start + cols
        inside = c < V
        x = tl.load(base + c, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(x, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(x - m_new)  # 0 outside the row (x = -inf)
        s = s * alpha + tl.sum(p, 0)
        if WITH_ENT:
            t = t * alpha + tl.sum(p * tl.where(inside, x, 0.0), 0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(TGT + row)
    x_t = tl.load(base + target).to(tl.float32) * inv_t
    tl.store(LSE + row, lse)
    tl.store(LOGP + row, x_t - lse)
    if WITH_ENT:
        tl.store(ENT + row, lse - t / s)


@triton.jit
def _grad_kernel(X, OUT, LSE, G, TGT, stride_x, stride_o, V, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = c < V
    x = tl.load(X + row * stride_x + c, mask=inside, other=0.0).to(tl.float32) * inv_t
    lse = tl.load(LSE + row)
    g = tl.load(G + row).to(tl.float32)
    target = tl.load(TGT + row)
    onehot = tl.where(c == target, 1.0, 0.0)
    d = (onehot - tl.exp(x - lse)) * (g * inv_t)
    tl.store(OUT + row * stride_o + c, d.to(OUT.dtype.element_ty), mask=inside)


def _rows(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [positions, vocab] with contiguous rows, got shape {tuple(logits.shape)} "
                         f"and strides {logits.stride()}")


def chunk_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """``logits [c, V]`` -> float32 (log-sum-exp, log-prob of the target, entropy or empty) of
    ``softmax(logits / temperature)``, each ``[c]``: one read of the logits."""
    _rows(logits)
    n, vocab = logits.shape
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    logp = torch.empty_like(lse)
    ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
    if n:
        _stats_kernel[(n,)](logits, targets.contiguous(), lse, logp, ent if with_entropy else lse, logits.stride(0),
                            vocab, 1.0 / temperature, BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)),
                            WITH_ENT=bool(with_entropy), num_warps=8)
    return lse, logp, ent


def chunk_grad(logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor,
               temperature: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``grad [c] x d logp[target] / d logits`` for ``logits [c, V]`` in the logits' dtype, written to ``out``
    (which may be ``logits`` itself) or a new tensor. A target outside ``[0, V)`` (a vocabulary slice that does
    not hold it) contributes only the softmax term."""
    _rows(logits)
    n, vocab = logits.shape
    if out is None:
        out = torch.empty_like(logits)
    _rows(out)
    if n:
        block = min(BLOCK_V, triton.next_power_of_2(vocab))
        _grad_kernel[(n, triton.cdiv(vocab, block))](logits, out, lse.contiguous(), grad.contiguous(),
                                                     targets.contiguous(), logits.stride(0), out.stride(0), vocab,
                                                     1.0 / temperature, BLOCK=block, num_warps=8)
    return out
