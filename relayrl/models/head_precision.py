"""An output head computed in float32 (``model.head_fp32``): the logits' matrix product in float32 whatever the
compute dtype, in the trainer's passes and in the native generator's sampling.

Why (ScaleRL, Khatri et al. 2025: an FP32 head in trainer and generator raised RL's asymptotic reward;
MiniMax-M1, 2025: its train/inference probability mismatch traced to the head's precision): a logit of size ~10
rounded to bf16 moves by up to 2^-6 ~ 0.03, and that error reaches the log-prob whole. Trainer and generator
round differently (other kernels, other shapes), so their log-probs of the same token differ by about that.
In float32 the rounding of the product is ~2^-24 relative; what is left of the mismatch is the body's.

How: the hidden states and the head's weight are cast to float32 for the product (the weight's storage is
left as it is: tied embeddings, FSDP2 shards, LoRA untouched), under autocast disabled, which would otherwise
cast the operands back. On CUDA with both operands in bf16/fp16, :func:`fp32_logits` asks cuBLAS for float32
output instead (``torch.mm(..., out_dtype=torch.float32)``): the same float32 accumulation of the same bf16
values, without a float32 copy of the ``[V, d]`` weight (vLLM's ``head_dtype`` path does the same).

This module holds the product for an unchunked head and for the generator (:func:`run_head_in_fp32`); the
trainer's chunked head (:mod:`relayrl.engines.training.head`) takes ``head_dtype`` and casts a chunk of
hidden states at a time against a weight cast once per pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from relayrl.errors import SettingError

__all__ = ["fp32_logits", "run_head_in_fp32"]

_LOW = (torch.bfloat16, torch.float16)
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()
"""Whether this torch has ``mm``'s ``out_dtype`` overload (CUDA kernels since torch 2.8); without it, the
float32 product casts both operands."""


def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``hidden [..., d] @ weight [V, d]^T (+ bias [V])`` computed and returned in float32, ``[..., V]``, whatever
    the operands' dtypes and any autocast around the call."""
    with torch.autocast(hidden.device.type, enabled=False):
        if _MM_OUT_DTYPE and hidden.is_cuda and hidden.dtype == weight.dtype and weight.dtype in _LOW:
            flat = torch.mm(hidden.reshape(-1, hidden.shape[-1]), weight.t(), out_dtype=torch.float32)
            out = flat.reshape(*hidden.shape[:-1], weight.shape[0])
            return out if bias is None else out + bias.float()
        return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


def _fp32_forward(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    return fp32_logits(hidden, head.weight, head.bias)


def run_head_in_fp32(model: nn.Module) -> None:
    """Make ``model``'s output head (``get_output_embeddings()``, an ``nn.Linear``) return float32 logits from a
    float32 product (:func:`fp32_logits`): its ``forward`` is replaced on that one module, so everything that
    calls the head (the Hugging Face model's forward, the static decoder's step, in or out of a CUDA graph)
    gets float32 logits. The parameters keep their names, dtypes and storage (weights relayed into them, or
    shared with a trainer, are read at each call)."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise SettingError(f"model.head_fp32: the model's output head is a {type(head).__name__}, not an nn.Linear; "
                           "set model.head_fp32=false")
    head.forward = _fp32_forward.__get__(head)  # a bound method on this instance only
