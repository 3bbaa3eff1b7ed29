"""k-step off-policy GRPO / DAPO on the streaming dataflow: rollouts run ahead within a staleness bound.

Seed 002's delayed parameter update (section 4.2.2) and seed 004's k-step asynchrony, on the pipeline of
:mod:`relayrl.workflows.dataflow`. The rollout has a pool of its own; two threads of the driver share the
dock, and samples pass only through it::

    rollout thread                                   trainer (the run loop's thread)
    for j = first, first+1, ...:                     for t = first, first+1, ...:
        wait until trained >= j-1-k                      f <- partition t (waits until it is open)
        [take the rollout engine]                        consume f: [reference, old, values,] advantages,
        apply the newest staged weights                      update per arriving group (accumulated)
        open partition j; sample + score into it         stage weights v_t (WeightRelay.stage), trained = t
          partial: newer staged weights are applied      close partition t
          between two decode steps, in-flight rows
          prefilled again
        [give the engine back when generation ends;
         the next batch starts while its last rewards land]

Partition ``t`` is trained by weights ``v_{t-1}``. Each of its tokens was sampled by some ``v_g`` with
``g >= t-1-k`` (the batch started at a version >= t-1-k and versions only grow), so every token's staleness
``t-1-g`` is at most ``k``. Tokens carry ``g`` (``token_versions``) and their behaviour log-prob
(``gen_logprobs``); the step logs the distribution: ``async/staleness_mean`` and ``_max`` over tokens,
``async/tokens_stale_<s>`` (tokens at each staleness), and ``async/multi_version_frac`` (samples whose
tokens span several versions: partial rollout).

The update is decoupled PPO: ``pi_old`` is the trainer's weights ``v_{t-1}`` (with one update per batch,
the update's own forward pass, detached: no second pass), and ``algorithm.tis_cap`` weights each token's
loss by ``min(pi_old / mu, cap)``, ``mu`` the behaviour log-prob recorded when the token was sampled.

Weights: the trainer stages each version into host buffers (``WeightRelay.stage``) and goes on; the rollout
thread applies the newest (``WeightRelay.apply_to_group``) before each batch, and with ``rollout.partial``
also while a batch generates: the rollout worker loads it between two decode steps and prefills the rows in
flight again (see the native engine for why it re-prefills rather than keep the cache). A staged version
replaced by a newer one before it was applied is discarded. An evaluation takes the rollout engine only
between two batches (it waits for the batch being generated), applies the trainer's newest weights and
evaluates them, so it never changes the weights of a batch being generated.

Checkpoints record the data position and sampler state at the start of batch ``t+1``, the first not
trained yet; a resumed run regenerates the batches that were in flight, with the checkpoint's (newer)
weights: it continues the run but is not bit-identical to an uninterrupted one.

A rollout that dies (its process, or the rollout thread) stops the partitions in flight; the trainer
raises the error (a :class:`~relayrl.cluster.errors.WorkerError` names the rank) instead of waiting, and a
partition it was consuming never reaches the optimizer step (the accumulated gradients are dropped).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from pathlib import Path

from relayrl.config.schema import Config, offpolicy_placement
from relayrl.weights.relay import StagedWeights
from relayrl.workflows.dataflow import DataflowGRPO, Flow
from relayrl.workflows.grpo import KEY_METRICS
from relayrl.workflows.workers import collective, rollout_rng

__all__ = ["OffPolicyGRPO", "staleness_metrics"]


def staleness_metrics(versions: list[dict[int, int]], step: int, k: int) -> dict[str, float]:
    """The token staleness of a batch trained at ``step`` (by weights ``step-1``).

    Args:
        versions: per sample, ``{weight version: tokens it sampled}``.
    Returns ``async/staleness_mean`` and ``_max`` over tokens, ``async/tokens_stale_<s>`` for ``s`` in
    ``0..k``, and ``async/multi_version_frac``; raises when a token is staler than ``k`` (the bound is
    broken: a bug, never trained on silently)."""
    counts: Counter = Counter()
    for row in versions:
        for v, c in row.items():
            counts[step - 1 - int(v)] += int(c)
    tokens = sum(counts.values())
    worst = max(counts) if counts else 0
    if worst > k or (counts and min(counts) < 0):
        raise RuntimeError(f"step {step}: tokens sampled by weight versions {sorted(step - 1 - s for s in counts)} "
                           f"break the staleness bound k={k} (trainer weights {step - 1})")
    m = {"async/staleness_mean": sum(s * c for s, c in counts.items()) / max(1, tokens),
         "async/staleness_max": float(worst),
         "async/multi_version_frac": sum(len(r) > 1 for r in versions) / max(1, len(versions))}
    m.update({f"async/tokens_stale_{s}": float(counts.get(s, 0)) for s in range(k + 1)})
    return m


class _Turn:
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


class _Ahead:
    """What the rollout thread and the trainer share; ``cond`` guards every field but ``engine``."""

    def __init__(self, version: int) -> None:
        self.cond = threading.Condition()
        self.trained = version  # newest weights the trainer has staged
        self.rollout_version = version  # weights the rollout engine holds
        self.staged: StagedWeights | None = None  # newest staged version not applied yet
        self.flows: dict[int, Flow] = {}  # open partitions the trainer has not taken yet
        self.producing: Flow | None = None
        self.starts: dict[int, tuple[dict, list]] = {}  # data position and sampler state at a batch's start
        self.relayed: dict[str, float] = {}  # relay metrics since the trainer's last step
        self.error: BaseException | None = None
        self.stopping = False
        self.engine = threading.Lock()  # the rollout engine: one batch's generation, or an evaluation


class OffPolicyGRPO(DataflowGRPO):
    """GRPO/DAPO with rollouts up to ``trainer.off_policy_steps`` versions ahead (see the module docstring)."""

    def __init__(self, cfg: Config) -> None:
        placed = offpolicy_placement(cfg)
        if placed is not cfg:
            print(f"relayrl: off-policy: the rollout runs ahead on a pool of its own ({placed.placement.rollout!r}, "
                  f"1 device; name another with placement.pools and placement.rollout)", flush=True)
        super().__init__(placed)
        self.k = cfg.trainer.off_policy_steps
        self.partial = cfg.rollout.partial
        self._relay_lock = threading.Lock()  # WeightRelay is single-threaded; the two threads both use it
        self._ahead: _Ahead | None = None
        self._thread: threading.Thread | None = None

    def run(self) -> Path:
        """Session.run's loop; the rollout thread starts with the first step and stops before the export."""
        def export(path: str) -> None:
            self._stop_ahead()
            self.actor.all("save_pretrained", path)

        def shutdown() -> None:
            self._stop_ahead()
            self.shutdown()

        return self.s.run(restore=self.restore, step=self.step, evaluate=self.evaluate, save=self.save,
                          export=export, shutdown=shutdown, key_metrics=KEY_METRICS)

    # ------------------------------------------------------------------ trainer
    def step(self, step: int) -> dict[str, float]:
        """The trainer's step: consume partition ``step`` as its groups arrive, then stage the new weights."""
        if self._ahead is None:  # the steps left from here on, generated ahead within the staleness bound
            self._start_ahead(step)
        a = self._ahead
        t0 = time.perf_counter()
        self._phase_metrics = {}
        for g in self._groups():  # (an evaluation's completions since the last step are not samples)
            g.reset_bytes()
        with self.s.span("wait_rollout", "actor", step):
            f = self._take(step)
        waited = time.perf_counter() - t0
        with a.cond:  # a checkpoint from now on records a later start
            a.starts.pop(step, None)
        try:
            f.run(self.consume_stages())
            while not f.produced.wait(0.2):  # the score stage's last acknowledgements
                if a.error is not None:
                    raise a.error
        finally:
            self.dock.close_partition(f.part)
        metrics = self.step_metrics(f)
        with self.s.span("stage_weights", "actor", step):
            self._stage(step)
        metrics.update(staleness_metrics([v for i in self.kept_infos(f) for v in i["versions"]], step, self.k))
        with a.cond:
            relayed, a.relayed = a.relayed, {}
        metrics.update({"async/wait_rollout_s": waited, "async/rollout_version": float(a.rollout_version),
                        **relayed})
        return self.perf(metrics, t0, self.flow_tokens(f), step)

    def _take(self, step: int) -> Flow:
        a = self._ahead
        with a.cond:
            while step not in a.flows:
                if a.error is not None:
                    raise a.error
                a.cond.wait(1.0)
            return a.flows.pop(step)

    def _stage(self, version: int) -> None:
        """The trainer's new weights into host buffers, for the rollout thread to apply; an older staged
        version it has not applied yet is dropped."""
        with self._relay_lock:
            staged = self.relay.stage(collective(self.actor, "named_weights"), version)
        a = self._ahead
        with a.cond:
            old, a.staged, a.trained = a.staged, staged, version
            a.cond.notify_all()
        if old is not None:
            with self._relay_lock:
                self.relay.discard(old)

    # ------------------------------------------------------------ rollout thread
    def _start_ahead(self, step: int) -> None:
        self._steps = range(step, self.cfg.trainer.steps + 1)
        self._ahead = _Ahead(version=step - 1)
        self._thread = threading.Thread(target=self._rollout_loop, name="rollout-ahead", daemon=True)
        self._thread.start()

    def _rollout_loop(self) -> None:
        a = self._ahead
        try:
            for j in self._steps:
                with a.cond:  # batch j is trained by weights j-1; generate it with weights >= j-1-k
                    a.cond.wait_for(lambda: a.stopping or a.trained >= j - 1 - self.k)
                    if a.stopping:
                        return
                turn = _Turn(a.engine)
                try:
                    self._apply_staged()
                    with a.cond:
                        a.starts[j] = (self.s.prompts.state(), rollout_rng(self.rollout))
                        a.cond.notify_all()
                    f = self.open_step(j)
                    f.state["turn"] = turn
                    with a.cond:
                        a.flows[j], a.producing = f, f
                        a.cond.notify_all()
                    # the next batch starts when this one's generation ends; its last rewards land meanwhile
                    threading.Thread(target=self._produce, args=(f,), name=f"produce-{j}", daemon=True).start()
                    while not f.generated.wait(0.2):
                        if f.stop.is_set():
                            raise f.errors[0] if f.errors else RuntimeError(f"batch {j} was stopped")
                    if f.errors:
                        raise f.errors[0]
                finally:
                    turn.release()
        except BaseException as e:  # noqa: BLE001 - raised in the trainer's thread
            with a.cond:
                a.error = e
                a.cond.notify_all()

    def _produce(self, f: Flow) -> None:
        """A partition's producing stages, on a thread of their own. An error stops the flow and stays in
        ``f.errors``: the rollout loop raises it if generation had not ended, the trainer's run of the
        partition's consuming stages raises it otherwise."""
        with contextlib.suppress(BaseException):
            f.run(self.produce_stages())
        f.produced.set()

    def sample(self, f: Flow) -> None:
        """The dataflow's sample stage; the rollout engine is given back as soon as generation ends."""
        try:
            super().sample(f)
        finally:
            f.state["turn"].release()

    def _while_generating(self, f: Flow) -> None:
        """Partial rollout: weights staged since the batch started go to the rollout now (its ranks load them
        between two decode steps)."""
        if self.partial:
            self._apply_staged()

    def _apply_staged(self) -> None:
        """The newest staged weights, if any, into every rollout rank (the caller holds the engine)."""
        a = self._ahead
        with a.cond:
            staged, a.staged = a.staged, None
        if staged is None:
            return
        t0 = time.perf_counter()
        with self._relay_lock:
            m = self.relay.apply_to_group(staged, self.rollout, "receive_weights")
        with a.cond:
            a.rollout_version = staged.version
            a.relayed = {**m, "timing/relay_s": a.relayed.get("timing/relay_s", 0.0) + time.perf_counter() - t0}

    def _stop_ahead(self) -> None:
        a = self._ahead
        if a is None:
            return
        with a.cond:
            a.stopping = True
            flows = [*a.flows.values(), *([a.producing] if a.producing is not None else [])]
            a.cond.notify_all()
        for f in flows:
            f.stop.set()
        if self._thread is not None:
            self._thread.join(timeout=600)

    # ------------------------------------------------------------ eval and state
    def evaluate(self, step: int) -> dict[str, float]:
        a = self._ahead
        if a is None:  # before the rollout thread: the engine is free
            return super().evaluate(step)
        with a.engine:  # between two batches: the newest staged weights (the trainer's) go in first
            self._apply_staged()
            if a.rollout_version != step:
                raise RuntimeError(f"evaluation at step {step}: the rollout engine holds weights {a.rollout_version}")
            return super().evaluate(step)

    def save(self, step: int) -> Path:
        # The data position and sampler state at the start of batch step+1, the first not trained yet. The
        # rollout thread is allowed to start it (the trainer staged version `step` >= step+1-1-k), so it will.
        a = self._ahead
        if a is not None and step + 1 in self._steps:
            deadline = time.monotonic() + 600
            with a.cond:
                while step + 1 not in a.starts:
                    if a.error is not None:
                        raise a.error
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"checkpoint at step {step}: the rollout thread did not start batch "
                                           f"{step + 1} in 600 s")
                    a.cond.wait(1.0)
                data, rng = a.starts[step + 1]
        else:  # the last step: nothing runs ahead any more
            data, rng = self.s.prompts.state(), rollout_rng(self.rollout)
        with self.s.span("checkpoint", "driver", step):
            return self.s.save(step, collective(self.actor, "state"), extra_state={"rollout_rng": rng, "data": data},
                               extra=self.extra_state())
