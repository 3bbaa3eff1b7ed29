"""Whether a model keeps packed sequences apart: the trainer's packed rows rely on it.

The trainer packs several sequences into one row (a GRPO group's prompt and responses, or whole sequences) and
keeps them apart with a 4-D attention mask (:mod:`relayrl.models.packing`). That is exact only when every layer
mixes tokens through attention under that mask. A layer that mixes them otherwise (a state-space or
linear-attention layer's recurrent state runs along the row; a position bias built from a 2-D mask) lets one
packed sequence change the next, and the trainer's log-probs would silently not be the model's.

:func:`packing_leak` measures it on the model itself: a short sequence's logits packed after another one, under
a block-diagonal causal mask with positions restarting, against the same sequence run alone (eager attention
for both, as :func:`relayrl.models.logits.check_head` does). The training engine runs it when it starts and
trains on padded rows instead when the two differ, saying so.
"""

from __future__ import annotations

import torch

from relayrl.models.logits import _configs, eager_eval

__all__ = ["packing_leak", "leak_reason", "unpacked_reason"]


@torch.no_grad()
def packing_leak(model: torch.nn.Module, *, tokens: int = 6) -> tuple[float, float]:
    """(the largest logit difference between a sequence packed after another and the same sequence alone, the
    largest logit): both run with eager attention in eval mode, the model's mode and attention restored after.
    The sequences are ``tokens`` long (at most the model's sliding window, which a 4-D mask would not apply)."""
    embed = model.get_input_embeddings()
    vocab, device = int(embed.weight.shape[0]), embed.weight.device
    window = min((getattr(c, "sliding_window", None) or tokens) for c in _configs(model))
    n = max(2, min(tokens, window))
    first = (torch.arange(n, device=device) * 5 + 3) % vocab
    second = (torch.arange(n, device=device) * 11 + 7) % vocab
    ids = torch.cat([first, second])[None]
    doc = torch.arange(2 * n, device=device) // n
    causal = torch.arange(2 * n, device=device)[:, None] >= torch.arange(2 * n, device=device)[None]
    allowed = causal & (doc[:, None] == doc[None])
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(1, 1, 2 * n, 2 * n, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    positions = torch.cat([torch.arange(n, device=device)] * 2)[None]
    with eager_eval(model):
        packed = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[0, n:]
        alone = model(input_ids=second[None], use_cache=False).logits[0]
    return float((packed.float() - alone.float()).abs().max()), float(alone.float().abs().max())


def leak_reason(model: torch.nn.Module) -> str | None:
    """Why packed rows would not give ``model``'s own log-probs (:func:`packing_leak` finds a sequence packed after
    another computing other logits than alone, or cannot run the model on a packed row), or None when they would:
    within float32's rounding (1e-5 of the largest logit; every attention model of the tests is within 3e-7 of
    it, LFM2's short convolutions leak 2e-5) or, for bf16 and float16 weights, 1% of it (a small leak then goes
    unseen: the layer types catch the known ones first)."""
    try:
        diff, spread = packing_leak(model)
    except Exception as e:  # (a model that takes no 4-D mask cannot be packed either)
        return f"the model could not be run on a packed row with a 4-D attention mask ({type(e).__name__}: {e})"
    half = next(model.parameters()).dtype != torch.float32  # (float32: attention models within 3e-7 of it)
    if diff > 1e-5 * max(1.0, spread) + (1e-2 * spread if half else 0.0):
        return (f"a sequence packed after another gets logits up to {diff:.3g} away from its own (largest logit "
                f"{spread:.3g}): the model mixes packed sequences outside attention (a state-space or "
                f"linear-attention layer, or a position bias built from a 2-D mask)")
    return None


def unpacked_reason(model: torch.nn.Module, takes_mask: bool, layer_types: set[str], window: int | None) -> str | None:
    """Why the trainer cannot pack ``model``'s rows, or None: an attention implementation that takes no 4-D mask
    (``takes_mask`` False), linear-attention layers, layer types whose masks the packed layout does not build,
    sliding layers without a window; and last :func:`leak_reason`, the check on the model itself."""
    impl = getattr(model.config, "_attn_implementation", None)
    if not takes_mask:
        return (f"attn_implementation={impl!r} takes neither a dense 4-D mask nor a BlockMask (load the model with "
                f"attn_implementation='sdpa' or 'flex_attention')")
    if "linear_attention" in layer_types:
        return ("its linear-attention layers (Qwen3.5's and Qwen3-Next's Gated DeltaNet) carry a recurrent state "
                "along a row, which would run from one packed sequence into the next")
    if not layer_types <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(layer_types)} need masks the packed layout does not build"
    if "sliding_attention" in layer_types and not window:
        return "the model has sliding-attention layers but no config.sliding_window"
    return leak_reason(model)
