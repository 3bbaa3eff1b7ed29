"""What an advantage estimator is to the rest of relayrl: a small frozen record that says what it needs and
computes, so the pipeline and the config checks ask it instead of branching on estimator names.

The formulas themselves are pure functions in :mod:`relayrl.algorithms.advantages`; an estimator binds one of
them to the inputs a step has (:class:`EstimatorInputs`) and declares:

* ``values``: it reads per-token critic values, so the step runs a critic (PPO);
* ``baseline``: it reads the reward of one greedy response per prompt, so the step generates and scores one
  (ReMax);
* ``reads_token_rewards``: its advantages come from per-token rewards, so a KL penalty in the reward
  applies (``algorithm.kl_in_reward``);
* ``group_relative``: a group's advantages depend on that group alone, so a streaming step computes them as
  each group arrives; otherwise they are whitened over the whole batch and wait for it;
* ``min_group``: responses per prompt it needs (2: a baseline from the other responses);
* ``group_baseline``: its advantage compares each outcome reward with the other rewards of its prompt group
  (their mean, or the others' mean) and with nothing else, so a reward that means something only within its
  group (GDPO's decoupled sum, ``reward.user_aggregation=normalize_then_sum``) is one it can take;
* ``token_stats``: it reads two per-token statistics of the policy before the update, the log-prob of each
  sampled token and ``sum_v p_v^2`` of each position's distribution (OTB), so the step runs the trainer's
  pre-update (pi_old) pass, which writes both, and computes the advantages after it;
* ``old_logprobs``: it reads the log-probs of that pass alone (online DPO's margins), with the same effect on the
  step (``token_stats`` implies it: :attr:`Estimator.reads_old`);
* ``reference``: it reads the reference model's log-probs of the sampled tokens (online DPO's implicit rewards),
  so the step builds a reference whatever ``algorithm.kl_coef`` says and computes the advantages after its pass;
* ``own_loss``: its advantages are the per-response gradient of a loss of its own (the name given, e.g. DPO's):
  ``-A log pi`` summed over each response's tokens and averaged over the batch's responses
  (``policy_loss=gpg``, ``loss_agg=seq-mean-token-sum``) then has exactly that loss's gradient, so the config
  refuses any other policy loss or aggregation and every term that would change that gradient (a KL term or
  KL reward, a rollout correction, token selection, the overlong filter, distillation);
* ``params``: the ``algorithm`` keys it reads besides the rewards (``gamma``, ``lam``, ``normalize_std``, the
  ``online_dpo`` section), so a value set for an estimator that ignores it is refused when the config loads;
* ``plugin``: a user's estimator loaded by path (``algorithm.advantage=file.py:NAME``,
  :mod:`relayrl.algorithms.plugins`; its ``name`` is then that path): a return that breaks the contract is the
  user's to fix, a :class:`~relayrl.plugins.PluginError` naming the key, where relayrl's own is a bug
  (``ValueError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:  # the records are torch-free: the config checks read them before torch is imported
    from torch import Tensor


__all__ = ["Advantages", "DPOSpec", "Estimator", "EstimatorInputs", "broadcast", "token_rewards"]


@dataclass(frozen=True)
class DPOSpec:
    """Online DPO's options (``algorithm.online_dpo``), as :func:`~relayrl.algorithms.dpo.dpo_loss` takes them."""

    beta: float = 0.1
    kind: str = "sigmoid"
    label_smoothing: float = 0.0
    nll_weight: float = 0.0


@dataclass(frozen=True)
class EstimatorInputs:
    """One batch of responses in the padded ``[B, T]`` response-token layout (``N == B`` responses)."""

    rewards: Tensor
    """``[N]`` outcome reward per response."""
    group_ids: Tensor
    """``[N]`` integer prompt-group id per response."""
    mask: Tensor
    """``[B, T]`` 1 on valid response tokens."""
    token_rewards: Tensor | None = None
    """``[B, T]`` per-token rewards (the outcome at the last token minus a KL penalty); read only by
    estimators with ``reads_token_rewards``."""
    values: Tensor | None = None
    """``[B, T]`` critic values ``V(s_t)`` (``values=True`` estimators)."""
    baseline: Tensor | None = None
    """``[N]`` reward of the greedy response to each response's prompt (``baseline=True`` estimators)."""
    gamma: float = 1.0
    lam: float = 1.0
    normalize_std: bool = True
    eps: float = 1e-6
    whiten: bool = False
    """GAE: whiten the advantages over the batch's valid tokens (as PPO implementations do in training)."""
    logprobs: Tensor | None = None
    """``[B, T]`` log-probs of the sampled tokens under the policy before the update (``token_stats=True``
    estimators)."""
    sum_sq: Tensor | None = None
    """``[B, T]`` ``sum_v p_v^2`` of each position's distribution under the same policy (``token_stats=True``)."""
    ref_logprobs: Tensor | None = None
    """``[B, T]`` log-probs of the sampled tokens under the reference model (``reference=True`` estimators)."""
    dpo: DPOSpec | None = None
    """Online DPO's options (``algorithm.online_dpo``); None: their defaults."""
    is_weights: Tensor | None = None
    """``[B, T]`` the rollout correction's per-token factor (``algorithm.correction``: the truncated or masked
    importance weight ``pi_old / mu``), for ``token_stats=True`` estimators when the correction is on (OTB weighs
    each token's energy by its square); None: no correction."""


class Advantages(NamedTuple):
    advantages: Tensor
    """``[B, T]``, 0 at masked positions."""
    returns: Tensor | None = None
    """``[B, T]`` the critic's regression targets (estimators with ``values=True``)."""
    metrics: dict[str, float] | None = None
    """The estimator's own figures of the batch (namespaced, e.g. ``online_dpo/loss``), logged with the step's."""


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: a config name, what it needs (module docstring) and ``fn``."""

    name: str
    fn: Callable[[EstimatorInputs], Advantages]
    paper: str
    values: bool = False
    baseline: bool = False
    reads_token_rewards: bool = False
    group_relative: bool = True
    min_group: int = 1
    group_baseline: bool = False
    token_stats: bool = False
    old_logprobs: bool = False
    reference: bool = False
    own_loss: str | None = None
    params: frozenset[str] = frozenset()
    plugin: bool = False

    @property
    def reads_old(self) -> bool:
        """It reads the trainer's pre-update (pi_old) pass: its log-probs (``old_logprobs``), or those and
        ``sum_v p_v^2`` (``token_stats``)."""
        return self.old_logprobs or self.token_stats

    def __call__(self, x: EstimatorInputs) -> Advantages:
        if self.values and x.values is None:
            raise ValueError(f"advantage estimator {self.name!r} needs values; pass values=...")
        if self.baseline and x.baseline is None:
            raise ValueError(f"advantage estimator {self.name!r} needs baseline_rewards; pass baseline_rewards=...")
        if self.token_stats and (x.logprobs is None or x.sum_sq is None):
            raise ValueError(f"advantage estimator {self.name!r} needs the policy's per-token statistics; pass "
                             f"logprobs=... and sum_sq=...")
        if self.old_logprobs and x.logprobs is None:
            raise ValueError(f"advantage estimator {self.name!r} needs the policy's pre-update log-probs; pass "
                             f"logprobs=...")
        if self.reference and x.ref_logprobs is None:
            raise ValueError(f"advantage estimator {self.name!r} needs the reference model's log-probs; pass "
                             f"ref_logprobs=...")
        return self._checked(self.fn(x), x)

    def _checked(self, out: object, x: EstimatorInputs) -> Advantages:
        """``out`` if it is what an estimator returns (advantages shaped like the mask, the critic's returns for
        ``values``, metrics that are floats by name), else a ValueError naming the estimator and the breach:
        a wrong one failed later, deep in the update (an IndexError, a missing attribute)."""
        what = f"algorithm.advantage={self.name}" if self.plugin else f"advantage estimator {self.name!r}"
        breach: type[ValueError] = ValueError
        if self.plugin:
            from relayrl.plugins import PluginError

            breach = PluginError
        adv = getattr(out, "advantages", None)
        if not isinstance(out, tuple) or not hasattr(adv, "shape"):
            raise breach(f"{what} returned {type(out).__name__}; return Advantages(advantages [B, T], "
                             f"returns=None, metrics=None) (relayrl.algorithms.estimators.base.Advantages)")
        if tuple(adv.shape) != tuple(x.mask.shape):
            raise breach(f"{what} returned advantages of shape {tuple(adv.shape)}; expected the mask's "
                             f"{tuple(x.mask.shape)} (one value per response token: broadcast(per_response, mask))")
        returns = getattr(out, "returns", None)
        if self.values and (returns is None or tuple(returns.shape) != tuple(x.mask.shape)):
            got = "none" if returns is None else f"shape {tuple(returns.shape)}"
            raise breach(f"{what} reads values, so it returns the critic's returns shaped like the mask "
                             f"{tuple(x.mask.shape)}; got {got}")
        metrics = getattr(out, "metrics", None)
        if metrics is not None:
            bad = {k: v for k, v in metrics.items() if not isinstance(k, str) or isinstance(v, bool)
                   or not isinstance(v, (int, float))} if isinstance(metrics, dict) else metrics
            if not isinstance(metrics, dict) or bad:
                raise breach(f"{what} returned metrics {bad!r}; metrics are a dict of Python floats by name "
                                 f"('mine/x': float(value))")
        return out


def broadcast(adv: Tensor, mask: Tensor) -> Tensor:
    """A per-response advantage ``[N]`` on every valid token of its row ``[N, T]``."""
    from relayrl.algorithms._checks import as_float_mask

    return adv.unsqueeze(1) * as_float_mask(mask, adv)


def token_rewards(x: EstimatorInputs) -> Tensor:
    """The per-token rewards of ``x``, or each outcome reward on its row's last valid token."""
    from relayrl.algorithms.advantages import outcome_to_token_rewards

    return x.token_rewards if x.token_rewards is not None else outcome_to_token_rewards(x.rewards, x.mask)
