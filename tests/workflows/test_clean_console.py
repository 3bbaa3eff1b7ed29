"""A default run prints no warnings: a GRPO step with every warning turned into an error completes.

transformers 5.24 renamed the key/value cache keyword of a model's forward from ``past_key_values`` to
``cache`` and warns (FutureWarning) at every generation call that uses the old name; the generation engines
pass the cache under the name the installed transformers takes (``relayrl.engines.generation.kv_cache``).
"""

from __future__ import annotations

import gc
import warnings

import pytest

from relayrl.config.loader import load_config
from relayrl.config.schema import Config
from relayrl.workflows.registry import train


@pytest.mark.filterwarnings("error")
@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_a_short_grpo_run_prints_no_warning(tmp_path):
    with warnings.catch_warnings():  # what earlier tests in this process left to the collector is not this run's
        warnings.simplefilter("ignore")
        gc.collect()
    cfg = load_config(Config, "recipes/arith_grpo.yaml", [
        f"run.dir={tmp_path}", "trainer.steps=1", "eval.size=8", "data.prompts_per_step=4", "rollout.n=4",
        "rollout.max_new_tokens=6", "telemetry.sinks=[jsonl]", "run.threads=1", "model.tiny.hidden_size=64",
        "model.tiny.intermediate_size=256"])
    out = train(cfg)
    assert (out / "config.json").is_file() and (tmp_path / "metrics.jsonl").is_file()
