"""A rank holding a vLLM engine whose engine core runs in a process of its own (importable by rank processes)."""
from __future__ import annotations

import os

from relayrl.cluster import Worker


class EngineCoreHolder(Worker):
    """A vLLM engine with ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in the environment, as a user may set it: vLLM
    then runs the engine core (and its worker) in processes of its own, which watch nothing of their parent."""

    def __init__(self, model_dir: str) -> None:
        from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine, VLLMSpec
        from relayrl.models.load import load_tokenizer
        from tests.vllm_cache import KV_CACHE_BYTES

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        self.engine = VLLMGenerationEngine(model_dir, load_tokenizer(model_dir), max_batch=8,
                                           spec=VLLMSpec(memory_utilization=0.1, kv_cache_bytes=KV_CACHE_BYTES))

    def children(self) -> list[int]:
        """This rank's live descendants, but multiprocessing's resource tracker (it leaves when its pipe closes)."""
        from tests.procs import descendants

        return descendants(skip_cmdline="resource_tracker")
