"""The training engine's settings (``engine.*`` in a run config): :class:`TrainEngineConfig` and its
:class:`OptimConfig`. No torch here: a recipe is validated before torch is imported."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["OptimConfig", "TrainEngineConfig"]


class OptimConfig(BaseModel):
    """AdamW with warm-up and a schedule, and gradient-norm clipping."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    lr: float = Field(1e-5, gt=0, description="AdamW's learning rate (the peak, after warm-up)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.999), description="AdamW's decay rates of the gradient's first and second moments")
    eps: float = Field(1e-8, gt=0, description="AdamW's term added to the second moment's root")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="the learning rate after warm-up: constant, or a cosine or linear decay to "
        "min_lr_ratio x lr at the run's last optimizer step")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="floor of the cosine/linear decay, as a fraction of lr")
    max_grad_norm: float | None = Field(1.0, gt=0, allow_inf_nan=True, description="clip the global grad norm; "
                                        "null (or inf) disables clipping")


class TrainEngineConfig(BaseModel):
    """The training engine (``engine.*``; ``critic.*`` has its own optimizer): the optimizer, micro-batching,
    the output head's chunking, mixed precision, data parallelism, checkpointing and compilation."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    optim: OptimConfig = OptimConfig()
    token_budget: int = Field(8192, ge=16, description="max padded tokens (prompt + response) per micro-batch")
    entropy_chunk: int = Field(1024, ge=1, description="positions per chunk when computing entropy")
    logprob_chunk: int = Field(1024, ge=0, description="positions per chunk of the output head in log-prob "
                               "passes: each chunk's [chunk, vocab] logits are reduced at once and recomputed "
                               "in the backward pass instead of stored; 0 materialises every position's logits "
                               "(an entropy bonus, entropy_coef > 0, always does)")
    fused_head: bool = Field(False, description="compile the chunked head's float32 steps (log-sum-exp, target "
                             "log-prob, entropy; the backward's softmax gradient) into fused kernels: each chunk's "
                             "[chunk, vocab] logits are read once in the compute dtype instead of copied to float32 "
                             "(for GPUs; rounding differs in the last bits; the first passes compile)")
    head_grad: Literal["positions", "vocab", "stored"] = Field(
        "positions", description="how the chunked head's backward pass gets its logits back: positions "
        "(recomputed logprob_chunk positions at a time, each chunk's share of the head weight's gradient added "
        "into a float32 sum), vocab (recomputed for every position a vocabulary slice of the same size at a "
        "time, so each slice of the weight's gradient is one matrix product over all positions, written once) "
        "or stored (no recompute: the forward pass keeps every position's logits in the compute dtype, "
        "positions x vocab values, and the backward rewrites them into their gradient)")
    compute_copy: bool = Field(False, description="mixed precision on one rank: run the passes on a copy of the "
                               "trained weights in the compute dtype instead of under torch.autocast (no weight "
                               "casts per pass; activations and the residual stream in the compute dtype, as under "
                               "FSDP2's policy). Each micro-batch's gradients are added into the float32 master "
                               "gradients and the copy is refreshed after each optimizer step; costs one copy of "
                               "the weights in the compute dtype")
    dp_sync: Literal["pass", "step"] = Field(
        "pass", description="data parallel (FSDP2): how often parameters are gathered and gradients reduced. "
        "pass: every micro-batch gathers, reshards and reduce-scatters (FSDP2's default: the least memory, "
        "collectives in every pass). step: once per optimizer step; between the micro-batches (or streamed "
        "chunks) of one step every rank keeps the gathered parameters and its unsharded float32 gradients "
        "(far fewer collectives, e.g. for the periodic trainer's chunks, when that fits a device)")
    dropout: Literal["auto", "none", "model"] = Field(
        "auto", description="the trained model's dropout (nn.Dropout layers and attention dropout). none: every "
        "rate set to 0 for training (the model's config is left as it is); model: as the model's config says. "
        "auto: none for grpo, dpo and rm, where dropout would make the ratio pi / pi_old or the preference margin "
        "noisy (as verl, OpenRLHF, TRL's DPO and reward trainers), model for sft")
    gradient_checkpointing: bool = Field(False, description="keep only each decoder layer's input and recompute "
                                         "its activations in the backward pass: less memory for one more "
                                         "forward pass of compute")
    compile: bool = Field(False, description="compile each decoder layer with torch.compile (dynamic shapes): "
                          "fuses the norms, activations and casts between the matrix products; the first "
                          "passes pay the compilation (tens of seconds)")
    cuda_graphs: bool = Field(False, description="with compile, on one CUDA device: replay each compiled decoder "
                              "layer's forward and backward as CUDA graphs (torch.compile's reduce-overhead mode, a "
                              "graph per packed length; each micro-batch starts a new step), against the launch gaps "
                              "of small models. Measured once, on an H200 (0.5B shape, two micro-batches): 0.276 s "
                              "per update against 0.282 s compiled without graphs; costs a recording per new length")
    router_aux_loss_coef: float = Field(
        0.0, ge=0.0, description="mixture-of-experts models: add this times the model's own load-balancing loss "
        "(transformers' load_balancing_loss_func, Switch Transformer eqs. 4-6, over each micro-batch's tokens) to "
        "the trained policy's loss in every pass with a gradient, weighted by the micro-batch's share of the "
        "batch's tokens (TRL's router_aux_loss_coef with output_router_logits=True; Qwen3-MoE's and Mixtral's "
        "configs say 0.001); reports <role>/router_aux_loss. 0: off, the routers learn from the policy loss alone")
    packing: Literal["none", "sequences", "shared_prompt"] = Field(
        "shared_prompt", description="forward layout: one prompt + its group's responses per unit (Periodic Asynchrony §4.2), "
        "packed sequences, or right-padded rows. A response's last token predicts nothing and is left out of the "
        "input (kept with routing replay or router_aux_loss_coef, which need every token's routing)")
    pack_length: int | None = Field(
        None, ge=16, description="max tokens per packed row; null packs rows up to the longest unit (a group or "
        "a sequence), so a packed row's attention never spans more than an unpacked row would")
    sequence_parallel: int = Field(
        1, ge=1, description="Ulysses sequence parallelism (DeepSpeed-Ulysses; verl's ulysses_sequence_parallel_size): "
        "the trainer's ranks form groups of this many consecutive ranks that share one micro-batch, each holding "
        "1/sequence_parallel of every packed sequence's tokens (activations per device shrink by as much; attention "
        "exchanges heads for tokens with two all-to-alls per layer). Applies to every role on the training engine "
        "(actor, reference, critic); the trainer group's ranks and the model's query heads must be multiples of it, "
        "and the model must use attn_implementation=sdpa with a packed layout. 1: off")

    expert_parallel: bool | int = Field(
        False, description="a mixture of experts on several trainer ranks: split every MoE layer's experts whole "
        "over a group of ranks and send each token to the rank of its group holding its expert and back (two "
        "all-to-alls per layer), instead of FSDP2 gathering every expert on every rank; the other parameters stay "
        "FSDP2's. true: one group of all the trainer's ranks; an integer e >= 2 dividing the ranks: groups of e "
        "consecutive ranks, each holding every expert (rank r of a group holds experts r c .. r c + c - 1, c = "
        "ceil(experts / e)), each expert shard replicated over the ranks / e groups and its gradient summed over "
        "them. Needs a mixture-of-experts model with at least e experts per layer; not with "
        "model.lora.target_parameters. false or 1: the experts are FSDP2 shards like the rest")

    @property
    def expert_parallel_on(self) -> bool:
        """Whether ``engine.expert_parallel`` asks for expert parallelism (true, or a group size >= 2)."""
        return self.expert_parallel is True or (self.expert_parallel is not False and self.expert_parallel > 1)

    def expert_group(self, ranks: int) -> int:
        """Ranks per expert group on ``ranks`` trainer ranks (``engine.expert_parallel``; true: all of them,
        false: 1, expert parallelism off)."""
        ep = self.expert_parallel
        return ranks if ep is True else 1 if ep is False else ep

    @field_validator("expert_parallel")
    @classmethod
    def _expert_group_size(cls, v: bool | int) -> bool | int:
        if not isinstance(v, bool) and v < 1:
            raise ValueError(f"engine.expert_parallel={v}: give true (one expert group of all the trainer's ranks), "
                             f"an expert group size >= 2 that divides the ranks, or false")
        return v

    @model_validator(mode="after")
    def _check_sequence_parallel(self) -> "TrainEngineConfig":
        if self.sequence_parallel > 1 and self.packing == "none":
            raise ValueError(f"engine.sequence_parallel={self.sequence_parallel} splits packed sequences; "
                             "engine.packing=none lays rows out padded: set engine.packing=sequences or shared_prompt")
        return self
