"""The user's mistakes end to end, as a new user meets them: the real CLI in a process of its own
(``e2e_cli.relayrl``: forked from a preloaded server, or ``python -m`` with RELAYRL_TEST_CLI_SUBPROCESS=1), its
exit code, its message and no traceback; Ctrl-C and SIGTERM reach a ``python -m`` process group (slow: each run
starts torch and the tiny model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_cli import FAST, ROOT, relayrl
from tests.procs import descendants, running

SFT = "recipes/arith_sft.yaml"

pytestmark = pytest.mark.slow


def refused(r: subprocess.CompletedProcess, code: int = 1) -> str:
    """stderr of a run that must have stopped with a message and no traceback."""
    assert r.returncode == code, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]
    return r.stderr


def steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_dir_never_mixes_two_runs(tmp_path):
    run = tmp_path / "run"
    args = ["train", SFT, "trainer.steps=2", f"run.dir={run}", *FAST]
    assert relayrl(*args, "run.seed=1").returncode == 0
    before = (run / "metrics.jsonl").read_text()
    # a fresh run into it is refused, the old run untouched
    err = refused(relayrl(*args, "run.seed=2"))
    assert f"run.dir={run} already holds a run with checkpoints (step-000002)" in err
    assert "run.resume=auto" in err and "run.overwrite=true" in err
    assert (run / "metrics.jsonl").read_text() == before
    # resuming it with another seed is refused, naming the key that differs
    err = refused(relayrl(*args[:2], "trainer.steps=3", f"run.dir={run}", *FAST, "run.seed=2", "run.resume=auto"))
    assert "belongs to a run with another configuration" in err and "run.seed: checkpoint 1, now 2" in err
    assert steps(run) == [0, 1, 2]
    # with the same seed it resumes; steps go on without a gap
    r = relayrl(*args[:2], "trainer.steps=3", f"run.dir={run}", *FAST, "run.seed=1", "run.resume=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert steps(run) == [0, 1, 2, 3]
    # run.overwrite=true moves the old run aside and starts a clean one
    r = relayrl(*args, "run.seed=2", "run.overwrite=true")
    assert r.returncode == 0, r.stderr[-3000:]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and f"moved the previous run in {run} to {aside[0]}" in r.stdout
    assert steps(aside[0]) == [0, 1, 2, 3] and steps(run) == [0, 1, 2]
    # the final model was swapped in whole: no scratch directory left beside it
    assert (run / "model" / "config.json").stat().st_size > 0
    assert not [p.name for p in run.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def test_an_edited_manifest_step_is_refused(tmp_path):
    args = ["train", SFT, f"run.dir={tmp_path}", *FAST]
    assert relayrl(*args, "trainer.steps=2").returncode == 0
    manifest_path = tmp_path / "checkpoints" / "step-000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["step"] = 7
    manifest_path.write_text(json.dumps(manifest))
    err = refused(relayrl(*args, "trainer.steps=9", "run.resume=auto"))
    assert "manifest.json: says step 7 but its directory is step-000002" in err
    assert steps(tmp_path) == [0, 1, 2]  # nothing was skipped or appended


@pytest.mark.parametrize("case", ["csv", "model_path", "reward_fn", "bad_rows"])
def test_user_mistakes_print_a_message_not_a_traceback(tmp_path, case):
    if case == "csv":
        data = tmp_path / "d.csv"
        data.write_text("prompt,answer\n1+1=,2\n")
        extra, says = ["data.task=null", f"data.path={data}", "reward.verifier=exact"], "relayrl does not read CSV"
    elif case == "model_path":
        extra, says = [f"model.path={tmp_path / 'none'}"], f"model.path={tmp_path / 'none'}: no such directory"
    elif case == "reward_fn":
        extra = ["reward.verifier=user", "reward.user_fn=no_such_pkg.rewards:score"]
        says = "reward function 'no_such_pkg.rewards:score'"
    else:
        data = tmp_path / "d.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(30)))
        extra, says = ["data.task=null", f"data.path={data}", "reward.verifier=exact"], "30 bad rows (the first 20"
    err = refused(relayrl("train", SFT, "trainer.steps=1", f"run.dir={tmp_path / 'run'}", *extra, *FAST))
    assert says in err and "(--debug or RELAYRL_DEBUG=1 shows the traceback)" in err
    debug = relayrl("train", SFT, "trainer.steps=1", f"run.dir={tmp_path / 'run'}", *extra, *FAST,
                    env={"RELAYRL_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr and says in debug.stderr


@pytest.mark.multiproc
def test_a_rank_error_on_two_ranks_is_one_message(tmp_path, tiny_dir):
    import shutil

    broken = tmp_path / "damaged-weights"  # (found by each rank as it loads; a directory without weights is
    shutil.copytree(tiny_dir, broken)       # refused before the ranks start)
    (broken / "model.safetensors").write_bytes(b"\x10")
    err = refused(relayrl("train", SFT, "trainer.steps=1", f"run.dir={tmp_path / 'run'}", f"model.path={broken}",
                          "cluster.devices=2", *FAST))
    assert "worker group 'actor' ranks 0, 1 failed in '__init__': model directory" in err
    assert err.count("model.safetensors is truncated or not a safetensors file") == 1


@pytest.mark.multiproc
@pytest.mark.parametrize("recipe,devices,sig", [(SFT, 2, signal.SIGINT), ("recipes/arith_grpo.yaml", 1, signal.SIGINT),
                                                (SFT, 2, signal.SIGTERM)])
def test_ctrl_c_says_the_step_exits_130_and_leaves_no_process(tmp_path, recipe, devices, sig):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it (the driver and its rank processes);
    SIGTERM to the driver alone, as ``kill`` or a scheduler's preemption sends it: the same clean stop, exit 143."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli.main", "train", recipe, "trainer.steps=100000", "run.save_every=2",
         f"cluster.devices={devices}", f"run.dir={run}", *FAST], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background shell may ignore SIGINT
    deadline = time.time() + 300
    while not any((run / "checkpoints").glob("step-*/manifest.json")) and time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    tree = descendants(proc.pid)  # (ranks lead groups of their own)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "relayrl: interrupted at step " in err and "resume with run.resume=auto" in err
    assert f"the last checkpoint is {run / 'checkpoints'}" in err
    gone = time.time() + 30
    while time.time() < gone:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            if not running(tree):
                break
        time.sleep(0.2)
    else:
        pytest.fail(f"processes of the interrupted run are still alive: {running(tree)}")
    assert not (run / "model").exists()
    done = steps(run)[-1]
    r = relayrl("train", recipe, f"trainer.steps={done + 2}", f"run.dir={run}", "run.resume=auto", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout and steps(run)[-1] == done + 2
