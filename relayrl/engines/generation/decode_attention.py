"""The decode step's attention over the KV cache as one Triton kernel (``StaticDecoder(attention="triton")``).

Why: in the compiled decode step on an H100 (2026-11-26, batch 256, context 384) the two batched matrix products
of :func:`relayrl.engines.generation.attend.attend` took 0.72 ms of a 2.6 ms step, reading about 67% of the
bandwidth their cache reads need, and they read the whole bucket (512 positions at context 384), not each row's
length. This kernel is FlashDecoding's loop without the split: one program per (row, key/value head) holds the
row's query heads of that group (``G = Hq / KV``, padded to 16 for the tensor cores), walks the row's own
positions ``0..pos`` in blocks of keys, keeps a running max, sum and output (the online softmax), and writes
the group's output once. Keys and values are read once, only as far as each row's position, and the scores
never leave the chip.

Numerics: scores and the softmax in float32 (the matmul path rounds its scores to the cache's dtype first);
probabilities meet the values in the cache's dtype, as in the matmul path.

It runs where Triton runs: CUDA, or Triton's interpreter on the CPU (``TRITON_INTERPRET=1`` set before this
module is imported; that is how the tests check it, in float16 and float32, since the interpreter has no
bfloat16). The op is a ``torch.library.triton_op``, so ``torch.compile`` traces it and CUDA graphs record it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

__all__ = ["decode_attention"]

BLOCK_N = 64  # keys per iteration


@triton.jit
def _decode_attention_kernel(Q, K, V, POS, O, scale,
                             sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h,
                             G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                             BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    n = tl.arange(0, BLOCK)
    gm = g < G
    dm = d < D
    heads = kvh * G + g
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    length = tl.load(POS + b) + 1  # the row attends its positions 0..pos
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    k_row = K + b * sk_b + kvh * sk_h
    v_row = V + b * sv_b + kvh * sv_h
    for start in range(0, length, BLOCK):
        cols = start + n
        cm = cols < length
        k = tl.load(k_row + cols[:, None] * sk_n + d[None, :], mask=cm[:, None] & dm[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(cm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_row + cols[:, None] * sv_n + d[None, :], mask=cm[:, None] & dm[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + b * so_b + heads[:, None] * so_h + d[None, :], out.to(O.dtype.element_ty),
             mask=gm[:, None] & dm[None, :])


@triton_op("relayrl::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """``q`` [B, H, 1, D] (one new token a row) over the cache ``k``, ``v`` [B, KV, >= pos + 1, D] (a slice
    of the cache buffers; the last dimension contiguous), row ``b`` attending its positions ``0..pos[b]``
    -> [B, H, D]; what :func:`relayrl.engines.generation.attend.attend` computes with ``valid = arange <= pos``."""
    B, H, _, D = q.shape
    KV = k.shape[1]
    G = H // KV
    out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    wrap_triton(_decode_attention_kernel)[(B, KV)](
        q, k, v, pos, out, scaling,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1),
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, D_PAD=max(16, triton.next_power_of_2(D)), BLOCK=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")  # (float32: no TF32 rounding of the products)
    return out
