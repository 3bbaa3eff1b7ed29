"""Small GRPO configs and runs of ``recipes/arith_grpo.yaml`` that the step tests share: a config with
overrides, the text of a refusal, and a two-step run's per-step records."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

RUN = ["trainer.steps=2", "eval.size=8", "eval.every=0", "data.prompts_per_step=2", "rollout.n=4",
       "rollout.max_new_tokens=8", "telemetry.sinks=[jsonl]", "engine.optim.lr=1e-3", "engine.optim.warmup_steps=0",
       "run.save_every=0"]
"""A short run: two steps of 2 prompts x 4 responses of up to 8 tokens, no evaluation between, no checkpoints."""


def recipe_cfg(*over: str):
    """``recipes/arith_grpo.yaml`` with the overrides."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config

    return load_config(Config, "recipes/arith_grpo.yaml", list(over))


def refused(*over: str) -> str:
    """The message of the error that refuses the recipe with these overrides."""
    from relayrl.config.loader import ConfigError

    with pytest.raises((ConfigError, ValidationError, ValueError)) as e:
        recipe_cfg(*over)
    return str(e.value)


def run_grpo(run_dir, student, *over: str) -> list[dict]:
    """A :data:`RUN` from ``student`` (later overrides win); its records after step 0."""
    from relayrl.workflows.pipeline import GRPOPipeline

    GRPOPipeline(recipe_cfg(f"run.dir={run_dir}", *RUN, f"trainer.init_from={student}", *over)).run()
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()][1:]
