"""Helpers of the end-to-end tests: run the CLI on the tiny model and read a run's metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAST = ["eval.size=16", "run.threads=1", "telemetry.sinks=[jsonl]", "model.tiny.hidden_size=64",
        "model.tiny.intermediate_size=256"]


def relayrl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relayrl.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
