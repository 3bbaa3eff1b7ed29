"""run.max_restarts: a lost worker process (or dock storage unit) is survived by recreating the groups (and the
dock) from the last checkpoint."""

from __future__ import annotations

import json
import os
import signal

import pytest

from relayrl.cluster.errors import WorkerError
from relayrl.dock import UnitLostError
from relayrl.workflows.pipeline import GRPOPipeline
from relayrl.workflows.restart import run_with_restarts

def config(run_dir, *over: str):
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config

    return load_config(Config, "recipes/arith_grpo.yaml", [
        f"run.dir={run_dir}", "trainer.steps=4", "eval.size=8", "eval.every=0", "data.prompts_per_step=4",
        "rollout.n=4", "rollout.max_new_tokens=6", "telemetry.sinks=[jsonl]", "reward.verifier=user",
        "reward.user_fn=dataflow_rewards:by_length", "run.save_every=1", "trainer.init_from=null",
        "placement.pools.gen=1", "placement.rollout=gen", *over])


def _kill_the_rollout_in_step_3(monkeypatch):
    """The rollout's process is SIGKILLed as step 3 starts, on the first attempt only."""
    real, killed = GRPOPipeline.step, []

    def step(self, s):
        if s == 3 and not killed:
            killed.append(self.rollout._ranks.pids()[0])
            os.kill(killed[0], signal.SIGKILL)
        return real(self, s)

    monkeypatch.setattr(GRPOPipeline, "step", step)
    return killed


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_lost_rollout_is_recreated_and_the_run_finishes_from_its_checkpoint(tmp_path, monkeypatch):
    killed = _kill_the_rollout_in_step_3(monkeypatch)
    lines: list[str] = []
    out = run_with_restarts(config(tmp_path, "run.max_restarts=1"), lambda c: GRPOPipeline(c).run(), lines.append)
    assert killed and (out / "config.json").is_file()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]  # step 3 trained once, after the restart
    assert [r.get("run/restarts", 0) for r in recs][-2:] == [1.0, 1.0]
    assert len(lines) == 1 and "restart 1/1" in lines[0] and "'rollout' rank 0" in lines[0]
    assert "died" in (tmp_path / "restarts.log").read_text()


@pytest.mark.slow
@pytest.mark.multiproc
def test_without_restarts_a_lost_worker_ends_the_run_naming_it(tmp_path, monkeypatch):
    _kill_the_rollout_in_step_3(monkeypatch)
    with pytest.raises(WorkerError) as info:
        run_with_restarts(config(tmp_path), lambda c: GRPOPipeline(c).run())
    assert info.value.lost and info.value.group == "rollout" and "died" in str(info.value)
    assert not (tmp_path / "restarts.log").exists()


def test_an_error_that_is_not_a_lost_worker_is_not_retried(tmp_path):
    calls = []

    def run(cfg):
        calls.append(cfg)
        raise WorkerError("actor", 0, "update", "ValueError: bad row", user_message="bad row")

    with pytest.raises(WorkerError):
        run_with_restarts(config(tmp_path, "run.max_restarts=3"), run)
    assert len(calls) == 1


def test_a_lost_dock_unit_is_restarted_like_a_lost_worker(tmp_path, monkeypatch):
    """A storage unit met dead by the driver (UnitLostError) restarts the run when run.max_restarts allows
    (fails before: it ended the run); without restarts it ends the run as before. A unit on a Ray node that
    is gone makes the restart wait until Ray marks the node dead, as a lost rank's node does."""
    import relayrl.workflows.restart as restart

    calls, lines, settled = [], [], []
    monkeypatch.setattr(restart, "_settle", lambda node_id, log: settled.append(node_id))

    def run(cfg):
        calls.append(cfg)
        if len(calls) == 1:
            raise UnitLostError("storage unit 0 (pid 4242) died (killed by signal SIGKILL); its rows are lost [drop]",
                                node_id="node-of-the-unit")
        return tmp_path / "model"

    assert run_with_restarts(config(tmp_path, "run.max_restarts=1"), run, lines.append) == tmp_path / "model"
    assert len(calls) == 2 and len(lines) == 1 and settled == ["node-of-the-unit"]
    assert "restart 1/1" in lines[0] and "storage unit 0 (pid 4242) died" in lines[0] and "the dock" in lines[0]
    assert "storage unit 0" in (tmp_path / "restarts.log").read_text()
    calls.clear()
    with pytest.raises(UnitLostError):
        run_with_restarts(config(tmp_path / "none"), run)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_killed_dock_unit_process_is_recreated_and_the_run_finishes(tmp_path, monkeypatch):
    real, killed = GRPOPipeline.step, []

    def step(self, s):
        if s == 3 and not killed:
            killed.append(self.dock._plane.pids[0])
            os.kill(killed[0], signal.SIGKILL)
        return real(self, s)

    monkeypatch.setattr(GRPOPipeline, "step", step)
    lines: list[str] = []
    cfg = config(tmp_path, "run.max_restarts=1", "dock.backend=process", "placement.pools={}",
                 "placement.rollout=main")
    run_with_restarts(cfg, lambda c: GRPOPipeline(c).run(), lines.append)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert killed and [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    assert len(lines) == 1 and f"storage unit 0 (pid {killed[0]}) died" in lines[0]
