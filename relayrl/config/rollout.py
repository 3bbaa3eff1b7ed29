"""The ``rollout`` section of a run's config: responses per prompt, sampling, lengths and stop strings, and the
engine that generates them (native, vLLM, an OpenAI-compatible server). Torch-free, as every config module: the
engines' own specs are built from it on demand (:meth:`RolloutConfig.sampling`, :meth:`RolloutConfig.remote`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relayrl.config.interrupt import InterruptConfig
from relayrl.config.paths import LocalPath
from relayrl.engines.generation.config import VLLMSpec, check_scale, check_top_k
from relayrl.engines.generation.vllm_sampling import NATIVE_ONLY, sampling_refusal

__all__ = ["RolloutConfig"]


class RolloutConfig(BaseModel):
    """Generation: responses per prompt, sampling, lengths and stop strings, the engine (native, vLLM, an
    OpenAI-compatible server) and how it batches."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    n: int = Field(8, ge=1, description="responses per prompt")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature (0: greedy, else >= 1e-5); a rollout "
                               "records log-probs under softmax(logits / temperature), before top-k/top-p filtering")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: the smallest set of tokens whose "
                         "probability reaches top_p (1: off)")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens (0: off)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="sample among the tokens at least min_p times as likely "
                         "as the most likely one (0: off); applied after top_k and top_p, as Hugging Face does")
    repetition_penalty: float = Field(
        1.0, gt=0.0, description="CTRL's repetition penalty, as Hugging Face generate and vLLM apply it: the "
        "logit of every token already in the prompt or the response is divided by this where positive and "
        "multiplied where negative, before the temperature (1: off; above 1 discourages repeats; 1e-5 to 1e5). Like "
        "top_k/top_p/min_p it changes what is sampled, not the recorded log-probs: those stay softmax(logits / "
        "temperature), the policy the trainer recomputes and updates")
    max_new_tokens: int = Field(16, ge=1, description="response length limit in tokens; responses cut there "
                                "count in response/clip_ratio (and DAPO's overlong options act on them)")
    stop_strings: list[str] = Field(default_factory=list, description="end a response when its text contains one "
                                    "of these (the end-of-sequence token always ends it); one that spells a special "
                                    "token of the tokenizer (e.g. <|im_end|>, a chat turn's end) stops at that token "
                                    "(native and vllm engines), since the text is decoded without special tokens")
    max_batch: int = Field(256, ge=1, description="sequences in flight in the generation engine")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="the rollout engine's weight dtype (null: model.dtype); the relay casts the actor's "
        "weights to it")
    decode: Literal["auto", "dynamic", "static"] = Field(
        "auto", description="auto: on CUDA, Llama-family models decode on a static KV cache with CUDA graphs, "
        "others (and CPU) with a dynamic cache; static: always the static cache (graphed on CUDA); dynamic: never")
    decode_compile: bool = Field(
        False, description="static decoding on CUDA: compile each decoder layer's decode step, the output head and "
        "the sampler's two reductions over the vocabulary with torch.compile (one compilation for every batch and "
        "cache length) before recording the graphs, with each layer's q/k/v and gate/up projections run as one "
        "product each (a copy of those weights: about 0.5 GB for a 0.5B model, 8.5 GB for a 7B). Fused "
        "element-wise kernels: a step of the 0.5B shape at batch 256 took 3.2 ms instead of 6.2 ms on an H100; "
        "the first generate pays the compilation (18-21 s on that shape)")
    engine: Literal["native", "vllm", "openai"] = Field(
        "native", description="native: relayrl's engine in the rollout workers; vllm: a vLLM engine in each rollout "
        "worker's process (pip install 'relayrl[vllm]'; see rollout.vllm); openai: sample through an "
        "OpenAI-compatible server at rollout.base_url (relayrl serve, vLLM, SGLang), weights pushed after every update")
    vllm: VLLMSpec = Field(VLLMSpec(), description="rollout.engine=vllm: how each rollout rank starts its vLLM engine")
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged", description="model.lora.enabled: what a weight sync sends the rollout. merged: W + (alpha / r) B @ A "
        "under the base model's names (every weight, any engine); adapter (rollout.engine=vllm): only the adapters' "
        "A and B, which the vLLM engine (started with LoRA support on the base model) loads as a new LoRA each "
        "version; every request then carries it. About r (in + out) / (in x out) of the merged bytes; vLLM's LoRA "
        "decode is slower than its plain decode")
    base_url: str | None = Field(None, description="rollout.engine=openai: the server's base URL, e.g. "
                                 "http://127.0.0.1:8000/v1")
    served_model: str | None = Field(None, description="rollout.engine=openai: the model name at the server "
                                     "(null: the first one /v1/models lists)")
    api_key_env: str | None = Field(None, description="rollout.engine=openai: environment variable holding the "
                                    "server's bearer token")
    weight_sync: Literal["relayrl", "vllm", "sglang", "none"] = Field(
        "relayrl", description="rollout.engine=openai: how new weights reach the server: relayrl (relayrl serve's "
        "weight endpoint), vllm or sglang (their reload endpoints, from rollout.weight_dir; vllm tested with vllm serve 0.32, sglang untested), none "
        "(the server's weights stay: evaluation only)")
    weight_dir: LocalPath | None = Field(None, description="rollout.engine=openai: a directory the server reads "
                                         "weights from (needed by weight_sync=vllm/sglang; relayrl: instead of "
                                         "sending them)")
    concurrency: int = Field(64, ge=1, description="rollout.engine=openai: requests in flight per rollout rank")
    timeout_s: float = Field(600.0, gt=0, description="rollout.engine=openai: seconds a request may wait for its "
                             "reply; past it the request has failed (rollout.on_error)")
    retries: int = Field(5, ge=0, description="rollout.engine=openai: retries of a request refused with 502, 503 or "
                         "504 (busy, a gateway) or a dropped connection, before it has failed; relayrl serve's 503 "
                         "after its generation loop stopped (code generation_stopped) fails the rollout at once, "
                         "naming the server's cause")
    on_error: Literal["fail", "drop_group"] = Field(
        "fail", description="rollout.engine=openai: a prompt's generation request that failed (an error reply, a "
        "malformed reply, rollout.timeout_s passed, after rollout.retries): fail stops the step naming the prompt "
        "and the cause; drop_group drops that prompt's group from the step (counted in rollout/errors; with "
        "algorithm.dynamic_sampling a later round replaces it)")
    partial: bool = Field(False, description="trainer.off_policy_steps > 0: partial rollout. When the trainer's "
                          "new weights arrive, responses still being generated pause, their contexts are "
                          "prefilled again with the new weights and they continue (each token records the "
                          "version that sampled it); off: weights change only between batches")
    interrupt: InterruptConfig = Field(InterruptConfig(), description="forced length interruption (ScaleRL's "
                                       "thinking budget): see rollout.interrupt.after_tokens")

    _top_k_off = field_validator("top_k", mode="before")(lambda v: check_top_k("rollout.top_k", v))

    _scale = field_validator("temperature", "repetition_penalty")(lambda v, info: check_scale(info.field_name, v))

    @model_validator(mode="after")
    def _remote(self) -> "RolloutConfig":
        if self.engine == "openai":
            if not self.base_url:
                raise ValueError("rollout.engine=openai needs rollout.base_url, the server's OpenAI base URL (e.g. "
                                 "rollout.base_url=http://127.0.0.1:8000/v1 for relayrl serve MODEL_DIR --port 8000)")
            if not self.base_url.startswith(("http://", "https://")):
                raise ValueError(f"rollout.base_url={self.base_url!r} must start with http:// or https://")
            if self.partial:
                raise ValueError("rollout.partial swaps new weights into responses between decode steps of the "
                                 "native engine; a server (rollout.engine=openai) takes weights between requests: "
                                 "drop rollout.partial")
            if self.weight_sync in ("vllm", "sglang") and not self.weight_dir:
                raise ValueError(f"rollout.weight_sync={self.weight_sync} loads new weights from disk: set "
                                 f"rollout.weight_dir to a directory the server can read")
        if self.engine == "vllm":
            from relayrl.engines.generation.config import INSTALL, vllm_available

            if not vllm_available():
                raise ValueError(f"rollout.engine=vllm: vLLM is not installed here; install it with {INSTALL}, "
                                 f"or set rollout.engine=native")
        if self.engine == "vllm" and (why := sampling_refusal(self, "rollout.")) is not None:
            raise ValueError(f"rollout.engine=vllm: {why}, or rollout.engine=native")
        if self.engine != "vllm" and "vllm" in self.model_fields_set:
            raise ValueError("rollout.vllm is read by rollout.engine=vllm only; set rollout.engine=vllm or drop "
                             "rollout.vllm")
        if self.engine != "native" and (native := [k for k in NATIVE_ONLY if k in self.model_fields_set]):
            raise ValueError(f"rollout.{native[0]} is read by the native engine only; rollout.engine={self.engine} "
                             f"decodes its own way: drop rollout.{native[0]}, or set rollout.engine=native")
        if self.engine != "openai":
            if self.on_error != "fail":
                raise ValueError(f"rollout.on_error={self.on_error} drops the group of a prompt whose request to a "
                                 f"server failed (rollout.engine=openai); the {self.engine} engine generates a "
                                 f"batch in one pass, so its errors are the whole batch's: drop rollout.on_error")
            remote_only = [k for k in ("base_url", "served_model", "api_key_env", "weight_dir") if getattr(self, k)]
            remote_only += [k for k in ("weight_sync", "concurrency", "timeout_s", "retries")
                            if k in self.model_fields_set]
            if remote_only:
                raise ValueError(f"rollout.{remote_only[0]} is read by rollout.engine=openai only; set "
                                 f"rollout.engine=openai or drop rollout.{remote_only[0]}")
        return self

    def sampling(self):
        """The rollout's :class:`~relayrl.engines.generation.base.SamplingParams` (``n`` responses a prompt)."""
        from relayrl.engines.generation.base import SamplingParams

        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                              max_new_tokens=self.max_new_tokens, stop_strings=tuple(self.stop_strings))

    def vllm_logprobs(self) -> str:
        """The vLLM engine's ``logprobs_mode`` (:func:`~relayrl.engines.generation.vllm_sampling.logprobs_mode`):
        raw_logprobs with a penalty or a filter on, else processed_logprobs."""
        from relayrl.engines.generation.vllm_sampling import logprobs_mode

        return logprobs_mode(self)

    def vllm_spec(self):
        """The vLLM engine's spec (``rollout.engine=vllm``), else None."""
        return self.vllm if self.engine == "vllm" else None

    @property
    def devices_per_rank(self) -> int:
        """Devices each rollout rank owns: ``rollout.vllm.tensor_parallel_size`` with the vLLM engine, else 1."""
        return self.vllm.tensor_parallel_size if self.engine == "vllm" else 1

    def remote(self):
        """The remote engine's spec (``rollout.engine=openai``), else None."""
        if self.engine != "openai":
            return None
        from relayrl.engines.generation.remote import RemoteSpec

        return RemoteSpec(base_url=self.base_url, model=self.served_model, api_key_env=self.api_key_env,
                          weight_sync=self.weight_sync, weight_dir=self.weight_dir, concurrency=self.concurrency,
                          timeout_s=self.timeout_s, retries=self.retries)
