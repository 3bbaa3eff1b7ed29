"""LoRA adapters through ``peft``: config, wrapping, merged weights and adapter-only state.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") freezes
a pretrained weight ``W`` [out, in] and trains a low-rank update beside it: the
layer computes ``x W^T + (alpha / r) * dropout(x) A^T B^T`` with ``A`` [r, in]
(random) and ``B`` [out, r] (zeros, so training starts at the base model). The
merged weight is ``W + (alpha / r) * B @ A``.

relayrl applies it with ``peft.get_peft_model`` to the trained roles (the
actor, and PPO's critic, whose value head stays fully trainable) and keeps
the engine's module the Hugging Face model itself, whose target linears peft
replaced in place; peft renames their weights (``q_proj.weight`` becomes
``q_proj.base_layer.weight`` beside ``q_proj.lora_A.default.weight``). So:

* the rollout gets :func:`merged_weights`: every base parameter under its base
  model name, the adapted ones as ``W + scale * B @ A`` (fresh tensors, so a
  colocated rollout cannot run on the actor's parameters; it keeps its own copy);
  under FSDP2 each rank merges its own rows of ``W`` and ``B`` with the gathered
  ``A``, and the merged shards are gathered as a full model's parameters are;
* checkpoints hold :func:`trainable_names` only (adapters, and a critic's head),
  and the optimizer only ever sees those parameters;
* :func:`adapters_disabled` runs the base model (the frozen reference of KL
  terms) without a second copy of the weights.

:func:`apply_lora` refuses, naming the key, what cannot work on the model at
hand: a target it has no linear layer for, a rank above a targeted layer's
``min(in, out)`` (the update's rank cannot exceed it; the adapters would only
take memory), and the output head (the engine computes log-probs from the
head's weight, past any adapter; a tied head is the input embedding as well).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

from relayrl.errors import UserError
from relayrl.models.lora_config import DEFAULT_TARGETS, LoraConfig  # torch-free (re-exported)

__all__ = ["LoraConfig", "LoraError", "apply_lora", "merged_weights", "base_name", "trainable_names", "linear_sides",
           "adapters_disabled", "DEFAULT_TARGETS", "resolve_targets", "adapter_weights", "peft_name", "peft_targets"]

_ADAPTER = "default"  # peft's name for the one adapter relayrl trains


class LoraError(UserError, ValueError):
    """``model.lora`` settings that do not fit the model being loaded; the message names the key and the fix."""


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, *, trainable: tuple[torch.nn.Module, ...] = ()):
    """Inject ``cfg``'s adapters into ``model`` (in place) and freeze everything else but ``trainable``
    (e.g. a critic's value head). Returns the ``peft.PeftModel`` around ``model`` (for saving the adapter);
    ``model`` itself keeps its class, and is what the engine trains. Raises :class:`LoraError` for targets
    the model cannot take (see the module docstring)."""
    import warnings

    import peft

    targets = resolve_targets(model, cfg)
    _check_targets(model, cfg, targets)
    params = _check_parameters(model, cfg)
    with warnings.catch_warnings():  # peft reads transformers' deprecated attribute: noise in every LoRA run
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False but the target module is `Conv1D`")
        wrapped = peft.get_peft_model(model, peft.LoraConfig(
            r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
            target_parameters=params, bias="none"))
    for m in trainable:
        m.requires_grad_(True)
    return wrapped


def linear_sides(m: torch.nn.Module) -> tuple[int, int] | None:
    """``(inputs, outputs)`` of a layer peft adapts as a linear one: ``nn.Linear``, or transformers' ``Conv1D``
    (GPT-2's projections: a linear layer whose weight is stored ``[in, out]``); None for any other module."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(m, torch.nn.Linear):
        return m.in_features, m.out_features
    if isinstance(m, Conv1D):
        return m.nx, m.nf
    return None


def resolve_targets(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """The target names ``cfg`` gives on ``model``: ``cfg.target_modules``, or (null) the names of every linear
    layer inside the model's decoder layers (:func:`~relayrl.models.load.decoder_layers`), in first-seen order,
    less those narrower than ``cfg.r`` (an update of them has a lower rank: Qwen3-Next's shared-expert gate, one
    output per token)."""
    if cfg.target_modules is not None:
        return list(cfg.target_modules)
    from relayrl.models.load import decoder_layers

    width: dict[str, int] = {}  # name -> its narrowest side over the layers
    for layer in decoder_layers(model):
        for n, m in layer.named_modules():
            if sides := linear_sides(m):
                key = n.rsplit(".", 1)[-1]
                width[key] = min(width.get(key, min(sides)), *sides)
    if not width:
        raise LoraError(f"{type(model).__name__}'s decoder layers hold no linear layer for an adapter; name the "
                        f"layers in model.lora.target_modules")
    names = [n for n, w in width.items() if w >= cfg.r] or list(width)  # (all too narrow: the r check says so)
    if narrow := [f"{n} ({w})" for n, w in width.items() if n not in names]:  # (it left them out without a word)
        logging.getLogger(__name__).warning(
            "model.lora.r=%d is larger than the narrowest side of %s: they get no adapter (name "
            "model.lora.target_modules to choose, or lower model.lora.r)", cfg.r, ", ".join(narrow))
    moved = _read_as_experts(model, names) | _refused_by_peft(model, names)
    return [n for n in names if n not in moved] or names


def _refused_by_peft(model: torch.nn.Module, names: list[str]) -> set[str]:
    """The names among ``names`` peft refuses to adapt on this architecture (its check for Mamba-style models:
    Falcon-H1's mixer ``out_proj``), asked of peft's own check."""
    try:
        import peft
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba as check
    except ImportError:
        return set()
    probe = peft.LoraConfig(r=8, target_modules=list(names))
    refused = set()
    for name in names:
        try:
            check(probe, model, name)
        except ValueError:
            refused.add(name)
    return refused


def _read_as_experts(model: torch.nn.Module, names: list[str]) -> set[str]:
    """The names among ``names`` that peft reads as an MoE layer's fused experts instead of as the linear layers
    of that name (its conversion for transformers 5's fused experts: on Qwen3-Next, ``gate_proj``, ``up_proj`` and
    ``down_proj`` would adapt the experts and not the shared expert that has those layers), found by running
    peft's own conversion on a config of ``names``."""
    try:
        import peft
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:
        return set()
    probe = peft.LoraConfig(r=8, target_modules=list(names))
    try:
        convert_peft_config_for_transformers(probe, model, None)
    except ValueError:  # (a fused pair named in part: peft refuses; none of these names then is moved)
        return set()
    return set(names) - set(probe.target_modules or ())


def _check_parameters(model: torch.nn.Module, cfg: LoraConfig) -> list[str] | None:
    """``cfg.target_parameters`` (peft's names of whole parameters: fused expert tensors), each checked to name a
    parameter of ``model`` (a name equal to it or ending in ``.name``); None when unset."""
    if not cfg.target_parameters:
        return None
    names = [n for n, _ in model.named_parameters()]
    missing = [t for t in cfg.target_parameters if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        fused = sorted({n.split("layers.", 1)[-1].split(".", 1)[-1] for n, p in model.named_parameters()
                        if p.dim() == 3})
        raise LoraError(f"model.lora.target_parameters names {missing}, which {type(model).__name__} has no "
                        f"parameter called; its fused (3-D) parameters are {fused or 'none'}")
    return list(cfg.target_parameters)


def _check_targets(model: torch.nn.Module, cfg: LoraConfig, targets: list[str]) -> None:
    """The linear layers ``targets`` names (by peft's rule: a module name equal to a target or ending in
    ``.target``) exist, none is the output head, and none is narrower than ``cfg.r``."""
    linears = {n: m for n, m in model.named_modules() if linear_sides(m)}
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    names = {n.rsplit(".", 1)[-1] for n, m in linears.items() if m is not head}  # (the head is refused below)
    hits = {t: [n for n in linears if n == t or n.endswith("." + t)] for t in targets}
    missing = [t for t, found in hits.items() if not found]
    if missing:
        raise LoraError(f"model.lora.target_modules names {missing}, which {type(model).__name__} has no linear "
                        f"layer called; the layers an adapter can go on are {sorted(names)}")
    targeted = {n: linears[n] for found in hits.values() for n in found}
    for name, m in targeted.items():
        if m is head:
            tied = embedding is not None and head.weight is getattr(embedding, "weight", None)
            why = (" (tied: it shares its weight with the input embedding, so one merged weight cannot serve "
                   "both)" if tied else "")
            raise LoraError(f"model.lora.target_modules targets {name}, the output head of "
                            f"{type(model).__name__}{why}; adapters on the output head are not supported (the "
                            f"training engine computes log-probs from the head's weight directly, past an "
                            f"adapter); drop it from model.lora.target_modules")
    name, narrowest = min(targeted.items(), key=lambda kv: min(linear_sides(kv[1])))
    inputs, outputs = linear_sides(narrowest)
    limit = min(inputs, outputs)
    if cfg.r > limit:
        raise LoraError(f"model.lora.r={cfg.r} is larger than {name} allows ({inputs} inputs, "
                        f"{outputs} outputs: an update of it has rank at most {limit}, so a larger r "
                        f"only takes memory); set model.lora.r <= {limit} (8 to 64 is usual), or drop "
                        f"{name.rsplit('.', 1)[-1]} from model.lora.target_modules")


def base_name(name: str) -> str:
    """A parameter's name in the base model (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``; adapters on
    two tensors of one module nest: ``experts.base_layer.base_layer.gate_up_proj`` -> ``experts.gate_up_proj``)."""
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".")
    return name


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name or ".lora_magnitude" in name


def merged_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model``'s weights as the base model names them, each adapted linear merged: ``W + scale * B @ A``
    (in ``W``'s dtype): `iter_merged_weights` kept whole. Unadapted parameters are returned as they are (no
    copy); merged ones are new tensors. A model without adapters gives its named parameters."""
    return list(iter_merged_weights(model))


def base_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors standing for `iter_merged_weights`' output, in its order: each merged weight's base
    weight (same name, shape and dtype; a DTensor row shard under FSDP2), the other parameters as they are.
    What a relay's layout is built from before any merge runs."""
    return [(base_name(n), p) for n, p in model.named_parameters() if not _is_adapter(n)]


def peft_name(name: str) -> str:
    """An adapter parameter's name as peft saves it (``adapter_model.safetensors``) and vLLM's LoRA loader reads
    it: ``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return "base_model.model." + name.replace(f".{_ADAPTER}.", ".")


def adapter_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The adapters alone (every ``A`` and ``B``, no copy; DTensor row shards under FSDP2) under :func:`peft_name`:
    what ``rollout.lora_sync=adapter`` relays instead of :func:`iter_merged_weights`. Raises where the model
    trains more than adapters (a module kept trainable beside them), which an adapter relay would leave out."""
    extra = [n for n in trainable_names(model) if not _is_adapter(n)]
    if extra:
        raise LoraError(f"rollout.lora_sync=adapter relays the adapters only, but the model also trains {extra[:3]}: "
                        f"set rollout.lora_sync=merged")
    return [(peft_name(n), p.detach()) for n, p in model.named_parameters() if _is_adapter(n)]


def peft_targets(wrapped) -> list[str]:
    """The module names a ``peft.PeftModel`` of :func:`apply_lora` put adapters on (its config's ``target_modules``,
    resolved), sorted: an ``adapter_config.json``'s list."""
    targets = wrapped.peft_config[_ADAPTER].target_modules
    return sorted([targets] if isinstance(targets, str) else targets)


@torch.no_grad()  # (wraps each step of the generator: the caller's grad mode is left alone between yields)
def iter_merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`merged_weights` one weight at a time: each adapted linear is merged when its turn comes and not kept,
    so a consumer that drops each tensor once loaded (a relay, an engine's ``update_weights``) never holds
    all the merged layers at once.

    Sharded by FSDP2 (parameters are ``DTensor`` row shards): a merged weight is a ``DTensor`` of the same
    rows as ``W``, each rank's shard ``W_rows + scale * B_rows @ A``: ``W`` and ``B`` have the same rows
    (``out``), so their shards line up, and only the small ``A`` ``[r, in]`` is gathered (every ``A`` in one
    bucketed all-gather when the stream starts; a collective, every rank reads the stream to its end). No
    base weight is gathered here: the caller gathers the merged rows bucket by bucket as it gathers a full
    fine-tuned model's parameters (:func:`relayrl.weights.stream_full_state`)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    adapted = {prefix: m for prefix, m in model.named_modules() if isinstance(m, LoraLayer) and _ADAPTER in m.lora_A}
    tensors = {base_name(f"{prefix}.{m.parameter_name}"): m for prefix, m in adapted.items()
               if isinstance(m, ParamWrapper)}  # (model.lora.target_parameters: W + delta per expert)
    layers = {prefix: m for prefix, m in adapted.items() if not isinstance(m, ParamWrapper)}
    sharded = (any(_is_dtensor(m.get_base_layer().weight) for m in layers.values())
               or any(_is_dtensor(m.get_param()) for m in tensors.values()))
    full = _gathered_factors(layers, tensors) if sharded else {}
    merged_at = {f"{prefix}.weight": m for prefix, m in layers.items()}
    for name, p in model.named_parameters():
        if _is_adapter(name):
            continue
        key = base_name(name)
        m = merged_at.get(key)
        if key in tensors:
            yield key, _merged_experts(key, tensors[key], full)
        elif m is None:
            yield key, p.detach()
        elif _is_dtensor(m.get_base_layer().weight):
            yield key, _merged_rows(key.removesuffix(".weight"), m, full)
        else:  # (unsharded, or a unit FSDP2 holds unsharded)
            w = m.get_base_layer().weight
            yield key, w.detach() + m.get_delta_weight(_ADAPTER).to(w.dtype)


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _gathered_factors(layers: dict, tensors: dict) -> dict[str, torch.Tensor]:
    """FSDP2: the full adapters a sharded merge needs, in one bucketed gather: every adapted layer's ``A``
    ``[r, in]`` by its prefix, and both factors of every expert tensor's adapter (``A`` ``[r E, in]``, ``B``
    ``[out, r E]``: a few rows per expert, while a rank holds whole experts of ``W``) by ``name.A``, ``name.B``.
    A collective: gathered in one order on every rank."""
    from relayrl.weights.gather import gather_full_state

    wanted = [(p, m.lora_A[_ADAPTER].weight) for p, m in layers.items()]
    for key, m in tensors.items():
        wanted += [(f"{key}.A", m.lora_A[_ADAPTER].weight), (f"{key}.B", m.lora_B[_ADAPTER].weight)]
    return dict(gather_full_state(wanted))


def _merged_experts(key: str, m, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """An adapted parameter (peft's ``ParamWrapper``: a fused expert tensor ``[E, ., .]``, or a 2-D weight)
    with its update added: whole, or under FSDP2 this rank's rows (whole experts: ``torch.chunk``'s split of
    dim 0) as a ``DTensor`` shaped and placed as the parameter, from the gathered adapter ``full``."""
    from torch.distributed.tensor import DTensor, Shard

    p = m.get_param()
    if not _is_dtensor(p):
        return p.detach() + adapter_delta(m.lora_A[_ADAPTER].weight, m.lora_B[_ADAPTER].weight, m.scaling[_ADAPTER],
                                          p.dim(), m.num_experts, slice(None), m._did_swap_in_out_features).to(p.dtype)
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise LoraError(f"{key}: a sharded merge of an expert tensor needs it split by experts (FSDP2's Shard(0) on "
                        f"one mesh dimension); this one is placed {p.placements}")
    local = p.to_local()
    start = p.device_mesh.get_local_rank() * -(-p.shape[0] // p.device_mesh.size())
    delta = adapter_delta(full[f"{key}.A"], full[f"{key}.B"], m.scaling[_ADAPTER], p.dim(), m.num_experts,
                          slice(start, start + local.shape[0]), m._did_swap_in_out_features)
    return DTensor.from_local(local + delta.to(local.dtype), p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def adapter_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, ndim: int, experts: int, rows: slice,
                  out_first: bool) -> torch.Tensor:
    """Rows ``rows`` of the update ``scaling * B A`` of a parameter adapted whole (peft's ``ParamWrapper``),
    from its full adapter. A 2-D ``[out, in]`` weight: ``(B @ A)[rows]``. A fused expert tensor: expert ``e``'s
    ``A_e`` is rows ``e r .. e r + r - 1`` of ``a`` ``[E r, in]``, its ``B_e`` the columns ``e, e + E, ...`` of
    ``b`` ``[out, r E]``, and ``rows`` picks experts; each expert's ``B_e A_e`` is laid out ``[out, in]`` when
    ``out_first`` (the tensor is stored ``[E, out, in]``, as transformers stores gate_up_proj and down_proj),
    else transposed (peft's two einsums)."""
    if ndim == 2:
        return b[rows] @ a * scaling
    a_e = a.reshape(experts, -1, a.shape[-1])[rows]
    b_e = b.reshape(b.shape[0], -1, experts)[..., rows]
    return torch.einsum("ore,eri->eoi" if out_first else "ore,eri->eio", b_e, a_e) * scaling


def _merged_rows(prefix: str, m, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """FSDP2: this rank's rows of ``W + scale * B @ A`` as a ``DTensor`` shaped and placed as ``W``."""
    from torch.distributed.tensor import DTensor

    w, b = m.get_base_layer().weight, m.lora_B[_ADAPTER].weight
    if getattr(m, "fan_in_fan_out", False) or w.placements != b.placements:  # (peft's Conv1D layout)
        raise LoraError(f"{prefix}: a sharded merge needs W [out, in] and B [out, r] split by the same rows; "
                        f"this layer's are {w.placements} and {b.placements}")
    rows = w.to_local() + (b.to_local() @ full[prefix].to(b.dtype) * m.scaling[_ADAPTER]).to(w.dtype)
    return DTensor.from_local(rows, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())


def trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of the parameters that train (the adapters, and any module kept trainable): what a LoRA
    checkpoint holds."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` as its base model (every adapter off) inside the block: the frozen initial policy,
    since adapters start at ``B = 0``. peft turns the adapters' ``requires_grad`` off while disabled and
    back on after."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
