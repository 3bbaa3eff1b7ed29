"""Token entropy of the policy from logits, chunked over positions.

``H_t = logsumexp(z_t) - sum_v softmax(z_t)_v * z_{t,v}`` for logits ``z``
``[B, T, V]``. Entropy is both a monitored metric (entropy collapse is what
DAPO's clip-higher addresses, DAPO §3.1) and an optional bonus
term in the loss.

Memory: a full-vocabulary softmax in fp32 over ``B*T`` positions costs as much
as the logits again. Positions are processed ``chunk_size`` at a time, each
chunk upcast to fp32 on its own. With gradients, each chunk runs under
activation checkpointing so the softmax of only one chunk is alive in
backward (a single chunk is not checkpointed); without gradients
(``grad=False`` or :func:`entropy_metric`) it runs under ``no_grad``. Masked
positions are 0.

:func:`high_entropy_mask` selects the "forking" tokens: Wang et al. 2025 ("Beyond the 80/20 Rule: High-Entropy
Minority Tokens Drive Effective Reinforcement Learning for LLM Reasoning") train on the policy gradient of the
top 20% of tokens by entropy only, and match or beat full-gradient RLVR on Qwen3 models. The quantile is taken
over the tokens at hand (a micro-batch, as TRL's ``top_entropy_quantile`` does per device batch).

:class:`EntropyController` adapts the entropy bonus's coefficient (Skywork-OR1, He et al. 2025, "adaptive
entropy control"): the bonus applies only while the policy's entropy is at or below a target, and its
coefficient climbs by ``delta`` each step the entropy stays below the target and falls by ``delta`` otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from relayrl.algorithms._checks import check_ndim, check_nonempty, to_floats
from relayrl.algorithms._ops import masked_mean

Tensor = torch.Tensor


def _entropy_rows(logits: Tensor) -> Tensor:
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logz = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    return logz - (p * z).sum(dim=-1)


def entropy_from_logits(
    logits: Tensor,
    mask: Tensor | None = None,
    *,
    chunk_size: int = 1024,
    grad: bool = True,
) -> Tensor:
    """Per-token entropy ``[B, T]`` (fp32, or the logits' dtype if wider).

    Args:
        logits: ``[B, T, V]``.
        mask: ``[B, T]``; entropy is 0 where the mask is 0.
        chunk_size: positions (of ``B*T``) processed per chunk.
        grad: keep the graph (checkpointed per chunk) when ``logits`` require
            grad; ``False`` computes under ``no_grad`` for metrics.
    """
    check_nonempty("logits", logits)
    check_ndim("logits", logits, 3)
    if mask is not None and tuple(mask.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"shape mismatch: logits has shape {tuple(logits.shape)} but mask has shape "
            f"{tuple(mask.shape)}; need mask.shape == logits.shape[:2]"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    B, T, V = logits.shape
    flat = logits.reshape(B * T, V)
    track = grad and logits.requires_grad and torch.is_grad_enabled()
    # Checkpointing only pays when there is more than one chunk to free between.
    recompute = track and B * T > chunk_size
    with torch.set_grad_enabled(track):
        parts = []
        for start in range(0, B * T, chunk_size):
            rows = flat[start : start + chunk_size]
            if recompute:
                parts.append(checkpoint(_entropy_rows, rows, use_reentrant=False))
            else:
                parts.append(_entropy_rows(rows))
        ent = torch.cat(parts).reshape(B, T)
        if mask is not None:
            ent = torch.where(mask.bool(), ent, torch.zeros_like(ent))
    return ent


def entropy_metric(
    logits: Tensor, mask: Tensor, *, chunk_size: int = 1024, key: str = "actor/entropy"
) -> dict[str, float]:
    """Mean token entropy over valid positions, under ``no_grad``: ``{key: float}``."""
    with torch.no_grad():
        ent = entropy_from_logits(logits, mask, chunk_size=chunk_size, grad=False)
        return to_floats({key: masked_mean(ent, mask)})


def high_entropy_mask(entropy: Tensor, mask: Tensor, top: float) -> tuple[Tensor, dict[str, float]]:
    """The valid tokens whose entropy is in the top ``top`` fraction of the valid tokens' (``entropy``, ``mask``
    ``[B, T]``): a float mask ``[B, T]``, 1 where ``entropy >= `` the ``1 - top`` quantile (linear
    interpolation; ``top=0`` keeps the highest-entropy token(s), ``top=1`` every valid token), and metrics
    ``actor/entropy_kept_frac`` (kept over valid tokens) and ``actor/entropy_threshold``."""
    if not 0.0 <= top <= 1.0:
        raise ValueError(f"top must be in [0, 1], got {top}")
    valid = mask > 0
    with torch.no_grad():
        ent = entropy.detach().float()
        values = ent[valid]
        if values.numel() == 0:
            return torch.zeros_like(ent), to_floats({"actor/entropy_kept_frac": 0.0, "actor/entropy_threshold": 0.0})
        threshold = torch.quantile(values, 1.0 - top)
        keep = ((ent >= threshold) & valid).float()
        return keep, to_floats({"actor/entropy_kept_frac": keep.sum() / valid.sum(),
                                "actor/entropy_threshold": threshold})


@dataclass
class EntropyController:
    """The entropy bonus's coefficient, step by step: fixed at ``coef`` (``target=None``), or adaptive.

    Adaptive (Skywork-OR1's section 4): with ``e`` the policy's mean token entropy of the last trained step,
    the coefficient the next step applies is ``c`` when ``e <= target`` and 0 otherwise, and ``c`` moves by
    ``delta`` toward more entropy when ``e < target`` (up) and less when ``e > target`` (down), kept in
    ``[low, high]``. Before any step is seen the bonus applies (``c``, the starting ``coef``).
    """

    coef: float
    target: float | None = None
    delta: float = 0.005
    low: float = 0.0
    high: float = 1.0
    last_entropy: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.coef < 0 or not math.isfinite(self.coef):
            raise ValueError(f"coef must be a finite number >= 0, got {self.coef}")
        if self.delta < 0 or not 0 <= self.low <= self.high:
            raise ValueError(f"need delta >= 0 and 0 <= low <= high, got {self.delta}, {self.low}, {self.high}")
        if self.target is not None and not self.low <= self.coef <= self.high:
            raise ValueError(f"coef must be in [low, high] = [{self.low}, {self.high}], got {self.coef}")

    @property
    def value(self) -> float:
        """The coefficient the next step applies."""
        if self.target is None or self.last_entropy is None or self.last_entropy <= self.target:
            return self.coef
        return 0.0

    def update(self, entropy: float) -> float:
        """After a trained step whose mean token entropy was ``entropy``: the next step's coefficient."""
        self.last_entropy = float(entropy)
        if self.target is not None and math.isfinite(self.last_entropy):
            e, t = self.last_entropy, self.target
            move = self.delta if e < t else -self.delta if e > t else 0.0
            self.coef = min(max(self.coef + move, self.low), self.high)
        return self.value

    def state_dict(self) -> dict[str, float | None]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        """Adaptive: the coefficient where a checkpointed run left it, kept in ``[low, high]`` (the resumed run's
        bounds), and the entropy it last saw. Fixed: that entropy only; the coefficient is the config's (a resumed
        run's ``algorithm.entropy_coef``), not the checkpoint's."""
        coef = float(state["coef"])
        if coef < 0 or not math.isfinite(coef):
            raise ValueError(f"a checkpointed entropy coefficient must be a finite number >= 0, got {coef}")
        if self.target is not None:
            self.coef = min(max(coef, self.low), self.high)
        self.last_entropy = state.get("last_entropy")
