"""apply_lora refuses, as a user error naming its key, what the model cannot take: a target it has no linear
layer for, a rank above a targeted layer's min(in, out), and the output head (tied or not)."""

import pytest
import torch

from relayrl.errors import is_user_error
from relayrl.models.load import load_model
from relayrl.models.lora import LoraConfig, LoraError, apply_lora


def _refused(model, *says: str, **cfg) -> str:
    with pytest.raises(LoraError) as e:
        apply_lora(model, LoraConfig(enabled=True, **cfg))
    assert is_user_error(e.value)
    for s in says:
        assert s in str(e.value), str(e.value)
    return str(e.value)


def test_a_rank_above_the_narrowest_targeted_layer_is_refused(tiny_dir):
    model = load_model(tiny_dir)
    width = model.config.hidden_size  # q/k/v/o are [width, width]; the MLP is wider
    _refused(model, f"model.lora.r={width + 1} is larger than model.layers.0.self_attn.q_proj allows",
             f"set model.lora.r <= {width}", "or drop q_proj from model.lora.target_modules", r=width + 1)
    _refused(model, f"model.lora.r=100000", f"set model.lora.r <= {width}", r=100000)
    # Only the MLP targeted: its narrowest side is the width too, named as gate_proj.
    _refused(model, "model.layers.0.mlp.gate_proj", r=width + 1, target_modules=["gate_proj", "up_proj"])
    assert not any(".lora_" in n for n, _ in model.named_parameters())  # refused before any adapter went in
    apply_lora(model, LoraConfig(enabled=True, r=width))  # the bound itself is fine


def test_a_target_the_model_lacks_is_a_user_error(tiny_dir):
    _refused(load_model(tiny_dir), "model.lora.target_modules names ['c_attn'], which Qwen2ForCausalLM has no "
             "linear layer called", target_modules=["q_proj", "c_attn"])


def test_targets_match_as_peft_matches_them_by_suffix(tiny_dir):
    model = load_model(tiny_dir)
    apply_lora(model, LoraConfig(enabled=True, r=4, target_modules=["self_attn.q_proj"]))
    adapted = {n.split(".lora_A.")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == {f"model.layers.{i}.self_attn.q_proj" for i in range(model.config.num_hidden_layers)}


def test_a_tied_output_head_is_refused_up_front(tiny_dir):
    model = load_model(tiny_dir)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    _refused(model, "model.lora.target_modules targets lm_head, the output head of Qwen2ForCausalLM (tied: it "
             "shares its weight with the input embedding", "drop it from model.lora.target_modules",
             r=4, target_modules=["q_proj", "lm_head"])


def test_an_untied_output_head_is_refused_too(tiny_dir):
    model = load_model(tiny_dir)
    head = model.get_output_embeddings()
    untied = torch.nn.Linear(head.in_features, head.out_features, bias=False)
    untied.weight.data.copy_(head.weight.data)
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(untied)
    msg = _refused(model, "targets lm_head, the output head of Qwen2ForCausalLM;",
                   "the training engine computes log-probs from the head's weight directly", r=4,
                   target_modules=["lm_head"])
    assert "tied" not in msg


def test_default_targets_narrower_than_the_rank_are_named_when_left_out(caplog):
    """(With model.lora.r above k_proj's and v_proj's width, the default targets left them out without a word.)"""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.models.lora import resolve_targets

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    kv = 32  # (grouped-query attention: the key/value projections are half the width)
    with caplog.at_level("WARNING", logger="relayrl.models.lora"):
        names = resolve_targets(model, LoraConfig(enabled=True, r=kv + 1))
    assert "k_proj" not in names and "v_proj" not in names and "q_proj" in names
    assert f"model.lora.r={kv + 1} is larger than the narrowest side of k_proj ({kv}), v_proj ({kv})" in caplog.text
    caplog.clear()
    resolve_targets(model, LoraConfig(enabled=True, r=kv))
    assert "narrowest side" not in caplog.text
