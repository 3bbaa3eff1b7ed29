"""A weight update the server applies whole or not at all.

The engine copies new weights in place, tensor by tensor (``NativeGenerationEngine.update_weights``); one that
fails halfway (an out-of-memory error on the device, a copy that raises) would leave some tensors new and some
old, and the server would go on sampling from a model that never existed under the old version number. Here
each tensor is kept on the host just before it is overwritten, and a failed update copies them back: the old
weights go on serving and the caller gets the cause. If putting them back fails too, the weights are neither,
and :class:`~relayrl.serving.batcher.Unrecoverable` stops the generation loop (every request then gets a 503
naming the cause) rather than serve them.
"""

from __future__ import annotations

from typing import Iterator

import torch

from relayrl.serving.batcher import Unrecoverable

__all__ = ["update_or_restore"]


@torch.no_grad()
def update_or_restore(engine, tensors: dict[str, torch.Tensor], version: int) -> int:
    """Load ``tensors`` (served names, checked) into ``engine`` as ``version`` and return the engine's version;
    on a failure the engine's weights and version are the old ones and the failure is raised."""
    live = {**dict(engine.model.named_parameters()), **dict(engine.model.named_buffers())}
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live tensor, its old value on the host)

    def keeping() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in tensors.items():
            p = live.get(name)
            if p is not None:  # (an unknown name: the engine raises before copying it)
                saved.append((p, p.detach().to("cpu", copy=True)))
            yield name, t

    try:  # (the engine moves its version after the last copy: a failed update leaves it as it was)
        engine.update_weights(keeping(), version)
    except BaseException as e:
        try:
            for p, old in reversed(saved):
                p.copy_(old)
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
        except BaseException as r:  # noqa: BLE001 - the weights are neither the old nor the new ones
            raise Unrecoverable(f"a weight load failed halfway ({e!r}) and the old weights could not be put back "
                                f"({r!r}); restart relayrl serve") from r
        raise
    return engine.weight_version
