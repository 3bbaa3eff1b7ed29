"""The decode step's attention over the static KV cache, three ways (``StaticDecoder(attention=...)``): two
batched matrix products and a softmax (:func:`attend`, the default), one FlexAttention call
(:func:`attend_flex`), or one Triton kernel (:func:`attend_triton`, :mod:`.decode_attention`). Each takes one
query position per row and gives ``[B, H, D]``."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["ATTENTION", "attend", "attend_flex", "attend_triton", "load_triton", "triton_reason"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [B, H, 1, D] over the cache k, v [B, KV, L, D] (the query heads of a key/value head grouped, no
    repetition of keys and values), ``valid`` [B, L] -> [B, H, D]."""
    B, H, _, D = q.shape
    KV = k.shape[1]
    qg = q.reshape(B, KV, H // KV, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scaling  # [B, KV, g, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(B, H, D)


def attend_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scaling: float) -> torch.Tensor:
    """What :func:`attend` computes, as one FlexAttention call: each row's keys past its position ``pos`` [B]
    masked in the score; compiled (``compile``), one kernel reads the cache once (FlexAttention's decode kernel)
    where :func:`attend` runs two matrix products and a softmax between them. -> [B, H, D]."""
    from torch.nn.attention.flex_attention import flex_attention

    def past_position(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= pos[b], score, -float("inf"))

    o = flex_attention(q, k, v, score_mod=past_position, scale=scaling, enable_gqa=True)
    return o.reshape(q.shape[0], q.shape[1], q.shape[-1])


_decode_attention: Callable | None = None  # relayrl.engines.generation.decode_attention's op, once loaded


def load_triton() -> None:
    """Import the Triton kernel :func:`attend_triton` calls (a decoder that asks for it, once its device is
    checked with :func:`triton_reason`): no import runs inside a compiled step."""
    global _decode_attention
    from relayrl.engines.generation.decode_attention import decode_attention as _decode_attention


def attend_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """What :func:`attend` computes, as one Triton kernel that reads each row's positions ``0..pos`` once
    (:mod:`.decode_attention`, loaded by the decoder that asks for it: no import inside a compiled step;
    ``k``, ``v`` the cache's rows, any length above ``pos``). -> [B, H, D]."""
    return _decode_attention(q, k, v, pos, scaling)


ATTENTION = {"matmul": "two batched matrix products and a softmax (the default)",
             "flex": "one FlexAttention call (needs compile)",
             "triton": "one Triton kernel reading each row's own positions once (CUDA)"}


def triton_reason(device: torch.device) -> str | None:
    """Why the Triton attention cannot run on ``device`` (None when it can): it needs the triton package and
    CUDA, or Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, which the tests use)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"it runs on CUDA (the model is on {device.type}; on a CPU only under TRITON_INTERPRET=1)"
    return None
