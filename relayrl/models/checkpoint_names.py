"""Weights under the names and layout a checkpoint stores, for engines that load checkpoints (vLLM, SGLang).

transformers 5 holds some models' weights in another layout than their checkpoints: an MoE layer's experts are
fused into one tensor each (Qwen3-MoE's ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj``
for the checkpoint's ``mlp.experts.N.gate_proj/up_proj/down_proj``), and Mixtral's ``block_sparse_moe`` is named
``mlp``. The trainer's weights come out under those in-memory names, while vLLM's loaders read the checkpoint's
and skip or refuse the rest: Mixtral's update was refused by name, and Qwen3-MoE's experts were skipped without a
word (they kept their first weights; one relay of moved experts left vLLM's log-probs 16 nats from the trainer's,
measured). :class:`CheckpointNames` maps each tensor back as ``save_pretrained`` would write it, with
transformers' own reverse conversion (``revert_weight_conversion``), one tensor at a time so a stream of them
stays a stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

__all__ = ["CheckpointNames"]


class CheckpointNames:
    """``(in-memory name, tensor) -> [(checkpoint name, tensor), ...]`` for one model class (a meta-device
    instance is enough: only its conversion mapping is read)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        conversions = _conversions(model)
        self.identity = not conversions
        """True when the in-memory names are the checkpoint's (Llama, Qwen2, Gemma, ...): nothing to map."""
        if conversions and getattr(model, "_weight_conversions", None) is None:
            # found once here, where revert_weight_conversion would look them up again for every tensor
            model._weight_conversions = conversions

    @classmethod
    def of_dir(cls, model_dir: str | Path) -> "CheckpointNames":
        """For the model in ``model_dir`` (its config only; built on the meta device)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        with torch.device("meta"):
            return cls(AutoModelForCausalLM.from_config(cfg))

    def __call__(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if self.identity:
            return [(name, tensor)]
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(self.model, {name: tensor}).items())

    def stream(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``named`` under checkpoint names, each tensor mapped as it comes."""
        for name, tensor in named:
            yield from self(name, tensor)


def _conversions(model: torch.nn.Module) -> list:
    """The weight conversions transformers would revert when saving ``model`` (empty: none), as
    ``revert_weight_conversion`` finds them for a model not loaded by ``from_pretrained``."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # a transformers without conversions keeps checkpoint names in memory
        return []
    found = getattr(model, "_weight_conversions", None)
    if found is None:
        found = get_model_conversion_mapping(model, add_legacy=False) or []
        found = [c for c in found if not isinstance(c, PrefixChange)]
    return list(found)
