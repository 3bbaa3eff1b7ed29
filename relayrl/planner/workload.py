"""What one step of a run asks for: prompts, samples, response lengths, reward latency, the model's shape.

The simulator draws every response's length and every reward call's latency from these distributions (Periodic
Asynchrony's observation: the long tail of response lengths is what asynchronous modes exploit, so the step is
simulated on sampled lengths, never on their mean). A length distribution is either *empirical* (lengths
measured by generating from the run's model, :func:`relayrl.planner.from_config.measure_lengths`) or a
*mixture* (a share of responses that stop early, the rest geometric up to ``max_new_tokens``), the form a
user writes for a model they have not run.
"""

from __future__ import annotations

import math
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["LengthDist", "LatencyDist", "ModelShape", "Workload"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # (inf latency planned nan s)


class LengthDist(_Model):
    """Response lengths in tokens, capped at ``max_new_tokens``."""

    kind: Literal["empirical", "mixture"] = "mixture"
    samples: tuple[int, ...] = Field((), description="empirical: measured lengths, drawn with replacement")
    short: int = Field(4, ge=1, description="mixture: length of a response that stops early")
    p_long: float = Field(0.0, ge=0.0, le=1.0, description="mixture: share of responses that run on")
    long_mean: float = Field(32.0, gt=0.0, description="mixture: mean extra tokens of a long response (geometric)")
    max_new_tokens: int = Field(..., ge=1)

    @model_validator(mode="after")
    def _check(self) -> "LengthDist":
        if self.kind == "empirical" and not self.samples:
            raise ValueError("lengths.samples: an empirical length distribution needs measured lengths; give "
                             "lengths.kind=mixture with short / p_long / long_mean instead")
        return self

    def mean(self) -> float:
        """The mean length (empirical: of the samples; mixture: of the distribution, ignoring the cap)."""
        if self.kind == "empirical":
            return sum(min(x, self.max_new_tokens) for x in self.samples) / len(self.samples)
        return self.short + self.p_long * self.long_mean

    def scaled(self, factor: float) -> "LengthDist":
        """Every length times ``factor`` (still capped at ``max_new_tokens``): responses that grow or shrink."""
        if self.kind == "empirical":
            return self.model_copy(update={"samples": tuple(max(1, round(x * factor)) for x in self.samples)})
        return self.model_copy(update={"short": max(1, round(self.short * factor)),
                                       "long_mean": max(1.0, self.long_mean * factor)})

    def draw(self, rng: random.Random, n: int) -> list[int]:
        if self.kind == "empirical":
            return [min(self.max_new_tokens, max(1, rng.choice(self.samples))) for _ in range(n)]
        out = []
        for _ in range(n):
            length = self.short
            if rng.random() < self.p_long:
                length += 1
                while rng.random() > 1.0 / self.long_mean and length < self.max_new_tokens:
                    length += 1
            out.append(min(length, self.max_new_tokens))
        return out


class LatencyDist(_Model):
    """Outside latency of scoring one response (a judge call, a test harness), uniform in [low_s, high_s]."""

    low_s: float = Field(0.0, ge=0.0)
    high_s: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _check(self) -> "LatencyDist":
        if self.high_s < self.low_s:
            raise ValueError(f"reward_latency.high_s={self.high_s} is below low_s={self.low_s}; swap them")
        return self

    def draw(self, rng: random.Random, n: int) -> list[float]:
        if self.high_s == 0.0:
            return [0.0] * n
        return [rng.uniform(self.low_s, self.high_s) for _ in range(n)]


class ModelShape(_Model):
    """What the memory model and the cost scaling need of the trained model."""

    params: int = Field(..., gt=0)
    layers: int = Field(..., gt=0)
    hidden: int = Field(..., gt=0)
    kv_dim: int = Field(..., gt=0, description="key/value width per layer (kv heads x head dim)")
    vocab: int = Field(..., gt=0)
    train_bytes: int = Field(4, description="bytes per weight of the master copy (fp32: 4)")
    compute_bytes: int = Field(4, description="bytes per value of activations, the KV cache and relayed weights "
                               "(fp32: 4, bf16: 2)")
    trainable: int = Field(0, ge=0, description="parameters that train (gradients, Adam's moments, float32); 0: "
                           "all of them. LoRA: the adapters' (the frozen base then holds compute_bytes per weight)")
    fused: int = Field(0, ge=0, description="weights of the q/k/v and gate/up projections, of which "
                       "rollout.decode_compile keeps a fused copy on a GPU")
    active: int = Field(0, ge=0, description="parameters a token runs through (a mixture of experts: the experts "
                        "by their routed share), which the compute scales with; 0: all of them")
    kv_layers: int = Field(0, ge=0, description="layers with a key/value cache (a hybrid's attention layers, not its "
                           "linear-attention ones); 0: every layer")
    routed: int = Field(0, ge=0, description="a mixture of experts: the experts' own parameters (0: none), which "
                        "engine.expert_parallel keeps out of FSDP2's gathers")
    experts_per_token: int = Field(0, ge=0, description="a mixture of experts: the experts each token is routed "
                                   "to (the pairs engine.expert_parallel sends)")

    @property
    def trained_params(self) -> int:
        return self.trainable or self.params

    @property
    def compute_params(self) -> int:
        """What a pass's compute scales with: the active parameters."""
        return self.active or self.params

    @classmethod
    def from_hf_config(cls, cfg, *, dtype: str = "float32", lora=None) -> "ModelShape":
        """From a Hugging Face model config (Qwen2/Llama-style fields; a mixture of experts or a hybrid counted on
        the model itself, :mod:`relayrl.planner.model_count`); ``lora``: a ``LoraConfig`` whose adapters are what
        trains."""
        hidden, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", heads) or heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        ffn = cfg.intermediate_size
        per_layer = hidden * (heads * head_dim) * 2 + hidden * kv * head_dim * 2 + 3 * hidden * ffn + 2 * hidden
        tied = getattr(cfg, "tie_word_embeddings", False)
        params = layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden
        compute = 2 if dtype in ("bfloat16", "float16") else 4
        fused = layers * hidden * ((heads + 2 * kv) * head_dim + 2 * ffn)
        from relayrl.planner import model_count

        if model_count.needs_count(cfg):  # experts or linear attention: counted on the model itself
            params, active, adapters, routed = model_count.count(cfg, lora)
            per_token = (model_count.experts_of(cfg) or (0, 0))[1] if routed else 0
            lora_on = lora is not None and lora.enabled
            types = list(getattr(cfg, "layer_types", None) or ())
            attention = sum(t in ("full_attention", "sliding_attention") for t in types) if types else 0
            return cls(params=params, layers=layers, hidden=hidden, kv_dim=kv * head_dim, vocab=vocab,
                       compute_bytes=compute, train_bytes=compute if lora_on else 4,
                       trainable=max(1, adapters) if lora_on else 0, fused=fused, active=active,
                       kv_layers=attention if attention < layers else 0, routed=routed, experts_per_token=per_token)
        if lora is None or not lora.enabled:
            return cls(params=params, layers=layers, hidden=hidden, kv_dim=kv * head_dim, vocab=vocab,
                       compute_bytes=compute, fused=fused)
        # (in, out) of each projection a target name matches; an adapter holds r x (in + out) weights
        dims = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim),
                "v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden),
                "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}
        adapters = sum(lora.r * (i + o) for name, (i, o) in dims.items()
                       if any(name.endswith(t) or t.endswith(name) for t in lora.target_modules or dims))
        return cls(params=params, layers=layers, hidden=hidden, kv_dim=kv * head_dim, vocab=vocab,
                   compute_bytes=compute, train_bytes=compute, trainable=max(1, adapters * layers), fused=fused)


class Workload(_Model):
    """One step's work: ``prompts`` groups of ``n`` responses."""

    prompts: int = Field(..., ge=1, description="data.prompts_per_step")
    n: int = Field(..., ge=1, description="rollout.n")
    prompt_tokens: int = Field(..., ge=1, description="prompt length in tokens (the mean; prompts vary little "
                               "next to responses)")
    lengths: LengthDist
    reward_latency: LatencyDist = LatencyDist()
    model: ModelShape
    token_budget: int = Field(8192, ge=16, description="engine.token_budget: padded tokens per micro-batch")
    stream_groups: int = Field(1, ge=1, description="trainer.stream_groups: groups per streamed chunk")
    dp_sync: Literal["pass", "step"] = Field("pass", description="engine.dp_sync: FSDP2 gathers the weights and "
                                             "reduces the gradients once per optimizer step, or in every pass")
    forward: tuple[Literal["reference", "teacher", "old", "values"], ...] = Field(
        (), description="the forward-only stages of the step plan's stage graph besides the update, on the "
        "trainer's pool: the reference's log-probs (KL), a teacher's (distillation), pi_old's (recomputed), the "
        "critic's values")
    ref_in_update: bool = Field(False, description="tri-model: the actor runs the reference's forward pass inside "
                                "the update (no reference stage)")
    critic: bool = Field(False, description="a critic is trained each step (GAE), costed like the actor's update")
    kl_in_reward: bool = Field(False, description="the KL is a reward penalty: the advantages wait for the "
                               "reference's log-probs")
    group_relative: bool = Field(True, description="the advantages of a group need only its own rewards (GRPO, "
                                 "RLOO, ...): they stream per chunk; False: whitened over the whole batch")
    token_stats: bool = Field(False, description="the advantages read the pi_old pass (OTB's per-token "
                              "statistics, online DPO's log-probs): they wait for that pass")
    reads_reference: bool = Field(False, description="the advantages read the reference's log-probs (online DPO's "
                                  "margins): they wait for the reference's pass")
    accumulate: bool = Field(True, description="in an overlapped mode (periodic, off-policy) the update "
                             "accumulates per chunk: the step plan's update='accumulate' (no critic, group-relative "
                             "advantages, one optimizer step per batch)")
    group_filter: bool = Field(False, description="DAPO's dynamic sampling: the forward passes wait for a group's "
                               "rewards; a group whose rewards are all equal is dropped and replaced in a next round")
    keep_frac: float = Field(1.0, gt=0.0, le=1.0, description="dynamic sampling: the share of groups a round keeps "
                             "(rewards not all equal); a run logs it as 1 - dapo/dropped_groups / dapo/sampled_groups")
    resample_rounds: int = Field(0, ge=0, description="dynamic sampling: algorithm.max_resample_rounds, the rounds "
                                 "after the first that replace dropped groups")
    baseline: bool = Field(False, description="ReMax: one greedy response per group, generated once sampling "
                           "ends and scored; the advantages wait for it")
    sequence_parallel: int = Field(1, ge=1, description="engine.sequence_parallel: each micro-batch's tokens are "
                                   "split over this many trainer ranks, which hold 1/sequence_parallel of its "
                                   "activations each; the trainer's ranks must be a multiple of it")
    checkpointing: bool = Field(False, description="engine.gradient_checkpointing: a layer's activations are "
                                "recomputed in the backward pass; only each layer's input is kept")
    offload: bool = Field(False, description="trainer.offload: colocated, each role's idle state leaves the "
                          "device between phases (the peak is the larger phase, not their sum)")
    max_batch: int = Field(256, ge=1, description="rows a rollout rank keeps in flight")
    packing: Literal["shared_prompt", "sequences", "none"] = Field(
        "shared_prompt", description="engine.packing: the training passes' layout (shared-prompt units, packed "
        "sequences, or padded rows)")
    pack_length: int = Field(0, ge=0, description="engine.pack_length: max tokens of a packed row; 0 packs rows up "
                             "to the longest unit")
    feed_last: bool = Field(False, description="the training passes feed each response's last token too (MoE "
                            "routing replay, a load-balancing loss); else it is left out, as it predicts nothing")
    decode_fused: bool = Field(False, description="rollout.decode_compile: on a GPU each rollout rank keeps a copy "
                               "of the model's q/k/v and gate/up weights (ModelShape.fused), fused")
    rollout_tp: int = Field(1, ge=1, description="rollout.vllm.tensor_parallel_size: each rollout rank spans this "
                            "many devices, each holding 1/N of the rollout's weights (memory only: generation is "
                            "costed as the native engine's, one rank per device)")
    head_stored: bool = Field(False, description="engine.head_grad=stored: the policy pass keeps its output "
                              "logits for the backward (positions x vocab values in the compute dtype; counted "
                              "for a whole micro-batch's token budget)")
    expert_parallel: bool = Field(False, description="engine.expert_parallel: the experts (ModelShape.routed) stay "
                                  "split over the trainer's ranks, and each pass sends every token's hidden state "
                                  "to its experts' ranks and back instead of gathering them")
    expert_group: int = Field(0, ge=0, description="engine.expert_parallel=e: the experts are split over groups of "
                              "e ranks and replicated over the groups (each rank holds 1/e of them, tokens travel "
                              "inside a group, the replicas sum their gradients each step); 0: one group of all "
                              "the trainer's ranks (engine.expert_parallel=true)")
    expand_kv: bool = Field(False, description="model.attn_implementation=flex_attention (GPU only) with grouped "
                            "keys and values: each layer keeps its keys and values repeated to the query heads for "
                            "the backward (relayrl.engines.training.flex.EXPAND_KV)")

    @property
    def rows(self) -> int:
        return self.prompts * self.n

    def experts_over(self, dp: int) -> int:
        """Ranks per expert group on ``dp`` trainer ranks (1: no expert parallelism). A placement whose ``dp`` the
        configured group does not divide (the search tries other pool sizes) takes their largest common divisor."""
        if not self.expert_parallel or dp == 1:
            return 1
        return math.gcd(self.expert_group, dp) if self.expert_group else dp

    @property
    def fsdp_params(self) -> tuple[int, int]:
        """(weights FSDP2 gathers, gradients it reduces): every parameter and the trained ones, less the experts
        under expert parallelism (they stay split, and their gradients arrive whole)."""
        m = self.model
        experts = m.routed if self.expert_parallel else 0
        return m.params - experts, m.trained_params - (experts if not m.trainable else 0)
