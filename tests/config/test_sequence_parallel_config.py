"""engine.sequence_parallel: what the config refuses before any worker starts, naming the key."""

from __future__ import annotations

import pytest

from relayrl.config.schema import Config


def validate(data: dict) -> Config:
    model = {"device": "cpu", **data.get("model", {})}
    return Config.model_validate({"cluster": {"oversubscribe": True}, **data, "model": model})


def refused(data: dict, *words: str) -> None:
    with pytest.raises(ValueError) as info:
        validate(data)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_sequence_parallel_defaults_off_and_accepts_a_divisor_of_every_trainer_pool():
    assert validate({}).engine.sequence_parallel == 1
    cfg = validate({"cluster": {"devices": 4, "oversubscribe": True}, "engine": {"sequence_parallel": 2},
                    "algorithm": {"kl_coef": 0.1}, "placement": {"pools": {"ref": 2}, "reference": "ref"}})
    assert cfg.train_engine().sequence_parallel == 2  # the reference and critic get the same engine config


def test_sequence_parallel_refusals_name_the_keys():
    refused({"engine": {"sequence_parallel": 2}}, "engine.sequence_parallel=2", "pool main has 1",
            "cluster.devices x cluster.nodes=1")
    refused({"cluster": {"devices": 4, "oversubscribe": True}, "engine": {"sequence_parallel": 3}},
            "pool main has 4", "multiple of 3")
    refused({"cluster": {"devices": 2, "oversubscribe": True}, "engine": {"sequence_parallel": 2},
             "algorithm": {"kl_coef": 0.1}, "placement": {"pools": {"ref": 1}, "reference": "ref"}},
            "pool ref has 1", "placement.pools.ref (placement.reference)")
    refused({"cluster": {"devices": 2, "oversubscribe": True}, "engine": {"sequence_parallel": 2},
             "model": {"attn_implementation": "eager"}}, "model.attn_implementation=eager", "set it to sdpa")
    refused({"cluster": {"devices": 2, "oversubscribe": True},
             "engine": {"sequence_parallel": 2, "packing": "none"}}, "engine.packing=sequences or shared_prompt")
    refused({"engine": {"sequence_parallel": 0}}, "sequence_parallel")
