"""What every workflow needs besides its algorithm.

A :class:`Session` resolves the model, the tokenizer, the prompts (a built-in
task or a user dataset) and the verifier; it owns the run directory with its
telemetry (metrics sinks, stage timeline), checkpoints and evaluation. The
workflows (``sft.py``, ``grpo.py``) hold only their algorithm's loop.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from relayrl.checkpoint import CheckpointManager, ResumePlan, capture_rng_state, restore_rng_state, resume_from
from relayrl.checkpoint.atomic import write_dir_atomically
from relayrl.checkpoint.rundir import check_fingerprint, check_run_dir, claim_run_dir, hold_run_dir, saved_config
from relayrl.workflows.restart import RESTARTS
from relayrl.cluster import ResourcePool
from relayrl.config.loader import ConfigError
from relayrl.config.schema import Config
from relayrl.data.tasks import Problem, make_task
from relayrl.errors import RunStopped
from relayrl.engines.reward.user import trainer_state, with_progress
from relayrl.evaluation.runner import EvalResult, evaluate, write_report
from relayrl.models.load import check_model_dir, load_tokenizer
from relayrl.models.tiny import build_tiny
from relayrl.telemetry import NonFiniteError, Timeline, Tracker, check_updates

__all__ = ["PromptSource", "Session", "RunInterrupted", "model_dirs", "resolve_model_path", "check_device"]


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; the message names the step, the last checkpoint and how to resume (with no
    checkpoint yet: how to start over, the partial run moved aside)."""


def footprint_line(sizes: dict[str, float]) -> str:
    """The actor's size as a run prints it once, e.g. ``actor: 494.0M parameters, 1.1M trained (0.2%);
    optimizer state 8.8 MB per rank`` (from ``params/total``, ``params/trainable``, ``optimizer/state_bytes``)."""
    total, trained, state = sizes["params/total"], sizes["params/trainable"], sizes["optimizer/state_bytes"]
    share = f" ({100 * trained / total:.1f}%)" if trained < total else ""
    return (f"actor: {total / 1e6:.1f}M parameters, {trained / 1e6:.1f}M trained{share}; "
            f"optimizer state {state / 1e6:.1f} MB per rank")


def check_device(cfg: Config) -> None:
    """``model.device=cuda`` on a local run needs a GPU that torch can see; say so naming the key."""
    if cfg.model.device == "cuda" and cfg.cluster.backend == "local" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        raise ConfigError(f"model.device=cuda but torch sees no GPU here (torch {torch.__version__}, {build}); set "
                          f"model.device=cpu (or auto, which picks a GPU when there is one)")


def model_dirs(cfg: Config) -> dict[str, str | None]:
    """The model directories a run reads, by config key (None: unset)."""
    return {"trainer.init_from": cfg.trainer.init_from, "model.path": cfg.model.path,
            "reward.model": cfg.reward.model, "reward.judge.path": cfg.reward.judge.path}


def resolve_model_path(cfg: Config) -> Path:
    """``trainer.init_from`` > ``model.path`` > the tiny default (built and cached on first use)."""
    for key, value in (("trainer.init_from", cfg.trainer.init_from), ("model.path", cfg.model.path)):
        if value:  # (checked here, not in each worker that loads the weights)
            return check_model_dir(value, key, f"{key}={value}")
    return build_tiny(cfg.model.tiny)


class PromptSource:
    """Training prompts in a reproducible order; :meth:`state` is the data position in checkpoints.

    A built-in task draws fresh problems from a seeded ``random.Random``,
    skipping the prompts in ``exclude`` (the held-out set, so that it stays
    held out); a dataset is walked in a per-epoch permutation.
    """

    def __init__(self, seed: int, *, task=None, problems: list[Problem] | None = None,
                 exclude: frozenset[str] = frozenset()) -> None:
        if (task is None) == (problems is None):
            raise ValueError("PromptSource needs exactly one of task or problems")
        if problems is not None and not problems:
            raise ValueError("the training dataset is empty")
        self.task, self.problems, self.seed, self.exclude = task, problems, seed, exclude
        self.rng = random.Random(seed)
        self.epoch, self.pos, self.consumed = 0, 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        if self.problems is None:
            return []
        order = list(range(len(self.problems)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            if self.task is not None:
                out.append(self._draw())
            else:
                if self.pos == len(self._order):
                    self.epoch, self.pos = self.epoch + 1, 0
                    self._order = self._permutation()
                out.append(self.problems[self._order[self.pos]])
                self.pos += 1
        self.consumed += n
        return out

    def _draw(self) -> Problem:
        for _ in range(10_000):
            p = self.task.sample(self.rng)
            if p.prompt not in self.exclude:
                return p
        raise RuntimeError(f"task {self.task.name!r}: 10,000 draws in a row were held-out prompts; "
                           f"the task's problem space is too small for its held-out set")

    def state(self) -> dict:
        rng = self.rng.getstate()
        return {"rng": [rng[0], list(rng[1]), rng[2]], "epoch": self.epoch, "pos": self.pos, "consumed": self.consumed}

    def load_state(self, state: dict) -> None:
        v, internal, gauss = state["rng"]
        self.rng.setstate((v, tuple(internal), gauss))
        self.epoch, self.pos, self.consumed = state["epoch"], state["pos"], state["consumed"]
        self._order = self._permutation()


class Session:
    """Model, data, verifier, run directory, telemetry, checkpoints and evaluation of one run."""

    def __init__(self, cfg: Config, *, log: Callable[[str], None] = print) -> None:
        from relayrl.engines.reward import RewardEngine

        self.cfg = cfg
        self.log = log
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed % 2**32)
        torch.manual_seed(cfg.run.seed)
        check_device(cfg)
        self.dir = Path(cfg.run.dir)
        # An in-process restart (run.max_restarts) starts again in the directory its first attempt claimed.
        restart = RESTARTS.get() > 0
        if not restart:
            check_run_dir(self.dir, cfg.run.resume, cfg.run.overwrite, models=model_dirs(cfg))
        self.model_path = resolve_model_path(cfg)
        self.tokenizer = load_tokenizer(self.model_path)
        self._encode_cache: dict[str, list[int]] = {}
        self.task, train, self.eval_problems = self._data()
        self._describe_tools(train)
        self._check_lengths(train)
        self.prompts = PromptSource(cfg.run.seed, task=self.task if train is None else None, problems=train,
                                    exclude=frozenset(p.prompt for p in self.eval_problems))
        cuda = cfg.model.device == "cuda" or (cfg.model.device == "auto" and torch.cuda.is_available())
        # (a user environment's episodes bring their own rewards, in training and evaluation: no reward engine)
        self.reward = None if cfg.env.own_rewards else RewardEngine(
            cfg.reward, task=self.task, chat_template=cfg.data.chat_template, device="cuda" if cuda else "cpu")
        if self.reward is not None:  # a field the user reward function needs, on the first rows, before any work
            self.reward.check_fields([p.meta.get("fields") for p in (train or self.eval_problems)[:1]] or [None])
        self.pool = ResourcePool(name="main", devices=cfg.cluster.devices, nodes=cfg.cluster.nodes,
                                 device_kind="cuda" if cuda else "cpu", node=cfg.placement.nodes.get("main"))
        self.ckpt = CheckpointManager(self.dir / "checkpoints", keep=cfg.run.keep_checkpoints)
        # A checkpoint path is checked before run.overwrite moves anything; resume=auto looks after the move
        # (a run moved aside leaves nothing to resume). Only then is anything written.
        plan = self._resume_plan() if cfg.run.resume not in ("never", "auto") else None
        if not restart:  # one run at a time in run.dir (a second one started beside it is refused here)
            hold_run_dir(self.dir)
        moved = None if restart else claim_run_dir(self.dir, cfg.run.resume, cfg.run.overwrite)
        if moved:
            hold_run_dir(self.dir)  # the lock file moved aside with the previous run
            log(f"relayrl: {moved}")
        self.plan = plan if plan is not None else self._resume_plan()
        self.start_step = 0
        self.step_done = 0  # the last step logged (or resumed from)
        self.stopped_early: dict | None = None  # {"step", "accuracy", "stop_at"} once eval.stop_at was reached
        self.nonfinite_skips = 0  # updates skipped for a NaN/Inf loss or gradient norm (run.on_nonfinite=skip)

    def _resume_plan(self) -> ResumePlan:
        """Where the run starts (``run.resume``), its checkpoint's config compared with this run's."""
        plan = resume_from(self.dir / "checkpoints", self.cfg.run.resume)
        if plan.path is not None and self.cfg.run.resume_check:  # before any worker starts
            check_fingerprint(plan.path, saved_config(plan.path), self.cfg.model_dump(mode="json"))
        return plan

    # ------------------------------------------------------------------ data
    def _data(self):
        from relayrl.data.datasets import load_problems

        d = self.cfg.data
        if d.task is not None:
            task = make_task(d.task, **d.task_options)
            eval_task = make_task(d.task, **{**d.task_options, **(d.eval_task_options or {}), "eval_size": self.cfg.eval.size})
            return task, None, eval_task.eval_set()
        rejected = d.rejected_key if self.cfg.workflow in ("dpo", "rm") else None  # preference pairs, every row checked
        train = load_problems(d.dataset(rejected_key=rejected))
        size = self.cfg.eval.size
        held_out = d.dataset(held_out=True, rejected_key=rejected if self.cfg.workflow == "rm" else None)
        if held_out is not None:
            return None, train, load_problems(held_out)[:size]
        if len(train) >= 2 * size:  # hold out a seeded sample of rows; train on the rest
            held = set(random.Random(self.cfg.run.seed).sample(range(len(train)), size))
            self.log(f"relayrl: no data.eval_path; holding out {size} of {len(train)} rows of {d.path or d.hf_name} for evaluation")
            return None, [p for i, p in enumerate(train) if i not in held], [train[i] for i in sorted(held)]
        self.log(f"relayrl: no data.eval_path and only {len(train)} rows in {d.path or d.hf_name}: evaluating on the first "
                 f"{min(size, len(train))} training rows (not held out); set data.eval_path for a held-out score")
        return None, train, train[:size]

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

    def _check_lengths(self, train: list[Problem] | None) -> None:
        """Refuse a row whose prompt plus the tokens generated after it exceed the model's
        ``max_position_embeddings`` (positions past it were never trained): the training rows when the workflow
        samples from them (grpo), the held-out rows always (evaluation generates). ``relayrl eval`` applies the
        same check (:func:`relayrl.data.lengths.check_context`)."""
        from relayrl.data.lengths import check_context, context_limit

        limit = context_limit(self.model_path)
        if limit is None:
            return  # a model config without the field: nothing to check against
        r, e = self.cfg.rollout, self.cfg.eval
        checks = [(self.eval_problems, e.max_new_tokens or r.max_new_tokens,
                   "eval.max_new_tokens" if e.max_new_tokens else "rollout.max_new_tokens")]
        if train is not None and self.cfg.workflow == "grpo":
            checks.insert(0, (train, r.max_new_tokens, "rollout.max_new_tokens"))
        for problems, budget, key in checks:
            check_context(problems, self.encode, budget, key, limit, self.model_path)

    def encode(self, problem: Problem) -> list[int]:
        """Prompt token ids (chat template applied to chat-message prompts), cached by prompt text."""
        ids = self._encode_cache.get(problem.prompt)
        if ids is None:
            from relayrl.data.datasets import encode_prompt

            ids = self._encode_cache[problem.prompt] = list(encode_prompt(self.tokenizer, problem, self.cfg.data.chat_template))
        return ids

    def progress(self, done: int):
        """The training's progress after ``done`` RL steps, as a TRL reward function's ``trainer_state`` reads
        it (:func:`~relayrl.engines.reward.user.trainer_state`)."""
        return trainer_state(done, self.cfg.trainer.steps)

    def score(self, prompts: list[str], responses: list[str], answers: list[str], columns=None) -> list[float]:
        """Evaluation's score: the verifier (and format term) only, never a learned reward, so held-out
        accuracy stays the task's whatever the training reward is."""
        return self.reward.verify(prompts, responses, answers, columns)

    # ------------------------------------------------------------ telemetry
    def open_telemetry(self, total_steps: int, key_metrics) -> None:
        """Start the run's files: ``config.json``, then the metrics sinks and the stage timeline. Nothing is
        written to ``run.dir`` before (a run that fails while its workers start leaves no run behind)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.json").write_text(json.dumps(self.cfg.model_dump(mode="json"), indent=2) + "\n")
        self.tracker = Tracker(self.dir, self.cfg.telemetry, total_steps, key_metrics=key_metrics,
                               start_step=self.start_step, run_config=self.cfg.model_dump(mode="json"))
        self.timeline = Timeline(self.dir, start_step=self.start_step)

    def span(self, name: str, group: str, step: int):
        return self.timeline.span(name, group, step)

    def log_step(self, step: int, metrics: dict[str, float], *, save: Callable[[int], None]) -> bool:
        """Log one step; on a NaN/Inf loss or gradient norm of any trained role (the actor, the critic, a reward
        model: ``telemetry.finite.UPDATE_METRICS``) save the last good state and stop, or, with
        ``run.on_nonfinite=skip``, say so and count it in ``run/nonfinite_skips``. False = skipped."""
        metrics.update(self.timeline.timing_metrics(step))
        try:
            check_updates(step, metrics)
        except NonFiniteError as e:
            was = "were" if len(e.roles) > 1 else "was"
            if self.cfg.run.on_nonfinite == "skip":
                self.nonfinite_skips += 1
                metrics["run/nonfinite_skips"] = float(self.nonfinite_skips)
                self.tracker.log(step, metrics)
                self.tracker.write_text(f"warning: {e}; {e.updates} {was} not applied (run.on_nonfinite=skip; "
                                        f"{self.nonfinite_skips} skipped so far)")
                return False
            self.tracker.log(step, metrics)
            # The engine never applies a non-finite update, so the role's weights are still the last good ones.
            path = save(step)
            raise RunStopped(f"{e}. {e.updates[0].upper()}{e.updates[1:]} {was} not applied; the last good weights "
                             f"are saved in {path} (resume continues after this batch); set run.on_nonfinite=skip "
                             f"to skip such updates and go on") from None
        self.tracker.log(step, metrics)
        self.step_done = step
        return True

    # ----------------------------------------------------------- evaluation
    def end_step(self, step: int, metrics: dict[str, float], *, evaluate: Callable[[int], dict[str, float]],
                 save: Callable[[int], Any]) -> bool:
        """Evaluate (every ``eval.every`` steps and at the end), log, checkpoint; True when the run stops here."""
        cfg = self.cfg
        last = step == cfg.trainer.steps
        if RESTARTS.get():
            metrics["run/restarts"] = float(RESTARTS.get())
        if (cfg.eval.every and step % cfg.eval.every == 0) or last:
            metrics.update(evaluate(step))
            last = self.target_reached(step, metrics) or last
        self.log_step(step, metrics, save=save)
        if (cfg.run.save_every and step % cfg.run.save_every == 0) or last:
            t0 = time.perf_counter()
            path = save(step)
            self.tracker.write_text(f"step {step}: checkpoint saved to {path} ({time.perf_counter() - t0:.1f} s)")
        return last

    def evaluate(self, generate, step: int | None, *, name: str = "eval") -> EvalResult:
        """Greedy accuracy on the held-out problems, with ``eval.k > 1`` also pass@k and avg@k of sampled answers;
        the report under ``RUN_DIR/eval``."""
        ro, ev = self.cfg.rollout, self.cfg.eval
        state = self.progress(step or 0)

        def score(prompts, responses, answers, columns):
            return self.score(prompts, responses, answers, with_progress(columns, state))

        result = evaluate(generate, self.encode, self.eval_problems, score,
                          max_new_tokens=ev.max_new_tokens or ro.max_new_tokens, k=ev.k,
                          temperature=self.eval_temperature, stop_strings=ro.stop_strings)
        write_report(result, self.dir / "eval", name=name if step is None else f"{name}-step{step:06d}",
                     extra={"step": step, "model": str(self.model_path)})
        return result

    @property
    def eval_temperature(self) -> float:
        """The temperature of the ``eval.k`` sampled answers: ``eval.temperature``, else the rollout's (1.0 for a
        greedy rollout)."""
        return self.cfg.eval.temperature or self.cfg.rollout.temperature or 1.0

    def target_reached(self, step: int, metrics: dict[str, float]) -> bool:
        """True once ``eval.stop_at`` is set and this step's held-out accuracy reaches it."""
        target, acc = self.cfg.eval.stop_at, metrics.get("eval/accuracy")
        if target is None or acc is None or acc < target:
            return False
        self.tracker.write_text(f"relayrl: held-out accuracy {acc:.3f} >= eval.stop_at={target} at step {step}; "
                                f"stopping early")
        self.stopped_early = {"step": step, "accuracy": acc, "stop_at": target}
        return True

    def steps(self) -> range:
        """The steps left to train: after the resumed step, up to ``trainer.steps``; none when the resumed
        run had stopped early at a held-out accuracy that still meets ``eval.stop_at``."""
        stop = self.stopped_early
        if stop is not None:
            target = self.cfg.eval.stop_at
            if target is not None and stop["accuracy"] >= target:
                self.log(f"relayrl: the run stopped early at step {stop['step']} (held-out accuracy "
                         f"{stop['accuracy']:.3f} >= eval.stop_at={target}); nothing left to train. Raise "
                         f"eval.stop_at (or unset it) to train on")
                return range(0)
            self.log(f"relayrl: the run had stopped early at step {stop['step']} (accuracy {stop['accuracy']:.3f} >= "
                     f"its eval.stop_at={stop['stop_at']}); eval.stop_at is now {target}: training on")
            self.stopped_early = None
        return range(self.start_step + 1, self.cfg.trainer.steps + 1)

    # ---------------------------------------------------------- checkpoints
    def save(self, step: int, policy_state: dict, *, generators: dict[str, Any] | None = None,
             extra_state: dict | None = None, extra: Any = None) -> Path:
        """Checkpoint ``step``: the policy's state, the data position and RNG states, ``extra_state`` (JSON)
        in the trainer state and ``extra`` (any picklable object, e.g. a critic's state) beside it."""
        rng = capture_rng_state(generators or {})
        return self.ckpt.save(
            step,
            model_state=policy_state["model"],
            optimizer_state=policy_state.get("optimizer"),
            scheduler_state=policy_state.get("scheduler"),
            trainer_state={"step": step, "data": self.prompts.state(), "stopped_early": self.stopped_early,
                           "nonfinite_skips": self.nonfinite_skips, **(extra_state or {})},
            rng_state=rng,
            config=self.cfg.model_dump(mode="json"),
            extra=extra,
        )

    def load(self, expected_shapes: dict[str, tuple]) -> Any:
        """Load the checkpoint the resume plan chose (None when starting fresh)."""
        self.log(f"relayrl: {self.plan.message}")
        if self.plan.path is None:
            return None
        ck = self.ckpt.load(self.plan.path, expected_shapes=expected_shapes)
        self.prompts.load_state(ck.trainer_state["data"])
        self.start_step = self.step_done = ck.step
        self.stopped_early = ck.trainer_state.get("stopped_early")
        self.nonfinite_skips = int(ck.trainer_state.get("nonfinite_skips", 0))
        return ck

    def restore_rng(self, ck, generators: dict[str, Any] | None = None) -> None:
        restore_rng_state(ck.rng_state, generators or {})

    # ------------------------------------------------------------- the loop
    def run(self, *, restore: Callable[[], None], step: Callable[[int], dict[str, float]],
            evaluate: Callable[[int], dict[str, float]], save: Callable[[int], Any], export: Callable[[str], None],
            shutdown: Callable[[], None], key_metrics,
            footprint: Callable[[], dict[str, float]] | None = None) -> Path:
        """The run loop every workflow shares::

            restore (the checkpoint the resume plan chose)
            evaluate the starting model (fresh runs)
            for each step left: metrics <- step(s); evaluate, log, checkpoint (end_step); stop early on target
            export the model (atomically)

        ``footprint`` (the actor's parameter counts and optimizer state, :func:`footprint_line`) is logged
        with the first step this process trains, when the optimizer state exists. ``shutdown`` stops the
        workflow's workers whatever happens; Ctrl-C becomes :class:`RunInterrupted`
        naming the checkpoint to resume from. Returns the exported model directory."""
        with self.interruptible():
            try:
                restore()
                self.open_telemetry(self.cfg.trainer.steps, key_metrics)
                if self.start_step == 0:
                    self.tracker.log(0, evaluate(0))
                for s in self.steps():
                    metrics = step(s)
                    if footprint is not None:
                        sizes, footprint = footprint(), None
                        metrics.update(sizes)
                        self.tracker.write_text(footprint_line(sizes))
                    if self.end_step(s, metrics, evaluate=evaluate, save=save):
                        break
                return self.finish(export)
            finally:
                shutdown()  # the ranks stop now, not at interpreter exit
                self.close_telemetry()  # (a failed run's metrics and spans files too: finish closes them otherwise)

    def close_telemetry(self) -> None:
        """Close the metrics sinks and the timeline's file (again is a no-op)."""
        for part in (getattr(self, "timeline", None), getattr(self, "tracker", None)):
            if part is not None:
                part.close()

    # ------------------------------------------------------ interrupt, finish
    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Turn Ctrl-C inside the block into :class:`RunInterrupted` saying where the run stopped."""
        try:
            yield
        except RunInterrupted:
            raise
        except KeyboardInterrupt:
            step = self.step_done + 1
            latest = self.ckpt.latest()
            if latest is not None:
                raise RunInterrupted(f"interrupted at step {step}; resume with run.resume=auto run.dir={self.dir} "
                                     f"(the last checkpoint is {latest})") from None
            # Nothing to resume; a fresh start refuses the partial run's files unless it may move them aside.
            raise RunInterrupted(
                f"interrupted at step {step}; no checkpoint was written yet (run.save_every="
                f"{self.cfg.run.save_every}), so there is nothing to resume. To start over, run the same command "
                f"with run.overwrite=true run.dir={self.dir} (it moves this partial run aside to "
                f"{self.dir}.replaced-<time>), or choose another run.dir"
            ) from None

    def finish(self, save_model: Callable[[str], None]) -> Path:
        """Export the final model to ``RUN_DIR/model`` atomically (it appears complete or not at all)."""
        from relayrl.telemetry import export_chrome_trace

        out = write_dir_atomically(self.dir / "model", lambda tmp: save_model(str(tmp)))
        self.timeline.close()
        self.tracker.close()
        export_chrome_trace(self.dir)
        return out

