"""The rollout role: :class:`RolloutWorker` owns a generation engine (the native one, vLLM in the process or an
OpenAI-compatible server), streams finished groups into the dock and takes relayed weights; and the driver's
calls on a group of them (:func:`generate`, the sampler state of checkpoints).

The trainer-side roles are in :mod:`relayrl.workflows.trainer_workers`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Sequence

import torch

from relayrl.cluster import Worker, WorkerGroup
from relayrl.data.tasks import Problem
from relayrl.engines.generation.base import Completion, RequestFailed, SamplingParams
from relayrl.engines.generation.interrupt import Interrupt, generate_interrupted
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.engines.generation.remote import RemoteGenerationEngine, RemoteSpec
from relayrl.engines.generation import vllm_lora
from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine, VLLMSpec
from relayrl.environments.base import Episode
from relayrl.environments.config import EpisodeSpec
from relayrl.models.load import load_model, load_tokenizer
from relayrl.models.lora_config import LoraConfig
from relayrl.weights import WeightReceiverMixin
from relayrl.workflows.rollout_stream import StreamingGeneration
from relayrl.workflows.worker_base import MemoryProbe, resolve_device, set_threads

__all__ = ["RolloutWorker", "generate", "rollout_rng", "restore_rollout_rng"]

log = logging.getLogger(__name__)


def _trim_heap() -> None:
    """Collect garbage and give the freed heap pages back to the OS (glibc keeps them for the process)."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the pages stay with the process until reused
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class RolloutWorker(StreamingGeneration, WeightReceiverMixin, MemoryProbe, Worker):
    """Samples responses with the native engine, a vLLM engine in this process (``vllm``,
    ``rollout.engine=vllm``) or through an OpenAI-compatible server (``remote``, ``rollout.engine=openai``); streams finished groups into the dock (:class:`StreamingGeneration`); takes
    packed weights (``receive_weights``; a vLLM engine with ``adapter``, ``rollout.lora_sync=adapter``: the actor's
    LoRA adapters); its RNG state is part of checkpoints."""

    def __init__(self, model_path: str, *, max_batch: int = 256, dtype: str = "float32", device: str = "auto",
                 attn_implementation: str = "sdpa", threads: int = 0, seed: int = 0, decode: str = "auto",
                 decode_compile: bool = False, remote: RemoteSpec | None = None, vllm: VLLMSpec | None = None,
                 chat_template: str | None = None, head_fp32: bool = False, record_routing: bool = False,
                 vllm_logprobs: str = "processed_logprobs", adapter: LoraConfig | None = None) -> None:
        set_threads(threads * max(1, len(getattr(self, "devices", ()))), self)  # (run.threads: per device)
        self.tokenizer = load_tokenizer(model_path, chat_template=chat_template)  # (tool turns render with it)
        if vllm is not None:  # a vLLM engine in this process, on the model directory
            dev = resolve_device(device, getattr(self, "device", None))
            # (rollout.lora_sync=adapter: the engine takes the actor's adapters, the base stays the directory's)
            spec = None if adapter is None else vllm_lora.adapter_spec(model_path, adapter)
            self.engine = VLLMGenerationEngine(model_path, self.tokenizer, dtype=dtype, device=dev,
                                               max_batch=max_batch, spec=vllm, seed=seed, head_fp32=head_fp32,
                                               devices=getattr(self, "devices", None),  # (several: vLLM's TP)
                                               logprobs_mode=vllm_logprobs, adapter=spec)
            self.generator = torch.Generator().manual_seed(seed + 7919 * getattr(self, "rank", 0))
            return
        if remote is not None:  # the server holds the model (and its head's precision); this worker keeps the
            # tokenizer and the seeds
            self.engine = RemoteGenerationEngine(remote, self.tokenizer, model_dir=model_path)
            self.generator = torch.Generator().manual_seed(seed + 7919 * getattr(self, "rank", 0))
            return
        dev = resolve_device(device, getattr(self, "device", None))
        # flex_attention serves the trainer's block-sparse packed masks; decoding (a KV cache, CUDA graphs) uses sdpa
        attn = "sdpa" if attn_implementation == "flex_attention" else attn_implementation
        model = load_model(model_path, dtype=dtype, device=dev, attn_implementation=attn)
        self.engine = NativeGenerationEngine(model, self.tokenizer, max_batch=max_batch, device=dev, decode=decode,
                                             decode_compile=decode_compile, head_fp32=head_fp32,
                                             record_routing=record_routing)  # (algorithm.routing_replay)
        self.generator = torch.Generator(device=dev).manual_seed(seed + 7919 * getattr(self, "rank", 0))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 on_error: str = "fail", interrupt: Interrupt | None = None) -> list[Completion]:
        """``params.n`` samples of each prompt (evaluations). A prompt whose request to a server failed
        (``rollout.engine=openai``) raises :class:`GenerationFailed` naming it; ``on_error="drop_group"``
        (``rollout.on_error``): its samples are empty responses instead, with a warning (an evaluation has no
        group to drop; it scores them as it scores any response). ``interrupt``: a thinking budget
        (``rollout.interrupt``, :mod:`relayrl.engines.generation.interrupt`)."""
        gen = self.generator if params.temperature > 0 else None
        if interrupt is not None:  # (a server cannot re-enter rows: the config refuses rollout.engine=openai)
            return generate_interrupted(self.engine, prompts, params, interrupt, generator=gen)
        if on_error == "fail":
            try:
                return self.engine.generate(prompts, params, generator=gen)
            except RequestFailed as e:
                raise self._request_failed(prompts, e) from None
        failed: list[RequestFailed] = []
        comps = self.engine.generate(prompts, params, generator=gen, on_error=failed.append)
        empty = torch.zeros(0, dtype=torch.long)
        for e in failed:
            log.warning("relayrl: generating the responses to prompt %r failed: %s; scored as empty responses "
                        "(rollout.on_error=drop_group)", self._text(prompts[e.index]), e.cause)
            comps += [Completion(e.index, i, empty, torch.zeros(0), "stop", self.engine.weight_version, "")
                      for i in range(params.n)]
        return sorted(comps, key=lambda c: (c.prompt_index, c.sample_index))

    def generate_rows(self, items: Sequence[tuple[int, Sequence[int]]], params: SamplingParams,
                      on_error: str = "fail", interrupt: Interrupt | None = None) -> list[Completion]:
        """``generate`` for ``(prompt_index, prompt)`` pairs: completions carry the given indexes (a rank of a
        data-parallel rollout gets a slice of the prompts)."""
        comps = self.generate([p for _, p in items], params, on_error, interrupt)
        return [replace(c, prompt_index=items[c.prompt_index][0]) for c in comps]

    def run_episodes(self, items: Sequence[tuple[int, Sequence[int], Problem]], params: SamplingParams,
                     spec: EpisodeSpec) -> list[Episode]:
        """``params.n`` multi-turn episodes per ``(problem_index, prompt ids, problem)`` triple, continuously
        batched across turns (:mod:`relayrl.environments.episodes`); episodes carry the given indexes."""
        from relayrl.environments.episodes import run_episodes

        eps = run_episodes(self.engine, self.tokenizer, [p for _, _, p in items], [q for _, q, _ in items],
                           self._env(spec), params, spec.limits, workers=spec.env.workers,
                           generator=self.generator if params.temperature > 0 else None)
        for e in eps:
            e.problem_index = items[e.problem_index][0]
        return eps

    def _env(self, spec: EpisodeSpec):
        """The environment factory of ``spec``, built (and its contract checked) once per spec."""
        from relayrl.environments.config import build_env_factory

        if getattr(self, "_env_spec", None) != spec:
            self._env_factory, self._env_spec = build_env_factory(spec, self.tokenizer), spec
        return self._env_factory

    def update_weights(self, named_tensors, version: int) -> bool:
        """Load ``named_tensors`` (tagged ``version``); whether the engine copied them (False: it runs on the
        colocated actor's own tensors, ``share_weights``, and only the version moved)."""
        self.engine.update_weights(named_tensors, version)
        return not getattr(self.engine, "shared", False)  # (a server's engine holds its own copy)

    def share_weights(self, named_tensors, version: int) -> bool:
        """Run on ``named_tensors`` (the colocated actor's live parameters) instead of a copy; False when the
        engine cannot (a vLLM engine or a server holds its own copy: it took a copy instead)."""
        if not isinstance(self.engine, NativeGenerationEngine):
            self.engine.update_weights(named_tensors, version)
            return False
        self.engine.share_weights(named_tensors, version)
        if self.engine.device.type == "cpu":  # give the dropped copy's pages back to the OS (glibc keeps them)
            _trim_heap()
        return True

    def offload(self) -> float:
        """Free the KV cache, and move the weights to host unless they are the actor's; seconds taken."""
        from relayrl.weights import offload as swap

        t0 = time.perf_counter()
        self.engine.release()  # (a vLLM engine sleeps on CUDA: KV cache dropped, weights to host)
        if not self.engine.shared and hasattr(self.engine, "model"):
            swap.offload_module(self.engine.model)
        if self.engine.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks to the other roles' allocations
        return time.perf_counter() - t0

    def reload(self, restore: bool = True) -> float:
        """Weights back on the device (``restore=False``: without their values, new weights come next)."""
        from relayrl.weights import offload as swap

        t0 = time.perf_counter()
        if not hasattr(self.engine, "model"):
            self.engine.wake()
        elif swap.is_offloaded(self.engine.model):
            swap.reload_module(self.engine.model, restore=restore)
        return time.perf_counter() - t0

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


# ------------------------------------------------------------- driver-side calls
def generate(rollout: WorkerGroup, prompts: Sequence[Sequence[int]], params: SamplingParams,
             on_error: str = "fail", interrupt: Interrupt | None = None) -> list[Completion]:
    """Generate on every rollout rank, each taking a contiguous slice of ``prompts``; completions come back
    in prompt order with ``prompt_index`` into ``prompts``. ``on_error``: ``rollout.on_error``, ``interrupt``:
    a thinking budget (:meth:`RolloutWorker.generate`)."""
    return rollout.split(RolloutWorker.generate_rows, list(enumerate(prompts)), params, on_error, interrupt)


def rollout_rng(rollout: WorkerGroup) -> list[list[int]]:
    """Each rollout rank's sampler state (for checkpoints)."""
    return [t.tolist() for t in rollout.all(RolloutWorker.rng_state)]


def restore_rollout_rng(rollout: WorkerGroup, states: list, log=print) -> None:
    """Give each rollout rank its saved sampler state; with a different rank count, keep the fresh seeds."""
    if states and isinstance(states[0], int):  # a checkpoint of one rank written before per-rank states
        states = [states]
    if len(states) != rollout.world_size:
        log(f"relayrl: the checkpoint has the sampler state of {len(states)} rollout rank(s) and this run has "
            f"{rollout.world_size}: rollout ranks start from fresh seeds")
        return
    for rank, st in enumerate(states):
        rollout.one(RolloutWorker.set_rng_state, torch.tensor(st, dtype=torch.uint8), rank=rank)
