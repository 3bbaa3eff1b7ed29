"""Runs that survive a lost worker: ``run.max_restarts``.

When a worker process (or a Ray actor) dies, the run loop has already shut every worker group down
(``Session.run``'s ``finally``). The run then starts again in the same run directory with
``run.resume=auto``: the workflow recreates its worker groups on the devices there are, restores the newest
complete checkpoint (weights, optimizer, data position, sampler states) and goes on; the steps after that
checkpoint are trained again. Each restart is printed and written to the run's log with its cause, and the
step records that follow carry ``run/restarts``. Errors that are not a lost worker (a bug, bad data, a
user's reward function that raises) end the run as before: restarting would only fail again.

A lost dock storage unit (its process died or stopped answering with ``dock.backend=process``, its actor or
host with ``backend=ray``: :class:`~relayrl.dock.UnitLostError`, met by the driver or inside a rank) is
recovered the same way: the new attempt builds a new dock, and the rows of the interrupted step are generated
again.

A lost *node* on Ray is recovered the same way (its actors die). Groups of pools that are not pinned
(``placement.nodes``) are recreated on what Ray offers; a pool pinned to the lost node waits for that node to
join again, up to ``cluster.start_timeout_s``, and the run ends if it does not (tested with two hosts in
``tests/cluster/test_two_hosts.py``).
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Callable

from relayrl.checkpoint import CheckpointManager
from relayrl.checkpoint.rundir import release_run_dir
from relayrl.cluster.errors import WorkerError
from relayrl.config.schema import Config
from relayrl.errors import ProcessLost

__all__ = ["RESTARTS", "run_with_restarts"]

RESTARTS: contextvars.ContextVar[int] = contextvars.ContextVar("relayrl_restarts", default=0)
"""Restarts so far in this run (the run loop adds ``run/restarts`` to every step record when > 0)."""


def run_with_restarts(cfg: Config, run: Callable[[Config], Path], log: Callable[[str], None] = print) -> Path:
    """``run(cfg)``, started again from the last checkpoint up to ``cfg.run.max_restarts`` times when a worker
    or a dock storage unit is lost (see the module docstring)."""
    done = 0
    token = RESTARTS.set(0)
    try:
        while True:
            try:
                return run(cfg)
            except (WorkerError, ProcessLost) as e:
                worker = isinstance(e, WorkerError)
                if (worker and not e.lost) or done >= cfg.run.max_restarts:
                    raise
                done += 1
                RESTARTS.set(done)
                cause = e.brief() if worker else str(e)
                log(f"relayrl: restart {done}/{cfg.run.max_restarts} (run.max_restarts): {cause}; "
                    f"recreating the worker groups (and the dock) and resuming from the last checkpoint in "
                    f"{cfg.run.dir}")
                _note(cfg.run.dir, f"restart {done}/{cfg.run.max_restarts}: {cause}")
                if e.node_id is not None:  # a rank, or a dock unit, on a Ray node that is gone
                    _settle(e.node_id, log)
                if cfg.run.resume != "auto" and CheckpointManager(Path(cfg.run.dir) / "checkpoints").latest():
                    # (no checkpoint of this run yet: start as the run did, from scratch or its resume path)
                    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": "auto"})})
    finally:
        RESTARTS.reset(token)
        release_run_dir(cfg.run.dir)  # held since the first attempt's Session (checkpoint.rundir.hold_run_dir)


def _settle(node_id: str, log: Callable[[str], None]) -> None:
    """Ray: wait until the node a lost rank ran on is marked dead, so that the new groups (and the dock's
    units) are not scheduled onto it."""
    import ray

    from relayrl.cluster.ray_backend import wait_node_dead

    if not ray.is_initialized():
        return
    log(f"relayrl: waiting for Ray to mark node {node_id[:12]} dead before placing the groups again")
    if not wait_node_dead(node_id):
        log(f"relayrl: node {node_id[:12]} still looks alive to Ray after 90 s; placing the groups anyway")


def _note(run_dir: Path, text: str) -> None:
    """Append a line to the run's restart log (``RUN_DIR/restarts.log``)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)  # a worker lost while the groups started: no files yet
    with open(Path(run_dir) / "restarts.log", "a") as f:
        f.write(text.rstrip() + "\n")
