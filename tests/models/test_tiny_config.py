"""The tiny model's shape is checked when the config loads (naming model.tiny and the values that fit),
not after a tokenizer was trained."""

import pytest
from pydantic import ValidationError

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config
from relayrl.models.tiny import TinyModelConfig


def test_heads_that_do_not_divide_the_width_are_refused_at_config_time():
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, ["model.tiny.hidden_size=100", "model.tiny.num_heads=3"])
    assert ("model.tiny: num_heads=3 does not divide hidden_size=100 (each head gets hidden_size / num_heads "
            "dimensions); set model.tiny.num_heads to one of [1, 2, 5, 10, 25, 50]") in str(e.value)


def test_an_odd_head_size_is_refused():  # rotary embeddings fail on it in the first forward pass
    with pytest.raises(ValidationError, match=r"hidden_size=36 / num_heads=4 gives heads of 9 dimensions, an odd "
                                              r"number .*one of \[1, 2, 3, 6, 9, 18\]"):
        TinyModelConfig(hidden_size=36, num_heads=4)


def test_shapes_that_fit_load():
    TinyModelConfig()  # 256 / 4
    TinyModelConfig(hidden_size=64, num_heads=2)
    TinyModelConfig(shape="qwen2-0.5b", hidden_size=100, num_heads=3)  # the fields then shape the tokenizer only


def test_experts_build_a_tiny_mixture_of_experts_with_the_dense_models_compute(tmp_path):
    import torch
    from transformers import AutoConfig

    from relayrl.models.load import load_model
    from relayrl.models.routing import router_shape
    from relayrl.models.tiny import build_tiny

    cfg = TinyModelConfig(hidden_size=64, intermediate_size=256, num_layers=2, experts=4, experts_per_token=2)
    path = build_tiny(cfg, cache_dir=tmp_path, verbose=False)
    assert path.name.startswith("tiny-qwen3moe-")
    conf = AutoConfig.from_pretrained(path)
    assert (conf.model_type, conf.num_experts, conf.num_experts_per_tok, conf.moe_intermediate_size) == (
        "qwen3_moe", 4, 2, 128)  # 2 routed experts of 128: the dense model's 256 per token
    model = load_model(path)
    assert router_shape(model).layers == 2
    assert torch.isfinite(model(torch.arange(3, 9)[None]).logits).all()
    dense = build_tiny(TinyModelConfig(hidden_size=64, intermediate_size=256, num_layers=2), cache_dir=tmp_path,
                       verbose=False)
    assert dense.name.startswith("tiny-qwen2-") and AutoConfig.from_pretrained(dense).model_type == "qwen2"


@pytest.mark.parametrize("over, message", [
    (dict(experts=1), "set experts >= 2 and 1 <= experts_per_token <= experts"),
    (dict(experts=4, experts_per_token=5), "set experts >= 2 and 1 <= experts_per_token <= experts"),
    (dict(experts=4, shape="qwen2-0.5b"), "model.tiny.shape=qwen2-0.5b is a published dense shape"),
    # (a dense model routes nothing: experts_per_token alone was taken and read by nothing)
    (dict(experts_per_token=3), "model.tiny.experts_per_token=3 routes each token of a mixture of experts, and "
                                "model.tiny.experts=0 builds a dense model: set model.tiny.experts"),
])
def test_a_tiny_mixture_that_cannot_be_built_is_refused(over, message):
    with pytest.raises(ValidationError, match=message):
        TinyModelConfig(**over)
