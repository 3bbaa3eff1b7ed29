"""A weight update the server applies whole or not at all, without a second copy of the weights.

The engine copies new weights in place, tensor by tensor (``NativeGenerationEngine.update_weights``); a load
that failed halfway would leave some tensors new and some old, and the server would go on sampling from a
model that never existed under the old version number. So a load has two phases:

1. :func:`checked` looks at every incoming tensor before any is written: its name is a parameter of the served
   model (a tied copy is taken as the tensor it ties to, and must equal it), its shape is the parameter's, its
   dtype casts to the parameter's (floating-point weights for a floating-point parameter; an integer buffer
   takes its own dtype), and its values are finite *after* that cast (a float32 value of 1e39 is finite, and
   infinite in bfloat16). A refusal is a 400 naming the tensor; nothing was written, the old weights serve on.
2. :func:`write` copies them in. What is left to fail there is the device itself (a CUDA error, a copy the
   device cannot finish): the weights may then be a mix of old and new, so :class:`~relayrl.serving.batcher.
   Unrecoverable` stops the generation loop (every request then gets a 503 naming the cause, code
   ``generation_stopped``) rather than serve them.

No host copy of the old weights is kept for a rollback (it cost one copy of every pushed tensor per load: 15 GB
a step for a 7B model pushed after every update). The incoming weights arrive whole: one POST (a safetensors
payload, or the path of files) holds every tensor of the update, in memory before the first write, so all of
them are checked first. (The relay's buckets are unpacked on the trainer side: ``rollout.engine=openai`` sends
the whole update in one request.)
"""

from __future__ import annotations

import torch

from relayrl.serving.batcher import Unrecoverable
from relayrl.serving.guard import HTTPRefusal

__all__ = ["checked", "write"]


def checked(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` under the served model's parameter names, every one checked (name, shape, dtype, finite in
    the served dtype) before anything is written; :class:`HTTPRefusal` (400) naming the first bad one.

    A tied weight has two names (``lm_head.weight`` is ``model.embed_tokens.weight`` when the config ties the
    embeddings) and the model lists only the first; a training checkpoint's state dict holds both. The second
    name is taken as the first: both given, they must be equal (they are one tensor in a model that ties them;
    different ones come from an untied model, which this one cannot serve); the head alone loads the embedding,
    since in the served model it is the embedding."""
    first: dict[int, str] = {}
    canonical: dict[str, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        canonical[name] = first.setdefault(id(t), name)
    have = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        served = canonical.get(name)
        if served is None:
            raise HTTPRefusal(400, f"weight {name!r} is not a parameter of the served model; nothing was loaded")
        p = have[served]
        if tuple(p.shape) != tuple(t.shape):
            raise HTTPRefusal(400, f"weight {name!r}: the served model's shape is {tuple(p.shape)}, the payload's "
                              f"{tuple(t.shape)}; nothing was loaded")
        _check_values(name, t, p.dtype)
        if served in out and not torch.equal(out[served], t):
            raise HTTPRefusal(400, f"weights {served!r} and its tied copy {name!r} differ; the served model ties "
                              "them (tie_word_embeddings): send weights of a model that ties them, or serve an "
                              "untied model")
        out.setdefault(served, t)
    if not out:
        raise HTTPRefusal(400, "no weights in the payload")
    return out


def _check_values(name: str, t: torch.Tensor, served: torch.dtype) -> None:
    """``t`` casts to ``served`` and (floating point) holds only finite values once cast."""
    if not served.is_floating_point:
        if t.dtype != served:
            raise HTTPRefusal(400, f"weight {name!r} is {t.dtype}; the served buffer is {served}: send it as "
                              f"{served}; nothing was loaded")
        return
    if not t.is_floating_point():  # (an integer, boolean or complex tensor is not a weight: a wrong file?)
        raise HTTPRefusal(400, f"weight {name!r} is {t.dtype}; the served parameter is {served}: send "
                          "floating-point weights; nothing was loaded")
    if not (finite := torch.isfinite(t)).all():  # (every completion would fail)
        raise HTTPRefusal(400, f"weight {name!r} holds {int((~finite).sum())} values that are not finite (NaN or "
                          "infinite): nothing was loaded; send finite weights (a run that diverged?)")
    del finite
    if t.dtype != served and not (finite := torch.isfinite(t.to(served))).all():  # (one tensor's cast at a time)
        big = float(t.abs().max())
        raise HTTPRefusal(400, f"weight {name!r} holds {int((~finite).sum())} values that overflow the served "
                          f"dtype {served} (largest |x| = {big:.4g}, {served} holds up to "
                          f"{torch.finfo(served).max:.4g}): nothing was loaded; send weights that fit, or serve "
                          "with a wider --dtype")


@torch.no_grad()
def write(engine, tensors: dict[str, torch.Tensor], version: int) -> int:
    """Copy ``tensors`` (from :func:`checked`) into ``engine`` as ``version``; return the engine's version. A
    failure here is the device's (everything that could be refused was): :class:`Unrecoverable`, naming it."""
    try:
        engine.update_weights(tensors.items(), version)
        if engine.device.type == "cuda":  # (a copy's device error surfaces here, not in a later request)
            torch.cuda.synchronize(engine.device)
    except Exception as e:  # noqa: BLE001 - the weights may be a mix of old and new ones: not served
        raise Unrecoverable(f"writing the checked weights of version {version} failed ({e!r}): a device fault "
                            "after some tensors may have been written; the weights are neither the old nor the new "
                            "ones; restart relayrl serve") from e
    return engine.weight_version
