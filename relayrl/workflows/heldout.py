"""What an evaluation of a run config needs, and ``relayrl eval --recipe``.

:class:`EvalSession` resolves a config's model, tokenizer, held-out problems (a built-in task's eval set, or
the rows a dataset holds out) and verifier, and runs the held-out evaluation a training run runs every
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
from relayrl.config.schema import Config
from relayrl.data.tasks import Problem, make_task
from relayrl.engines.generation.interrupt import Interrupt, build_interrupt
from relayrl.engines.reward.user import trainer_state, with_progress
from relayrl.evaluation.runner import EvalResult, evaluate, write_report
from relayrl.models.load import check_model_dir, load_tokenizer
from relayrl.models.tiny import build_tiny
from relayrl.workflows.episodes import episode_spec, evaluate_episodes
from relayrl.workflows.roles import rollout_init
from relayrl.workflows.rollout_worker import RolloutWorker, generate

__all__ = ["EvalSession", "evaluate_config", "check_evaluable", "check_device", "resolve_model_path"]


def check_device(cfg: Config) -> None:
    """``model.device=cuda`` on a local run needs a GPU that torch can see; say so naming the key."""
    if cfg.model.device == "cuda" and cfg.cluster.backend == "local" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        raise ConfigError(f"model.device=cuda but torch sees no GPU here (torch {torch.__version__}, {build}); set "
                          f"model.device=cpu (or auto, which picks a GPU when there is one)")


def resolve_model_path(cfg: Config) -> Path:
    """``trainer.init_from`` > ``model.path`` > the tiny default (built and cached on first use)."""
    for key, value in (("trainer.init_from", cfg.trainer.init_from), ("model.path", cfg.model.path)):
        if value:  # (checked here, not in each worker that loads the weights)
            return check_model_dir(value, key, f"{key}={value}")
    return build_tiny(cfg.model.tiny)


class EvalSession:
    """Model, tokenizer, held-out problems, verifier and evaluation of a run config; reports go to
    ``report_dir`` (``NAME-stepNNNNNN.json`` for a step, ``NAME.json`` without one), with ``report_extra``
    beside the metrics."""

    def __init__(self, cfg: Config, *, report_dir: Path, report_extra: dict | None = None,
                 log: Callable[[str], None] = print) -> None:
        from relayrl.engines.reward import RewardEngine

        self.cfg, self.log = cfg, log
        self.report_dir, self.report_extra = report_dir, dict(report_extra or {})
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed % 2**32)
        torch.manual_seed(cfg.run.seed)
        check_device(cfg)
        self.model_path = resolve_model_path(cfg)
        self.tokenizer = load_tokenizer(self.model_path, chat_template=cfg.model.template())
        self._encode_cache: dict[str, list[int]] = {}
        self.task, self.train_problems, self.eval_problems = self._data()
        """``train_problems``: a dataset's training rows (None for a built-in task, which draws fresh ones)."""
        self._describe_tools(self.train_problems)
        self._check_lengths()
        self.interrupt, self.eval_interrupt = interrupts(cfg, self.tokenizer)
        """``rollout.interrupt`` with its phrase tokenized: the rollout's thinking budget (capped by
        ``rollout.max_new_tokens``) and evaluation's (None with ``rollout.interrupt.eval=false``; capped by
        ``eval.max_new_tokens`` when set); both None when it is off."""
        cuda = cfg.model.device == "cuda" or (cfg.model.device == "auto" and torch.cuda.is_available())
        # (a user environment's episodes bring their own rewards, in training and evaluation: no reward engine)
        self.reward = None if cfg.env.own_rewards else RewardEngine(
            cfg.reward, task=self.task, chat_template=cfg.data.chat_template, device="cuda" if cuda else "cpu")
        if self.reward is not None:  # a field the user reward function needs, on the first rows, before any work
            rows = (self.train_problems or self.eval_problems)[:1]
            self.reward.check_fields([p.meta.get("fields") for p in rows] or [None])
        self.pool = ResourcePool(name="main", devices=cfg.cluster.devices, nodes=cfg.cluster.nodes,
                                 device_kind="cuda" if cuda else "cpu", node=cfg.placement.nodes.get("main"),
                                 pack=pool_pack(cfg, "main"))

    # ------------------------------------------------------------------ data
    def _data(self) -> tuple[object, list[Problem] | None, list[Problem]]:
        """(the task or None, a dataset's training rows or None, the held-out problems)."""
        from relayrl.data.datasets import load_problems

        d = self.cfg.data
        if d.task is not None:
            task = make_task(d.task, **d.task_options)
            eval_task = make_task(d.task, **{**d.task_options, **(d.eval_task_options or {}), "eval_size": self.cfg.eval.size})
            return task, None, eval_task.eval_set()
        rejected = d.rejected_key if self.cfg.workflow in ("dpo", "rm") else None  # preference pairs, every row checked
        kto = self.cfg.workflow == "kto"  # labelled rows, every label checked; only desirable answers are scored
        label = d.label_key if kto else None
        train = load_problems(d.dataset(rejected_key=rejected, label_key=label))
        size = self.cfg.eval.size
        held_out = d.eval_datasets(rejected_key=rejected if self.cfg.workflow == "rm" else None, label_key=label)
        if held_out:  # each held-out set's first eval.size rows (verl's data.val_files list)
            return None, train, [p for i, ds in enumerate(held_out) for p in self._held_out(ds, i, len(held_out), kto)]
        if len(train) >= 2 * size:  # hold out a seeded sample of rows; train on the rest
            held = set(random.Random(self.cfg.run.seed).sample(range(len(train)), size))
            self.log(f"relayrl: no data.eval_path; holding out {size} of {len(train)} rows of {d.path or d.hf_name} for evaluation")
            return None, [p for i, p in enumerate(train) if i not in held], _scored([train[i] for i in sorted(held)], kto)
        self.log(f"relayrl: no data.eval_path and only {len(train)} rows in {d.path or d.hf_name}: evaluating on the first "
                 f"{min(size, len(train))} training rows (not held out); set data.eval_path for a held-out score")
        return None, train, _scored(train, kto)[:size]

    def _held_out(self, ds, i: int, of: int, kto: bool = False) -> list[Problem]:
        """The first ``eval.size`` scored rows of held-out set ``ds`` (kto: its desirable rows), item ``i`` of
        ``of`` (an error names the item of a data.eval_path list)."""
        from relayrl.data.datasets import DatasetError, load_problems

        try:
            return _scored(load_problems(ds), kto)[: self.cfg.eval.size]
        except DatasetError as e:
            if of == 1:
                raise
            raise DatasetError(f"data.eval_path item {i} ({ds.path}): {e}") from None

    def _describe_tools(self, train: list[Problem] | None) -> None:
        """``env.tools_in_prompt``: the tool environment's tools go into each chat prompt's template, in its
        ``tools`` list (as TRL renders them), so an instruct model knows what it may call."""
        env = self.cfg.env
        chats = [p for p in (*(train or ()), *self.eval_problems) if "messages" in p.meta]
        if env.name != "tools" or not env.tools_in_prompt or not chats:
            return
        from relayrl.environments.config import load_tool
        from relayrl.environments.tools import tool_schema

        if "tools" not in str(getattr(self.tokenizer, "chat_template", None) or ""):
            self.log(f"relayrl: env.tools_in_prompt: the chat template of {self.model_path} has no tools list, so "
                     f"the prompts do not describe the tools; describe them in data.system_prompt (or set "
                     f"env.tools_in_prompt=false to silence this)")
            return
        schemas = [tool_schema(load_tool(t, env.sandbox)) for t in env.tools]
        for p in chats:
            p.meta["tools"] = schemas

    def _check_lengths(self) -> None:
        """Refuse (or with ``data.long_prompts=drop`` leave out) a held-out row longer than
        ``data.max_prompt_tokens`` or whose prompt plus the tokens generated after it exceed the model's
        ``max_position_embeddings`` (positions past it were never trained); a training session fits its
        training rows first. ``relayrl eval --task/--data`` applies the same context check
        (:func:`relayrl.data.lengths.check_context`)."""
        e = self.cfg.eval
        key = "eval.max_new_tokens" if e.max_new_tokens else "rollout.max_new_tokens"
        budget = e.max_new_tokens or self.cfg.rollout.max_new_tokens
        self.eval_problems = self._fit(self.eval_problems, "held-out", budget, key)

    def _fit(self, problems: list[Problem], what: str, budget: int | None, key: str) -> list[Problem]:
        """The ``what`` rows that fit ``data.max_prompt_tokens`` and the model's context beside ``budget`` new
        tokens (None: the rows are not generated from), as :func:`relayrl.data.lengths.fit_prompts` keeps them."""
        from relayrl.data.lengths import PromptRoom, context_limit, fit_prompts

        d = self.cfg.data
        room = PromptRoom(max_tokens=d.max_prompt_tokens, budget=budget, key=key,
                          limit=context_limit(self.model_path), model=self.model_path)
        return fit_prompts(problems, self.encode, room, drop=d.long_prompts == "drop", what=what, log=self.log)

    def encode(self, problem: Problem) -> list[int]:
        """Prompt token ids (chat template applied to chat-message prompts), cached by prompt text."""
        ids = self._encode_cache.get(problem.prompt)
        if ids is None:
            from relayrl.data.datasets import encode_prompt

            ids = self._encode_cache[problem.prompt] = list(encode_prompt(self.tokenizer, problem, self.cfg.data.chat_template,
                                                                 self.cfg.data.chat_template_kwargs))
        return ids

    def progress(self, done: int):
        """The training's progress after ``done`` RL steps, as a TRL reward function's ``trainer_state`` reads
        it (:func:`~relayrl.engines.reward.user.trainer_state`)."""
        return trainer_state(done, self.cfg.trainer.steps)

    def score(self, prompts: list[str], responses: list[str], answers: list[str], columns=None) -> list[float]:
        """Evaluation's score: the verifier (and format term) only, never a learned reward, so held-out
        accuracy stays the task's whatever the training reward is."""
        return self.reward.verify(prompts, responses, answers, columns)

    # ----------------------------------------------------------- evaluation
    def evaluate(self, generate, step: int | None, *, name: str = "eval") -> EvalResult:
        """Greedy accuracy on the held-out problems, with ``eval.k > 1`` also pass@k and avg@k of sampled answers;
        the report in :attr:`report_dir`."""
        ro, ev = self.cfg.rollout, self.cfg.eval
        score = self.score
        if step is not None:  # a training run's evaluation: TRL reward functions get its progress
            state = self.progress(step)

            def score(prompts, responses, answers, columns):
                return self.score(prompts, responses, answers, with_progress(columns, state))

        result = evaluate(generate, self.encode, self.eval_problems, score,
                          max_new_tokens=ev.max_new_tokens or ro.max_new_tokens, k=ev.k,
                          temperature=self.eval_temperature, stop_strings=ro.stop_strings,
                          interrupted=self.eval_interrupt is not None)
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
    spec = episode_spec(cfg, s.tokenizer)  # the environment's contract, checked before the model loads
    ev = cfg.eval
    what = (f"greedy episodes (env.name={cfg.env.name}, at most env.max_turns={cfg.env.max_turns} turns)"
            if spec is not None else "greedy answers")
    if s.eval_interrupt is not None:
        what += f" (a thinking budget: rollout.interrupt.after_tokens={s.eval_interrupt.after_tokens})"
    sampled = f", then eval.k={ev.k} sampled at temperature {s.eval_temperature:g} each" if ev.k > 1 else ""
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


def _scored(problems: list[Problem], kto: bool) -> list[Problem]:
    """The held-out problems whose answer is a ground truth to score against: for workflow kto the rows
    labelled desirable (an undesirable completion is no answer to reach)."""
    if not kto:
        return problems
    good = [p for p in problems if p.meta.get("label", True)]
    if not good:
        from relayrl.data.errors import DatasetError

        raise DatasetError(f"workflow kto evaluates greedy accuracy against the held-out rows labelled desirable, "
                           f"and none of the {len(problems)} held-out rows is: give data.eval_path rows with "
                           f"label true")
    return good
