"""A policy loss without PPO's dual clip or sequence ratio refuses them naming only the key that is set: with
``algorithm.ratio_level=sequence`` alone the message said "drop algorithm.dual_clip and set
algorithm.ratio_level=token", a key the user never set (and GMPO's aside showed in Clip-Cov's message)."""

from __future__ import annotations

import pytest

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config


def _error(*over: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(Config, "arith_grpo", list(over))
    return str(e.value)


def test_the_sequence_ratio_alone_is_named_alone():
    said = _error("algorithm.policy_loss=gmpo", "algorithm.ratio_level=sequence")
    assert "algorithm.policy_loss=gmpo has no dual clip and takes token ratios (its sequence ratio is their " \
           "geometric mean): set algorithm.ratio_level=token" in said
    assert "dual_clip" not in said.split(":")[-1]


def test_the_dual_clip_alone_is_named_alone():
    said = _error("algorithm.policy_loss=clip_cov", "algorithm.dual_clip=3")
    assert "algorithm.policy_loss=clip_cov has no dual clip and takes token ratios: drop algorithm.dual_clip" in said
    assert "ratio_level" not in said and "gmpo" not in said


def test_both_are_named_when_both_are_set():
    said = _error("algorithm.policy_loss=gpg", "algorithm.dual_clip=3", "algorithm.ratio_level=sequence")
    assert "algorithm.policy_loss=gpg has no ratio: drop algorithm.dual_clip and set algorithm.ratio_level=token" in said
