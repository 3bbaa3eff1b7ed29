"""What a model's forward does to its output head's product before it returns logits.

relayrl's trainer and static decoder do not call a causal LM's ``forward`` for its logits: they run the decoder,
then the output head on the positions they need (the trainer a chunk at a time, never materialising
``[positions, vocab]``; :mod:`relayrl.engines.training.head`). Most decoders return ``h W^T`` as it is, but some
change it first, and the log-probs are then the model's only when the same change is made:

* Gemma 2, 3 and 4 cap the logits: ``cap * tanh(z / cap)`` with ``final_logit_softcapping`` (30 in Gemma 2);
* Cohere (Command R) multiplies them by ``logit_scale`` (0.0625);
* Granite divides them by ``logits_scaling`` (8 to 16 in the published models);
* Falcon-H1 multiplies them by ``lm_head_multiplier``.

:class:`LogitTransform` is that change, ``logits = softcap(scale * h W^T)``, read from the model's config by
:meth:`LogitTransform.of`. A model that changes its logits some other way would go unnoticed by the config
alone, so :func:`check_head` compares the model's own forward with the decoder-then-head route on a few tokens
and raises when they differ: the trainer's and the static decoder's log-probs are then never silently another
model's. The sampling temperature divides the transformed logits, as in Hugging Face's and vLLM's samplers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["LogitTransform", "check_head", "HeadMismatchError", "eager_eval"]


class HeadMismatchError(ValueError):
    """The model's forward returns logits the decoder-then-head route does not reproduce."""


@dataclass(frozen=True)
class LogitTransform:
    """``logits = softcap(scale * z)`` for the head's product ``z = h W^T (+ b)``; ``softcap(x) = cap *
    tanh(x / cap)`` when ``softcap`` is set."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> "LogitTransform":
        """The transform a Hugging Face model config declares (its text config for a multimodal one)."""
        conf = config.get_text_config() if hasattr(config, "get_text_config") else config
        scale = 1.0
        if getattr(conf, "logit_scale", None) is not None:  # Cohere, Cohere2
            scale *= float(conf.logit_scale)
        if getattr(conf, "logits_scaling", None) is not None:  # Granite, GraniteMoe
            scale /= float(conf.logits_scaling)
        if getattr(conf, "lm_head_multiplier", None) is not None:  # Falcon-H1
            scale *= float(conf.lm_head_multiplier)
        cap = getattr(conf, "final_logit_softcapping", None)  # Gemma 2, 3, 4
        return cls(scale, float(cap) if cap else None)

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """The logits from the head's product ``z`` (any shape, its dtype kept)."""
        if self.scale != 1.0:
            z = z * self.scale
        return z if self.softcap is None else softcap(z, self.softcap)

    def describe(self) -> str:
        parts = ([f"x {self.scale:g}"] if self.scale != 1.0 else []) + \
                ([f"capped at {self.softcap:g}"] if self.softcap is not None else [])
        return "the head's product " + " then ".join(parts) if parts else "the head's product as it is"


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's final logit soft-capping)."""
    return torch.tanh(x / cap) * cap


def softcap_grad(y: torch.Tensor, cap: float) -> torch.Tensor:
    """``d softcap(x) / dx`` from the capped value ``y = softcap(x)``: ``1 - (y / cap)^2``, float32."""
    return 1.0 - (y.float() / cap) ** 2


@contextlib.contextmanager
def eager_eval(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode with eager attention (its config's and its text config's), both restored after: how
    the start-up probes (:func:`check_head`, :func:`relayrl.models.packing_check.packing_leak`) run a model."""
    was_training, configs = model.training, _configs(model)
    attn = [getattr(c, "_attn_implementation", None) for c in configs]
    model.eval()
    try:
        for c in configs:
            c._attn_implementation = "eager"
        yield
    finally:
        for c, a in zip(configs, attn):
            c._attn_implementation = a
        model.train(was_training)


def _configs(model: torch.nn.Module) -> list:
    """The model's config and its text config when that is another object (a multimodal model's)."""
    conf = model.config
    text = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
    return [conf] if text is conf else [conf, text]


@torch.no_grad()
def check_head(model: torch.nn.Module, transform: LogitTransform | None = None, *, tokens: int = 8) -> LogitTransform:
    """``transform`` (default: :meth:`LogitTransform.of` the model's config) after checking it on ``tokens``
    positions: the model's own forward against ``transform(head(decoder(ids)))``. Raises
    :class:`HeadMismatchError` naming the model and the difference when they disagree. Runs in eval mode
    (dropout off), restoring the model's mode after."""
    transform = transform or LogitTransform.of(model.config)
    head = model.get_output_embeddings()
    vocab = int(head.weight.shape[0])
    device = head.weight.device
    ids = (torch.arange(tokens, device=device)[None] * 7 + 3) % vocab
    # eager attention for the probe: any kernel the model was loaded with may be missing here (the route to the
    # hidden states is the same both ways; only the head's end is compared)
    with eager_eval(model):
        full = model(input_ids=ids, use_cache=False).logits.float()
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        ours = transform(head(hidden)).float()
    diff = float((full - ours).abs().max())
    spread = float(full.abs().max())
    if diff > 1e-3 * max(1.0, spread) + (1e-2 if full.dtype != head.weight.dtype else 0.0) * spread:
        raise HeadMismatchError(
            f"{type(model).__name__}'s forward returns logits that differ by up to {diff:.3g} (largest logit "
            f"{spread:.3g}) from its decoder's output passed through its output head and "
            f"{transform.describe()}: the model changes its logits in a way relayrl does not know, so relayrl's "
            f"log-probs would not be the model's. relayrl/models/logits.py lists the transforms it applies")
    return transform
