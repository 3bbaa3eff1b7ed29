"""What an evaluation of a run config needs, and ``relayrl eval --recipe``.

:class:`EvalSession` resolves a config's model, tokenizer, held-out problems (a built-in task's eval set, or
the rows a dataset holds out: :class:`~relayrl.workflows.problems.RunProblems`) and verifier, and runs the held-out evaluation a training run runs every
``eval.every`` steps. The training :class:`~relayrl.workflows.session.Session` is one with a run directory,
training prompts, telemetry and checkpoints added; :func:`evaluate_config` is one with a rollout group of
its own and no training (``relayrl eval --model DIR --recipe RECIPE``)::

    session  <- the config's model (--model), tokenizer, held-out problems, verifier
    rollout  <- the config's rollout role (a rank per cluster.devices; one device: in this process)
    env.name set:  evaluate_episodes(rollout, session)      greedy episodes, eval/env/*, eval.k samples
    else:          session.evaluate(generate on rollout)    greedy answers, eval.k samples
    the report -> OUT/eval.json, OUT/eval_samples.jsonl

Both paths are the functions a training run's evaluation calls, so the numbers are the ones the run
would log for the same weights (the timing metrics aside).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from relayrl.cluster import ResourcePool, make_group
from relayrl.config.loader import ConfigError
from relayrl.config.rollout_devices import pool_pack
from relayrl.config.rules import scores_responses
from relayrl.config.schema import Config
from relayrl.engines.generation.interrupt import Interrupt, build_interrupt
from relayrl.engines.reward.user import trainer_state, with_progress
from relayrl.evaluation.runner import EvalResult, evaluate, write_report
from relayrl.workflows.episodes import episode_spec, evaluate_episodes
from relayrl.workflows.problems import RunProblems
from relayrl.workflows.roles import rollout_init
from relayrl.workflows.rollout_worker import RolloutWorker, generate

__all__ = ["EvalSession", "evaluate_config", "check_evaluable", "check_device"]


def check_device(cfg: Config, training: bool = True) -> None:
    """``model.device=cuda`` on a local run, or ``reward.model_device=cuda`` for a training run's reward model or
    judge (an evaluation loads neither), needs a GPU that torch can see; say so naming the key (the reward model
    loaded at the first step's scoring, and failed there with torch's AssertionError)."""
    if cfg.cluster.backend != "local" or torch.cuda.is_available():
        return
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
    if cfg.model.device == "cuda":
        raise ConfigError(f"model.device=cuda but torch sees no GPU here (torch {torch.__version__}, {build}); set "
                          f"model.device=cpu (or auto, which picks a GPU when there is one)")
    r = cfg.reward
    if training and r.model_device == "cuda" and (r.model is not None or r.judge.path is not None):
        raise ConfigError(f"reward.model_device=cuda but torch sees no GPU here (torch {torch.__version__}, "
                          f"{build}) for the {'reward model' if r.model is not None else 'LLM judge'}; set "
                          f"reward.model_device=cpu (or auto: the run's model.device)")


class EvalSession(RunProblems):
    """Model, tokenizer, held-out problems (:class:`~relayrl.workflows.problems.RunProblems`), verifier and
    evaluation of a run config; reports go to ``report_dir`` (``NAME-stepNNNNNN.json`` for a step, ``NAME.json``
    without one), with ``report_extra`` beside the metrics. ``training``: the problems as a training run loads
    them (its training rows fitted, ``data.max_rows`` of them)."""

    def __init__(self, cfg: Config, *, report_dir: Path, report_extra: dict | None = None,
                 log: Callable[[str], None] = print, training: bool = False) -> None:
        from relayrl.engines.reward import RewardEngine

        self.report_dir, self.report_extra = report_dir, dict(report_extra or {})
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed % 2**32)
        torch.manual_seed(cfg.run.seed)
        check_device(cfg, training)
        super().__init__(cfg, training=training, log=log)
        self.interrupt, self.eval_interrupt = interrupts(cfg, self.tokenizer)
        """``rollout.interrupt`` with its phrase tokenized: the rollout's thinking budget (capped by
        ``rollout.max_new_tokens``) and evaluation's (None with ``rollout.interrupt.eval=false``; capped by
        ``eval.max_new_tokens`` when set); both None when it is off."""
        cuda = cfg.model.device == "cuda" or (cfg.model.device == "auto" and torch.cuda.is_available())
        # (a user environment's episodes bring their own rewards, in training and evaluation, and workflow rm scores
        # no response: no reward engine, whose verifier=task would want a built-in task)
        self.reward = None if cfg.env.own_rewards or not scores_responses(cfg.workflow) else RewardEngine(
            cfg.reward, task=self.task, chat_template=cfg.data.chat_template, device="cuda" if cuda else "cpu",
            template_kwargs=cfg.data.chat_template_kwargs)
        if self.reward is not None:  # a field the user reward function needs, on the first rows, before any work
            rows = (self.train_problems or self.eval_problems)[:1]
            self.reward.check_fields([p.meta.get("fields") for p in rows] or [None])
        self.pool = ResourcePool(name="main", devices=cfg.cluster.devices, nodes=cfg.cluster.nodes,
                                 device_kind="cuda" if cuda else "cpu", node=cfg.placement.nodes.get("main"),
                                 pack=pool_pack(cfg, "main"))

    def progress(self, done: int):
        """The training's progress after ``done`` RL steps, as a TRL reward function's ``trainer_state`` reads
        it (:func:`~relayrl.engines.reward.user.trainer_state`)."""
        return trainer_state(done, self.cfg.trainer.steps)

    def score(self, prompts: list[str], responses: list[str], answers: list[str], columns=None,
              extra=None) -> list[float]:
        """Evaluation's score: the verifier (and format term) only, never a learned reward, so held-out
        accuracy stays the task's whatever the training reward is. ``extra``: receives the rows' logged columns
        (:data:`~relayrl.evaluation.runner.ScoreFn`)."""
        return self.reward.verify(prompts, responses, answers, columns, extra)

    # ----------------------------------------------------------- evaluation
    def evaluate(self, generate, step: int | None, *, name: str = "eval") -> EvalResult:
        """Greedy accuracy on the held-out problems, with ``eval.k > 1`` also pass@k and avg@k of sampled answers;
        the report in :attr:`report_dir`."""
        ro, ev = self.cfg.rollout, self.cfg.eval
        score = self.score
        if step is not None:  # a training run's evaluation: TRL reward functions get its progress
            state = self.progress(step)

            def score(prompts, responses, answers, columns, extra):
                return self.score(prompts, responses, answers, with_progress(columns, state), extra)

        result = evaluate(generate, self.encode, self.eval_problems, score,
                          max_new_tokens=ev.max_new_tokens or ro.max_new_tokens, k=ev.k,
                          temperature=self.eval_temperature, top_p=ev.top_p, top_k=ev.top_k, min_p=ev.min_p,
                          stop_strings=ro.stop_strings,
                          interrupted=self.eval_interrupt is not None,
                          decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False))
        self.report(result, step, name=name)
        return result

    def report(self, result: EvalResult, step: int | None, *, name: str = "eval") -> tuple[Path, Path]:
        """Write an evaluation's report (metrics, and every sample) to :attr:`report_dir`."""
        at = {} if step is None else {"step": step}
        return write_report(result, self.report_dir, name=name if step is None else f"{name}-step{step:06d}",
                            extra={**at, "model": str(self.model_path), **self.report_extra})

    @property
    def eval_temperature(self) -> float:
        """The temperature of the ``eval.k`` sampled answers: ``eval.temperature``, else the rollout's (1.0 for a
        greedy rollout)."""
        return self.cfg.eval.temperature or self.cfg.rollout.temperature or 1.0


def interrupts(cfg: Config, tokenizer) -> tuple[Interrupt | None, Interrupt | None]:
    """``rollout.interrupt`` for the rollout and for evaluation (:attr:`EvalSession.interrupt`), its phrase
    tokenized once; :class:`~relayrl.engines.generation.interrupt.InterruptError` naming the keys when the
    phrase's tokens do not fit the response budget (before any work)."""
    it = cfg.rollout.interrupt
    if not it.enabled:
        return None, None

    def build(budget: int, key: str) -> Interrupt:
        return build_interrupt(tokenizer, after_tokens=it.after_tokens, text=it.text, answer_tokens=it.answer_tokens,
                               marker=it.marker, max_new_tokens=budget, budget_key=key)

    ev = cfg.eval.max_new_tokens
    rollout = build(cfg.rollout.max_new_tokens, "rollout.max_new_tokens")
    if not it.eval:
        return rollout, None
    return rollout, rollout if ev is None else build(ev, "eval.max_new_tokens")


def check_evaluable(cfg: Config) -> None:
    """Refuse a config whose model generates nothing to evaluate (a reward model's, ``workflow: rm``)."""
    if cfg.workflow == "rm":
        raise ConfigError("relayrl eval --recipe: workflow rm trains a reward model, which generates nothing; "
                          "its held-out pair accuracy is logged by its training run (rm/accuracy)")


def evaluate_config(cfg: Config, out: Path, *, extra: dict | None = None,
                    log: Callable[[str], None] = print) -> dict[str, float]:
    """Evaluate ``cfg``'s model on ``cfg``'s held-out set as its training run would (``relayrl eval --recipe``):
    multi-turn episodes with ``env.name`` set, single answers otherwise; ``eval.k > 1`` adds sampled ones. The
    report (``eval.json``, ``eval_samples.jsonl``) goes to ``out``, with ``extra`` beside the metrics; returns
    the metrics."""
    check_evaluable(cfg)
    s = EvalSession(cfg, report_dir=out, report_extra=extra, log=log)
    if s.reward is not None:  # (no training run: no trainer_state for a TRL reward function)
        s.reward.check_standalone()
    spec = episode_spec(cfg, s.tokenizer)  # the environment's contract, checked before the model loads
    ev = cfg.eval
    what = (f"greedy episodes (env.name={cfg.env.name}, at most env.max_turns={cfg.env.max_turns} turns)"
            if spec is not None else "greedy answers")
    if s.eval_interrupt is not None:
        what += f" (a thinking budget: rollout.interrupt.after_tokens={s.eval_interrupt.after_tokens})"
    filters = "".join(f", eval.{k}={getattr(ev, k):g}" for k, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0))
                      if getattr(ev, k) != off)
    sampled = f", then eval.k={ev.k} sampled at temperature {s.eval_temperature:g}{filters} each" if ev.k > 1 else ""
    log(f"relayrl eval: {s.model_path} on {len(s.eval_problems)} held-out problems: {what}{sampled}")
    # (one rank runs in this process, as a training run's rollout does on a single device; more are processes)
    rollout = make_group(cfg.cluster.model_copy(update={"in_process": True}), RolloutWorker, s.pool, "rollout",
                         init_kwargs=rollout_init(cfg, str(s.model_path)),
                         devices_per_rank=cfg.rollout.devices_per_rank)
    try:
        if spec is not None:
            return evaluate_episodes(rollout, s, spec, None)
        return s.evaluate(lambda p, sp: generate(rollout, p, sp, cfg.rollout.on_error, s.eval_interrupt),
                          None).metrics
    finally:
        rollout.shutdown()
