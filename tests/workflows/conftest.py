"""The SFT model the end-to-end tests start from (trained once per test session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e_cli import FAST, records, relayrl


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sft")
    r = relayrl("train", "recipes/arith_sft.yaml", "trainer.steps=4", f"run.dir={run}", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(run)
    assert [x["step"] for x in recs] == [0, 1, 2, 3, 4]
    assert all("sft/loss" in x for x in recs[1:]) and "eval/accuracy" in recs[-1]
    return run / "model"
