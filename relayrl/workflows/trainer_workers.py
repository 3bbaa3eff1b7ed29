"""Trainer-side worker roles: each owns one training engine; none knows which algorithm runs.

* :class:`PolicyWorker`  - the actor: a training engine (log-probs, updates, weights).
* :class:`CriticWorker` - PPO's critic: the same engine on a value-head model (values, updates).
* :class:`RewardModelTrainer` - ``workflow: rm``: the critic's engine on a reward model (scores, updates,
  saved as a Hugging Face sequence classifier).
* :class:`ReferenceWorker` - a frozen copy of the initial policy for KL, on its own (the tri-model
  keeps it inside the actor instead: ``PolicyWorker(tri_model=True)``, Periodic Asynchrony §4.1).

The rollout is :class:`relayrl.workflows.rollout_worker.RolloutWorker`. Workers are started by
:class:`relayrl.cluster.WorkerGroup` on a resource pool; the driver calls their methods by reference
(``group.split(PolicyWorker.update, ...)``). In a multi-rank group the actor, critic and reference shard their
model with FSDP2, so the driver calls their state and weight methods on every rank and keeps rank 0's answer
(``group.all_rank0(PolicyWorker.state)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from relayrl.cluster import Worker
from relayrl.engines.training import fsdp
from relayrl.engines.training.base import REF_FIELD, LossFn, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.models import lora as lora_lib
from relayrl.models.export import export_dtype as resolve_export_dtype, save_model
from relayrl.models.routing import ROUTES_COLUMN
from relayrl.models.load import check_loaded, load_model, load_tokenizer, load_value_model, progress_bars, resolve_dtype
from relayrl.weights import WeightStream, gather_full_state, stream_full_state
from relayrl.weights.shm import pack_into_shared
from relayrl.workflows.worker_base import MemoryProbe, resolve_device, set_threads

__all__ = ["rows_batch", "PolicyWorker", "CriticWorker", "RewardModelTrainer", "ReferenceWorker"]


def rows_batch(cols: dict[str, list], fields: Sequence[str] = (), drop_truncated: bool = False) -> SequenceBatch:
    """Rows read from the dock as a :class:`SequenceBatch` (``groups`` from the ``group`` column);
    ``drop_truncated``: without the rows cut at ``max_new_tokens`` (DAPO's overlong filter)."""
    batch = SequenceBatch(cols["prompt_ids"], cols["response_ids"], {f: cols[f] for f in fields},
                          [int(g) for g in cols["group"]], cols.get(ROUTES_COLUMN))  # (MoE routing replay)
    if drop_truncated:
        batch = batch.select([i for i, t in enumerate(cols["truncated"]) if not bool(t)])
    return batch


def _dock_rows(items: Sequence, fields: Sequence[str] = (), drop_truncated: bool = False):
    """This rank's rows and the slots for its outputs, from ``items``: its ``(reader, slots)`` pair
    (``group.split`` hands each rank its own). An empty batch when the driver gave it none (a chunk of fewer
    groups than ranks: the engine still joins the group's collectives)."""
    (reader, slots), = items
    if reader is None:
        return SequenceBatch([], [], {f: [] for f in fields}, []), None
    return rows_batch(reader.read(), fields, drop_truncated), slots


def _written(slots, columns: dict) -> list:
    """The write receipt of ``columns`` in this rank's ``slots`` (a list, for ``group.split``); none when the
    driver gave the rank no rows (its pass joined the collectives only)."""
    return [] if slots is None else [slots.write(columns)]


class _TrainerWorker(MemoryProbe, Worker):
    """A trained model behind a training engine: updates, checkpoint state (shared by actor and critic).

    In a GRPO-family step every call reads its rows from the dock (``items``: this rank's reader and slots)::

        forward_into(items, column)         a forward-only pass, its output written into ``column``
        forward_backward(items, loss, ...)  forward + backward, gradients accumulated (``fresh``: the first
                                            chunk of an update, older gradients dropped)
        optim_step()                        the optimizer step over what was accumulated
        train_batch(items, loss, ...)       mini-batches x epochs optimizer steps on the rows

    Whole batch or accumulated per arriving group is the caller's choice; both are the same update.
    """

    engine: TorchTrainingEngine

    tri_model = False
    """Whether the engine holds a frozen reference copy and fills ``ref_logprobs`` in place (PolicyWorker)."""

    peft_model = None
    """The ``peft.PeftModel`` around the engine's model when ``model.lora.enabled`` (adapters trained, base
    frozen; :mod:`relayrl.models.lora`), else None."""

    def _start(self, load, model_path: str, engine: TrainEngineConfig, total_steps: int, *, dtype: str, device: str,
               attn_implementation: str, threads: int, seed: int, compute_dtype: str | None = None,
               lora: lora_lib.LoraConfig | None = None, head_fp32: bool = False, **engine_kwargs) -> None:
        set_threads(threads, self)
        torch.manual_seed(seed)
        dev = resolve_device(device, getattr(self, "device", None))
        model = load(model_path, dtype=dtype, device=dev, attn_implementation=attn_implementation)
        if lora is not None and lora.enabled:  # a critic's value head (fresh, zero) trains in full
            head = (model.get_output_embeddings(),) if engine_kwargs.get("output") == "values" else ()
            self.peft_model = lora_lib.apply_lora(model, lora, trainable=head)
        reference = None
        if self.tri_model and self.peft_model is None:  # the initial policy again, in the compute dtype
            reference = load_model(model_path, dtype=compute_dtype or dtype, device=dev,
                                   attn_implementation=attn_implementation)
        self.engine = TorchTrainingEngine(model, engine, total_steps=total_steps, device=dev,
                                          compute_dtype=resolve_dtype(compute_dtype or dtype), reference=reference,
                                          reference_adapters_off=self.tri_model and self.peft_model is not None,
                                          head_fp32=head_fp32, **engine_kwargs)

    def _in_place_reference(self, batch: SequenceBatch) -> bool:
        """Tri-model: the update computes the reference log-probs unless the batch already carries them."""
        return self.tri_model and REF_FIELD not in batch.fields

    def update(self, batch: SequenceBatch, loss_fn: LossFn, *, mini_batches: int = 1, epochs: int = 1,
               temperature: float = 1.0, with_entropy: bool | str = False, seed: int = 0) -> dict[str, float]:
        """Epochs x mini-batches optimizer steps. Tri-model, batch without ``ref_logprobs``: every
        micro-batch also runs the reference (once per epoch: with several, pass them from ``logprobs(...,
        with_reference=True)`` instead)."""
        gen = torch.Generator().manual_seed(seed)
        return self.engine.train_step(batch, loss_fn, mini_batches=mini_batches, epochs=epochs,
                                      temperature=temperature, with_entropy=with_entropy,
                                      with_reference=self._in_place_reference(batch), generator=gen)

    def forward_backward(self, items: Sequence, loss_fn: LossFn, fields: Sequence[str], *, fresh: bool = False,
                         drop_truncated: bool = False, temperature: float = 1.0,
                         with_entropy: bool | str = False) -> list[int]:
        """Forward and backward on this rank's rows from the dock, gradients accumulated for :meth:`optim_step`;
        ``fresh``: start a new update (gradients of an unfinished one are dropped). Returns the rows trained."""
        batch, _ = _dock_rows(items, fields, drop_truncated)
        self.accumulate(batch, loss_fn, fresh=fresh, temperature=temperature, with_entropy=with_entropy)
        return [len(batch)]

    def optim_step(self) -> dict[str, float]:
        """The optimizer step over the chunks given to :meth:`forward_backward` (or :meth:`accumulate`); the
        metrics ``update`` returns for the whole batch (every rank: the global figures)."""
        return self.engine.finish_accumulation()

    def train_batch(self, items: Sequence, loss_fn: LossFn, fields: Sequence[str], *, drop_truncated: bool = False,
                    **kwargs) -> dict[str, float]:
        """:meth:`update` (mini-batches x epochs optimizer steps) on this rank's rows from the dock; its metrics
        (every rank: the global figures, so the driver keeps rank 0's: ``group.split_rank0``)."""
        batch, _ = _dock_rows(items, fields, drop_truncated)
        return self.update(batch, loss_fn, **kwargs)

    def accumulate(self, batch: SequenceBatch, loss_fn: LossFn, *, fresh: bool = False, temperature: float = 1.0,
                   with_entropy: bool | str = False) -> None:
        """Forward + backward of a chunk of the batch (e.g. the prompt groups finished so far), gradients
        accumulated (:mod:`relayrl.engines.training.accumulate`). Every rank gets the same number of calls;
        a rank's chunk may be empty. Tri-model: the reference log-probs are computed in place (the chunk must
        then not carry them: all chunks of one update, empty ones included, have the same fields). ``fresh``:
        the first chunk of an update (gradients of an unfinished one are dropped)."""
        if fresh:
            self.engine.begin_accumulation()
        self.engine.accumulate(batch, loss_fn, temperature=temperature, with_entropy=with_entropy,
                               with_reference=self._in_place_reference(batch))

    def state(self) -> dict | None:
        """Full model, optimizer and scheduler state (collective when sharded; None on ranks > 0). LoRA: the
        model state holds the trained parameters only (the adapters; a critic's head), as does the optimizer."""
        keep = self._checkpointed()
        state = self.engine.state(trainable_only=keep is not None)  # LoRA: the frozen base is not gathered
        if keep is not None:
            state["model"] = {k: v for k, v in state["model"].items() if k in keep}
        return state if getattr(self, "rank", 0) == 0 else None

    def load_state(self, state: dict) -> None:
        """Load a checkpoint's state (every rank gets the full state and keeps its shard)."""
        keep = self._checkpointed()
        if keep is not None and state.get("model") is not None:  # before the optimizer state meets it
            extra = sorted(set(state["model"]) - keep)
            if extra:
                raise ValueError(f"checkpoint does not match the LoRA model (model.lora.enabled): unexpected "
                                 f"{extra[:5]}; a LoRA checkpoint holds the adapters only")
        missing, unexpected = self.engine.load_state(state)
        if keep is not None:  # the frozen base comes from the model path, not the checkpoint
            missing = [m for m in missing if m in keep]
        check_loaded("checkpoint", missing, unexpected)

    def footprint(self) -> dict[str, float]:
        """The model's total and trainable parameters and this rank's optimizer state in bytes."""
        return self.engine.footprint()

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of what a checkpoint of this model holds (LoRA: the trained parameters only)."""
        shapes = {n: tuple(t.shape) for n, t in self.engine.model.state_dict().items()}
        keep = self._checkpointed()
        return shapes if keep is None else {n: s for n, s in shapes.items() if n in keep}

    def _checkpointed(self) -> set[str] | None:
        """LoRA: the names a checkpoint holds (the trained parameters: adapters, a critic's head); None: the
        whole model state."""
        return None if self.peft_model is None else set(lora_lib.trainable_names(self.engine.model))

    def offload(self, weights: bool = True) -> float:
        """Optimizer state (and weights, unless a colocated rollout reads them) to host; seconds taken."""
        return self.engine.offload(weights=weights)

    def reload(self) -> float:
        return self.engine.reload()


class PolicyWorker(_TrainerWorker):
    """The actor: trains the policy and serves its weights to the relay.

    ``tri_model=True`` (Periodic Asynchrony §4.1): the actor also holds the reference policy, a frozen copy of
    the initial weights loaded from ``model_path`` in the compute dtype, on the same device and sharded like
    the actor, without optimizer or gradients; it follows :meth:`offload` / :meth:`reload`. An update (or a
    streamed chunk) whose batch has no ``ref_logprobs`` then runs the reference on each micro-batch's packed
    input under ``no_grad`` and hands the loss its log-probs (no separate reference worker, phase or
    packing); the old policy is the detached current one when there is one update per batch (the loss's
    default). The metrics ``actor/ref_forward_passes`` / ``actor/ref_forward_tokens`` count these
    reference passes: each is a pass the separate reference phase no longer makes.
    """

    def __init__(self, model_path: str, engine: TrainEngineConfig, total_steps: int, *, dtype: str = "float32",
                 compute_dtype: str | None = None, device: str = "auto", attn_implementation: str = "sdpa",
                 threads: int = 0, seed: int = 0, tri_model: bool = False, lora: lora_lib.LoraConfig | None = None,
                 chat_template: str | None = None, head_fp32: bool = False, routing_replay: bool = False,
                 routing_compare: bool = False, export_dtype: str = "auto", relay_adapter: bool = False) -> None:
        self.tri_model = tri_model
        self.relay_adapter = relay_adapter  # (rollout.lora_sync=adapter: the relay sends the adapters alone)
        self.export_dtype = resolve_export_dtype(export_dtype, model_path)  # (model.export_dtype: auto is the
        # checkpoint's own)
        self._start(load_model, model_path, engine, total_steps, dtype=dtype, compute_dtype=compute_dtype,
                    device=device, attn_implementation=attn_implementation, threads=threads, seed=seed, lora=lora,
                    head_fp32=head_fp32, routing_replay=routing_replay, routing_compare=routing_compare)
        self.tokenizer = load_tokenizer(model_path, chat_template=chat_template)  # saved with the model

    def logprobs(self, batch: SequenceBatch, temperature: float = 1.0, with_reference: bool = False):
        """Per-row response log-probs (a list, so ``group.split`` concatenates ranks' results).
        ``with_reference`` (tri-model): ``(policy, reference)`` log-probs, both from one micro-step per
        micro-batch, e.g. the old and reference log-probs before several updates per batch (``group.split``
        then gives each rank's pair)."""
        if with_reference:
            return self.engine.logprobs_with_reference(batch, temperature=temperature)
        return self.engine.logprobs(batch, temperature=temperature)[0]

    def forward_into(self, items: Sequence, column: str, temperature: float = 1.0, sum_sq_column: str = "",
                     routes_column: str = "") -> list:
        """Log-probs of this rank's dock rows (pi_old) into ``column`` (and each position's ``sum_v p_v^2``, from
        the same pass, into ``sum_sq_column`` when named: the Optimal Token Baseline's; the experts its routers
        chose for every token into ``routes_column`` when named: routing replay of the old policy); the write
        receipt."""
        batch, slots = _dock_rows(items)
        if routes_column:
            lp, routes, sq = self.engine.logprobs_with_routes(batch, temperature=temperature,
                                                              with_sum_sq=bool(sum_sq_column))
            return _written(slots, {column: lp, routes_column: routes,
                                    **({sum_sq_column: sq} if sum_sq_column else {})})
        if not sum_sq_column:
            return _written(slots, {column: self.logprobs(batch, temperature)})
        lp, sq = self.engine.logprobs_with_sum_sq(batch, temperature=temperature)
        return _written(slots, {column: lp, sum_sq_column: sq})

    def named_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """The model's weights whole (checkpoints, exports, the reference's sync). Sharded: a collective;
        rank 0 gets host copies (its device holds one gathered bucket at a time), the others None. Unsharded:
        the live parameters, no copy. LoRA: the merged weights ``W + scale * B @ A``, base names."""
        return self._whole(self._stream(adapter=False))

    def relayed_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """:meth:`weight_stream` whole (a relay over Ray or pipes), as :meth:`named_weights` gathers."""
        return self._whole(self.weight_stream())

    def weight_stream(self) -> WeightStream:
        """The weights to relay as a stream: their names, shapes and dtypes now, their full values one at a
        time (sharded: gathered a bucket at a time, a collective every rank reads to its end; LoRA: each
        adapted layer merged when its turn comes, or with ``rollout.lora_sync=adapter`` the adapters' ``A`` and
        ``B`` alone, peft's names). A relay packs them, or an engine loads them, as they come."""
        return self._stream(adapter=self.relay_adapter)

    def _stream(self, adapter: bool) -> WeightStream:
        m = self.engine.model
        if self.peft_model is None:
            held, values = self.engine.named_weights(), None
        elif adapter:
            held, values = lora_lib.adapter_weights(m), None
        else:
            held, values = lora_lib.base_weights(m), lora_lib.iter_merged_weights(m)  # sharded: merged rows
        return WeightStream(held, stream_full_state(values or held) if self.engine.sharded else values)

    def _whole(self, w: WeightStream) -> list[tuple[str, torch.Tensor]] | None:
        if not self.engine.sharded:
            return list(w)
        return [(n, t.cpu()) for n, t in w] if self.rank == 0 else gather_full_state(w.values, keep=False)

    def mix_reference(self, alpha: float) -> None:
        """Tri-model, ``trainer.ref_sync_every``: reference <- ``alpha`` x policy + (1 - alpha) x reference."""
        self.engine.mix_reference(alpha)

    def reference_state(self) -> dict | None:
        """Tri-model: the reference copy's full weights for a checkpoint (collective; None on ranks > 0)."""
        state = fsdp.full_model_state(self.engine.reference_model)
        return state if getattr(self, "rank", 0) == 0 else None

    def load_reference_state(self, state: dict) -> None:
        check_loaded("checkpoint's reference", *fsdp.load_full_state(self.engine.reference_model, state))

    def pack_weights_into(self, handles, key: str | None, bucket_bytes: int) -> dict | None:
        """:meth:`weight_stream` packed by rank 0 straight into the driver's shared-memory buckets (every rank
        must call this; see :meth:`relayrl.weights.WeightRelay.push_from_group`); the other ranks return None."""
        w, rank0 = self.weight_stream(), getattr(self, "rank", 0) == 0  # (each rank holds one bucket at a time)
        res = pack_into_shared(w.held, handles, key, bucket_bytes, self.__dict__.setdefault("_relay_shm", {}),
                               values=w.values, write=rank0)
        return res if rank0 else None

    def save_pretrained(self, path: str) -> None:
        """Save the model as a Hugging Face directory in ``model.export_dtype`` (:mod:`relayrl.models.export`;
        collective when sharded; rank 0 writes). LoRA: the merged model there (base names, loads like any model)
        and the adapter alone in ``path/adapter`` (peft's format: ``adapter_config.json``,
        ``adapter_model.safetensors``)."""
        if self.peft_model is not None:
            merged, adapter = self.named_weights(), self.engine.state(trainable_only=True)["model"]
            full = None if merged is None else {n: t.detach().cpu().clone() for n, t in merged}
        else:
            full = fsdp.full_model_state(self.engine.model)
        if getattr(self, "rank", 0) != 0:
            return
        Path(path).mkdir(parents=True, exist_ok=True)
        with progress_bars(sum(t.numel() * t.element_size() for t in full.values())):
            save_model(self.engine.model, full, path, self.export_dtype)
        self.tokenizer.save_pretrained(path)
        if self.peft_model is not None:
            # (the adapters' full values: under FSDP2 the peft model's own state dict holds row shards)
            self.peft_model.save_pretrained(str(Path(path) / "adapter"),
                                            state_dict={f"base_model.model.{n}": t for n, t in adapter.items()})


class CriticWorker(_TrainerWorker):
    """The critic of PPO: the policy's network with a scalar value head, trained on GAE returns."""

    def __init__(self, model_path: str, engine: TrainEngineConfig, total_steps: int, *, dtype: str = "float32",
                 compute_dtype: str | None = None, device: str = "auto", attn_implementation: str = "sdpa",
                 threads: int = 0, seed: int = 0, lora: lora_lib.LoraConfig | None = None,
                 head_fp32: bool = False) -> None:  # (model.head_fp32 is for LM heads: a value head stays as it is)
        self._start(load_value_model, model_path, engine, total_steps, dtype=dtype, compute_dtype=compute_dtype,
                    device=device, attn_implementation=attn_implementation, threads=threads, seed=seed,
                    lora=lora, output="values", metric_prefix="critic")

    def values(self, batch: SequenceBatch) -> list[torch.Tensor]:
        """Per-row values ``V(s_t)`` of the response positions (a list, for ``group.split``)."""
        return self.engine.logprobs(batch)[0]

    def forward_into(self, items: Sequence, column: str = "values") -> list:
        """Values of this rank's dock rows into ``column``; the write receipt."""
        batch, slots = _dock_rows(items)
        return _written(slots, {column: self.values(batch)})


class RewardModelTrainer(_TrainerWorker):
    """A reward model in training (``workflow: rm``): the policy's network with a scalar head without bias
    (:func:`relayrl.models.load.load_value_model`), trained on preference pairs; exported as a one-label
    sequence classifier (:mod:`relayrl.models.reward`)."""

    def __init__(self, model_path: str, engine: TrainEngineConfig, total_steps: int, *, dtype: str = "float32",
                 compute_dtype: str | None = None, device: str = "auto", attn_implementation: str = "sdpa",
                 threads: int = 0, seed: int = 0, chat_template: str | None = None,
                 head_fp32: bool = False, export_dtype: str = "auto") -> None:  # (model.head_fp32 is for LM heads:
        from functools import partial  # a value head stays as it is)

        self.export_dtype = resolve_export_dtype(export_dtype, model_path)  # (as a policy's: model.export_dtype)
        self._start(partial(load_value_model, bias=False), model_path, engine, total_steps, dtype=dtype,
                    compute_dtype=compute_dtype, device=device, attn_implementation=attn_implementation,
                    threads=threads, seed=seed, output="values", metric_prefix="rm")
        self.tokenizer = load_tokenizer(model_path, chat_template=chat_template)

    def values(self, batch: SequenceBatch) -> list[torch.Tensor]:
        """Per-row values of the response positions (a row's score is the last one), a list for ``split``."""
        return self.engine.logprobs(batch)[0]

    def save_pretrained(self, path: str) -> None:
        """Save as a Hugging Face ``*ForSequenceClassification`` in ``model.export_dtype`` (collective when
        sharded; rank 0 writes)."""
        from relayrl.models.reward import export_reward_model

        full = fsdp.full_model_state(self.engine.model)
        if getattr(self, "rank", 0) == 0:
            export_reward_model(self.engine.model, self.tokenizer, path, state_dict=full, dtype=self.export_dtype)


class ReferenceWorker(MemoryProbe, Worker):
    """Frozen reference policy: log-probs only."""

    def __init__(self, model_path: str, engine: TrainEngineConfig, *, dtype: str = "float32", device: str = "auto",
                 attn_implementation: str = "sdpa", threads: int = 0, head_fp32: bool = False) -> None:
        set_threads(threads, self)
        dev = resolve_device(device, getattr(self, "device", None))
        model = load_model(model_path, dtype=dtype, device=dev, attn_implementation=attn_implementation)
        self.engine = TorchTrainingEngine(model, engine, total_steps=1, device=dev, trainable=False,
                                          head_fp32=head_fp32)

    def logprobs(self, batch: SequenceBatch, temperature: float = 1.0):
        return self.engine.logprobs(batch, temperature=temperature)[0]

    def mix_weights(self, named, alpha: float) -> None:
        """``trainer.ref_sync_every``: ``alpha`` x ``named`` (the actor's weights) + (1 - alpha) x itself."""
        self.engine.mix_weights(named, alpha)

    def state(self) -> dict | None:
        """The reference's full weights for a checkpoint of a run that moves them (None on ranks > 0)."""
        state = fsdp.full_model_state(self.engine.model)
        return state if getattr(self, "rank", 0) == 0 else None

    def load_state(self, state: dict) -> None:
        """Load :meth:`state`'s weights (every rank gets the full state and keeps its shard)."""
        check_loaded("checkpoint's reference", *self.engine.load_state({"model": state}))

    def forward_into(self, items: Sequence, column: str, temperature: float = 1.0) -> list:
        """Reference log-probs of this rank's dock rows into ``column``; the write receipt."""
        batch, slots = _dock_rows(items)
        return _written(slots, {column: self.logprobs(batch, temperature)})

    def offload(self) -> float:
        """Weights to host while the reference is idle; seconds taken."""
        return self.engine.offload()

    def reload(self) -> float:
        return self.engine.reload()
