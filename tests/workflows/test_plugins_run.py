"""GRPO steps with a user's advantage estimator and policy loss named by file path (``algorithm.advantage``,
``algorithm.policy_loss``): they are what the step uses (their metrics are logged; advantages scaled by 0 leave
nothing to train), and every process that calls one, the driver, rank processes, Ray workers, loads the file
itself (each call writes its process id beside the file)."""

from __future__ import annotations

import os
import textwrap

import pytest

from grpo_runs import run_grpo

VARIED = ["reward.verifier=user", f"reward.user_fn={os.path.dirname(__file__)}/dataflow_rewards.py:by_length"]
"""A reward that varies within a group (the tiny model's sums score 0 alike: no advantage to scale)."""

PLUGINS = textwrap.dedent('''
    import os
    from pathlib import Path

    from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, broadcast

    CALLS = Path(__file__).with_suffix(".calls")


    def _note(what: str) -> None:
        with CALLS.open("a") as f:
            f.write(f"{what} {os.getpid()}\\n")


    def _scaled(x: EstimatorInputs) -> Advantages:
        from relayrl.algorithms.advantages import grpo

        _note("estimator")
        scale = float(os.environ.get("MINE_SCALE", "1"))
        return Advantages(broadcast(grpo(x.rewards, x.group_ids) * scale, x.mask), metrics={"mine/scale": scale})


    SCALED = Estimator("scaled", _scaled, paper="test", min_group=2)


    def pg_loss(logprobs, old_logprobs, advantages, mask, *, tag=0.0, **common):
        _note("loss")
        ratio = (logprobs - old_logprobs.detach()).exp()
        return -advantages * ratio, {"mine/ratio_mean": (ratio.detach() * mask).sum() / mask.sum(), "mine/tag": tag}
''')


@pytest.fixture()
def plugins(tmp_path):
    path = tmp_path / "plugins" / "mine.py"
    path.parent.mkdir()
    path.write_text(PLUGINS)
    return path


def _calls(plugins) -> dict[str, set[int]]:
    """The process ids that called each plugin."""
    out: dict[str, set[int]] = {}
    for line in plugins.with_suffix(".calls").read_text().splitlines():
        what, pid = line.split()
        out.setdefault(what, set()).add(int(pid))
    return out


@pytest.mark.slow
def test_a_user_estimator_and_loss_from_files_are_what_two_grpo_steps_use(tmp_path, tiny_dir, plugins, monkeypatch):
    rel = os.path.relpath(plugins)  # (a relative path, made absolute when the config loads)
    mine = [f"algorithm.advantage={rel}:SCALED", f"algorithm.policy_loss={rel}:pg_loss"]
    monkeypatch.setenv("MINE_SCALE", "0")
    zero = run_grpo(tmp_path / "zero", tiny_dir, *VARIED, *mine)
    assert [r["step"] for r in zero] == [1, 2]
    for r in zero:  # advantages x 0: no gradient at all (kl_coef=0, no entropy bonus)
        assert r["mine/scale"] == 0.0 and r["actor/grad_norm"] == 0.0 and r["mine/ratio_mean"] == pytest.approx(1.0)
    monkeypatch.setenv("MINE_SCALE", "1")
    one = run_grpo(tmp_path / "one", tiny_dir, *VARIED, *mine)
    assert all(r["mine/scale"] == 1.0 and "mine/ratio_mean" in r for r in one)
    assert any(r["actor/grad_norm"] > 0 for r in one)
    assert _calls(plugins) == {"estimator": {os.getpid()}, "loss": {os.getpid()}}  # (local backend: in-process)


@pytest.mark.slow
@pytest.mark.multiproc
def test_rank_processes_load_the_users_loss_themselves(tmp_path, tiny_dir, plugins):
    """Two actor ranks, each a spawned process: they receive the loss object, which holds the path and the
    loss's own options (``algorithm.policy_loss_options``), and import the file themselves (the local backend's
    scorer, which calls the estimator, runs in the driver)."""
    recs = run_grpo(tmp_path / "run", tiny_dir, *VARIED, f"algorithm.advantage={plugins}:SCALED",
                    f"algorithm.policy_loss={plugins}:pg_loss", "algorithm.policy_loss_options.tag=3",
                    "cluster.devices=2", "cluster.oversubscribe=true")
    assert all(r["mine/scale"] == 1.0 and "mine/ratio_mean" in r and r["mine/tag"] == 3 for r in recs)
    assert any(r["actor/grad_norm"] > 0 for r in recs)
    calls = _calls(plugins)
    assert len(calls["loss"]) == 2 and os.getpid() not in calls["loss"] and calls["estimator"] == {os.getpid()}


@pytest.mark.multiproc
def test_a_process_handed_the_algorithm_section_loads_the_users_estimator_itself(tmp_path, plugins):
    """The scorer on a pool of its own (``placement.reward``) is handed the config's algorithm section, pickled:
    a fresh interpreter that unpickles it finds the estimator by its path, with what its record declares."""
    import pickle
    import subprocess
    import sys

    from relayrl.config.schema import Config

    section = Config.model_validate({"algorithm": {"advantage": f"{plugins}:SCALED"}}).algorithm
    (tmp_path / "algorithm.pkl").write_bytes(pickle.dumps(section))
    probe = ("import pickle, sys; from relayrl.algorithms.estimators import estimator; "
             f"a = pickle.load(open({str(tmp_path / 'algorithm.pkl')!r}, 'rb')); e = estimator(a.advantage); "
             "print(e.min_group, e.plugin, 'relayrl_user_mine' in ''.join(sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "True", "True"], r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.ray
def test_ray_workers_load_the_users_loss_themselves(tmp_path, tiny_dir, plugins):
    """On Ray the two actor ranks are Ray actors: they receive the loss object, which holds the path, and
    import the file themselves."""
    recs = run_grpo(tmp_path / "run", tiny_dir, *VARIED, f"algorithm.advantage={plugins}:SCALED",
                    f"algorithm.policy_loss={plugins}:pg_loss", "cluster.backend=ray", "cluster.num_cpus=4",
                    "cluster.devices=2")
    assert all(r["mine/scale"] == 1.0 and "mine/ratio_mean" in r for r in recs)
    calls = _calls(plugins)
    assert len(calls["loss"]) == 2 and os.getpid() not in calls["loss"]
