"""A run driven from Python (``relayrl.workflows.registry``): ``run`` is what ``relayrl train`` does
(restarts included), and a run started while a worker process imports the user's script is refused with the
fix (the ``__main__`` guard) instead of failing on the run directory's lock."""

from __future__ import annotations

import multiprocessing

import pytest

import relayrl.workflows.registry as registry
from relayrl.config.loader import load_run_config
from relayrl.dock import UnitLostError
from relayrl.errors import UserError
from e2e_cli import ROOT


def _config(run_dir, *over: str):
    return load_run_config(ROOT / "recipes/arith_grpo.yaml", [f"run.dir={run_dir}", "telemetry.sinks=[jsonl]", *over])


@pytest.mark.parametrize("entry", ["run", "train"])
def test_a_run_started_while_a_worker_imports_the_script_names_the_main_guard(tmp_path, monkeypatch, entry):
    """Worker ranks (forkserver, spawn) run the user's main script again while they bootstrap; a script without
    ``if __name__ == "__main__":`` started a second run in each rank, which failed with 'run.dir ... is in use by
    another run'."""
    def started(*a, **k):
        raise AssertionError("the workflow started inside a bootstrapping worker process")

    monkeypatch.setattr(registry, "import_module", started)
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(UserError, match='if __name__ == "__main__":'):
        getattr(registry, entry)(_config(tmp_path / "run"))


def test_run_restarts_a_lost_worker_as_relayrl_train_does(tmp_path, monkeypatch):
    """``registry.train`` is one attempt; ``registry.run`` applies run.max_restarts, as the CLI does."""
    calls = []

    def once(cfg):
        calls.append(cfg)
        if len(calls) == 1:
            raise UnitLostError("storage unit 0 (pid 4242) died; its rows are lost [drop]")
        return tmp_path / "model"

    monkeypatch.setattr(registry, "train", once)
    assert registry.run(_config(tmp_path / "run", "run.max_restarts=1")) == tmp_path / "model"
    assert len(calls) == 2


def test_a_config_changed_by_assignment_is_checked_across_keys_before_the_run(tmp_path):
    """``cfg.rollout.n = 1`` passes the rollout section's own checks; group advantages need two responses per
    prompt, which only the whole config knows: train refuses it before anything is written."""
    from relayrl.config.loader import ConfigError

    cfg = load_run_config(ROOT / "recipes" / "arith_grpo.yaml", [f"run.dir={tmp_path / 'r'}"])
    cfg.rollout.n = 1
    with pytest.raises(ConfigError, match=r"rollout.n=1: group advantages \(grpo\) need rollout.n >= 2"):
        registry.run(cfg)
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_an_error_of_yours_in_a_worker_reaches_a_script_as_a_worker_error_with_its_message(tmp_path):
    """docs/runs.md: an environment (or reward function) that fails inside a worker group reaches ``run`` as a
    ``WorkerError`` (not a ``UserError``): its ``user_message`` is the message the command line prints, and
    ``brief()`` the line it prints, while ``str()`` holds the remote traceback."""
    from relayrl.cluster.errors import WorkerError
    from test_env_errors import ENV
    from test_reward_errors import RUN

    cfg = load_run_config(RUN[0], [*RUN[1:], f"run.dir={tmp_path / 'r'}", *ENV])
    with pytest.raises(WorkerError) as caught:
        registry.run(cfg)
    e = caught.value
    assert not isinstance(e, UserError) and e.user_message is not None
    assert "ended with an environment error: env.step raised RuntimeError: sandbox crashed" in e.user_message
    assert e.brief() == f"worker group 'rollout' rank 0 failed in 'poll_stream': {e.user_message}"
    assert "--- remote traceback (rank 0) ---" in str(e)
