"""Runs ended in a chosen step, as a kill there would end them (resume tests)."""

from __future__ import annotations

import pytest


def run_killed_in_step(monkeypatch, cfg, step: int) -> None:
    """Run ``GRPOPipeline(cfg)`` with its update raising in ``step`` (after the checkpoints before it, with the
    batches generated ahead in flight), as a kill there would end it; the update is put back after."""
    from relayrl.workflows.consume import Consume
    from relayrl.workflows.pipeline import GRPOPipeline

    real = Consume.update

    def dies(self, f):
        if f.step == step:
            raise RuntimeError(f"killed in step {step}")
        return real(self, f)

    monkeypatch.setattr(Consume, "update", dies)
    try:
        with pytest.raises(RuntimeError, match=f"killed in step {step}"):
            GRPOPipeline(cfg).run()
    finally:
        monkeypatch.setattr(Consume, "update", real)
    # the failed run closed its metrics and spans files (the run.dir lock stays with the process, as it does
    # for restarts: relayrl.checkpoint.rundir)
    assert [f for f in open_files_under(cfg.run.dir) if not f.endswith(".relayrl.lock")] == []


def open_files_under(folder) -> list[str]:
    """Files under ``folder`` this process holds open (Linux: /proc/self/fd)."""
    import os
    from pathlib import Path

    root = str(Path(folder).resolve())
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root + os.sep):
            out.append(target)
    return out
