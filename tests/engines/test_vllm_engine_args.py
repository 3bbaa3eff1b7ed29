"""vLLM's start-up arguments (``engine_args``): what relayrl asks of ``vllm.LLM``, without starting vLLM."""

import torch

from relayrl.engines.generation.config import VLLMSpec
from relayrl.engines.generation.vllm_engine import engine_args


def _args(device: str, **spec):
    return engine_args(VLLMSpec(**spec), torch.device(device), dtype="bfloat16", seed=3, max_batch=64,
                       head_fp32=False)


def test_on_cuda_the_engine_can_sleep_so_that_release_frees_memory():
    """Without enable_sleep_mode vLLM's weights and KV cache are not in the allocator that sleep() empties:
    a colocated run's offload (trainer.offload) would free nothing on the GPU."""
    assert _args("cuda")["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in _args("cpu")  # vLLM's CPU backend has no sleep mode (it would refuse)


def test_sampling_arguments_and_tensor_parallelism():
    a = _args("cpu")
    assert a["logprobs_mode"] == "processed_logprobs" and a["skip_tokenizer_init"] and a["max_num_seqs"] == 64
    assert "tensor_parallel_size" not in a and a["hf_overrides"] is None
    tp = _args("cuda", tensor_parallel_size=2)
    assert tp["tensor_parallel_size"] == 2 and tp["distributed_executor_backend"] == "mp"
    assert engine_args(VLLMSpec(), torch.device("cpu"), dtype="float32", seed=0, max_batch=8,
                       head_fp32=True)["hf_overrides"] == {"head_dtype": "float32"}
    # a penalty or a filter: raw log-probs (before every processor), relayrl's at temperature 1
    assert engine_args(VLLMSpec(), torch.device("cpu"), dtype="float32", seed=0, max_batch=8, head_fp32=False,
                       logprobs_mode="raw_logprobs")["logprobs_mode"] == "raw_logprobs"


def test_a_worker_apart_uses_the_multiprocess_executor_with_one_worker():
    a = engine_args(VLLMSpec(), torch.device("cpu"), dtype="float32", seed=0, max_batch=8, head_fp32=False, apart=True)
    assert a["distributed_executor_backend"] == "mp" and a["tensor_parallel_size"] == 1


def test_the_kv_cache_can_be_sized_in_bytes():
    """(On CPU vLLM sizes its cache as a share of the NUMA node less the process's resident size, trainer included:
    on an 8 GiB node it refused to start; relayrl had no key for vLLM's kv_cache_memory_bytes.)"""
    assert "kv_cache_memory_bytes" not in _args("cpu")
    assert _args("cpu", kv_cache_bytes=1 << 30)["kv_cache_memory_bytes"] == 1 << 30


def test_the_chat_template_warmup_warning_of_a_tokenizer_free_engine_is_not_shown(caplog):
    """(Every start logged 'Chat template warmup failed' with a ValueError traceback: vLLM has no tokenizer here.)"""
    import logging

    with caplog.at_level("WARNING"):
        logging.getLogger("vllm.renderers.base").warning("Chat template warmup failed", exc_info=False)
        logging.getLogger("vllm.renderers.base").warning("Multi-modal warmup failed")
    assert "Chat template warmup failed" not in caplog.text and "Multi-modal warmup failed" in caplog.text
