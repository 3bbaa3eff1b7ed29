"""``rollout.lora_sync``: merged by default; ``adapter`` taken with a vLLM rollout of a LoRA GRPO run, and refused,
naming the key and the fix, where the rollout cannot load an adapter."""

from __future__ import annotations

import pytest

from relayrl.config.lora_sync import VLLM_LORA_RANKS
from relayrl.config.schema import Config
from relayrl.engines.generation.config import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="rollout.engine=vllm is validated against an install")


def adapter(**over) -> dict:
    """A LoRA GRPO run on CPU whose vLLM rollout takes the adapters."""
    lora = {"enabled": True, "r": 8, **over.pop("lora", {})}
    rollout = {"engine": "vllm", "lora_sync": "adapter", **over.pop("rollout", {})}
    return {"model": {"device": "cpu", "lora": lora}, "rollout": rollout, **over}


def refused(data: dict, *words: str) -> None:
    with pytest.raises(ValueError) as info:
        Config.model_validate(data)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_merged_is_the_default_and_adapter_is_taken_with_vllm():
    assert Config.model_validate({"model": {"device": "cpu"}}).rollout.lora_sync == "merged"
    assert Config.model_validate(adapter()).rollout.lora_sync == "adapter"
    assert Config.model_validate(adapter(lora={"r": 512})).rollout.lora_sync == "adapter"


def test_what_cannot_take_an_adapter_is_refused_naming_the_fix():
    refused({"model": {"device": "cpu"}, "rollout": {"engine": "vllm", "lora_sync": "adapter"}}, "rollout.lora_sync=adapter", "model.lora.enabled=false",
            "set model.lora.enabled=true, or drop rollout.lora_sync")
    refused(adapter(rollout={"engine": "native"}), "rollout.engine=native takes merged weights only",
            "set rollout.engine=vllm, or rollout.lora_sync=merged")
    refused(adapter(lora={"target_parameters": ["mlp.experts.gate_up_proj"]}), "model.lora.target_parameters",
            "set rollout.lora_sync=merged")
    refused(adapter(lora={"r": VLLM_LORA_RANKS[-1] + 1}), "model.lora.r=513 is above vLLM's largest LoRA rank (512)")
    refused(adapter(workflow="sft"), "workflow sft relays merged weights", "drop rollout.lora_sync")


def test_the_openai_engine_is_refused_too():
    refused(adapter(rollout={"engine": "openai", "base_url": "http://127.0.0.1:8000/v1"}),
            "rollout.engine=openai takes merged weights only")
