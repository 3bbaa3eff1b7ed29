"""A generation engine backed by vLLM (``rollout.engine: vllm``), inside the rollout worker's process.

Token ids in; token ids and per-token log-probs out, the same records as the native engine
(:class:`~relayrl.engines.generation.base.Completion`), so the dock, the trainer and the metrics cannot tell
which engine sampled. How each part maps onto vLLM 0.32's Python API:

- **Sampling.** One ``vllm.LLM`` per rollout worker, its engine core in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a rollout rank is already a process of its own where the
  placement says so, and in-process the weight updates pass tensors by reference). Requests go in with
  ``LLMEngine.add_request`` and the loop calls ``step()`` itself, so a finished sample reaches ``on_finish``
  (the dock writer) the step it ends, and new weights can come in between two steps. Each sample is its own
  request with a seed drawn from the worker's generator: a run repeats with the same seed.
- **Log-probs.** relayrl's: log_softmax(logits / temperature) of the sampled token, before any penalty or filter,
  what the trainer recomputes. Without a penalty or filter, ``logprobs_mode="processed_logprobs"`` (after the
  temperature). vLLM's processed log-probs are taken after its penalties, min-p and top-k/top-p masks too (of the
  renormalised, masked distribution, :data:`~relayrl.engines.generation.vllm_sampling.PROCESSED_DIFFERS`), so with
  one on the engine starts with ``raw_logprobs`` (before everything, the temperature included), which are
  relayrl's at temperature 1 and greedy: the config refuses a penalty or filter at another temperature, and
  ``generate`` refuses what the engine's mode cannot record (as a temperature in (0, 0.01), which vLLM would raise
  to 0.01), unless the request reads no log-probs (``SamplingParams.logprobs=False``: evaluation), when only the
  sampling refusals apply. What every sampling key becomes is :mod:`relayrl.engines.generation.vllm_sampling`'s
  table.
- **Stops.** vLLM gets no tokenizer (``skip_tokenizer_init``: relayrl's tokenizer is the one that
  matters); the EOS ids (the tokenizer's and the checkpoint's ``generation_config.json``'s,
  :mod:`relayrl.models.eos`) and ``stop_token_ids`` are vLLM stop tokens (the native engine's set,
  :func:`~relayrl.engines.generation.base.stop_token_ids`), stop strings are checked here on the decoded tail
  after every step (a hit aborts the request), as the native engine does. A row whose prompt and budget pass
  vLLM's ``max_model_len`` is refused (vLLM would end it there as ``length``).
- **Weights.** ``update_weights`` hands the named tensors to the worker through ``collective_rpc`` and
  ``model_runner.reload_weights``; a tied output head is sent as ``lm_head.weight`` too when vLLM's model keeps one
  of its own (vLLM's CPU
  backend keeps its own copy), and the prefix cache is reset (its KV came from the old weights).
- **Adapters** (``rollout.lora_sync=adapter``, :mod:`relayrl.engines.generation.vllm_lora`): the engine starts
  with vLLM's LoRA support; ``update_weights`` takes the adapter's tensors (peft's names) and loads them as a new
  LoRA, which every request from then on carries.
- **Tensor parallelism** (``rollout.vllm.tensor_parallel_size`` N > 1): the engine core stays in this
  process and vLLM's multiprocess executor starts one worker process per device of this rank; a weight update
  goes to every worker in buckets (:mod:`relayrl.engines.generation.vllm_tp`).
- **Models on vLLM's Transformers backend** (architectures vLLM has no implementation of its own for: OLMo 2,
  SmolLM3, Phi, GPT-NeoX, ...; :func:`transformers_backend`): that backend decorates the transformers model class
  in place for its compiler (vLLM's ``support_torch_compile``), after which the class cannot be built, nor an
  instance of it run, outside a vLLM config. The trainer builds the same class (in this process when colocated),
  so such a model's single worker runs in a process of its own too, through the multiprocess executor, and takes
  its weights in buckets as tensor-parallel workers do.
- **Partial rollout** (``between`` returns True: new weights were loaded between two steps): requests in
  flight are aborted and submitted again as prompt + the tokens so far, so their KV cache is computed
  again with the new weights and they continue, each token keeping the version and log-prob it was
  sampled with. This is what the native engine does (prefill again); vLLM's ``pause_generation(mode=
  "keep")`` would keep KV entries computed by the old weights.
- **Output head precision** (``model.head_fp32``): vLLM's ``head_dtype`` (``hf_overrides``, generation
  models since 0.32): its logits processor computes the head's product in float32 (on CUDA, bf16 operands
  with float32 output; elsewhere both cast to float32) for an unquantized head, and samples and reports
  log-probs from those logits.
- **Colocated memory** (``release``/``offload``): on CUDA the engine starts with ``enable_sleep_mode`` (vLLM's
  own allocator holds its weights and KV cache, which is what sleep can free), ``sleep(level=1)`` drops the
  KV cache and moves the weights to host, ``wake_up`` brings them back, as verl and NeMo-RL do. vLLM's CPU backend has no
  sleep mode: there the weights and the KV cache stay where they are.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from relayrl.engines.generation import vllm_lora, vllm_tp
from relayrl.engines.generation.base import (Completion, PromptFeed, SamplingParams, generate_from_feed,
                                             hits_stop_string, stop_token_ids)
from relayrl.engines.generation.config import INSTALL, VLLMSpec, vllm_available  # torch-free (re-exported)
from relayrl.engines.generation.vllm_sampling import PROCESSED, sampling_kwargs, sampling_refusal
from relayrl.errors import UserError
from relayrl.models.checkpoint_names import CheckpointNames
from relayrl.models.eos import checkpoint_generation_config, eos_ids

__all__ = ["VLLMSpec", "VLLMGenerationEngine", "engine_args", "VLLMMissingError", "vllm_available"]



class VLLMMissingError(UserError, ImportError):
    """``rollout.engine=vllm`` without vLLM installed."""


@dataclass
class _Row:
    """A sample in flight: its key, prompt, tokens and log-probs so far, and the version of each token."""

    key: tuple[int, int]
    prompt: list[int]
    budget: int
    seed: int | None
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    sent: int = 0  # tokens already in the running request's prompt (after a resubmission)


class _TokenizerFreeWarmup(logging.Filter):
    """vLLM renders a chat template at start to warm it up, which needs the tokenizer relayrl does not give it
    (``skip_tokenizer_init``: token ids in and out); its warning with a traceback reports nothing wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Chat template warmup failed"


logging.getLogger("vllm.renderers.base").addFilter(_TokenizerFreeWarmup())


def engine_args(spec: VLLMSpec, device: torch.device, *, dtype: str, seed: int, max_batch: int,
                head_fp32: bool, apart: bool = False, logprobs_mode: str = PROCESSED) -> dict:
    """``vllm.LLM``'s arguments besides the model (module docstring). On CUDA, ``enable_sleep_mode``: vLLM then
    allocates its weights and KV cache through its own allocator, which is what ``sleep`` frees; without it
    ``release`` would free nothing (its CPU backend has no sleep mode). ``apart``: the workers run in processes
    of their own (vLLM's multiprocess executor), as they always do with tensor parallelism. ``logprobs_mode``:
    :func:`~relayrl.engines.generation.vllm_sampling.logprobs_mode` of the rollout section."""
    args = dict(dtype=dtype, seed=seed, enforce_eager=spec.enforce_eager, gpu_memory_utilization=spec.memory_utilization,
                max_model_len=spec.max_model_len, max_num_seqs=max_batch, skip_tokenizer_init=True,
                logprobs_mode=logprobs_mode, enable_prefix_caching=spec.prefix_caching,
                hf_overrides={"head_dtype": "float32"} if head_fp32 else None)
    if spec.kv_cache_bytes is not None:
        args["kv_cache_memory_bytes"] = spec.kv_cache_bytes
    if apart or spec.tensor_parallel_size > 1:
        args.update(tensor_parallel_size=spec.tensor_parallel_size, distributed_executor_backend="mp")
    if device.type == "cuda":
        args["enable_sleep_mode"] = True
    return args


class VLLMGenerationEngine:
    """Generation through a vLLM engine in this process; see the module docstring."""

    adapter: vllm_lora.AdapterSlot | None = None
    """``rollout.lora_sync=adapter``: the LoRA the engine's requests carry (None: plain weights, updated in place)."""

    def __init__(self, model_dir: str, tokenizer, *, dtype: str = "float32", device: str | torch.device = "cpu",
                 max_batch: int = 256, spec: VLLMSpec | None = None, seed: int = 0, head_fp32: bool = False,
                 devices: Sequence[str | torch.device] | None = None, logprobs_mode: str = PROCESSED,
                 adapter: vllm_lora.AdapterSpec | None = None) -> None:
        if not vllm_available():
            raise VLLMMissingError(f"rollout.engine=vllm: vLLM is not installed; install it with {INSTALL}, or "
                                   f"set rollout.engine=native")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if spec is not None and spec.tensor_parallel_size > 1:  # (reads the config only: before vLLM's import)
            vllm_tp.check_heads_split(str(model_dir), spec.tensor_parallel_size)
        if torch.device(device).type == "cpu":
            _check_cpu_head_dim(str(model_dir))
        from vllm import LLM

        spec = spec or VLLMSpec()
        self.spec, self.tokenizer, self.max_batch = spec, tokenizer, max_batch
        self.logprobs_mode = logprobs_mode  # (raw_logprobs with a penalty or a filter: vllm_sampling)
        self.device = torch.device(device)
        self.tp = spec.tensor_parallel_size
        self.devices = vllm_tp.tp_devices(self.device, devices, self.tp)
        self.model_dir = str(model_dir)
        # (workers in processes of their own: with tensor parallelism, and for the Transformers backend, whose
        # decoration of the transformers class would break the trainer's copy of it in this process)
        self.apart = self.tp > 1 or transformers_backend(self.model_dir)
        self.adapter = None if adapter is None else vllm_lora.AdapterSlot(adapter)  # (rollout.lora_sync=adapter)
        args = engine_args(spec, self.device, dtype=dtype, seed=seed, max_batch=max_batch, head_fp32=head_fp32,
                           apart=self.apart, logprobs_mode=logprobs_mode)
        if adapter is not None:
            args.update(vllm_lora.lora_engine_args(adapter))
        try:
            with vllm_tp.worker_env(self.devices, self.apart):
                self.llm = LLM(model=self.model_dir, **args)
        except ValueError as e:  # vLLM's own words name neither the key nor that its share counts this process
            if "failed to be inspected" in str(e):  # (vLLM imports its implementation in a subprocess: say why)
                raise UserError(f"rollout.engine=vllm: vLLM could not load its implementation of the model in "
                                f"{self.model_dir}: {_import_failure(self.model_dir)}. Install what it needs, or set "
                                f"rollout.engine=native") from None
            if "memory" not in str(e).lower():
                raise
            raise UserError(f"rollout.engine=vllm: vLLM could not reserve its KV cache with "
                            f"rollout.vllm.memory_utilization={spec.memory_utilization}: {e} The share covers this "
                            f"process's own memory too (the trainer's, when colocated): raise "
                            f"rollout.vllm.memory_utilization, or free memory") from None
        self.engine = self.llm.llm_engine
        self.max_model_len = int(self.engine.model_config.max_model_len)  # (prompt + response, as vLLM planned)
        # vLLM's CPU attention plans its work for the OpenMP threads it saw at start-up and checks them at every
        # call; OpenMP's thread count is per thread, and generation may run on another thread (a rank process
        # generates on a thread of its own): each call sets the same count first.
        self._threads = torch.get_num_threads()
        # (vLLM adds the generation config's EOS ids to the stops only without ignore_eos, which _sampling sets)
        self.eos_ids = eos_ids(tokenizer, checkpoint_generation_config(self.model_dir))
        self._version = 0
        self._sleeping = False
        self.shared = False  # a vLLM engine holds its own copy of the weights
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._tied = None
        self._names: CheckpointNames | None = None  # in-memory names -> the checkpoint's (weight_shapes sets it)
        self._head_copy: bool | None = None  # vLLM's model holds lm_head apart from the embedding (tied checkpoints)
        self._next_id = 0

    # ---------------------------------------------------------------- weights
    @property
    def weight_version(self) -> int:
        return self._version

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The Hugging Face parameter names and shapes this engine takes (from the model's config, on the
        meta device): the relay checks a layout against them before sending. With an adapter
        (``rollout.lora_sync=adapter``): the adapter's tensors, by peft's names."""
        if self.adapter is not None:
            return dict(self.adapter.spec.shapes)
        if self._shapes is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            cfg = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
            self._shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
            self._tied = bool(getattr(cfg, "tie_word_embeddings", False))
            self._names = CheckpointNames(model)  # (vLLM loads checkpoint names: MoE experts unfused)
        return self._shapes

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights into the running vLLM model (``reload_weights`` on its worker) and set the
        version. The tensors are read as they come and not kept (a stream, e.g. a relay's gathered buckets
        or LoRA layers merged one at a time, never sits here whole). Unknown names and shape mismatches raise
        before anything loads when the names are known up front (a list, or a stream's ``held``); in a bare
        iterator, when the tensor comes. With an adapter (``rollout.lora_sync=adapter``): ``named_tensors`` is every
        adapter tensor, loaded as the engine's new LoRA (:class:`~relayrl.engines.generation.vllm_lora.AdapterSlot`);
        the base weights stay."""
        if self.adapter is not None:
            self.wake()
            self._same_threads()
            self.adapter.load(self.engine.collective_rpc, named_tensors, version, self.devices, self.apart)
            self.engine.reset_prefix_cache()
            self._version = version
            return
        shapes = self.weight_shapes()
        held = getattr(named_tensors, "held", named_tensors if isinstance(named_tensors, (list, tuple)) else ())
        for name, t in held:
            self._check_weight(shapes, name, t)
        self.wake()
        self._same_threads()
        stream = self._checked(shapes, named_tensors, copy_head=bool(self._tied) and self._head_is_a_copy())
        if not self.apart:  # one worker, in this process: the tensors pass by reference, read as they come
            self.engine.collective_rpc(_reload_weights, args=(stream,))
        else:
            vllm_tp.send(self.engine.collective_rpc, stream, self.devices)  # every worker, bucket by bucket
        self.engine.reset_prefix_cache()
        self._version = version

    @staticmethod
    def _check_weight(shapes: dict[str, tuple[int, ...]], name: str, t: torch.Tensor) -> None:
        if name not in shapes:
            raise KeyError(f"vLLM engine: the model has no parameter {name!r}")
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"weight {name!r}: model shape {shapes[name]} != incoming {tuple(t.shape)}")

    def _checked(self, shapes: dict[str, tuple[int, ...]], named: Iterable[tuple[str, torch.Tensor]],
                 copy_head: bool = False):
        """``named`` checked as it passes and sent under the checkpoint's names and layout
        (:class:`~relayrl.models.checkpoint_names.CheckpointNames`: an MoE layer's fused experts as the checkpoint's
        one tensor per expert, which is what vLLM's loaders read); a tied checkpoint's ``lm_head.weight`` is dropped
        unless ``copy_head``; with ``copy_head`` (a tied checkpoint whose vLLM model keeps its own
        head: :meth:`_head_is_a_copy`) the embedding is sent as ``lm_head.weight`` too, after it, holding only
        that one tensor."""
        embed, head = None, False
        for name, t in named:
            self._check_weight(shapes, name, t)
            head = head or name == "lm_head.weight"
            if name == "model.embed_tokens.weight":
                embed = t
            if name == "lm_head.weight" and self._tied and not copy_head:
                continue  # (a tied head is the embedding; vLLM's model has no lm_head to take it: Gemma, Cohere)
            yield from self._names(name, t)
        if copy_head and not head and embed is not None:
            yield "lm_head.weight", embed

    def _head_is_a_copy(self) -> bool:
        """Whether vLLM's model of a tied checkpoint has an output head module (Qwen2 does, and on vLLM's CPU backend
        takes new weights for it only under ``lm_head.weight``) or none (Gemma, Cohere read the embedding and
        refuse the name). Asked of the worker once."""
        if self._head_copy is None:
            self._head_copy = bool(self.engine.collective_rpc(_has_own_head)[0])
        return self._head_copy

    def share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> bool:
        """vLLM keeps its own copy: the tensors are copied in (returns False: not shared)."""
        self.update_weights(named_tensors, version)
        return False


    # ---------------------------------------------------------------- memory
    def release(self) -> None:
        """Free what can be freed between generations: on CUDA vLLM sleeps (KV cache dropped, weights to
        host); its CPU backend has no sleep mode, so there nothing moves."""
        if self.device.type == "cuda" and not self._sleeping:
            self.llm.sleep(level=1)
            self._sleeping = True

    def wake(self) -> None:
        """Back from :meth:`release` (on CUDA: weights and KV cache on the device again)."""
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False

    # ------------------------------------------------------------- generation
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None,
                 on_finish: Callable[[Completion], None] | None = None,
                 between: Callable[[], bool] | None = None) -> list[Completion]:
        """All ``params.n`` samples of every prompt in (prompt, sample) order; ``on_finish`` sees each as it
        ends; ``between`` (partial rollout) runs before every step (see the module docstring)."""
        return generate_from_feed(self.generate_feed, prompts, params, generator, on_finish, between)

    def generate_feed(self, feed: PromptFeed, params: SamplingParams, generator: torch.Generator | None,
                      on_finish: Callable[[Completion], None], between: Callable[[], bool] | None = None) -> None:
        """Rows from ``feed`` as slots free up (multi-turn episodes feed each next turn); each gets
        ``params.n`` samples and its own token budget; returns when the feed is done and nothing runs."""
        if (why := sampling_refusal(params, mode=self.logprobs_mode)) is not None:  # (before any request goes in)
            raise ValueError(f"the vLLM engine: {why}")
        self.wake()
        self._same_threads()
        stops = sorted(stop_token_ids(params, self.eos_ids, self.tokenizer))  # (the native engine's own)
        live: dict[str, _Row] = {}
        while True:
            if between is not None and between() and live:
                self._resubmit(live, params, stops)
            while len(live) + params.n <= max(self.max_batch, params.n):
                item = feed.take()
                if item is None:
                    break
                key, prompt, budget = item
                if len(prompt) == 0:
                    raise ValueError(f"prompt {key} is empty")
                if len(prompt) + budget > self.max_model_len:  # (vLLM would cut it short as "length", silently)
                    raise ValueError(f"prompt {key}: its {len(prompt)} tokens and {budget} new ones exceed the "
                                     f"{self.max_model_len} tokens vLLM plans for (rollout.vllm.max_model_len, null: "
                                     f"the model's max_position_embeddings), where vLLM would end it before its "
                                     f"budget; raise rollout.vllm.max_model_len, or lower the new tokens")
                for s in range(params.n):
                    seed = None if generator is None else int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
                    row = _Row((key, s), list(prompt), budget, seed)
                    live[self._submit(row, params, stops)] = row
            if not live:
                if not feed.wait():
                    return
                continue
            for o in self.engine.step():
                row = live.get(o.request_id)
                if row is None:
                    continue
                done = self._advance(row, o.outputs[0], o.finished, params)
                if done is not None:
                    del live[o.request_id]
                    if not o.finished:
                        self.engine.abort_request([o.request_id])
                    on_finish(self._completion(row, done))

    def _same_threads(self) -> None:
        if self.device.type == "cpu" and torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)

    def _sampling(self, row: _Row, params: SamplingParams, stops: list[int]):
        from vllm import SamplingParams as VSampling
        from vllm.sampling_params import RequestOutputKind

        # a resubmitted row draws from a fresh stream (the same seed would repeat its first tokens' draws)
        seed = None if row.seed is None else (row.seed + 1_000_003 * len(row.tokens)) % 2**31
        return VSampling(**sampling_kwargs(params, max_tokens=row.budget - len(row.tokens), seed=seed, stop_ids=stops,
                                           mode=self.logprobs_mode), output_kind=RequestOutputKind.DELTA)

    def _submit(self, row: _Row, params: SamplingParams, stops: list[int]) -> str:
        rid = f"r{self._next_id}"
        self._next_id += 1
        row.sent = len(row.tokens)
        self.engine.add_request(rid, {"prompt_token_ids": row.prompt + row.tokens}, self._sampling(row, params, stops),
                                lora_request=None if self.adapter is None else self.adapter.request)
        return rid

    def _resubmit(self, live: dict[str, _Row], params: SamplingParams, stops: list[int]) -> None:
        """New weights: every request in flight starts again from its prompt and tokens so far."""
        self.engine.abort_request(list(live))
        rows = list(live.values())
        live.clear()
        for row in rows:
            live[self._submit(row, params, stops)] = row

    def _advance(self, row: _Row, out, finished: bool, params: SamplingParams) -> str | None:
        """Append a step's new tokens to ``row``; the finish reason once it is done, else None. A stop string
        ends the row at the token that completes it, as in the native engine, also when the step brought several
        tokens (the ones after it are dropped)."""
        logprobs = out.logprobs or ()
        if len(logprobs) != len(out.token_ids):
            raise RuntimeError("vLLM returned tokens without their log-probs (logprobs=0 was asked for)")
        for t, lp in zip(out.token_ids, logprobs):
            row.tokens.append(int(t))
            row.logps.append(float(lp[int(t)].logprob))
            row.versions.append(self._version)
            if hits_stop_string(self.tokenizer, row.tokens, params.stop_strings):
                return "stop"
        if not finished:
            return None
        return "length" if out.finish_reason == "length" else "stop"

    def _completion(self, row: _Row, reason: str) -> Completion:
        return Completion(prompt_index=row.key[0], sample_index=row.key[1],
                          token_ids=torch.tensor(row.tokens, dtype=torch.long),
                          logprobs=torch.tensor(row.logps, dtype=torch.float32), finish_reason=reason,  # type: ignore[arg-type]
                          weight_version=self._version,
                          text=self.tokenizer.decode(row.tokens, skip_special_tokens=True),
                          token_versions=torch.tensor(row.versions, dtype=torch.long))

    def close(self) -> None:
        """Shut the engine down (its memory goes back; with tensor parallelism its worker processes end)."""
        import gc

        llm, self.llm, self.engine = self.llm, None, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # (vLLM's finalizer would, once collected: here, now)
        del llm
        gc.collect()


def _check_cpu_head_dim(model_dir: str) -> None:
    """vLLM's CPU attention supports a fixed set of head sizes; say so before its kernel fails mid-run."""
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise UserError(f"rollout.engine=vllm: vLLM's CPU attention supports head sizes {sizes}; the model in "
                        f"{model_dir} has {head} (hidden_size {cfg.hidden_size} / {cfg.num_attention_heads} heads). "
                        f"Use a model with one of those head sizes (tiny model: model.tiny.num_heads = "
                        f"model.tiny.hidden_size / 32 or / 64), or rollout.engine=native")



def transformers_backend(model_dir: str) -> bool:
    """Whether vLLM runs the checkpoint in ``model_dir`` through its Transformers backend: its registry maps the
    checkpoint's first known architecture there, or knows none of them (vLLM then falls back to that backend).
    True too when the registry cannot be read (a vLLM whose internals moved): a worker of its own is always
    correct, only slower to start."""
    try:
        known = [module for _, module in _registered(model_dir) if module is not None]
    except (ImportError, AttributeError, TypeError):
        return True
    return not known or known[0].rsplit(".", 1)[-1] == "transformers"


def _registered(model_dir: str) -> list[tuple[str, str | None]]:
    """Each architecture the checkpoint in ``model_dir`` names, with the module vLLM's registry keeps its
    implementation in (None where the registry has no entry)."""
    from transformers import AutoConfig
    from vllm.model_executor.models import ModelRegistry

    archs = getattr(AutoConfig.from_pretrained(model_dir, local_files_only=True), "architectures", None) or []
    return [(a, str(ModelRegistry.models[a].module_name) if a in ModelRegistry.models else None) for a in archs]


def _import_failure(model_dir: str) -> str:
    """Why vLLM's implementation of the checkpoint's architecture does not import here (vLLM inspects it in a
    subprocess and reports only that it failed): the module and the exception, e.g. ``vllm.model_executor.models.
    qwen3_5: ModuleNotFoundError: No module named 'torchvision'``."""
    import importlib

    found = _registered(model_dir)
    for arch, module in found:
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 (whatever stops the import is the answer)
            return f"{arch} lives in {module}, whose import fails with {type(e).__name__}: {e}"
    return f"vLLM could not inspect {[a for a, _ in found] or 'its architecture'} (its log above says why)"


def _has_own_head(worker) -> bool:
    """Runs on vLLM's worker: whether its model has an ``lm_head`` module with a weight (its own, or the embedding's
    under a second name: a tied head on vLLM's CPU backend, which packs a copy of it for its kernels and updates
    that copy only when the name comes)."""
    named = worker.model_runner.model.named_parameters(remove_duplicate=False)
    return any(n.split(".")[0] == "lm_head" for n, _ in named)


def _reload_weights(worker, named: Iterable[tuple[str, torch.Tensor]]) -> bool:
    """Runs on vLLM's worker (``collective_rpc``): load ``named`` (Hugging Face names) in place, read once."""
    vllm_tp.forget_cpu_moe_kernels(worker.model_runner.get_model(), worker.device)
    worker.model_runner.reload_weights(weights_iterator=iter(named))
    return True
