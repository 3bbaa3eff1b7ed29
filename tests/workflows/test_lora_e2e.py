"""LoRA GRPO from the CLI (recipes/arith_grpo_lora.yaml): checkpoints of adapters resume exactly, the exported
model is the merged one (plus the adapter in peft's format), and the tri-model reference is the base with the
adapters off (slow: each run is a few seconds)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from e2e_cli import FAST, records, relayrl
from safetensors.torch import load_file

from tests.workflows.test_e2e import _stable


@pytest.mark.slow
def test_lora_grpo_resumes_exactly_and_exports_the_merged_model(sft_model, tmp_path, monkeypatch):
    # a reward by response length varies within the barely trained model's groups, so the adapters move
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    common = ["trainer.steps=4", "run.save_every=2", "eval.every=2", f"trainer.init_from={sft_model}",
              "model.lora.r=4", "reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length",
              "rollout.max_new_tokens=8", *FAST]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    r = relayrl("train", "recipes/arith_grpo_lora.yaml", f"run.dir={ref}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    r = relayrl("train", "recipes/arith_grpo_lora.yaml", f"run.dir={cut}", *common, "trainer.steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    r = relayrl("train", "recipes/arith_grpo_lora.yaml", f"run.dir={cut}", "run.resume=auto", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout + r.stderr
    a, b = records(ref), records(cut)
    assert [x["step"] for x in b] == [x["step"] for x in a] == list(range(5))
    assert all(x["actor/grad_norm"] > 0 for x in a[1:])
    for x, y in zip(a[3:], b[3:]):  # steps 3 and 4 need the saved adapters and their Adam state
        assert _stable(x) == _stable(y), f"step {x['step']} differs"

    ck = load_file(ref / "checkpoints" / "step-000004" / "model.safetensors")
    assert ck and all(".lora_A." in k or ".lora_B." in k for k in ck)  # adapters only
    assert len(torch.load(ref / "checkpoints" / "step-000004" / "optimizer.pt")["state"]) == len(ck)

    model = load_file(ref / "model" / "model.safetensors")
    base = load_file(sft_model / "model.safetensors")
    assert set(model) == set(base)  # the merged model under the base model's names
    moved = [k for k in base if not torch.equal(model[k], base[k])]
    assert moved and all(k.rsplit(".", 2)[-2].endswith("_proj") for k in moved)
    adapter = json.loads((ref / "model" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["peft_type"] == "LORA"
    assert (ref / "model" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_lora_tri_model_kl_run(sft_model, tmp_path):
    r = relayrl("train", "recipes/arith_grpo_lora.yaml", f"run.dir={tmp_path}", "trainer.steps=2",
                "algorithm.kl_coef=0.05", "trainer.tri_model=true", f"trainer.init_from={sft_model}", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    last = records(tmp_path)[-1]
    assert last["actor/ref_forward_passes"] >= 1 and "actor/kl" in last


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["arith_ppo", "arith_dpo", "arith_sft"])
def test_lora_runs_in_every_workflow(sft_model, tmp_path, recipe):
    """PPO (actor and critic adapted, the critic's head trained in full), DPO and SFT take model.lora too."""
    r = relayrl("train", f"recipes/{recipe}.yaml", f"run.dir={tmp_path}", "trainer.steps=2", "run.save_every=2",
                "model.lora.enabled=true", "model.lora.r=4", f"trainer.init_from={sft_model}", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = tmp_path / "checkpoints" / "step-000002"
    assert all(".lora_" in k for k in load_file(ck / "model.safetensors"))
    if recipe == "arith_ppo":
        critic = torch.load(ck / "extra.pt", weights_only=False)["critic"]["model"]
        assert {"lm_head.weight", "lm_head.bias"} <= set(critic)
        assert all(".lora_" in k or k.startswith("lm_head.") for k in critic)
    assert (tmp_path / "model" / "adapter" / "adapter_config.json").is_file()
    sized = [x for x in records(tmp_path) if "params/total" in x]  # logged once, with the first step
    assert [x["step"] for x in sized] == [1]
    total, trained, state = (sized[0][k] for k in ("params/total", "params/trainable", "optimizer/state_bytes"))
    assert 0 < trained < 0.2 * total
    assert 8 * trained <= state < 8 * total  # Adam's two fp32 moments of the actor's adapters
    assert "M trained (" in r.stdout + r.stderr
    assert f"step 2: checkpoint saved to {ck} (" in r.stdout + r.stderr


@pytest.mark.slow
def test_colocated_rollout_takes_merged_weights_not_the_actors_parameters(tmp_path):
    """In one process the rollout would run on the actor's parameters (zero-copy); with LoRA it keeps its own
    copy, and after a step holds exactly the actor's merged weights."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.pipeline import GRPOPipeline

    wf = GRPOPipeline(load_config(Config, "recipes/arith_grpo_lora.yaml", [
        f"run.dir={tmp_path}", "trainer.steps=1", "eval.every=0", "data.prompts_per_step=2", "rollout.n=4",
        "rollout.max_new_tokens=8", "reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length",
        "trainer.init_from=null", "engine.optim.warmup_steps=0", *FAST]))
    try:
        assert wf.actor.in_driver and wf.rollout.in_driver and not wf.shared
        assert list(wf.begin()) == [1]  # restore (the first relay), telemetry, the step-0 evaluation
        metrics = wf.step(1)
        assert metrics["actor/grad_norm"] > 0
        merged = dict(wf.actor.one("named_weights"))
        rollout = dict(wf.rollout._ranks.worker.engine.model.named_parameters())
        assert set(rollout) == set(merged)
        for n, p in rollout.items():
            assert torch.equal(p, merged[n]) and p.data_ptr() != merged[n].data_ptr(), n
    finally:
        wf.shutdown()


@pytest.mark.slow
@pytest.mark.multiproc
def test_lora_grpo_on_two_data_parallel_ranks_resumes_on_one(sft_model, tmp_path):
    """cluster.devices=2 with LoRA: the adapted actor sharded over two ranks (FSDP2), its tri-model reference
    the same shards with the adapters off; the rollout ranks sample with the merged weights built from the
    shards, so the generator's log-probs are the trainer's to float32 rounding at every step. The adapters-only
    checkpoint of the 2-rank run resumes on one rank."""
    common = [f"trainer.init_from={sft_model}", "model.lora.r=4", "algorithm.kl_coef=0.05", "trainer.tri_model=true",
              "reward.verifier=user", "reward.user_fn=dataflow_rewards:by_length", "rollout.max_new_tokens=8", *FAST]
    env = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    r = relayrl("train", "recipes/arith_grpo_lora.yaml", "trainer.steps=2", "run.save_every=1", f"run.dir={tmp_path}",
                "cluster.devices=2", *common, env={"PYTHONPATH": env})
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(tmp_path)
    assert [x["step"] for x in recs][-2:] == [1, 2]
    for x in recs[-2:]:
        assert x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), x["step"]
        assert x["rollout/logprob_error_max"] < 1.001 and x["actor/grad_norm"] > 0
        assert x["actor/ref_forward_passes"] >= 1 and "actor/kl" in x
    ck = load_file(tmp_path / "checkpoints" / "step-000002" / "model.safetensors")
    assert ck and all(".lora_A." in k or ".lora_B." in k for k in ck)  # adapters only, full tensors
    base = load_file(sft_model / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj"
    assert ck[f"{q}.lora_A.default.weight"].shape == (4, base[f"{q}.weight"].shape[1])
    assert (tmp_path / "model" / "adapter" / "adapter_model.safetensors").is_file()
    r = relayrl("train", "recipes/arith_grpo_lora.yaml", "trainer.steps=3", f"run.dir={tmp_path}", "run.resume=auto",
                *common, env={"PYTHONPATH": env})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout
    assert [x["step"] for x in records(tmp_path)][-3:] == [1, 2, 3]
