"""``rollout.engine=openai``: GRPO whose rollouts all go through a ``relayrl serve`` subprocess over HTTP."""

from __future__ import annotations

import json

import pytest
import requests

from e2e_cli import relayrl
from serve_proc import start_server

FAST = ["eval.size=8", "run.threads=1", "telemetry.sinks=[jsonl]", "trainer.steps=3", "eval.every=0",
        "engine.optim.lr=1e-3", "engine.optim.warmup_steps=0", "algorithm.entropy_coef=0.05",
        "data.prompts_per_step=4", "rollout.n=4"]  # the entropy bonus moves the weights even at reward 0


def train(tiny_dir, run_dir, url: str, *extra: str) -> list[dict]:
    r = relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={run_dir}", f"model.path={tiny_dir}",
                "rollout.engine=openai", f"rollout.base_url={url}", *FAST, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_rollouts_through_relayrl_serve_with_weights_after_every_step(tiny_dir, tmp_path):
    server = start_server(tiny_dir, tmp_path / "serve.log", "--name", "tiny")
    try:
        before = requests.get(f"{server.root}/health").json()
        recs = train(tiny_dir, tmp_path / "synced", server.url)
        after = requests.get(f"{server.root}/health").json()
        steps = [r for r in recs if r.get("step", 0) > 0 and "rollout/logprob_error" in r]
        assert len(steps) == 3
        for r in steps:  # every update is on-policy: the server sampled with the trainer's current weights
            assert r["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3)
            assert r["rollout/logprob_error_max"] < 1.01
            assert r["actor/grad_norm"] > 0  # and the weights did move between steps
        assert after["weight_version"] == 3  # the weights of the last update reached the server
        # every rollout went through it: 3 steps x 4 prompts x 4 samples, plus the evaluations
        assert after["generated_tokens"] - before["generated_tokens"] >= 3 * 16
        # control: without weight sync the server samples from stale weights and the error shows it
        stale = train(tiny_dir, tmp_path / "stale", server.url, "rollout.weight_sync=none", "trainer.steps=3")
        last = [r for r in stale if "rollout/logprob_error" in r][-1]
        assert last["rollout/logprob_error"] > 1.0 + 1e-3
        # the path variant of the relayrl sync: the trainer writes a file, the server reads it
        recs = train(tiny_dir, tmp_path / "path", server.url, f"rollout.weight_dir={tmp_path / 'weights'}",
                     "trainer.steps=2")
        assert all(r["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3) for r in recs
                   if "rollout/logprob_error" in r)
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["weights-v2.safetensors"]
        # split placement: the rollout rank is a process of its own that writes finished groups into the dock
        # (the streaming dataflow) and takes relayed weight buckets, which it pushes on to the server
        recs = train(tiny_dir, tmp_path / "split", server.url, "placement.pools.gen=1", "placement.rollout=gen",
                     "trainer.steps=2")
        steps = [r for r in recs if "rollout/logprob_error" in r]
        assert len(steps) == 2 and all(r["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3) for r in steps)
    finally:
        server.stop()


def test_remote_config_names_the_key_and_the_fix():
    from relayrl.config.loader import ConfigError, load_config
    from relayrl.config.schema import Config

    with pytest.raises(ConfigError, match="rollout.base_url"):
        load_config(Config, None, ["rollout.engine=openai"])
    with pytest.raises(ConfigError, match="http://"):
        load_config(Config, None, ["rollout.engine=openai", "rollout.base_url=localhost:8000"])
    with pytest.raises(ConfigError, match="rollout.weight_dir"):
        load_config(Config, None, ["rollout.engine=openai", "rollout.base_url=http://h:1/v1",
                                   "rollout.weight_sync=sglang"])
    with pytest.raises(ConfigError, match="rollout.engine=openai"):
        load_config(Config, None, ["rollout.base_url=http://h:1/v1"])
    with pytest.raises(ConfigError, match="rollout.partial"):
        load_config(Config, None, ["rollout.engine=openai", "rollout.base_url=http://h:1/v1", "rollout.partial=true",
                                   "trainer.off_policy_steps=1"])
    with pytest.raises(ConfigError, match="trainer.offload"):
        load_config(Config, None, ["rollout.engine=openai", "rollout.base_url=http://h:1/v1", "trainer.offload=true"])
    cfg = load_config(Config, None, ["rollout.engine=openai", "rollout.base_url=http://h:1/v1"])
    assert cfg.rollout.remote().base_url == "http://h:1/v1"


def test_parse_choice_reads_ids_from_either_field():
    from relayrl.engines.generation.remote import RemoteEngineError, parse_choice

    lp = {"tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-0.5, -1.0]}
    assert parse_choice({"logprobs": lp}) == ([5, 9], [-0.5, -1.0])
    assert parse_choice({"logprobs": lp, "token_ids": [5, 9]}) == ([5, 9], [-0.5, -1.0])
    with pytest.raises(RemoteEngineError, match="token_id"):
        parse_choice({"logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}})
    with pytest.raises(RemoteEngineError, match="logprobs"):
        parse_choice({"text": "x"})


def test_every_sampling_field_is_sent_so_no_server_default_applies():
    """Old behaviour: top_k, min_p and repetition_penalty were left out at their neutral values, so a vllm serve
    (or relayrl serve) of a model whose generation_config.json sets top_k=20 sampled with it, while the trainer's
    log-probs and the rollout/logprob_error check assumed no top-k."""
    from relayrl.engines.generation.base import SamplingParams
    from relayrl.engines.generation.remote import RemoteGenerationEngine

    eng = object.__new__(RemoteGenerationEngine)  # (the request body alone: no server to ask for its models)
    eng.model, eng.tokenizer = "m", None  # (no stop strings: the tokenizer is not read)
    body = eng._body([1, 2], SamplingParams(n=2, temperature=1.0, max_new_tokens=4), seed=None)
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"], body["repetition_penalty"]) == \
        (1.0, 1.0, -1, 0.0, 1.0)
    body = eng._body([1, 2], SamplingParams(temperature=0.7, top_k=5, min_p=0.1, max_new_tokens=4), seed=3)
    assert (body["top_k"], body["min_p"], body["seed"]) == (5, 0.1, 3)
