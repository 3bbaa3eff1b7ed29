"""Parameter counts of a model the Llama-shaped formula does not describe: mixtures of experts and hybrids.

:meth:`relayrl.planner.workload.ModelShape.from_hf_config` counts a decoder's parameters from its config's
widths, which is exact for Llama-shaped layers (attention and one MLP). A mixture of experts holds many MLPs per
layer of its own width (``moe_intermediate_size``, not ``intermediate_size``), of which a token runs through
``num_experts_per_tok``; a hybrid's linear-attention layers have projections of their own. For those the
counts come from the model itself, built from the config on the meta device (no memory, no weights):

- ``params``: every parameter (what the weights, gradients, optimizer state, relay and FSDP traffic scale with);
- ``routed``: the experts' own tensors (what ``engine.expert_parallel`` keeps out of FSDP2's gathers);
- ``active``: the parameters a token runs through, the experts counted by their routed share (what the
  compute scales with);
- ``adapters``: LoRA's trained parameters, ``r x (in + out)`` over the linear layers its targets name (the
  default: :func:`relayrl.models.lora.resolve_targets`, which leaves out what peft reads as fused experts).
"""

from __future__ import annotations

__all__ = ["experts_of", "needs_count", "count"]


def experts_of(cfg) -> tuple[int, int] | None:
    """(experts per layer, experts a token is routed to) from the config's usual names, or None (no experts)."""
    total = next((getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                  if isinstance(getattr(cfg, k, None), int) and getattr(cfg, k) > 1), None)
    per_token = getattr(cfg, "num_experts_per_tok", None)
    return (total, per_token) if total and isinstance(per_token, int) and per_token >= 1 else None


def needs_count(cfg) -> bool:
    """Whether ``cfg`` describes layers the Llama-shaped formula miscounts: experts, or layer types other than
    full and sliding attention (Qwen3.5's linear attention)."""
    types = set(getattr(cfg, "layer_types", None) or ())
    return experts_of(cfg) is not None or not types <= {"full_attention", "sliding_attention"}


def count(cfg, lora=None) -> tuple[int, int, int, int]:
    """(params, active, adapters, routed) of the causal LM ``cfg`` describes, built on the meta device;
    ``adapters`` is 0 without ``lora`` (or with it disabled), ``routed`` the experts' own parameters (0 without
    experts)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    experts = experts_of(cfg)
    routed = sum(p.numel() for n, m in model.named_modules() if n.endswith(".experts") for p in m.parameters())
    active = params - routed + (routed * experts[1] // experts[0] if experts else routed)
    adapters = 0
    if lora is not None and getattr(lora, "enabled", False):
        from relayrl.models.lora import linear_sides, resolve_targets

        head = model.get_output_embeddings()
        targets = resolve_targets(model, lora)
        adapters = sum(lora.r * sum(linear_sides(m)) for n, m in model.named_modules()
                       if linear_sides(m) and m is not head and any(n == t or n.endswith("." + t) for t in targets))
        tensors = getattr(lora, "target_parameters", None) or ()  # fused experts [E, a, b]: an adapter per expert
        adapters += sum(lora.r * p.shape[0] * (p.shape[1] + p.shape[2]) for n, p in model.named_parameters()
                        if p.dim() == 3 and any(n == t or n.endswith("." + t) for t in tensors))
    return params, active, adapters, routed
