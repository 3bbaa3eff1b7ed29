"""A user's advantage estimator or policy loss, named by path in the config instead of by a registered name:
``algorithm.advantage=path/to/mine.py:MINE`` (or ``package.module:MINE``) and
``algorithm.policy_loss=path/to/mine.py:my_loss`` (:mod:`relayrl.plugins` finds the object; the config makes a
file's path absolute when it loads, so every process, the driver, rank processes and Ray workers, imports the
same file itself: the config and the loss carry only the path).

**Estimator.** The object is an :class:`~relayrl.algorithms.estimators.base.Estimator` record (what it needs
declared as the registered ones declare it: ``min_group``, ``values``, ``group_relative``, ...), or a plain
function ``fn(x: EstimatorInputs) -> Advantages``, taken as a record with the defaults, except that it is not
group-relative (it sees the whole batch: nothing tells it is not whitening over the batch) and reads the rewards,
group ids and mask only. The config's checks ask the record as they ask a registered one (``rollout.n >=
min_group``, a critic for ``values``, ...); its return is checked at every call (``Estimator._checked``).

**Policy loss.** A function called as the registered ones are (:data:`~relayrl.algorithms.losses.POLICY_LOSSES`)::

    fn(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, dual_clip, agg, level, is_weights,
       global_tokens, global_seqs, constant, group_tokens, global_groups) -> (loss, metrics)

with ``logprobs`` ``[B, T]`` (with grad), ``old_logprobs``, ``advantages``, ``mask`` ``[B, T]`` and the keywords
of :class:`~relayrl.algorithms.ratio.LossArgs` (:data:`COMMON_LOSS_ARGS`; ``**common`` takes them all).
``loss`` is either a 0-dim tensor, the micro-batch's loss already aggregated (``LossArgs.of(name,
common).reduce(token_losses, mask)``, as the registered ones do), or a ``[B, T]`` tensor of token losses that
relayrl aggregates so (``algorithm.loss_agg`` with the mini-batch's global counts, times ``is_weights``: a
rollout correction or a token selection). ``metrics`` is a dict of floats (or 0-dim tensors) by name
(``"mine/x"``), logged with the step's; a name ending in ``loss`` is summed over micro-batches, ``_max`` /
``_min`` take extremes, a ``seq_..`` name is averaged over responses, others over tokens
(:func:`~relayrl.engines.training.base.metric_reduction`). The signature is checked when the config loads; the
return at every call (its type and shape) and, at a process's first call, that it is finite and carries the
gradient of ``logprobs``. ``algorithm.policy_loss_options`` go to ``fn`` by keyword, each a parameter it names
(:meth:`UserLoss.check_options`); ``fn.uses_ratio = False`` declares that it never reads ``old_logprobs``.

This module imports no torch (the config checks run it while a recipe is validated); a user's file is imported
when the config naming it loads.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace
from typing import Any, Callable

from relayrl.algorithms.estimators.base import Estimator
from relayrl.plugins import PluginError, resolve

__all__ = ["COMMON_LOSS_ARGS", "UserLoss", "load_estimator", "load_policy_loss"]

COMMON_LOSS_ARGS: tuple[str, ...] = ("clip_low", "clip_high", "dual_clip", "agg", "level", "is_weights",
                                     "global_tokens", "global_seqs", "constant", "group_tokens", "global_groups")
"""The keywords every policy loss is called with: the fields of :class:`~relayrl.algorithms.ratio.LossArgs`."""

_ESTIMATORS: dict[str, Estimator] = {}
_LOSSES: dict[str, "UserLoss"] = {}


def _bind(fn: Callable, key: str, args: tuple, kwargs: dict, called: str) -> None:
    """Refuse ``fn`` (at ``key``) unless its signature can take ``args`` and ``kwargs``."""
    if inspect.isclass(fn) or not callable(fn):
        raise PluginError(f"{key}: {type(fn).__name__ if not inspect.isclass(fn) else 'a class'} is not a "
                          f"function; point at a function called as {called}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # (no signature to read: the call's check still applies)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise PluginError(f"{key}: {getattr(fn, '__name__', fn)!r} has signature {sig}, which cannot be called as "
                          f"{called}: {e}") from None


def load_estimator(path: str) -> Estimator:
    """The estimator at ``path`` (``algorithm.advantage``), loaded once per process: an ``Estimator`` record or a
    plain function (module docstring), named by ``path``. A missing file, module or attribute, another kind of
    object, or a function that cannot take one argument is a :class:`PluginError` naming the key."""
    if path in _ESTIMATORS:
        return _ESTIMATORS[path]
    key = f"algorithm.advantage={path}"
    obj = resolve(path, key, PluginError, shape="package.module:ESTIMATOR")
    if isinstance(obj, Estimator):
        _bind(obj.fn, key, (None,), {}, "fn(x: EstimatorInputs) -> Advantages")
        est = replace(obj, name=path, plugin=True)
    elif callable(obj) and not inspect.isclass(obj):
        _bind(obj, key, (None,), {}, "fn(x: EstimatorInputs) -> Advantages")
        est = Estimator(path, obj, paper=f"user function {getattr(obj, '__name__', path)}", group_relative=False,
                        plugin=True)
    else:
        raise PluginError(f"{key} is a {type(obj).__name__ if not inspect.isclass(obj) else 'class'}; point at an "
                          f"Estimator record (relayrl.algorithms.estimators.base.Estimator) or a function "
                          f"fn(x: EstimatorInputs) -> Advantages")
    _ESTIMATORS[path] = est
    return est


def load_policy_loss(path: str) -> "UserLoss":
    """The policy loss at ``path`` (``algorithm.policy_loss``), loaded once per process, its signature checked
    (module docstring); a breach is a :class:`PluginError` naming the key."""
    if path in _LOSSES:
        return _LOSSES[path]
    key = f"algorithm.policy_loss={path}"
    fn = resolve(path, key, PluginError, shape="package.module:my_loss")
    _bind(fn, key, (None, None, None, None), dict.fromkeys(COMMON_LOSS_ARGS),
          "fn(logprobs, old_logprobs, advantages, mask, **common) with common the keywords "
          f"{', '.join(COMMON_LOSS_ARGS)} (take **common for those you do not read)")
    loss = _LOSSES[path] = UserLoss(path, fn)
    return loss


class UserLoss:
    """A user's policy loss, called as the registered ones are; its return checked (module docstring)."""

    def __init__(self, path: str, fn: Callable[..., Any]) -> None:
        self.path, self.fn, self.key = path, fn, f"algorithm.policy_loss={path}"
        uses = getattr(fn, "uses_ratio", True)
        if not isinstance(uses, bool):
            raise PluginError(f"{self.key}: its uses_ratio attribute is {uses!r}; set fn.uses_ratio = False for a "
                              f"loss that never reads old_logprobs (no pi_old pass then), or leave it out")
        self.uses_ratio = uses
        """Whether the loss reads ``old_logprobs`` (the ratio): a function that sets ``uses_ratio = False``
        declares it does not, and a step with several optimizer steps then skips the pi_old pass for it."""
        self.checked = False
        """Whether a call of this process has been checked for a finite loss with a gradient (once: the check
        reads the loss to the host)."""

    def __call__(self, logprobs: Any, old_logprobs: Any, advantages: Any, mask: Any,
                 **common: Any) -> tuple[Any, dict[str, Any]]:
        """``(loss 0-dim, metrics)`` of ``fn``'s call: a ``[B, T]`` return aggregated by ``common``'s ``agg``
        and counts (times ``is_weights``). ``common`` also holds ``algorithm.policy_loss_options``."""
        import torch

        out = self.fn(logprobs, old_logprobs, advantages, mask, **common)
        if not isinstance(out, tuple) or len(out) != 2:
            raise PluginError(f"{self.key} returned {type(out).__name__}; return (loss, metrics): loss a 0-dim "
                              f"tensor or [B, T] token losses, metrics a dict of floats by name ({{}}: none)")
        loss, metrics = out
        if not isinstance(loss, torch.Tensor):
            raise PluginError(f"{self.key} returned a loss of type {type(loss).__name__}; return a torch tensor "
                              f"(0-dim, or [B, T] token losses) computed from logprobs, so it carries the gradient")
        if loss.dim() != 0:
            if tuple(loss.shape) != tuple(mask.shape):
                raise PluginError(f"{self.key} returned a loss of shape {tuple(loss.shape)}; return a 0-dim "
                                  f"tensor or token losses shaped like the mask {tuple(mask.shape)}")
            from relayrl.algorithms.ratio import LossArgs

            loss = LossArgs(**{k: v for k, v in common.items() if k in COMMON_LOSS_ARGS}).reduce(loss, mask)
        if not isinstance(metrics, dict) or any(
                not isinstance(k, str) or isinstance(v, bool) or not (isinstance(v, (int, float)) or (
                    isinstance(v, torch.Tensor) and v.numel() == 1)) for k, v in metrics.items()):
            raise PluginError(f"{self.key} returned metrics {metrics!r}; return a dict of floats (or 0-dim "
                              f"tensors) by name, e.g. {{'mine/x': float(x)}} ({{}}: none)")
        if not self.checked:
            self._check_first(loss, logprobs)
        from relayrl.algorithms._checks import to_floats

        return loss, to_floats({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()})

    def check_options(self, options: dict[str, Any]) -> None:
        """Refuse ``algorithm.policy_loss_options`` that ``fn`` does not name as keyword parameters (a
        ``**common`` would swallow a misspelt one without a word) or that are common keywords."""
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            return  # (no signature to read)
        named = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)][4:]
        for key in sorted(options):
            if key in COMMON_LOSS_ARGS:
                raise PluginError(f"algorithm.policy_loss_options.{key}: relayrl passes {key} to every policy loss "
                                  f"itself (from algorithm.clip_low, clip_high, dual_clip, loss_agg, ratio_level "
                                  f"and the batch's counts); set it there, or give your option another name")
            if key not in named:
                has = ", ".join(n for n in named if n not in COMMON_LOSS_ARGS) or "none"
                raise PluginError(f"algorithm.policy_loss_options.{key}: {getattr(self.fn, '__name__', self.path)!r} "
                                  f"({self.path}) has no keyword parameter {key!r} (its own: {has}); add "
                                  f"'{key}=<default>' to its signature or drop the option")

    def _check_first(self, loss: Any, logprobs: Any) -> None:
        """The first call of a process: a finite loss that depends on ``logprobs``."""
        value = float(loss.detach())
        if not math.isfinite(value):
            raise PluginError(f"{self.key} returned a loss of {value} at its first call; it must be finite (a "
                              f"log of 0, a division by a zero count?)")
        if getattr(logprobs, "requires_grad", False) and not loss.requires_grad:
            raise PluginError(f"{self.key} returned a loss with no gradient (detached, or not computed from "
                              f"logprobs): the update would change nothing; compute it from logprobs")
        self.checked = True
