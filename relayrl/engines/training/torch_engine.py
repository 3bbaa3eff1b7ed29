"""Single-process PyTorch training engine (CPU or one GPU).

Forward passes lay out rows at the last moment, in one of three ways
(``TrainEngineConfig.packing``):

* ``"shared_prompt"`` (default; Periodic Asynchrony §4.2): the rows of one prompt
  group are packed as one sequence ``[prompt, response_1, ..., response_n]``
  with a shared-prompt attention mask and per-response position ids
  (:mod:`relayrl.models.packing`), so the prompt is computed once and a group
  carries no padding. Rows are grouped by ``SequenceBatch.groups`` *and* checked
  to have identical prompts; without groups this is sequence packing.
* ``"sequences"``: each row is its own unit; short rows share a packed row
  under a block-diagonal causal mask.
* ``"none"``: one row per sequence, right-padded to the micro-batch's longest.

Packed units (a group never splits unless it alone exceeds the token budget)
are bin-packed into rows no longer than the longest unit (or
``pack_length``), and rows are cut into micro-batches whose *padded* token
count stays under ``token_budget`` (:mod:`relayrl.engines.training.layout`); a
response's last token, which predicts nothing, is not fed (packed or padded)
unless routing replay or a load-balancing loss needs every token's routing. The mask goes to the Hugging Face model in
a form transformers passes through untouched: a dense 4-D tensor, boolean for
``attn_implementation="sdpa"`` and additive float for ``"eager"``, or for
``"flex_attention"`` a block-sparse FlexAttention ``BlockMask`` that skips the
empty tiles of the pack (:mod:`relayrl.engines.training.flex`; a micro-batch's
packed rows then run as one row padded to a multiple of 128 tokens, since the
mask keeps units apart anyway; CUDA only for training); a model with sliding-window
layers gets a per-layer-type mask dict. Flash-attention would ignore or misread
these masks, so the engine falls back to ``packing="none"`` with a warning.
Logits are computed only at response positions (decoder hidden states are
gathered first, then the output head is applied), which avoids materialising
``[B, L, V]`` logits for the prompt. Every path returns response-aligned
``[B, T]`` tensors, so loss functions do not know which layout ran. A critic
(``output="values"``: a model whose head has one output, see
:func:`relayrl.models.load.load_value_model`) runs the same passes and returns
the value ``V(s_t)`` of each response position where a policy returns
log-probs; ``MicroBatch.logprobs`` then holds the values.

Gradients accumulate over micro-batches; the loss function normalises by the
mini-batch's global token/sequence counts, so accumulation is exact (Periodic Asynchrony
§3). With ``torch.distributed`` initialised over more than one rank the
engine is data parallel: the model is sharded with FSDP2, the counts and the
reported metrics are summed over ranks, and every rank runs as many forward
passes as the busiest one (:mod:`relayrl.engines.training.fsdp`). Each rank
takes exactly ``mini_batches`` optimizer steps, each over one global
mini-batch: every rank's rows numbered in rank order, shuffled by the same
generator on every rank and cut into ``mini_batches`` slices
(:func:`minibatch_slices`, :func:`minibatch_rows`), so N ranks take the steps one
rank takes on the whole batch. A mini-batch needs a row of the whole batch,
not one on every rank: a rank holding none of a mini-batch's rows (or no
rows at all) joins the busiest rank's passes on a one-token row with a zero
loss; when the whole batch holds fewer rows than ``mini_batches``, every
rank refuses the call (a collective decision).
With ``engine.sequence_parallel`` > 1 the ranks form groups that pool their
rows and split each packed sequence among themselves, attention exchanging
tokens for heads (Ulysses, :mod:`relayrl.engines.training.ulysses`); a group
counts its rows and reports its metrics once.
The same step can be taken over a batch that arrives in chunks
(``begin_accumulation`` / ``accumulate`` / ``finish_accumulation``, periodic
asynchrony: :mod:`relayrl.engines.training.accumulate`).

Tri-model (Periodic Asynchrony §4.1): with ``reference=`` (a frozen copy of the
initial policy) the engine keeps it in the policy's layout (same device, FSDP2
sharding when sharded, no optimizer, no grad; its weights in their own dtype,
usually the compute dtype, under autocast only if that differs) and, when a
call passes ``with_reference``, runs it under ``no_grad`` on each micro-batch's
packed input before the policy pass: the loss gets the reference log-probs as
the ``ref_logprobs`` field without a second packing or a separate worker.
Departure from the paper: there is no separate old-policy copy; with one update
per batch the old policy is the detached current policy (the loss's default),
and with several the workflow computes old and reference log-probs together
beforehand (``logprobs_with_reference``). With LoRA adapters on the model
(``reference_adapters_off``, :mod:`relayrl.models.lora`) the reference is the
model's own pass with every adapter switched off: the frozen base, which is the
initial policy since adapters start at zero, with no second copy of the weights.

Output head precision (``head_fp32``, ``model.head_fp32``): the head's matrix product runs in float32 in
the policy's, the old policy's and the reference's passes, whatever ``compute_dtype``
(:mod:`relayrl.models.head_precision`); a critic refuses it (a value head is not an LM head).

Mixed precision (``compute_dtype`` lower than the weights' dtype): the
weights, gradients and optimizer state stay in the weights' dtype (float32
master weights) and the forward and backward passes compute in
``compute_dtype``: on one rank under ``torch.autocast``, under FSDP2 through
its ``MixedPrecisionPolicy`` (parameters gathered in ``compute_dtype``,
gradients reduced in float32). A 1e-6 step then moves a weight of 0.02, which
a bf16 weight cannot represent. With ``compute_copy`` one rank instead runs the
passes on a ``compute_dtype`` copy of the weights (like FSDP2's gathered
parameters), adds each micro-batch's gradients into the float32 master
gradients, and refreshes the copy after each optimizer step.

A non-finite gradient norm skips the optimizer step (weights stay at the last
good state) and is reported as ``actor/nonfinite_grad``; the workflow decides
whether to stop or go on.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from typing import Any, Literal

import torch

from relayrl.engines.training import expert_parallel, flex, fsdp, ulysses
from relayrl.models import routing
from relayrl.algorithms._checks import deferred_metrics, metric_value
from relayrl.engines.training.accumulate import MetricSums, StreamedUpdate
from relayrl.engines.training.state import EngineState
from relayrl.engines.training.base import (REF_FIELD, LossFn, MicroBatch, SequenceBatch, finished,
                                          with_group_tokens)
from relayrl.engines.training.config import TrainEngineConfig
from relayrl.engines.training.forward import Forward, pad_field, with_loss_mask
from relayrl.engines.training.layout import PassLayout
from relayrl.engines.training.logprob_passes import LogprobPasses
from relayrl.engines.training.routed import RoutedPasses
from relayrl.engines.training.steps import make_scheduler, minibatch_rows, minibatch_slices, over_steps
from relayrl.models.logits import LogitTransform, check_head
from relayrl.models.packing import PackUnit, build_packed_batch, plan_microbatches, to_device
from relayrl.errors import SettingError

__all__ = ["TrainEngineConfig", "TorchTrainingEngine", "Forward", "plan_microbatches", "minibatch_slices", "make_scheduler"]


def _check_role(output: str, reference, reference_adapters_off: bool, head_fp32: bool) -> None:
    """The engine's role (a policy, ``logprobs``, or a critic, ``values``) against the options only a policy
    has."""
    if output not in ("logprobs", "values"):
        raise ValueError(f"output={output!r} must be 'logprobs' (a policy) or 'values' (a critic)")
    if (reference is not None or reference_adapters_off) and output == "values":
        raise ValueError("a reference model belongs to a policy engine (output='logprobs'), not a critic")
    if head_fp32 and output == "values":
        raise ValueError("head_fp32 computes an LM head's logits in float32; a critic's value head is not one")
    if reference is not None and reference_adapters_off:
        raise ValueError("pass reference= (a frozen copy) or reference_adapters_off=True (the model's base "
                         "under its LoRA adapters), not both")


class TorchTrainingEngine(PassLayout, LogprobPasses, RoutedPasses, StreamedUpdate, EngineState):
    """See the module docstring. ``model`` is a Hugging Face causal LM; ``reference`` an optional frozen
    copy of the initial policy (same architecture) laid out like ``model`` (tri-model, Periodic Asynchrony §4.1)."""

    def __init__(self, model, cfg: TrainEngineConfig, *, total_steps: int, device: str | torch.device = "cpu",
                 trainable: bool = True, metric_prefix: str = "actor",
                 output: Literal["logprobs", "values"] = "logprobs", compute_dtype: torch.dtype | None = None,
                 reference=None, reference_adapters_off: bool = False, head_fp32: bool = False,
                 routing_replay: bool = False, routing_compare: bool = False) -> None:
        _check_role(output, reference, reference_adapters_off, head_fp32)
        self.values = output == "values"  # a critic: the head's one output per position is the value
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.cfg = cfg
        if cfg.dropout == "none":  # ("auto" is the workflow's to resolve: Config.train_engine; here, as loaded)
            from relayrl.models.load import disable_dropout

            disable_dropout(self.model)
        # what the model's forward does to the head's product (Gemma's cap, Granite's scale), checked on a few
        # tokens before any layer is compiled, sharded or given another attention (a critic's head: nothing)
        self.transform = LogitTransform() if self.values else check_head(self.model)
        self.prefix = metric_prefix
        self._resolve_packing(trainable)
        self.sp = self._sequence_parallel(reference)  # engine.sequence_parallel > 1: this rank's Ulysses group
        weights = next(self.model.parameters()).dtype
        self.compute_dtype = compute_dtype or weights
        mixed = self.compute_dtype != weights
        self.runner = self._runner(mixed and trainable)  # the module the passes run
        # MoE routing replay (relayrl.models.routing): the policy's routers choose the experts a batch's routes name
        # (routing_compare: the batch's routes are compared with the routers' own choices, which stand)
        self.routing = (routing.Routing(self.runner, compare=routing_compare and not routing_replay)
                        if routing_replay or routing_compare else None)
        # engine.router_aux_loss_coef: the policy's load-balancing loss in every pass with a gradient
        self._balance = (routing.load_balancing(self.runner) if cfg.router_aux_loss_coef > 0 and trainable
                         and output == "logprobs" else None)
        mode = self._prepare_layers()
        # model.head_fp32 (relayrl.models.head_precision): the head's product in float32 in every pass
        self.head_dtype = torch.float32 if head_fp32 else None
        self.net = fsdp.ResponseLogits(self.runner, self.head_dtype, self.transform)
        # FSDP2 when the group has > 1 rank; it casts the gathered parameters itself
        self.sharded = fsdp.shard_model(self.net, self.device, compute_dtype=self.compute_dtype if mixed else None,
                                        expert_parallel=cfg.expert_parallel)
        self._autocast = mixed and not self.sharded and self.runner is self.model
        self._weights_offloaded = False  # offload() moved the weights to host (FSDP2 shards move with .to)
        self.reference, self.reference_model, self._ref_autocast, self._ref_offloaded = None, None, False, False
        self.reference_adapters_off = reference_adapters_off  # LoRA: the reference is the base, adapters off
        if reference is not None:
            self._set_reference(reference, mode)
        self._accumulation = None  # an open streamed update (accumulate.StreamedUpdate)
        self.world = fsdp.world_size()
        self.optimizer, self.scheduler = self._optimizer(total_steps) if trainable else (None, None)
        if not trainable:
            self.model.requires_grad_(False).eval()

    def _sequence_parallel(self, reference) -> Any:
        """``engine.sequence_parallel > 1``: this rank's Ulysses group (relayrl.engines.training.ulysses),
        installed in the model and the reference; else None."""
        if self.cfg.sequence_parallel <= 1:
            return None
        ulysses.check_model(self.model, self.cfg.sequence_parallel)
        sp = ulysses.setup(self.cfg.sequence_parallel)
        for m in (self.model, reference):
            if m is not None:
                ulysses.install(m, sp)
        return sp

    def _runner(self, mixed_trained: bool) -> torch.nn.Module:
        """The model, or (``engine.compute_copy``, one rank, a trained model in another compute dtype) a copy of
        it in ``compute_dtype``."""
        if not (mixed_trained and self.cfg.compute_copy and fsdp.world_size() == 1):
            return self.model
        runner = copy.deepcopy(self.model)
        for p in runner.parameters():  # parameters only: buffers (rotary frequencies) stay float32
            p.data = p.data.to(self.compute_dtype)
        return runner

    def _prepare_layers(self) -> str | None:
        """Gradient checkpointing, CUDA graphs (checked) and per-layer compilation of the runner; the compile
        mode, for the reference's layers too."""
        cfg = self.cfg
        if cfg.gradient_checkpointing:
            self.runner.gradient_checkpointing_enable()
        if cfg.cuda_graphs:
            self._check_cuda_graphs()
        mode = "reduce-overhead" if cfg.cuda_graphs else None
        if cfg.compile:  # per layer, before sharding (as torchtitan does): one graph reused by every layer
            for layer in fsdp.decoder_layers(self.runner):
                layer.compile(dynamic=True, mode=mode)
        return mode

    def _set_reference(self, reference, mode: str | None) -> None:
        """The frozen reference: no optimizer, compiled and sharded like the policy, in its own dtype (usually
        the compute dtype)."""
        self.reference_model = reference.to(self.device).requires_grad_(False).eval()
        for layer in fsdp.decoder_layers(reference) if self.cfg.compile else ():
            layer.compile(dynamic=True, mode=mode)
        self.reference = fsdp.ResponseLogits(self.reference_model, self.head_dtype, self.transform).eval()
        ref_mixed = next(reference.parameters()).dtype != self.compute_dtype
        fsdp.shard_model(self.reference, self.device, compute_dtype=self.compute_dtype if ref_mixed else None,
                         expert_parallel=self.cfg.expert_parallel)
        self._ref_autocast = ref_mixed and not self.sharded

    def _optimizer(self, total_steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """AdamW over the trainable parameters and its learning-rate schedule (``engine.optim``)."""
        o = self.cfg.optim
        optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
            fused=True,  # one kernel per step and no parameter-sized temporaries (foreach makes some)
        )
        return optimizer, make_scheduler(optimizer, o, total_steps)

    def _check_cuda_graphs(self) -> None:
        """engine.cuda_graphs needs what the graphs assume: compiled layers, one CUDA device, no recomputation."""
        why = ("engine.compile=false (the graphs are of the compiled layers)" if not self.cfg.compile else
               f"the engine runs on {self.device.type}" if self.device.type != "cuda" else
               "the model is sharded over ranks (FSDP2's hooks run between the layers)" if fsdp.world_size() > 1 else
               "engine.gradient_checkpointing=true (recomputed layers replay outside the step)"
               if self.cfg.gradient_checkpointing else
               "MoE routing replay (every micro-batch replays other routes into the routers)" if self.routing else
               "engine.router_aux_loss_coef > 0 (the router logits leave the layers beside their outputs)"
               if self.cfg.router_aux_loss_coef > 0 else None)
        if why:
            raise SettingError(f"engine.cuda_graphs=true needs compiled layers on one CUDA device, but {why}; set "
                               f"engine.cuda_graphs=false")

    # --------------------------------------------------------------- forward
    def _compute(self, enabled: bool | None = None):
        """The mixed-precision context of a forward pass (autocast to ``compute_dtype`` on one rank)."""
        if not (self._autocast if enabled is None else enabled):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _forward(self, batch: SequenceBatch, item, temperature: float, with_entropy: bool | str,
                 with_reference: bool = False, with_sum_sq: bool = False, record: bool = False,
                 balance: bool = False) -> Forward:
        """One micro-batch's pass (see :class:`Forward`); ``with_reference`` also runs the reference copy
        on the same input (first, so its activations are gone before the policy pass keeps its own);
        ``with_sum_sq``: each position's ``sum_v p_v^2`` too; ``record``: the experts the policy's routers chose
        for every token of each row (MoE routing replay of the old policy), the batch's routes not replayed;
        ``balance``: the policy's load-balancing loss of the pass (``engine.router_aux_loss_coef``)."""
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 (log-probs of greedy samples: pass 1.0)")
        if self.cfg.cuda_graphs:  # a new micro-batch: the previous one's graph outputs are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        if self.packing == "none":
            return self._forward_padded(batch, item, temperature, with_entropy, with_reference, with_sum_sq, record,
                                        balance)
        if self.flex:  # the micro-batch's units in one row: no row padding, batch size 1 for the compiled kernel
            item = [[unit for row in item for unit in row]]
        pb = build_packed_batch(batch.prompt_ids, batch.response_ids, item)
        if self.flex or self.sp:  # whole tiles, at least two (see relayrl.engines.training.flex); whole shards
            multiple = math.lcm(flex.BLOCK if self.flex else 1, self.sp.size if self.sp else 1)
            pb = pb.pad_to(multiple, at_least=2 * flex.BLOCK) if self.flex else pb.pad_to(multiple)
        pb = pb.to(self.device)
        mask = self._attention_mask(pb.doc_ids, pb.segment_ids, pb.position_ids)
        args = (pb.input_ids, mask, pb.position_ids, pb.token_pack, pb.token_src)  # logits at response positions only
        targets, whole, cols = pb.targets, (lambda t: t), slice(None)
        if self.sp:  # this rank's columns and response tokens; every rank's per-token outputs gathered back
            cut = ulysses.Shard.of(pb, self.sp)
            args, targets, whole = (cut.input_ids, mask, cut.position_ids, cut.rows, cut.cols), cut.targets, cut.gather
            width = pb.input_ids.shape[1] // self.sp.size
            cols = slice(self.sp.rank * width, (self.sp.rank + 1) * width)
        routes = None if record else self._routes(batch, pb.seq_row, pb.seq_pos, cols)
        ref = pb.to_rows(whole(self._reference_logprobs(args, targets, None, temperature))) if with_reference else None
        self._replay(routes)
        gates = [] if balance else None
        with self._record(record) as rec:
            lp, ent, sq = (whole(t) for t in self._head(self.net, args, targets, None, temperature, with_entropy,
                                                        self._autocast, with_sum_sq, gates))
        recorded = None if rec is None else routing.per_row(
            self._gathered(rec, pb.input_ids.shape[0]), pb.seq_row, pb.seq_pos, [u for row in item for u in row])
        return Forward(pb.to_rows(lp), to_device(pb.response_mask(), self.device), None if ent is None else pb.to_rows(ent),
                       list(pb.rows), int(pb.input_ids.numel()), ref, None if sq is None else pb.to_rows(sq),
                       self._agreement(routes), recorded, self._balanced(gates, (pb.seq_row >= 0)[:, cols]))

    def _head(self, net, args: tuple, targets: torch.Tensor, mask: torch.Tensor | None, temperature: float,
              with_entropy: bool | str, autocast: bool, with_sum_sq: bool = False, router_logits: list | None = None):
        """``net(*args)``'s log-probs of ``targets`` (a critic: its values), entropy and ``sum_v p_v^2`` (each
        None unless asked), shaped like ``targets``; zero where ``mask`` (when given) is 0. ``router_logits``: a
        list that gets the pass's MoE router logits."""
        gates = {} if router_logits is None else {"router_logits": router_logits}
        with self._compute(autocast):
            if self._chunked(with_entropy):
                out = net(*args, targets=targets, temperature=temperature, chunk=self.cfg.logprob_chunk,
                          with_entropy=bool(with_entropy), fused=self.cfg.fused_head,
                          grad_by=self.cfg.head_grad, with_sum_sq=with_sum_sq, **gates)
                lp, ent, sq = (*out, None) if len(out) == 2 else out
                return tuple(t if t is None or mask is None else t * mask for t in (lp, ent, sq))
            logits = net(*args, **gates)
        if self.values:
            return (logits[..., 0] if mask is None else logits[..., 0] * mask), None, None
        lp, ent = self._token_logprobs(logits, targets, mask, temperature, with_entropy)
        if not with_sum_sq:
            return lp, ent, None
        x = logits.float() / temperature  # sum p^2 = exp(logsumexp(2x) - 2 logsumexp(x))
        sq = torch.exp(torch.logsumexp(2.0 * x, dim=-1) - 2.0 * torch.logsumexp(x, dim=-1)).detach()
        return lp, ent, sq if mask is None else sq * mask

    @torch.no_grad()
    def _reference_logprobs(self, args: tuple, targets: torch.Tensor, mask: torch.Tensor | None,
                            temperature: float) -> torch.Tensor:
        """The frozen reference's log-probs of ``targets`` on the policy pass's input ``args``."""
        if self.reference_adapters_off:  # LoRA: the policy's own pass with every adapter off (B = 0 at start)
            from relayrl.models.lora import adapters_disabled

            if self.routing is not None:  # the reference routes on its own (relayrl.models.routing)
                self.routing.replay(None)
            with adapters_disabled(self.runner):
                return self._head(self.net, args, targets, mask, temperature, False, self._autocast)[0]
        if self.reference is None:
            raise RuntimeError("with_reference on an engine built without a reference model (pass reference=)")
        return self._head(self.reference, args, targets, mask, temperature, False, self._ref_autocast)[0]

    def _chunked(self, with_entropy: bool | str) -> bool:
        """Whether a policy pass takes the chunked head (no [positions, vocab] logits kept)."""
        head = self.model.get_output_embeddings()
        return (not self.values and self.cfg.logprob_chunk > 0 and with_entropy != "grad"
                and getattr(head, "bias", None) is None)

    def _token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None,
                        temperature: float, with_entropy: bool | str):
        """Log-probs of ``targets`` under ``softmax(logits / temperature)`` for ``logits`` [..., V] (and the
        entropy of that distribution), same leading shape. The caller passes the temperature the tokens were
        sampled at, so these log-probs are comparable with the generator's (the engine does not know why)."""
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
        if mask is not None:
            logprobs = logprobs * mask
        if not with_entropy:
            return logprobs, None
        if logits.shape[0] == 0 or logits.shape[-2] == 0:
            return logprobs, torch.zeros(logits.shape[:-1], device=logits.device)
        from relayrl.algorithms.entropy import entropy_from_logits

        # Gradient through the entropy only when a loss term uses it (an entropy bonus).
        flat = logits.dim() == 2
        entropy = entropy_from_logits(logits[None] if flat else logits, None if flat else mask,
                                      chunk_size=self.cfg.entropy_chunk, grad=with_entropy == "grad")
        return logprobs, entropy[0] if flat else entropy

    def _padded_len(self, batch: SequenceBatch, rows: list[int]) -> int:
        """Tokens of a padded micro-batch: its rows times the longest one fed."""
        return len(rows) * max(self._fed_len(batch, i) for i in rows)

    def _forward_padded(self, batch: SequenceBatch, rows: list[int], temperature: float,
                        with_entropy: bool | str, with_reference: bool, with_sum_sq: bool = False,
                        record: bool = False, balance: bool = False) -> Forward:
        """One row per sequence, right-padded (each response's last token fed only with :attr:`_feed_last`)."""
        lp_len = [int(batch.prompt_ids[i].numel()) for i in rows]
        rs_len = [int(batch.response_ids[i].numel()) for i in rows]
        total = [self._fed_len(batch, i) for i in rows]
        L, T = max(total), max(rs_len)
        if self.flex:  # whole tiles, as packed rows get (relayrl.engines.training.flex)
            L = max(2 * flex.BLOCK, -(-L // flex.BLOCK) * flex.BLOCK)
        ids = torch.zeros(len(rows), L, dtype=torch.long)
        attn = torch.zeros(len(rows), L, dtype=torch.long)
        targets = torch.zeros(len(rows), T, dtype=torch.long)
        for j, i in enumerate(rows):
            seq = torch.cat([batch.prompt_ids[i].long(), batch.response_ids[i].long()])[:total[j]]
            ids[j, : seq.numel()] = seq
            attn[j, : seq.numel()] = 1
            targets[j, : rs_len[j]] = batch.response_ids[i]
        ar = torch.arange(T)
        pos = (torch.tensor(lp_len)[:, None] - 1 + ar[None, :]).clamp(max=L - 1)  # position predicting token t
        mask = (ar[None, :] < torch.tensor(rs_len)[:, None]).float()
        ids, attn, pos, mask, targets = (to_device(t, self.device) for t in (ids, attn, pos, mask, targets))

        args = (ids, attn, None, torch.arange(len(rows), device=self.device)[:, None].expand_as(pos), pos)
        ref = self._reference_logprobs(args, targets, mask, temperature) if with_reference else None
        routes = None
        if self.routing is not None:  # row j's token l is token l of batch row rows[j]
            seq_row = torch.where(attn.cpu().bool(), torch.tensor(rows)[:, None], -1)
            seq_pos = torch.arange(L).expand(len(rows), L)
            routes = None if record else self._routes(batch, seq_row, seq_pos)
        self._replay(routes)
        gates = [] if balance else None
        with self._record(record) as rec:
            lp, ent, sq = self._head(self.net, args, targets, mask, temperature, with_entropy, self._autocast,
                                     with_sum_sq, gates)
        recorded = None if rec is None else routing.per_row(
            self._gathered(rec, len(rows)), seq_row, seq_pos, [PackUnit((i,), a, (b,)) for i, a, b in
                                                              zip(rows, lp_len, rs_len)])
        return Forward(lp, mask, ent, list(rows), self._padded_len(batch, rows), ref, sq, self._agreement(routes),
                       recorded, self._balanced(gates, attn))

    # ---------------------------------------------------------------- update
    def _pool(self, batch: SequenceBatch) -> tuple[SequenceBatch, range]:
        """Sequence parallel: the SP group's rows, the same on each of its ranks, and this rank's among them
        (a collective); else ``batch`` itself."""
        return ulysses.pool(batch, self.sp) if self.sp else (batch, range(len(batch)))

    @property
    def _counts_own(self) -> bool:
        """Whether this rank's rows, counts and metrics are its own (not the first SP rank's copy of them)."""
        return self.sp is None or self.sp.leads

    def _global(self, tokens: int, seqs: int, groups: float = 0.0) -> tuple[int, int, float]:
        own = self._counts_own  # an SP group's rows are counted once, by its first rank
        g_tokens, g_seqs, g_groups = fsdp.sum_over_ranks([tokens, seqs, groups] if own else [0, 0, 0.0], self.device)
        return int(g_tokens), int(g_seqs), float(g_groups)

    def _rows_before(self, held: int) -> tuple[int, int]:
        """``(rows of the data-parallel replicas before this one, rows of all of them)``: a collective (an SP
        group's pooled rows counted once, by its first rank)."""
        first = (torch.distributed.get_rank() - self.sp.rank) if self.sp else (
            torch.distributed.get_rank() if self.sharded else 0)
        return fsdp.rows_before(held if self._counts_own else 0, first, self.device)

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn, *, mini_batches: int = 1, epochs: int = 1,
                   temperature: float = 1.0, with_entropy: bool | str = False, with_reference: bool = False,
                   generator: torch.Generator | None = None) -> dict[str, float]:
        """``with_reference``: each micro-batch also runs the frozen reference (``reference=``) on its packed
        input and hands the loss its log-probs as the ``ref_logprobs`` field (tri-model, Periodic Asynchrony §4.1)."""
        if self.optimizer is None:
            raise RuntimeError("train_step on an engine built with trainable=False")
        if self._accumulation is not None:
            raise RuntimeError("train_step while an accumulation is open: call finish_accumulation() first")
        batch, _ = self._pool(batch)
        # the mini-batches are cut from every replica's rows together (numbered in replica order), so N replicas
        # take the steps one rank takes on the whole batch (minibatch_rows); a collective, so every rank refuses
        # together below and none is left waiting in a collective of a step the others do not take
        offset, total = self._rows_before(len(batch))
        if total == 0:
            raise ValueError("train_step got an empty batch" + (" on every data-parallel replica" * self.sharded))
        if not 1 <= mini_batches <= total:
            where = "rows in the batch" + (" over every data-parallel replica" * self.sharded)
            raise ValueError(f"mini_batches={mini_batches} must be in [1, {total}] ({where}): every mini-batch "
                             f"is one optimizer step and needs a row (lower trainer.mini_batches)")
        # A replica holding no row of a mini-batch (or none at all) still takes its step: it joins the busiest
        # replica's passes on a one-token row with a zero loss and adds zeros to the counts and the metrics.
        batch = with_group_tokens(batch, loss_fn)  # before the mini-batches cut the groups apart
        agree = self.sharded and (mini_batches > 1 or -fsdp.max_over_ranks(-len(batch), self.device) == 0)
        self.runner.train()
        steps: list[tuple[dict[str, float], int, int]] = []  # each optimizer step's metrics, tokens and rows
        for _ in range(epochs):
            perm = torch.randperm(total, generator=generator).tolist() if mini_batches > 1 else list(range(total))
            for rows in minibatch_slices(total, mini_batches):
                sub = batch.select(minibatch_rows(perm, rows, offset, len(batch)))
                counts = self._global(sub.num_tokens, sub.num_seqs, sub.num_groups)
                partial = MetricSums(tuple(getattr(loss_fn, "summed", ())), with_reference)
                self._backward(sub, loss_fn, temperature, with_entropy, with_reference, counts, partial)
                metrics = partial.reduce(self.device, counts[0], counts[1], self.prefix, counted=self._counts_own,
                                         agree_names=agree)  # (a rank may hold none of a mini-batch's rows)
                steps.append((self._apply_gradients(metrics), counts[0], counts[1]))
        return finished(loss_fn, over_steps(steps, self.prefix, tuple(getattr(loss_fn, "summed", ()))))

    def _backward(self, sub: SequenceBatch, loss_fn: LossFn, temperature: float, with_entropy: bool | str,
                  with_reference: bool, counts: tuple[int, int, float], partial: MetricSums, *,
                  sync: bool = True) -> None:
        """Forward and backward of every micro-batch of ``sub``, gradients adding up in ``.grad``; the loss
        sees ``counts`` as ``(global_tokens, global_seqs, global_groups)``; its metrics go into ``partial``. Sharded: every
        rank runs as many passes as the busiest one (a collective), padding with zero-loss passes; the last
        pass reduces the gradients over ranks (``sync=False``: none does, :meth:`_sync_gradients` will)."""
        if with_reference and REF_FIELD in sub.fields:
            raise ValueError(f"with_reference computes {REF_FIELD!r}, and the batch carries them too: drop one")
        plan = self._plan(sub) if len(sub) else []
        # Agreed before any pass: a rank done with its own passes must not enter this all-reduce while another
        # is still in a pass's FSDP2 all-gather (the collectives would not match).
        passes = fsdp.max_over_ranks(len(plan), self.device) if self.sharded else len(plan)
        for i, item in enumerate(plan):
            self._grad_sync(sync and i == passes - 1)
            f = self._forward(sub, item, temperature, with_entropy, with_reference, balance=self._balance is not None)
            fields = {k: pad_field(v, f.rows, f.logprobs.shape[1], self.device) for k, v in sub.fields.items()}
            if f.ref is not None:
                fields[REF_FIELD] = f.ref
            f = with_loss_mask(f, fields)
            with deferred_metrics():  # no host read between passes: the metrics stay on the device until reduce
                loss, metrics = loss_fn(MicroBatch(f.logprobs, f.mask, fields, counts[0], counts[1], f.entropy,
                                              counts[2]))
                weight, seqs = metric_value(f.mask.sum()), metric_value((f.mask.sum(-1) > 0).sum())
                loss, metrics = self._with_balance(loss, metrics, f, counts[0])
            (loss * self.world if self.sharded else loss).backward()  # FSDP2 averages over ranks; we want the sum
            self._master_grads()
            if self.cfg.cuda_graphs and self.runner is self.model:  # a first gradient may be a graph's output,
                for p in self.model.parameters():  # which the next micro-batch's replay overwrites
                    if p.grad is not None:
                        p.grad = p.grad.clone()
            partial.add(metrics, weight, seqs, f.tokens, with_reference, f.routing_counts)
        if self.sharded:
            # Ranks with fewer micro-batches repeat one with a zero loss, so that FSDP2's collectives match up;
            # a rank with no rows (a streamed chunk can be empty) repeats a one-token row.
            pad_batch, pad_item = (sub, plan[-1]) if plan else self._one_token()
            for i in range(len(plan), passes):
                self._grad_sync(sync and i == passes - 1)
                lp = self._forward(pad_batch, pad_item, temperature, False, with_reference).logprobs
                (lp.sum() * 0.0).backward()

    def _one_token(self) -> tuple[SequenceBatch, list]:
        shape = self.routing.shape if self.routing is not None else None  # (routing replay: no route, its own)
        batch = SequenceBatch([torch.zeros(1, dtype=torch.long)], [torch.zeros(1, dtype=torch.long)],
                              routes=None if shape is None else [torch.zeros(0, shape.layers, shape.top_k)])
        return batch, self._plan(batch)[0]

    def _apply_gradients(self, metrics: dict[str, float]) -> dict[str, float]:
        """Clip, step (unless the norm is not finite), clear the gradients, advance the schedule; ``metrics``
        with the grad norm, learning rate and ``nonfinite_grad`` added."""
        experts = self.cfg.expert_group(self.world) > 1 and self.sharded
        if experts:  # (several expert groups: each expert shard's replicas sum their groups' gradients)
            expert_parallel.reduce_replicas(self.model)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.max_grad_norm
        norm = fsdp.clip_grad_norm(params, max_norm if max_norm is not None else float("inf"))
        metrics[f"{self.prefix}/grad_norm"] = norm
        if experts:
            load = expert_parallel.load_imbalance(self.model, self.device)
            if load is not None:
                metrics[f"{self.prefix}/expert_load_imbalance"] = load
        metrics[f"{self.prefix}/lr"] = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(norm):
            self.optimizer.step()
            self._refresh_copy()
            metrics[f"{self.prefix}/nonfinite_grad"] = 0.0
        else:
            metrics[f"{self.prefix}/nonfinite_grad"] = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # a skipped first step still counts; torch would call it a misordering
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`", UserWarning)
            self.scheduler.step()
        return metrics
