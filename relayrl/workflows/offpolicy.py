"""k-step off-policy GRPO / DAPO: rollouts run ahead of the trainer, with a staleness bound.

Seed 002's delayed parameter update and seed 004's k-step asynchrony. The
rollout group gets its own resource pool (split placement), and a rollout
thread in the driver generates and scores batch ``j`` while the trainer
updates on earlier batches::

    rollout thread                               trainer (driver main thread)
    for j = 1, 2, ...:                           for t = 1, 2, ...:
        wait until trained version >= j-1-k          batch <- batch t (wait if not ready)
        swap in the newest staged weights            learn(batch)          -> weights v_t
        batch j <- generate + score                  stage v_t in host memory
                                                     (the rollout swaps it in before
                                                      its next generation)

Batch ``t`` is trained by weights ``v_{t-1}``; it was generated with some
``v_g``, ``g >= t-1-k``: the **staleness** ``t-1-g`` is at most ``k`` (logged
as ``async/staleness``). ``trainer.off_policy_steps=0`` runs the synchronous
workflow instead (``grpo.py``).

The update is decoupled PPO: ``pi_old`` is recomputed by the trainer before
the update (the ratio is clipped against the trainer's weights, not the stale
rollout's), and ``algorithm.tis_cap`` adds truncated importance weights
``min(pi_old / mu, cap)`` for the rollout policy ``mu``.

Weights are copied out of the trainer after each update (host memory) and
pushed into the rollout engine by the rollout thread between two batches,
never during one (a DAPO batch may take several generation rounds). An
evaluation takes the rollout engine between two batches too
(``RolloutAhead.hold_engine``): it waits for the batch in progress, swaps in
the newest staged weights (the trainer's current ones) and evaluates them, so
a batch never mixes weight versions and the next batch's ``async/staleness``
counts from the evaluated version. Checkpoints record the data position and sampler state at the start
of the first batch not yet trained, so a resumed run regenerates the batches
that were in flight, with the checkpoint's (newer) weights: it continues the
run but is not bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from relayrl.cluster import ClusterConfig, ResourcePool
from relayrl.config.schema import Config
from relayrl.workflows.grpo import KEY_METRICS, GRPOWorkflow
from relayrl.workflows.relay import relay_weights
from relayrl.workflows.workers import collective, rollout_rng

__all__ = ["OffPolicyGRPO", "RolloutAhead", "rollout_gpu"]


class RolloutAhead:
    """The rollout thread: generates batches ahead of the trainer within the staleness bound ``k``.

    ``produce(step)`` is called on the thread for each step (it returns what
    the trainer needs); ``push(version, weights)`` is called on the thread to
    swap in staged weights. The trainer calls ``take(step)`` and ``stage``.
    """

    def __init__(self, produce, push, steps: range, k: int, version: int) -> None:
        self._produce, self._push, self.k = produce, push, k
        self._cond = threading.Condition()
        self._trained = version  # newest weights the trainer has staged
        self._staged: tuple[int, Any] | None = None
        self.rollout_version = version  # weights the rollout engine holds
        self._ready: dict[int, tuple[Any, int]] = {}
        # Held by whoever uses the rollout engine: the thread for one batch (push + every generation round of
        # it), or the trainer for an evaluation. Weights change only while it is held, never inside a batch.
        self._engine = threading.Lock()
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, args=(steps,), name="rollout-ahead", daemon=True)
        self._thread.start()

    def _run(self, steps: range) -> None:
        try:
            for j in steps:
                with self._cond:
                    # Batch j is trained at version j-1; generate it with version >= j-1-k.
                    self._cond.wait_for(lambda: self._stop or self._trained >= j - 1 - self.k)
                    if self._stop:
                        return
                with self._engine:
                    self._swap_in_staged()
                    out = self._produce(j)
                    version = self.rollout_version
                with self._cond:
                    self._ready[j] = (out, version)
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised in the trainer by take()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _swap_in_staged(self) -> None:
        """Push the newest staged weights, if any, into the rollout engine (holding ``_engine``)."""
        with self._cond:
            staged, self._staged = self._staged, None
        if staged is not None:
            self._push(*staged)
            self.rollout_version = staged[0]

    @contextlib.contextmanager
    def hold_engine(self):
        """The rollout engine for the trainer's thread (an evaluation), with the newest staged weights in it;
        waits for the batch being generated to finish, and the rollout thread waits meanwhile. Yields the
        version the engine holds."""
        with self._engine:
            self._swap_in_staged()
            yield self.rollout_version

    def take(self, step: int) -> tuple[Any, int]:
        """Batch ``step`` and the weight version that generated it (waits for it)."""
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready or self._error is not None)
            if step not in self._ready:
                raise RuntimeError(f"the rollout thread failed before batch {step}") from self._error
            return self._ready.pop(step)

    @property
    def failed(self) -> bool:
        return self._error is not None

    def stage(self, version: int, weights: Any) -> None:
        """New trainer weights (host copies): swapped into the rollout engine before its next generation."""
        with self._cond:
            self._trained = version
            self._staged = (version, weights)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=600)


def rollout_gpu(count: int, used: list[int]) -> int:
    """The GPU index for the off-policy rollout on a machine with ``count`` GPUs, ``used`` by the trainer's
    pool: the lowest one the trainer does not use, so generation overlaps training instead of time-sharing
    a device; the last GPU (shared with the trainer) when every GPU is in use."""
    if count < 1:
        raise ValueError("a CUDA pool on a machine that torch sees no GPU on")
    free = [i for i in range(count) if i not in set(used)]
    return free[0] if free else count - 1


def _host_copy(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Detached CPU copies: the trainer may change its tensors while the rollout waits to load them."""
    return [(n, t.detach().to("cpu", copy=True)) for n, t in named]


class OffPolicyGRPO(GRPOWorkflow):
    """GRPO/DAPO with rollouts up to ``trainer.off_policy_steps`` updates ahead (see the module docstring)."""

    def __init__(self, cfg: Config) -> None:
        if cfg.run.threads == 0 and cfg.model.device != "cuda" and not torch.cuda.is_available():
            # Trainer and rollout compute at the same time: split the cores instead of oversubscribing them
            # (2 x 2 threads on 2 cores measured 2.9x slower per step than 2 x 1: 1.8 vs 0.63 s).
            half = max(1, (os.cpu_count() or 2) // 2)
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"threads": half})})
            print(f"relayrl: off-policy on CPU: {half} torch thread(s) for the trainer and {half} for the rollout "
                  f"(set run.threads to choose)")
        super().__init__(cfg)
        self.k = cfg.trainer.off_policy_steps

    def _rollout_cluster(self) -> ClusterConfig:
        # Its own process on the local backend: generation then overlaps training instead of
        # competing with it for the driver's interpreter lock.
        return self.cfg.cluster.model_copy(update={"in_process": False})

    def _rollout_pool(self, main: ResourcePool) -> ResourcePool:
        ids = None
        if main.device_kind == "cuda" and self.cfg.cluster.backend == "local":  # (Ray places pools itself)
            used = [int(d.split(":")[1]) for d in main.local_devices()]
            ids = (rollout_gpu(torch.cuda.device_count(), used),)
        return ResourcePool(name="rollout", devices=1, device_kind=main.device_kind, device_ids=ids)

    def run(self) -> Path:
        """Session.run's loop; the rollout thread starts with the first step and stops before the export."""
        self._ahead: RolloutAhead | None = None
        self._starts: dict[int, tuple[dict, list[int]]] = {}
        self._starts_cond = threading.Condition()
        self._relayed: dict[int, dict[str, float]] = {}  # relay metrics of each pushed version, logged once

        def export(path: str) -> None:
            self._close_ahead()
            self.actor.all("save_pretrained", path)

        def shutdown() -> None:
            self._close_ahead()
            self.shutdown()

        return self.s.run(restore=self.restore, step=self.train_step, evaluate=self.evaluate, save=self.save,
                          export=export, shutdown=shutdown, key_metrics=KEY_METRICS)

    def _close_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.close()

    def train_step(self, step: int) -> dict[str, float]:
        """The trainer's step: take the batch the rollout thread made, learn, stage the weights."""
        s = self.s
        if self._ahead is None:  # the steps left from here on, generated ahead within the staleness bound
            self._steps = range(step, self.cfg.trainer.steps + 1)
            self._ahead = RolloutAhead(self._produce, self._push, self._steps, self.k, version=step - 1)
        t0 = time.perf_counter()
        with s.span("wait_rollout", "actor", step):
            rolled, gen_version = self._ahead.take(step)
        waited = time.perf_counter() - t0
        with self._starts_cond:
            self._starts.pop(step, None)  # a checkpoint from now on records a later start
        self._phase_metrics = {}
        metrics = self.learn(step, *rolled)
        metrics.update(self._phase_metrics)
        with s.span("stage_weights", "actor", step):  # (unchanged weights after a skipped step)
            self._ahead.stage(step, _host_copy(collective(self.actor, "named_weights")))
        metrics = self.perf(metrics, t0, self.sample_tokens(rolled.problems, rolled.comps), step)
        metrics.update({"async/staleness": float(step - 1 - gen_version), "async/wait_rollout_s": waited,
                        "async/rollout_version": float(gen_version), **self._relayed.pop(gen_version, {})})
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        if getattr(self, "_ahead", None) is None:  # before the rollout thread: the engine is free
            return super().evaluate(step)
        # The trainer staged version `step` before this call; the rollout engine takes it between two batches.
        with self._ahead.hold_engine() as version:
            if version != step:
                raise RuntimeError(f"evaluation at step {step}: the rollout engine holds weights {version}")
            return super().evaluate(step)

    # ------------------------------------------------------------ rollout thread
    def _produce(self, step: int):
        with self._starts_cond:
            self._starts[step] = (self.s.prompts.state(), rollout_rng(self.rollout))
            self._starts_cond.notify_all()
        return self.rollout_and_score(step)

    def _push(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load host weights into the rollout engine (calls to the rollout group never overlap)."""
        t0 = time.perf_counter()
        metrics = relay_weights(self.actor, self.rollout, version=version, relay=self.relay, named=weights)
        self._relayed[version] = {**metrics, "timing/relay_s": time.perf_counter() - t0}

    def save(self, step: int) -> Path:
        # The data position and sampler state at the start of batch step+1, the first not trained yet. The
        # rollout thread is allowed to start it (the trainer staged version `step` >= step+1-1-k), so it will.
        if step + 1 in self._steps:
            deadline = time.monotonic() + 600
            with self._starts_cond:
                while step + 1 not in self._starts:
                    if self._ahead.failed or time.monotonic() > deadline:
                        raise RuntimeError(f"checkpoint at step {step}: the rollout thread did not start batch {step + 1}")
                    self._starts_cond.wait(timeout=1.0)
                data, rng = self._starts.pop(step + 1)
        else:  # the last step: nothing runs ahead any more
            data, rng = self.s.prompts.state(), rollout_rng(self.rollout)
        with self.s.span("checkpoint", "driver", step):
            return self.s.save(step, collective(self.actor, "state"), extra_state={"rollout_rng": rng, "data": data},
                               extra=self.extra_state())
