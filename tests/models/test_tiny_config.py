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
