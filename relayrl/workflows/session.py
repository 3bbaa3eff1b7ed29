"""What every workflow needs besides its algorithm.

A :class:`Session` resolves the model, the tokenizer, the prompts (a built-in
task or a user dataset) and the verifier, and evaluates on the held-out set
(its :class:`~relayrl.workflows.heldout.EvalSession` part, which ``relayrl eval
--recipe`` uses alone); it owns the run directory with its telemetry (metrics
sinks, stage timeline), checkpoints and the training prompts' order, and runs the one loop every workflow
shares (:meth:`Session.run`). The workflows (the GRPO family's ``pipeline.py``, the offline ``offline.py`` of
SFT, DPO, KTO and RM) supply only their step.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from relayrl.checkpoint import CheckpointManager, ResumePlan, capture_rng_state, restore_rng_state, resume_from
from relayrl.checkpoint.atomic import run_files_full, write_dir_atomically
from relayrl.checkpoint.resume import verify_newest
from relayrl.checkpoint.rundir import check_fingerprint, check_run_dir, claim_run_dir, hold_run_dir, saved_config
from relayrl.cluster.interrupt import say_stopped, stop_calls_in_flight
from relayrl.workflows.restart import RESTARTS
from relayrl.config.paths import absolute_paths
from relayrl.config.schema import Config
from relayrl.errors import RunStopped, UserError
from relayrl.workflows.heldout import EvalSession
from relayrl.workflows.prompt_source import Drawn, PromptSource, RowsExhausted
from relayrl.telemetry import NonFiniteError, Timeline, Tracker, check_updates

__all__ = ["PromptSource", "Drawn", "RowsExhausted", "Session", "RunInterrupted", "model_dirs"]


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


def write_run_config(run_dir: Path, config: dict) -> None:
    """``RUN_DIR/config.json``, whole or not at all (a scratch file renamed over it): a run killed or out of disk
    while it writes it leaves the previous one, not an empty or cut file that no longer says it is a run's."""
    tmp = run_dir / f".config.json.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp, run_dir / "config.json")
    finally:
        tmp.unlink(missing_ok=True)


RESUMES_FILE = "resumes.jsonl"
"""``RUN_DIR/resumes.jsonl``: one record per resume that changed the config (:func:`record_resume`)."""


def config_changes(old: Any, new: Any, prefix: str = "") -> dict[str, list]:
    """``{dotted key: [old value, new value]}`` for every leaf where two JSON-dumped configs differ (a key one of
    them lacks: ``"<unset>"``); a pure function."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: dict[str, list] = {}
        for k in list(old) + [k for k in new if k not in old]:
            out.update(config_changes(old.get(k, "<unset>"), new.get(k, "<unset>"), f"{prefix}{k}."))
        return out
    return {} if old == new else {prefix[:-1]: [old, new]}


def record_resume(run_dir: Path, step: int, config: dict, checkpoint: Path | None = None,
                  log: Callable[[str], None] = print) -> dict[str, list]:
    """Before a resumed run rewrites ``RUN_DIR/config.json`` with its own config: append what changed (and the
    whole previous config) to ``RUN_DIR/resumes.jsonl``, so the file says what the run is now and the history how
    it got there. Returns the changes ({} when none: nothing is written).

    A ``config.json`` that is missing, or damaged (not JSON: kept as ``config.json.damaged``, said with ``log``),
    is replaced, for the comparison, by the config saved in ``checkpoint`` (the one resumed from), which the
    record names in ``previous_config_from``."""
    path = run_dir / "config.json"
    source = path
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        if path.is_file():  # (its bytes are kept: the rewrite below would lose them)
            kept = path.with_name("config.json.damaged")
            path.replace(kept)
            log(f"relayrl: {path} was not valid JSON ({type(e).__name__}: {e}); kept as {kept}, and this resume is "
                f"recorded against the config of {checkpoint} instead")
        previous = saved_config(checkpoint) if checkpoint is not None else None
        if previous is None:
            return {}  # (no previous config anywhere: nothing to compare)
        source = checkpoint / "config.json"
    changes = config_changes(previous, config)
    changes.pop("run.resume", None)  # (how this session started, not what the run is)
    if changes:
        record = {"resumed_at_step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changed": changes,
                  "previous_config": previous}
        if source != path:
            record["previous_config_from"] = str(source)
        with open(run_dir / RESUMES_FILE, "a+b") as f:
            f.seek(0, os.SEEK_END)
            cut = f.tell() > 0 and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n"  # (a record cut mid-line)
            f.write((("\n" if cut else "") + json.dumps(record) + "\n").encode("utf-8"))
    return changes


def model_dirs(cfg: Config) -> dict[str, str | None]:
    """The model directories a run reads, by config key (None: unset)."""
    return {"trainer.init_from": cfg.trainer.init_from, "model.path": cfg.model.path,
            "reward.model": cfg.reward.model, "reward.judge.path": cfg.reward.judge.path}


class Session(EvalSession):
    """Model, data, verifier, run directory, telemetry, checkpoints and evaluation of one run (the evaluation's
    part, :class:`~relayrl.workflows.heldout.EvalSession`, reports under ``RUN_DIR/eval``)."""

    def __init__(self, cfg: Config, *, log: Callable[[str], None] = print) -> None:
        self.dir = Path(cfg.run.dir)
        # An in-process restart (run.max_restarts) starts again in the directory its first attempt claimed.
        restart = RESTARTS.get() > 0
        if not restart:  # (before the model and the data load)
            check_run_dir(self.dir, cfg.run.resume, cfg.run.overwrite, models=model_dirs(cfg))
        super().__init__(cfg, report_dir=self.dir / "eval", log=log, training=True)
        train = self.train_problems
        # The rows are known now (long prompts dropped, held-out rows carved out, data.max_rows): trainer.total_epochs
        # becomes trainer.steps before anything reads it (the workflow's LR schedule, progress, the resume plan)
        self.cfg, line = self.resolved_steps()
        if line is not None:
            log(f"relayrl: {line}")
        self.prompts = PromptSource(cfg.run.seed, task=self.task if train is None else None, problems=train,
                                    exclude=frozenset(p.prompt for p in self.eval_problems), shuffle=cfg.data.shuffle)
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
        self.nonfinite_streak = 0  # of those, skipped in a row up to the last step (run.nonfinite_skip_limit)
        self.saving: int | None = None  # the step whose checkpoint is being written (for Ctrl-C's message)

    def _resume_plan(self) -> ResumePlan:
        """Where the run starts (``run.resume``), its checkpoint's config compared with this run's."""
        plan = resume_from(self.dir / "checkpoints", self.cfg.run.resume)
        if plan.path is not None and self.cfg.run.resume_check:  # before any worker starts
            saved = saved_config(plan.path)  # (a checkpoint of an older run may name its paths relative: as here)
            check_fingerprint(plan.path, saved and absolute_paths(saved, os.getcwd()), self.config_record())
        return plan

    def config_record(self) -> dict:
        """The run's config as ``RUN_DIR/config.json``, each checkpoint and the metrics sinks record it: every
        key, its local paths absolute (:func:`~relayrl.config.paths.absolute_paths`), so that the file loads as a
        recipe from any directory."""
        return absolute_paths(self.cfg.model_dump(mode="json"), os.getcwd())

    # ------------------------------------------------------------ telemetry
    def open_telemetry(self, total_steps: int, key_metrics) -> None:
        """Start the run's files: ``config.json``, then the metrics sinks and the stage timeline. Nothing is
        written to ``run.dir`` before (a run that fails while its workers start leaves no run behind)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.start_step > 0:  # a resume: config.json becomes this session's config, the old one kept
            record_resume(self.dir, self.start_step, self.config_record(), self.plan.path, self.log)
        write_run_config(self.dir, self.config_record())
        self.tracker = Tracker(self.dir, self.cfg.telemetry, total_steps, key_metrics=key_metrics,
                               start_step=self.start_step, run_config=self.config_record())
        self.timeline = Timeline(self.dir, start_step=self.start_step)

    def span(self, name: str, group: str, step: int):
        return self.timeline.span(name, group, step)

    def log_step(self, step: int, metrics: dict[str, float], *, save: Callable[[int], None]) -> bool:
        """Log one step; on a NaN/Inf loss or gradient norm of any trained role (the actor, the critic, a reward
        model: ``telemetry.finite.UPDATE_METRICS``) save the last good state and stop, or, with
        ``run.on_nonfinite=skip``, say so and count it in ``run/nonfinite_skips`` (until
        ``run.nonfinite_skip_limit`` skips in a row stop the run). False = skipped."""
        metrics.update(self.timeline.timing_metrics(step))
        self.timeline.forget(step)  # (read: its sums, and any left by earlier steps, are not needed again)
        run = self.cfg.run
        try:
            check_updates(step, metrics)
        except NonFiniteError as e:
            was = "were" if len(e.roles) > 1 else "was"
            streak = self.nonfinite_streak + 1
            if run.on_nonfinite == "skip" and streak < run.nonfinite_skip_limit:
                self.nonfinite_skips, self.nonfinite_streak = self.nonfinite_skips + 1, streak
                metrics["run/nonfinite_skips"] = float(self.nonfinite_skips)
                self.tracker.log(step, metrics)
                self.tracker.write_text(f"warning: {e}; {e.updates} {was} not applied (run.on_nonfinite=skip; "
                                        f"{self.nonfinite_skips} skipped so far); {streak} in a row, the run stops "
                                        f"at run.nonfinite_skip_limit={run.nonfinite_skip_limit}")
                return False
            self.tracker.log(step, metrics)
            # The engine never applies a non-finite update, so the role's weights are still the last good ones.
            path = save(step)
            fix = ("set run.on_nonfinite=skip to skip such updates and go on" if run.on_nonfinite == "stop" else
                   f"run.on_nonfinite=skip skipped the {streak} last updates in a row (run.nonfinite_skip_limit="
                   f"{run.nonfinite_skip_limit}): every batch failing points at the weights or the optimizer "
                   f"state, not the data; lower engine.optim.lr or resume from an earlier checkpoint")
            raise RunStopped(f"{e}. {e.updates[0].upper()}{e.updates[1:]} {was} not applied; the last good weights "
                             f"are saved in {path} (resume continues after this batch); {fix}") from None
        self.tracker.log(step, metrics)
        self.step_done, self.nonfinite_streak = step, 0
        return True

    # ----------------------------------------------------------- evaluation
    def end_step(self, step: int, metrics: dict[str, float], *, evaluate: Callable[[int], dict[str, float]],
                 save: Callable[[int], Any]) -> bool:
        """Evaluate (every ``eval.every`` steps and at the end), log, checkpoint; True when the run stops here."""
        cfg = self.cfg
        last = step == cfg.trainer.steps or self.rows_exhausted(step)
        if RESTARTS.get():
            metrics["run/restarts"] = float(RESTARTS.get())
        if (cfg.eval.every and step % cfg.eval.every == 0) or last:
            metrics.update(evaluate(step))
            last = self.target_reached(step, metrics) or last
        self.log_step(step, metrics, save=save)
        if (cfg.run.save_every and step % cfg.run.save_every == 0) or last:
            t0, self.saving = time.perf_counter(), step
            path = save(step)
            self.saving = None
            self.tracker.write_text(f"step {step}: checkpoint saved to {path} ({time.perf_counter() - t0:.1f} s)")
        return last

    def target_reached(self, step: int, metrics: dict[str, float]) -> bool:
        """True once ``eval.stop_at`` is set and this step's held-out accuracy reaches it."""
        target, acc = self.cfg.eval.stop_at, metrics.get("eval/accuracy")
        if target is None or acc is None or acc < target:
            return False
        self.tracker.write_text(f"relayrl: held-out accuracy {acc:.3f} >= eval.stop_at={target} at step {step}; "
                                f"stopping early")
        self.stopped_early = {"step": step, "accuracy": acc, "stop_at": target}
        return True

    def rows_exhausted(self, step: int) -> bool:
        """True once ``data.retire_solved`` has retired every training row (said in the run's log): the run
        ends after this step, evaluated, checkpointed and exported as at its last step."""
        if self.prompts.active_rows != 0:
            return False
        self.tracker.write_text(f"relayrl: every one of the {len(self.prompts.problems):,} training rows is "
                                f"retired (solved at a pass rate >= data.retire_solved={self.cfg.data.retire_solved}) "
                                f"at step {step} of {self.cfg.trainer.steps}; stopping early")
        return True

    def finished(self) -> str | None:
        """Why a resumed run has nothing left to train (every row retired, or stopped early at an accuracy that
        still meets ``eval.stop_at``), or None; :meth:`steps` says it, a pass before the steps (``trainer.
        precompute_ref``) skips itself."""
        if self.prompts.active_rows == 0:
            return (f"the run had retired every one of its {len(self.prompts.problems):,} training rows by step "
                    f"{self.start_step} (data.retire_solved); nothing left to train. Start a new run (or resume "
                    f"with data.retire_solved=null to draw them all again)")
        stop, target = self.stopped_early, self.cfg.eval.stop_at
        if stop is not None and target is not None and stop["accuracy"] >= target:
            return (f"the run stopped early at step {stop['step']} (held-out accuracy {stop['accuracy']:.3f} >= "
                    f"eval.stop_at={target}); nothing left to train. Raise eval.stop_at (or unset it) to train on")
        return None

    def steps(self) -> range:
        """The steps left to train: after the resumed step, up to ``trainer.steps``; none when the resumed
        run had stopped early at a held-out accuracy that still meets ``eval.stop_at``, or had retired every
        training row (``data.retire_solved``)."""
        done = self.finished()
        if done is not None:
            self.log(f"relayrl: {done}")
            return range(0)
        total = self.cfg.trainer.steps
        if 0 < total <= self.start_step:  # (a resume: a fresh run starts at 0)
            how = "past" if self.start_step > total else "at"
            self.log(f"relayrl: the checkpoint is at step {self.start_step}, {how} trainer.steps={total}: nothing "
                     f"left to train (raise trainer.steps to train on)")
            return range(0)
        stop = self.stopped_early
        if stop is not None:
            target = self.cfg.eval.stop_at
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
                           "nonfinite_skips": self.nonfinite_skips, "nonfinite_streak": self.nonfinite_streak,
                           **(extra_state or {})},
            rng_state=rng,
            config=self.config_record(),
            extra=extra,
        )

    def load(self, expected_shapes: dict[str, tuple]) -> Any:
        """Load the checkpoint the resume plan chose (None when starting fresh)."""
        self.log(f"relayrl: {self.plan.message}")
        if self.plan.path is None:
            return None
        auto = self.cfg.run.resume == "auto"
        if auto:  # (a damaged newest checkpoint: the message names the one before it)
            verify_newest(self.ckpt.root, self.plan.path)
        ck = self.ckpt.load(self.plan.path, expected_shapes=expected_shapes, verify_hashes=not auto)
        self.prompts.load_state(ck.trainer_state["data"])
        if (changed := self.prompts.rows_changed(ck.trainer_state["data"])) is not None:
            self.log(f"relayrl: warning: the training rows are not those the checkpoint was saved with ({changed}; "
                     f"data.path or its file changed?): the run goes on from its data position in the rows as they "
                     f"are now, which is not the continuation of the run it resumes")
        if self.cfg.data.retire_solved is None and self.prompts.retired:
            self.log(f"relayrl: the checkpoint had retired {len(self.prompts.retired):,} training rows; "
                     f"data.retire_solved=null draws them again")
            self.prompts.retired.clear()
        self.start_step = self.step_done = ck.step
        self.stopped_early = ck.trainer_state.get("stopped_early")
        self.nonfinite_skips = int(ck.trainer_state.get("nonfinite_skips", 0))
        self.nonfinite_streak = int(ck.trainer_state.get("nonfinite_streak", 0))
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
        workflow's workers whatever happens (after Ctrl-C without waiting for a call still running in the
        background: :mod:`relayrl.cluster.interrupt`); Ctrl-C becomes :class:`RunInterrupted`
        naming the checkpoint to resume from, a full disk one ``DiskFullError`` naming run.dir. Returns the
        exported model directory."""
        with self.interruptible(), self.no_space():
            try:
                for s in self.begin(restore=restore, evaluate=evaluate, key_metrics=key_metrics):
                    metrics = step(s)
                    if footprint is not None:
                        sizes, footprint = footprint(), None
                        metrics.update(sizes)
                        self.tracker.write_text(footprint_line(sizes))
                    if self.end_step(s, metrics, evaluate=evaluate, save=save):
                        break
                return self.finish(export)
            except KeyboardInterrupt:  # (and SIGTERM): a call running in the background is not waited for
                say_stopped(stop_calls_in_flight())
                raise
            finally:
                shutdown()  # the ranks stop now, not at interpreter exit
                self.close_telemetry()  # (a failed run's metrics and spans files too: finish closes them otherwise)

    def begin(self, *, restore: Callable[[], None], evaluate: Callable[[int], dict[str, float]],
              key_metrics) -> range:
        """The loop's opening (:meth:`run`'s, and a test's or benchmark's that calls the steps itself): restore,
        open the telemetry, log the starting model's evaluation as step 0 (a fresh run with
        ``eval.before_training``); returns the steps left to train (:meth:`steps`)."""
        restore()
        self.open_telemetry(self.cfg.trainer.steps, key_metrics)
        if self.start_step == 0 and self.cfg.eval.before_training:
            self.tracker.log(0, evaluate(0))
        return self.steps()

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
            where, latest = f"step {self.step_done + 1}", self.ckpt.latest()
            if self.saving is not None and latest != self.ckpt.step_dir(self.saving):
                # (the step was trained and logged; its checkpoint's partial write was removed)
                where = f"step {self.saving}, while its checkpoint was written (that checkpoint is incomplete)"
            if latest is not None:
                raise RunInterrupted(f"interrupted at {where}; resume with run.resume=auto run.dir={self.dir} "
                                     f"(the last checkpoint is {latest})") from None
            # Nothing to resume; a fresh start refuses the partial run's files unless it may move them aside.
            raise RunInterrupted(
                f"interrupted at {where}; no checkpoint was written yet (run.save_every="
                f"{self.cfg.run.save_every}), so there is nothing to resume. To start over, run the same command "
                f"with run.overwrite=true run.dir={self.dir} (it moves this partial run aside to "
                f"{self.dir}.replaced-<time>), or choose another run.dir"
            ) from None

    @contextlib.contextmanager
    def no_space(self) -> Iterator[None]:
        """Turn a full disk met writing the run's files (metrics, spans, reports: a bare ``OSError: [Errno 28]``
        when a flush fails, and again when the file is closed) into one ``DiskFullError`` naming run.dir."""
        try:
            yield
        except UserError:
            raise
        except Exception as e:
            full = run_files_full(e, self.dir, self.step_done + 1)
            if full is None:
                raise
            raise full from e

    def finish(self, save_model: Callable[[str], None]) -> Path:
        """Export the final model to ``RUN_DIR/model`` atomically (it appears complete or not at all)."""
        from relayrl.telemetry import export_chrome_trace

        out = write_dir_atomically(self.dir / "model", lambda tmp: save_model(str(tmp)))
        self.timeline.close()
        self.tracker.close()
        export_chrome_trace(self.dir)
        return out

