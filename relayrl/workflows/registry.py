"""The workflows by config name (``workflow:``), and the entry points of a run from Python.

Each entry is the import path of a ``train(cfg) -> model dir`` function, imported when it runs (a run of
one workflow does not import the others). A new workflow is a module with that function and one line here.

A run from Python is what ``relayrl train`` does::

    from relayrl.config.loader import load_run_config
    from relayrl.workflows.registry import run

    if __name__ == "__main__":   # worker processes re-import this script; they must not start a run
        cfg = load_run_config("recipes/arith_grpo.yaml", ["trainer.steps=3", "run.dir=runs/x"])
        model_dir = run(cfg)     # run.max_restarts applies; train(cfg) is one attempt without restarts
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import Callable

from relayrl.config.schema import Config
from relayrl.errors import UserError

__all__ = ["WORKFLOWS", "run", "train", "train_grpo"]

WORKFLOWS: dict[str, str] = {
    "grpo": "relayrl.workflows.registry:train_grpo",
    "sft": "relayrl.workflows.sft:train_sft",
    "dpo": "relayrl.workflows.dpo:train_dpo",
    "kto": "relayrl.workflows.kto:train_kto",
    "rm": "relayrl.workflows.rm:train_rm",
}


def run(cfg: Config) -> Path:
    """Run ``cfg.workflow`` as ``relayrl train`` does: a lost worker restarts it from the last checkpoint, up to
    ``run.max_restarts`` times (:mod:`relayrl.workflows.restart`); returns the directory of the trained model."""
    from relayrl.workflows.restart import run_with_restarts

    _check_not_bootstrapping()
    return run_with_restarts(cfg, train)


def train(cfg: Config) -> Path:
    """Run ``cfg.workflow`` once (no restart on a lost worker: :func:`run` restarts); returns the directory of
    the trained model."""
    _check_not_bootstrapping()
    cfg = checked(cfg)
    module, _, name = WORKFLOWS[cfg.workflow].partition(":")
    fn: Callable[[Config], Path] = getattr(import_module(module), name)
    return fn(cfg)


def checked(cfg: Config) -> Config:
    """``cfg`` with the checks across its sections made again (``ConfigError`` naming the key, as loading
    does): an assignment in Python (``cfg.rollout.n = 1``) checks only that section, so a change that breaks
    a rule across keys (``rollout.n >= 2`` for group advantages) would run."""
    from relayrl.config.loader import validate

    return validate(type(cfg), dict(cfg))


class MainGuardError(UserError, RuntimeError):
    """A run was started while a worker process imported the user's script."""


def _check_not_bootstrapping() -> None:
    """Refuse a run started while multiprocessing bootstraps a new process: a worker rank (started with
    ``spawn`` or ``forkserver``) runs the parent's main script again before it starts, and a script that
    calls :func:`run` at its top level would start a second run in every rank (which then fails on the run
    directory's lock, a message about another run, not about the script)."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise MainGuardError(
            "a relayrl run was started while a worker process was importing your script: worker processes run "
            "the main script again before they start; put the code that starts the run under "
            "`if __name__ == \"__main__\":`")


def train_grpo(cfg: Config) -> Path:
    """Run a GRPO-family workflow (synchronous, periodic, or k-step off-policy); returns the model dir."""
    from relayrl.workflows.pipeline import GRPOPipeline

    return GRPOPipeline(cfg).run()
