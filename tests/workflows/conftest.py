"""The SFT models the end-to-end tests start from (each trained once per test session, by whichever pytest-xdist
worker asks first; the other waits for it and reads the same directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e_cli import FAST, once_per_session, records, relayrl
from vllm_runs import H32


def _train_sft(run: Path, *extra: str) -> None:
    r = relayrl("train", "recipes/arith_sft.yaml", "trainer.steps=4", f"run.dir={run}", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(run)
    assert [x["step"] for x in recs] == [0, 1, 2, 3, 4]
    assert all("sft/loss" in x for x in recs[1:]) and "eval/accuracy" in recs[-1]


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory) -> Path:
    return once_per_session(tmp_path_factory, "sft", lambda run: _train_sft(run, *FAST)) / "model"


@pytest.fixture(scope="session")
def sft32(tmp_path_factory) -> Path:
    """The arith SFT model (4 steps) in the shape with heads of 32 dimensions, for the vLLM runs (vLLM's CPU
    attention has no 16, the other tests' tiny shape): answers end in EOS, some are right."""
    return once_per_session(tmp_path_factory, "sft32", lambda run: _train_sft(run, *H32)) / "model"
