"""k-step off-policy: a rollout thread that runs up to ``k`` weight versions ahead of the trainer.

The delayed parameter update of AsyncFlow (TransferQueue, §4.2.2) and NeMo-RL's k-step asynchrony, on the
same step as the on-policy modes. Three kinds of driver threads share the dock (samples pass only through it)
and, under ``cond``, three fields: ``flows`` (open partitions, rollout -> trainer), ``packed`` (the newest
weights not applied yet, one slot, trainer -> rollout) and ``trained`` (the trainer's newest version)::

    trainer thread (the run loop: pipeline)        rollout thread "rollout-ahead" (_loop)
    for t = first, first+1, ...:                    for j = first, first+1, ...:
      f = take(t)  <--------- flows[t] ----------     _wait_turn(j): until trained >= j-1-k
      consume f: [reference, old, values,]            _Hold(engine); apply_packed()
        advantages, update per arriving group         flows[j] = open(j)   --> a trainer's take(j)
      pack_weights(v_t) --> packed, trained = t       start produce-j; wait until f.generated
      close partition t                                 |
    evaluate(t): holds engine between two batches    produce-j thread (one per batch, _produce_flow)
                                                        sample + score into partition j; gives the
                                                        engine back when generation ends, its last
                                                        rewards still landing; partial rollout:
                                                        apply_packed() between two decode steps

    who waits                     for                           unblocked by
    trainer, take(t)              flows[t]                      the rollout thread opening partition t
    trainer, consuming t          rows of partition t (dock)    produce-t writing them
    rollout, _wait_turn(j)        trained >= j-1-k              the trainer's pack_weights(j-1-k)
    rollout, _Hold(engine)        the engine                    an evaluation ending (batch j-1 gave it back)
    rollout, after open(j)        f.generated                   produce-j
    trainer, evaluate(t)          the engine                    the batch in flight's generation ending

Partition ``t`` is trained by weights ``v_{t-1}``. Each of its tokens was sampled by some ``v_g`` with
``g >= t-1-k`` (its batch started at a version >= t-1-k and versions only grow), so every token's staleness
``t-1-g`` is at most ``k`` (``async/staleness_*``, checked every step by
:func:`~relayrl.workflows.step_metrics.staleness_metrics`).

Weights: the trainer packs each version into host buffers (``WeightRelay.pack``; an actor in processes of
its own packs into shared memory, ``pack_from_group``, so the weights skip the driver) and goes on; this thread
applies the newest before each batch and, with partial rollout, while a batch generates (the rollout loads
it between two decode steps). A packed version replaced by a newer one before it was applied is discarded.
An evaluation holds the engine between two batches and evaluates the trainer's newest weights.

Checkpoints record the data position and sampler state at the start of batch ``t+1``, the first not trained
yet; a resumed run regenerates the batches that were in flight, with the checkpoint's (newer) weights.

Errors: a rollout that dies, or a producing stage that fails (also after generation ended), stops the
partitions in flight; the trainer raises the error instead of waiting, and a partition it was consuming
never reaches the optimizer step.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from relayrl.weights.relay import PackedWeights, WeightRelay
from relayrl.workflows.flow import Flow
from relayrl.workflows.rollout_worker import RolloutWorker
from relayrl.workflows.trainer_workers import PolicyWorker

__all__ = ["RolloutAhead"]


class _Hold:
    """One hold of the rollout engine's lock that any thread may give back, once."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock, self._mu = lock, threading.Lock()
        lock.acquire()
        self._held = True

    def release(self) -> None:
        with self._mu:
            if self._held:
                self._held = False
                self._lock.release()


class RolloutAhead:
    """The rollout thread and what it shares with the trainer (module docstring); ``cond`` guards every field
    but ``engine``."""

    def __init__(self, k: int, steps: range, *, open_flow: Callable[[int], Flow], produce: Callable[[Flow], None],
                 batch_start: Callable[[], tuple], relay: WeightRelay, rollout, partial: bool,
                 settle: bool = False) -> None:
        self.k, self.steps, self.partial, self.settle = k, steps, partial, settle
        self._open, self._produce, self._batch_start = open_flow, produce, batch_start
        self.relay, self.rollout = relay, rollout
        self.cond = threading.Condition()
        self.trained = steps.start - 1  # newest weights the trainer has packed
        self.rollout_version = steps.start - 1  # weights the rollout engine holds
        self.packed: PackedWeights | None = None  # newest packed version not applied yet
        self.flows: dict[int, Flow] = {}  # open partitions the trainer has not taken yet
        self.producing: list[Flow] = []
        self.starts: dict[int, tuple] = {}  # batch -> data position, sampler state (and reward moments) at its start
        self.relayed: dict[str, float] = {}  # relay metrics since the trainer's last step
        self.error: BaseException | None = None
        self.stopping = False
        self.engine = threading.Lock()  # the rollout engine: one batch's generation, or an evaluation
        self._thread = threading.Thread(target=self._loop, name="rollout-ahead", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- trainer
    def take(self, step: int) -> Flow:
        """Partition ``step``, once the rollout thread has opened it (raises the rollout's error)."""
        with self.cond:
            while step not in self.flows:
                self.raise_error()
                self.cond.wait(1.0)
            self.starts.pop(step, None)  # a checkpoint from now on records a later start
            return self.flows.pop(step)

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def pack_weights(self, version: int, actor) -> None:
        """The trainer's new weights into host buffers for the rollout thread; an older packed version it has
        not applied yet is dropped. An actor in processes of its own packs them straight into shared memory
        (its rank 0; the weights do not pass through the driver); else they are gathered here and packed."""
        # (the relay lets this thread pack while the rollout thread applies: neither waits for the other)
        packed = None if actor.in_driver else self.relay.pack_from_group(actor, PolicyWorker.pack_weights_into,
                                                                           version)
        if packed is None and actor.in_driver:  # packed as the stream comes (LoRA: merged a layer at a time)
            packed = self.relay.pack(actor.one(PolicyWorker.weight_stream), version)
        elif packed is None:  # every rank takes part (FSDP2 gathers a bucket at a time); rank 0 gets host copies
            packed = self.relay.pack(actor.all_rank0(PolicyWorker.relayed_weights), version)
        with self.cond:
            old, self.packed, self.trained = self.packed, packed, version
            self.cond.notify_all()
        if old is not None:
            self.relay.discard(old)

    def step_metrics(self) -> dict[str, float]:
        """The rollout's weight version and the relay metrics since the last call."""
        with self.cond:
            relayed, self.relayed = self.relayed, {}
            return {"async/rollout_version": float(self.rollout_version), **relayed}

    def start_of(self, step: int, timeout_s: float = 600) -> tuple:
        """The data position and sampler state at the start of batch ``step`` (waits for the rollout thread
        to start it; it may, as the trainer packed weights ``step-1``)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while step not in self.starts:
                self.raise_error()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"checkpoint: the rollout thread did not start batch {step} in {timeout_s:.0f} s")
                self.cond.wait(1.0)
            return self.starts[step]

    def evaluate(self, step: int, fn: Callable[[], dict]) -> dict:
        """``fn()`` with the rollout engine held between two batches and holding the trainer's weights ``step``."""
        with self.engine:
            self.apply_packed()
            if self.rollout_version != step:
                raise RuntimeError(f"evaluation at step {step}: the rollout engine holds weights {self.rollout_version}")
            return fn()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            flows = [*self.flows.values(), *self.producing]
            self.cond.notify_all()
        for f in flows:
            f.stop.set()
        self._thread.join(timeout=600)

    # ----------------------------------------------------------------- rollout
    def between_polls(self) -> None:
        """Partial rollout: weights packed since the batch started go to the rollout now."""
        if self.partial:
            self.apply_packed()

    def apply_packed(self) -> None:
        """The newest packed weights, if any, into every rollout rank (the caller holds the engine)."""
        with self.cond:
            packed, self.packed = self.packed, None
        if packed is None:
            return
        t0 = time.perf_counter()
        m = self.relay.apply_to_group(packed, self.rollout, RolloutWorker.receive_weights)
        with self.cond:
            self.rollout_version = packed.version
            self.relayed = {**m, "timing/relay_s": self.relayed.get("timing/relay_s", 0.0) + time.perf_counter() - t0}

    def _loop(self) -> None:
        """The rollout thread: each batch in turn, once the trainer is close enough (module docstring)."""
        try:
            for j in self.steps:
                if not self._wait_turn(j):
                    return
                self._generate(j)
        except BaseException as e:  # noqa: BLE001 - raised in the trainer's thread
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _wait_turn(self, j: int) -> bool:
        """Wait until batch ``j`` may start: it is trained by weights ``j-1`` and generated with weights
        ``>= j-1-k``, so the trainer must have packed ``j-1-k``. False when the run is stopping."""
        with self.cond:
            self.cond.wait_for(lambda: self.stopping or self.trained >= j - 1 - self.k)
            return not self.stopping

    def _generate(self, j: int) -> None:
        """Batch ``j``, the engine held: the newest weights applied, partition ``j`` opened for the trainer and
        its producing stages started on a thread of their own; returns once its generation ended (the next
        batch starts while its last rewards land)."""
        hold = _Hold(self.engine)
        try:
            self.apply_packed()
            if self.settle:  # state the earlier batches' scores add to (running reward moments): all of it in
                with self.cond:
                    earlier = list(self.producing)
                for x in earlier:
                    while not x.produced.wait(0.2):
                        if self.stopping or x.stop.is_set():
                            break
            with self.cond:
                self.starts[j] = self._batch_start()
                self.cond.notify_all()
            f = self._open(j)
            f.state.hold = hold
            with self.cond:
                self.flows[j] = f
                self.producing = [x for x in self.producing if not x.produced.is_set()] + [f]
                self.cond.notify_all()
            threading.Thread(target=self._produce_flow, args=(f,), name=f"produce-{j}", daemon=True).start()
            while not f.generated.wait(0.2):
                if f.stop.is_set():
                    raise f.errors[0] if f.errors else RuntimeError(f"batch {j} was stopped")
            if f.errors:
                raise f.errors[0]
        finally:
            hold.release()

    def _produce_flow(self, f: Flow) -> None:
        """A partition's producing stages on a thread of their own; an error stops the flow, and reaches the
        trainer (the flow's errors, and this object's error so the trainer stops waiting)."""
        try:
            self._produce(f)
        except BaseException as e:  # noqa: BLE001 - the trainer raises it
            with self.cond:
                if self.error is None and not self.stopping:
                    self.error = e
                self.cond.notify_all()
        finally:
            f.produced.set()
