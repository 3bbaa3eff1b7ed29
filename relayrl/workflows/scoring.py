"""The scorer: reward and advantage calls of a GRPO-family step, reading responses from the dock and writing
rewards, baselines and advantages back (scalars and receipts to the driver, no sample tensors).

It runs in the driver's process: on the driver's threads (rule verifiers, user functions: calls in flight
at once), or as a one-rank group on a pool whose turns it takes (``placement.reward=<pool>``: a reward model
or judge on that pool's device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from relayrl.algorithms.advantage_stats import AdvantageSums
from relayrl.algorithms.dapo import overlong_penalty

from relayrl.cluster import Worker
from relayrl.engines.reward import RewardError
from relayrl.engines.reward.extra import ExtraLog
from relayrl.environments.extras import EXTRAS_COLUMN, decode_extras
from relayrl.engines.reward.user import fn_rows, with_ids, with_progress
from relayrl.workflows.estimate import advantage_rows

__all__ = ["ScoreWorker", "Scored", "RewardShaping"]


@dataclass(frozen=True)
class RewardShaping:
    """Rewards ``[N]`` from verifier scores ``[N]`` and response lengths ``[N]``: DAPO's overlong shaping when
    enabled, else the scores. A plain record, so that a scorer on a pool of its own (``placement.reward``),
    built in a Ray actor there, receives it pickled."""

    overlong: bool
    penalty: float
    max_len: int
    cache: int

    @classmethod
    def of(cls, cfg) -> "RewardShaping":
        """The shaping of run config ``cfg`` (``algorithm.overlong_*``, ``rollout.max_new_tokens``)."""
        a = cfg.algorithm
        return cls(a.overlong_shaping, a.overlong_penalty, cfg.rollout.max_new_tokens, a.overlong_cache)

    def __call__(self, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if not self.overlong:
            return scores.clone()
        return scores + self.penalty * overlong_penalty(lengths, self.max_len, self.cache)


class Scored(NamedTuple):
    """What :meth:`ScoreWorker.score_rows` returns for a batch of rows (scalars only)."""

    scores: list[float]
    """The verifier's score of each row."""
    rewards: list[float]
    """Each row's reward after the run's shaping."""
    metrics: dict[str, float]
    """The reward engine's metrics for the call."""
    groups: list[int]
    """Each row's prompt group."""
    each: list[list[float]] | None = None
    """Each row's score by each user function (NaN: the function returned None), when the advantages read
    them (``reward.user_aggregation=normalize_then_sum``); else None."""
    extra: list[dict] | None = None
    """The first rows' columns logged by the user functions (``log_extra``), one dict each (``{}``: none), for
    the step's samples; None when none were asked for."""
    rows: dict[str, int] | None = None
    """The rows a metric is over where they are not the rows scored (``reward/fn/NAME_*``: the rows the function
    did not return ``None`` for), for the step's row-weighted means; None: none such."""


class ScoreWorker(Worker):
    """The reward and advantage stages, in the driver's process: reads responses from the dock, scores them
    with the run's reward engine (rule verifiers, user functions, a reward model or LLM judge, on this
    worker's pool device when it has one) and writes rewards; computes advantages of
    complete groups (or of the whole batch) and writes them."""

    def __init__(self, reward, tokenizer, algorithm, shape) -> None:
        self.reward, self.tokenizer, self.algorithm, self.shape = reward, tokenizer, algorithm, shape
        # a rank of a pool (placement.reward=<pool>); no reward engine: a user environment's own rewards
        if hasattr(self, "device") and reward is not None and reward.cfg.model_device == "auto":
            reward.place(self.device)  # its learned rewards (reward model, judge) run on the pool's device

    def score_rows(self, reader, problems: Sequence, progress: Any = None, extra: int = 0) -> Scored:
        """Score the rows (any rows: a group's responses may come in several calls; ``problems[group]`` holds
        each row's prompt and answer): the verifier's scores and the rewards after the run's shaping. Rows
        with ``env_rewards`` (episodes) take those as scores. Nothing is written: the score stage writes a
        group's rewards once all its rows are scored (:meth:`write_rewards`), or drops it (DAPO).
        ``progress``: the training's progress for a TRL reward function's ``trainer_state``
        (:func:`~relayrl.engines.reward.user.trainer_state`; None: not passed). ``extra``: how many of the
        first rows' ``log_extra`` columns to return (the room left in the step's samples; 0: none kept)."""
        cols = reader.read()
        log = ExtraLog(extra) if extra > 0 else None
        groups = [int(g) for g in cols["group"]]
        if "env_rewards" in cols:  # multi-turn episodes: their environments gave the rewards
            scores, metrics, each = [float(r) for r in cols["env_rewards"]], {}, None
        else:
            texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in cols["response_ids"]]
            probs = [problems[g] for g in groups]
            scores, metrics, each = self.reward.score_each(
                [p.prompt for p in probs], texts, [p.answer for p in probs],
                columns=_rows(probs, cols["response_ids"], progress), extra=log)
        lengths = torch.tensor([len(r) for r in cols["response_ids"]], dtype=torch.float32)
        rewards = self.shape(torch.tensor(scores, dtype=torch.float32), lengths)
        decoupled = self.reward is not None and self.reward.cfg.decoupled
        rows = fn_rows(each, self.reward.fn_names) if each is not None and len(self.reward.fn_names) > 1 else None
        extras = None if log is None else log.rows(len(groups))
        if extras is not None and EXTRAS_COLUMN in cols:  # (an episode's: what its environment's steps logged)
            extras = [decode_extras(x) for x in cols[EXTRAS_COLUMN][:len(extras)]]
        return Scored([float(x) for x in scores], rewards.tolist(), metrics, groups, each if decoupled else None,
                      extras, rows)

    def fold_moments(self) -> dict[str, float] | None:
        """A step's (a batch's) start, every earlier one's rewards scored: ``reward.normalize=running``'s
        moments take in the rewards scored since the last start (one update: :meth:`RewardEngine.fold_moments`),
        and are what this step's rewards are whitened by, whatever calls score them. Returns their state (None
        without ``reward.normalize``)."""
        if getattr(self.reward, "moments", None) is None:
            return None
        self.reward.fold_moments()
        return self.reward.moments.state()

    def reward_moments(self) -> dict[str, float] | None:
        """``reward.normalize=running``: the moments of every reward scored so far, for a checkpoint (what the
        next :meth:`fold_moments` makes them; None without)."""
        return None if getattr(self.reward, "moments", None) is None else self.reward.folded_moments()

    def load_reward_moments(self, state: dict[str, float]) -> None:
        """A checkpoint's :meth:`reward_moments` back (nothing to load into without ``reward.normalize``)."""
        if getattr(self.reward, "moments", None) is not None:
            self.reward.load_moments(state)

    @staticmethod
    def write_rewards(slots, rewards: Sequence[float], each: Sequence[Sequence[float]] | None = None) -> Any:
        """Write ``rewards`` (one per slot row) and, given ``each`` (GDPO), each row's score by each user
        function as ``fn_scores`` (``[K]`` per row, NaN: not scored); returns the receipt."""
        cols: dict[str, list] = {"rewards": [float(r) for r in rewards]}
        if each is not None:
            cols["fn_scores"] = [torch.tensor(x, dtype=torch.float32) for x in each]
        return slots.write(cols)

    def baseline_into(self, reader, slots, problems: Sequence, progress: Any = None) -> tuple[Any, list[float]]:
        """ReMax: the (shaped) reward of each group's greedy response (``baseline_ids``, the same in every row
        of the group), written as every row's ``baseline``; returns ``(receipt, one baseline per group)``."""
        cols = reader.read()
        groups = [int(g) for g in cols["group"]]
        first = {g: i for i, g in reversed(list(enumerate(groups)))}
        order = sorted(first)
        ids = [cols["baseline_ids"][first[g]] for g in order]
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in ids]
        scores, _ = self.reward.score([problems[g].prompt for g in order], texts, [problems[g].answer for g in order],
                                      columns=_rows([problems[g] for g in order], ids, progress),
                                      learn=False)  # (a reference point: reward.normalize's moments are the samples')
        failed = [g for g, x in zip(order, scores) if x != x]  # reward.on_error=drop_group
        if failed:  # (the group's sampled rows may be in other stages' hands already: too late to drop it)
            raise RewardError(f"the reward failed on the greedy baseline response to prompt "
                              f"{problems[failed[0]].prompt[:200]!r} (ReMax): a group cannot be dropped once its "
                              f"baseline is due; fix the reward source (the log names the cause), or use another "
                              f"algorithm.advantage with reward.on_error=drop_group")
        lengths = torch.tensor([len(r) for r in ids], dtype=torch.float32)
        base = dict(zip(order, self.shape(torch.tensor(scores, dtype=torch.float32), lengths).tolist()))
        return slots.write({"baseline": [base[g] for g in groups]}), [base[g] for g in order]

    def advantages_into(self, reader, slots, kl_coef: float | None = None
                        ) -> tuple[Any, dict[str, float], AdvantageSums]:
        """Advantages of the rows (whole groups, or the whole batch for batch-whitened estimators); ``kl_coef``:
        the step's KL coefficient (KL in the rewards; None: ``algorithm.kl_coef``). Rows with ``fn_scores``
        (GDPO) take their advantages from those, not from ``rewards`` (:func:`advantage_rows`). Returns the
        receipt, the KL (and estimator) metrics and the advantages' sums over the rows' valid tokens (the
        step's ``advantage/*``)."""
        cols = reader.read()
        decoupled = {} if "fn_scores" not in cols else dict(  # (GDPO: reward.user_aggregation=normalize_then_sum)
            fn_scores=torch.stack(cols["fn_scores"]), fn_weights=torch.tensor(self.reward.cfg.fn_weights))
        out, kl = advantage_rows(
            self.algorithm, torch.tensor([float(r) for r in cols["rewards"]]), [len(r) for r in cols["response_ids"]],
            torch.tensor([int(g) for g in cols["group"]]), **decoupled, gen_logprobs=cols.get("gen_logprobs"),
            ref_logprobs=cols.get("ref_logprobs"), values=cols.get("values"),
            teacher_logprobs=cols.get("teacher_logprobs"), old_logprobs=cols.get("old_logprobs"),
            sum_sq=cols.get("sum_pi_squared"),
            baseline=torch.tensor([float(b) for b in cols["baseline"]]) if "baseline" in cols else None,
            loss_masks=cols.get("loss_mask"), kl_coef=kl_coef)
        return slots.write(out), kl, AdvantageSums.of(out["advantages"], cols.get("loss_mask"))


def _rows(problems: Sequence, token_ids: Sequence, progress: Any) -> list[dict]:
    """The columns a user reward function may take: each row's dataset fields, its response's token ids and,
    when given, the training's progress."""
    rows = with_ids([p.meta.get("fields") for p in problems], token_ids)
    return rows if progress is None else with_progress(rows, progress)
