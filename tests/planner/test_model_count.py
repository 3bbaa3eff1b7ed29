"""The planner's parameter counts of mixtures of experts and hybrids (relayrl/planner/model_count.py): the
Llama-shaped formula counted Qwen3-30B-A3B's shape as 3B parameters (its dense intermediate_size, no experts),
so every memory verdict on it was ten times too kind."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from relayrl.models.lora import LoraConfig
from relayrl.planner.workload import ModelShape

from tests.models.architectures import ARCHS, COMMON


def _meta_params(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())


def test_qwen3_30b_a3b_shape_counts_its_experts_and_the_routed_share():
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                               num_experts_per_tok=8, vocab_size=151936, intermediate_size=6144,
                               tie_word_embeddings=False)
    shape = ModelShape.from_hf_config(cfg, dtype="bfloat16")
    assert 30.4e9 < shape.params < 30.6e9 and 3.2e9 < shape.active < 3.4e9  # (the published 30.5B / 3.3B)
    assert shape.compute_params == shape.active
    assert shape.routed == 48 * 128 * 3 * 2048 * 768 and shape.experts_per_token == 8  # (what expert parallelism keeps)


def _tiny(name: str):
    return AutoConfig.for_model(name, **{**COMMON, **ARCHS[name]})


def test_every_tiny_moe_and_hybrid_counts_what_the_model_holds():
    for name in ("qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_text", "gpt_oss", "jamba", "nemotron_h"):
        cfg = _tiny(name)
        shape = ModelShape.from_hf_config(cfg)
        assert shape.params == _meta_params(cfg), name
        if name in ("qwen3_5_text", "nemotron_h"):  # (no experts: every parameter is active)
            assert shape.active == shape.params
        else:
            assert 0 < shape.active < shape.params, name


def test_a_dense_model_keeps_the_formula_and_lora_on_experts_trains_the_adapters():
    dense = _tiny("qwen2")
    assert ModelShape.from_hf_config(dense).active == 0  # (compute_params is params)
    assert ModelShape.from_hf_config(_tiny("qwen3_5_text")).routed == 0  # (a hybrid without experts)
    cfg = _tiny("qwen3_moe")
    lora = ModelShape.from_hf_config(cfg, dtype="bfloat16", lora=LoraConfig(enabled=True, r=4))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    attn = sum(4 * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert lora.trainable == attn and lora.train_bytes == 2  # (its experts are fused: not LoRA's by default)


def test_a_hybrids_kv_cache_is_its_attention_layers_only():
    shape = ModelShape.from_hf_config(_tiny("qwen3_5_text"))
    assert (shape.layers, shape.kv_layers) == (4, 1)  # three Gated DeltaNet layers hold no keys and values
    assert ModelShape.from_hf_config(_tiny("qwen3_moe")).kv_layers == 0  # (every layer)
    assert ModelShape.from_hf_config(_tiny("jamba")).kv_layers == 2  # (attention every other layer)
    assert ModelShape.from_hf_config(_tiny("nemotron_h")).kv_layers == 1  # (the pattern M*M-)


def test_lora_on_expert_tensors_counts_an_adapter_per_expert():
    from relayrl.models.lora import apply_lora

    cfg = _tiny("qwen3_moe")
    lora = LoraConfig(enabled=True, r=4, target_modules=["q_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    planned = ModelShape.from_hf_config(cfg, lora=lora).trainable
    model = AutoModelForCausalLM.from_config(cfg)
    apply_lora(model, lora)
    assert planned == sum(p.numel() for p in model.parameters() if p.requires_grad)
