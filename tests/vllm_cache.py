"""The KV cache the tests' vLLM engines start with: 64 MiB, tens of thousands of tokens of the tiny models (a
test's batch needs a few thousand), in place of what ``memory_utilization`` leaves for it. That share of this
machine's RAM came to about 2.9 GB, which vLLM's CPU backend allocated and warmed at every start: its
"init engine (profile, create kv cache, warmup model)" took 4.5 s against 0.09 s with 64 MiB, one engine of
the tests' tiny model on the loaded 2-core machine (2026-12-06). The tests of the share itself leave it out."""

KV_CACHE_BYTES = 64 << 20
"""``rollout.vllm.kv_cache_bytes`` (``VLLMSpec.kv_cache_bytes``) of the tests' engines."""

KV_CACHE = f"rollout.vllm.kv_cache_bytes={KV_CACHE_BYTES}"
"""The same as a command-line override."""
