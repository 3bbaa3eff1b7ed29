"""``rollout.lora_sync=adapter``: the cross-section checks of relaying a LoRA run's adapters instead of its merged
weights (:mod:`relayrl.engines.generation.vllm_lora` loads them into vLLM). Torch-free."""

from __future__ import annotations

from typing import Any

Config = Any
"""A :class:`relayrl.config.schema.Config` (not imported: the schema imports these rules)."""

__all__ = ["check_lora_sync", "VLLM_LORA_RANKS"]

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (its ``MaxLoRARanks``); the engine starts with the smallest one
that holds ``model.lora.r``."""

KEY = "rollout.lora_sync=adapter"


def check_lora_sync(cfg: Config) -> None:
    """Refuse ``rollout.lora_sync=adapter`` where the rollout cannot take an adapter (naming the key and the fix):
    without ``model.lora.enabled``, on an engine other than vLLM, with adapters on expert tensors
    (``model.lora.target_parameters``: the adapter route does not carry them; vLLM's expert LoRA is untested here), with
    a rank above vLLM's largest, or in a workflow other than grpo."""
    if cfg.rollout.lora_sync != "adapter":
        return
    lora = cfg.model.lora
    if not lora.enabled:
        raise ValueError(f"{KEY} relays a LoRA run's adapters, but model.lora.enabled=false (a full fine-tune "
                         f"has none): set model.lora.enabled=true, or drop rollout.lora_sync")
    if cfg.rollout.engine != "vllm":
        raise ValueError(f"{KEY} loads the adapters into vLLM's LoRA support; rollout.engine={cfg.rollout.engine} "
                         f"takes merged weights only: set rollout.engine=vllm, or rollout.lora_sync=merged")
    if lora.target_parameters:
        raise ValueError(f"{KEY}: model.lora.target_parameters puts adapters on fused expert tensors, which the "
                         f"adapter route does not carry to vLLM (its expert LoRA is untested here): set rollout.lora_sync=merged (the experts are "
                         f"merged before the relay), or drop model.lora.target_parameters")
    if lora.r > VLLM_LORA_RANKS[-1]:
        raise ValueError(f"{KEY}: model.lora.r={lora.r} is above vLLM's largest LoRA rank ({VLLM_LORA_RANKS[-1]}): "
                         f"lower model.lora.r, or set rollout.lora_sync=merged")
    if cfg.workflow != "grpo":
        raise ValueError(f"{KEY} is read by workflow grpo (the GRPO family: its rollout takes every update's "
                         f"weights); workflow {cfg.workflow} relays merged weights to its evaluation rollout: drop "
                         f"rollout.lora_sync")
