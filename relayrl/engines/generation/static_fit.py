"""Which models the static decoder (:mod:`relayrl.engines.generation.static`) can run, read from their structure
and config: its decode step re-implements a Llama-shaped layer (two norms, q/k/v/o projections with optional
per-head q/k norms, rotary embeddings on every layer, an MLP), so anything else a layer computes is refused here
with the reason; :func:`~relayrl.engines.generation.static.step_mismatch` then checks one decode step against the
model's own forward for what no structure shows. :func:`fuse_reason`: whether a layer's projections can be fused
into two products for the compiled step."""

from __future__ import annotations

import inspect
import sys

from torch import nn

from relayrl.errors import SettingError

__all__ = ["StaticDecodeError", "unsupported_reason", "fuse_reason"]


class StaticDecodeError(SettingError):
    """``rollout.decode=static`` on a model the static decode step does not compute: the user's to fix (the
    message names the reason and ``rollout.decode=dynamic``), printed as one line, not a traceback."""

_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")



def unsupported_reason(model: nn.Module) -> str | None:
    """Why the static decoder cannot run ``model`` (None when it can)."""
    conf = model.config
    try:
        dec = model.get_decoder()
        layers = list(dec.layers)
    except AttributeError:
        return f"{type(model).__name__} has no decoder with .layers"
    if not all(hasattr(dec, a) for a in ("embed_tokens", "norm", "rotary_emb")):
        return f"{type(dec).__name__} lacks embed_tokens, norm or rotary_emb"
    for layer in layers:
        if not all(hasattr(layer, a) for a in _LAYER_PARTS) or not all(hasattr(layer.self_attn, a) for a in _ATTN_PARTS):
            return f"{type(layer).__name__} is not a Llama-style layer (q/k/v/o projections, two norms, an MLP)"
        extra = [n for n, _ in layer.named_children() if "norm" in n and n not in _LAYER_PARTS] + \
                [n for n, _ in layer.self_attn.named_children() if "norm" in n and n not in ("q_norm", "k_norm")]
        if extra:  # (GLM-4's post_self_attn_layernorm, Gemma 2's pre/post_feedforward_layernorm, ...)
            return f"{type(layer).__name__} has norms the step does not apply ({', '.join(extra)})"
    if 0 in (getattr(conf, "no_rope_layers", None) or []):
        return "some layers have no rotary position embedding (NoPE)"
    multipliers = [k for k in ("embedding_multiplier", "residual_multiplier") if getattr(conf, k, 1.0) not in (None, 1.0)]
    if multipliers:  # (Granite)
        streams = " and ".join(m.split("_")[0] for m in multipliers)
        return f"the model scales its {streams} stream ({', '.join(multipliers)})"
    from relayrl.models.load import attention_windows

    types, window, _ = attention_windows(conf)
    if "sliding_attention" in types and window < (getattr(conf, "max_position_embeddings", None) or window + 1):
        return "the model has sliding-window layers"
    rope = getattr(conf, "rope_parameters", None) or getattr(conf, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3"):
        return f"its rotary scaling ({rope.get('rope_type')}) depends on the sequence length"
    attn = layers[0].self_attn
    if not callable(getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)):
        return f"{type(attn).__module__} has no apply_rotary_pos_emb"
    if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
        return f"{type(model).__name__}.forward takes no logits_to_keep (prefill keeps the last positions' logits)"
    return None


def fuse_reason(layer: nn.Module) -> str | None:
    """Why ``layer``'s q/k/v and gate/up projections cannot run as one matrix product each (None when they can):
    each must be a plain ``nn.Linear``, the MLP ``down(act(gate(x)) * up(x))``, and biases all there or none."""
    attn, mlp = layer.self_attn, layer.mlp
    parts = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    mlp_parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(m) is nn.Linear for m in parts + mlp_parts) or not callable(getattr(mlp, "act_fn", None)):
        return f"{type(layer).__name__}'s projections are not plain nn.Linear modules with a gated MLP"
    for group in (parts, mlp_parts[:2]):
        if len({m.bias is None for m in group}) > 1:
            return f"{type(layer).__name__} has a bias on some of its projections only"
    return None
