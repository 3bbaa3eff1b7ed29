"""Session.begin, the opening of the one run loop (Session.run's, and that of the tests and benchmarks that call
a workflow's steps themselves): restore, telemetry, the step-0 evaluation of a fresh run, the steps left."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SFT = str(ROOT / "recipes" / "arith_sft.yaml")
FAST = ["eval.size=8", "run.threads=1", "telemetry.sinks=[jsonl]", "model.tiny.hidden_size=64",
        "model.tiny.intermediate_size=256"]


def _session(tmp_path, *overrides: str):
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.session import Session

    cfg = load_config(Config, SFT, [f"run.dir={tmp_path / 'run'}", "trainer.steps=3", *FAST, *overrides])
    return Session(cfg, log=lambda _: None)


@pytest.mark.parametrize("before_training", [True, False])
def test_begin_restores_opens_telemetry_and_evaluates_a_fresh_run_at_step_0(tmp_path, before_training):
    s = _session(tmp_path, f"eval.before_training={str(before_training).lower()}")
    calls: list[str] = []

    def restore() -> None:
        assert not (s.dir / "config.json").exists()  # (restored before anything is written)
        calls.append("restore")

    def evaluate(step: int) -> dict[str, float]:
        calls.append(f"evaluate {step}")
        return {"eval/accuracy": 0.25}

    try:
        steps = s.begin(restore=restore, evaluate=evaluate, key_metrics=("eval/accuracy",))
    finally:
        s.close_telemetry()
    assert steps == range(1, 4)
    assert calls == ["restore", "evaluate 0"] if before_training else ["restore"]
    assert (s.dir / "config.json").is_file()
    records = [json.loads(line) for line in (s.dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("eval/accuracy")) for r in records] == ([(0, 0.25)] if before_training else [])


def test_log_step_forgets_the_timeline_sums_it_read(tmp_path):
    """The timeline's per-step sums were never dropped: they grew by one dict a step for the whole run."""
    s = _session(tmp_path)
    s.open_telemetry(total_steps=3, key_metrics=())
    try:
        t = time.time()
        for step in (1, 2, 3):
            s.timeline.add_span("update", "actor", step, t, t + 0.5)
            s.timeline.add_span("checkpoint", "driver", step - 1, t, t + 0.1)  # (recorded after its step's log)
            metrics: dict[str, float] = {}
            assert s.log_step(step, metrics, save=lambda _: None)
            assert metrics["timing/update_s"] == pytest.approx(0.5)
            assert s.timeline.durations(step) == {} and s.timeline.durations(step - 1) == {}
    finally:
        s.close_telemetry()
