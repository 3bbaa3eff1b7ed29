"""``rollout.lora_sync=adapter``: a LoRA run's adapters, not its merged weights, into the vLLM engine.

verl offers both routes for an FSDP LoRA actor (``lora.merge``: merge before the transfer, or hand vLLM the
adapter); relayrl's default merges (:func:`relayrl.models.lora.iter_merged_weights`). Here the engine starts with
vLLM's LoRA support (``enable_lora``, ``max_lora_rank`` the smallest vLLM rank >= ``model.lora.r``, one LoRA
slot) on the base model it loads from the model directory once, and each sync carries only every ``A`` and ``B``
(peft's names, :func:`relayrl.models.lora.peft_name`; FSDP2 shards gathered whole by the relay as any weight is).
The engine makes them a new LoRA in memory on every worker (vLLM's ``LoRAModel.from_lora_tensors``, what its
``from_local_checkpoint`` does after reading the files, so no directory is written), under a new integer id per
version, activates it and drops the previous one; every request after that carries its ``LoRARequest``. Before
the first sync requests carry none: the base model, which is the initial policy since ``B`` starts at zero.

Departure from vLLM's path: vLLM loads an adapter when a request names an id its worker does not hold, reading
``lora_path``; here the adapter is in the worker before any request names it, so the path (``relayrl://adapter/
v{version}``) is never read. The tensors are cloned on the worker (the relay reuses its buffers for the next
version, and vLLM may activate a cached adapter again later from its own tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from relayrl.config.lora_sync import VLLM_LORA_RANKS
from relayrl.engines.generation import vllm_tp
from relayrl.models.lora_config import LoraConfig

__all__ = ["AdapterSpec", "adapter_spec", "lora_engine_args", "AdapterSlot", "load_adapter"]


@dataclass(frozen=True)
class AdapterSpec:
    """What the engine's adapter is: its rank and scale, the modules it adapts and every tensor's shape."""

    r: int
    """``model.lora.r``."""
    alpha: float
    """``model.lora.alpha`` (vLLM scales by ``alpha / r``, as peft does)."""
    targets: tuple[str, ...]
    """The module names peft put adapters on (``target_modules`` resolved on the model)."""
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """Every adapter tensor (peft's name) and its shape: a sync must bring exactly these."""

    def peft_config(self) -> dict:
        """The ``adapter_config.json`` fields vLLM's ``PEFTHelper`` reads."""
        return {"r": self.r, "lora_alpha": self.alpha, "target_modules": list(self.targets), "bias": "none"}


def adapter_spec(model_dir: str, lora: LoraConfig) -> AdapterSpec:
    """The adapter ``lora`` puts on the model in ``model_dir``, found as the trainer finds it: the model built on
    the meta device (no weights read) and wrapped by :func:`relayrl.models.lora.apply_lora`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from relayrl.models import lora as lora_lib

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
        wrapped = lora_lib.apply_lora(model, lora)
    shapes = tuple((n, tuple(t.shape)) for n, t in lora_lib.adapter_weights(model))
    return AdapterSpec(r=lora.r, alpha=float(lora.alpha), targets=tuple(lora_lib.peft_targets(wrapped)),
                       shapes=shapes)


def lora_engine_args(spec: AdapterSpec) -> dict:
    """``vllm.LLM``'s LoRA arguments: one adapter at a time (each version replaces the last), its rank the
    smallest vLLM takes that holds ``spec.r``."""
    rank = next(r for r in VLLM_LORA_RANKS if r >= spec.r)  # (the config refuses an r above the largest)
    return dict(enable_lora=True, max_lora_rank=rank, max_loras=1, max_cpu_loras=1)


class AdapterSlot:
    """The engine's current adapter: loads each version's tensors on every worker and names it in requests."""

    def __init__(self, spec: AdapterSpec) -> None:
        self.spec = spec
        self.request = None  # the current version's vllm LoRARequest (None: the base model)
        self.nbytes = 0  # bytes of the last adapter loaded

    def load(self, rpc: Callable, named: Iterable[tuple[str, torch.Tensor]], version: int,
             devices: tuple[torch.device, ...], apart: bool) -> None:
        """Check ``named`` (every adapter tensor, by peft's names) against the spec, then make it the engine's
        LoRA on every worker (``rpc``: the engine's ``collective_rpc``) under a new id, the old one dropped."""
        from vllm.lora.request import LoRARequest

        want = dict(self.spec.shapes)
        got = [(n, t) for n, t in named]
        for n, t in got:
            if n not in want:
                raise KeyError(f"vLLM engine (rollout.lora_sync=adapter): the adapter has no tensor {n!r}")
            if tuple(t.shape) != want[n]:
                raise ValueError(f"adapter tensor {n!r}: shape {want[n]} != incoming {tuple(t.shape)}")
        if missing := sorted(set(want) - {n for n, _ in got}):
            raise ValueError(f"vLLM engine (rollout.lora_sync=adapter): the sync lacks {len(missing)} adapter "
                             f"tensor(s), e.g. {missing[0]!r}")
        old = 0 if self.request is None else self.request.lora_int_id
        new = old + 1
        if apart:
            with vllm_tp.encoded(got, devices[0]) as payload:
                ids = rpc(load_adapter, args=(new, old, payload, self.spec.peft_config()))
        else:  # one worker, in this process: the tensors pass by reference (cloned there)
            ids = rpc(load_adapter, args=(new, old, got, self.spec.peft_config()))
        if ids != [[new]] * len(ids) or not ids:
            raise RuntimeError(f"vLLM workers hold LoRA ids {ids} after loading id {new} (each should hold it alone)")
        self.request = LoRARequest(lora_name=f"relayrl-v{version}", lora_int_id=new,
                                   lora_path=f"relayrl://adapter/v{version}")
        self.nbytes = sum(t.numel() * t.element_size() for _, t in got)


def load_adapter(worker, new: int, old: int, named: list, config: dict) -> list[int]:
    """Runs on every vLLM worker (``collective_rpc``): build LoRA ``new`` from ``named`` (full peft tensors, or
    :func:`~relayrl.engines.generation.vllm_tp.encoded` payloads), drop LoRA ``old``, activate ``new``; returns
    the ids the worker then holds. vLLM's ``WorkerLoRAManager._load_adapter`` with the tensors in hand."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    mgr = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": mgr.max_position_embeddings})
    helper.validate_legal(mgr.lora_config)
    manager = mgr._adapter_manager
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    tensors = {n: vllm_tp.open_tensor(x, worker.device).detach().clone() for n, x in named}
    lora = LoRAModel.from_lora_tensors(new, tensors, helper, device="cpu", dtype=mgr.lora_config.lora_dtype,
                                       model_vocab_size=mgr.vocab_size,
                                       weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
                                       skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    if old in manager.list_adapters():
        manager.remove_adapter(old)
    manager.add_adapter(lora)
    manager.activate_adapter(new)
    return sorted(manager.list_adapters())
