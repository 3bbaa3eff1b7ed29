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
pushed into the rollout engine by the rollout thread between two
generations, never during one. Evaluation pushes the trainer's current weights
first. Checkpoints record the data position and sampler state at the start
of the first batch not yet trained, so a resumed run regenerates the batches
that were in flight, with the checkpoint's (newer) weights: it continues the
run but is not bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from relayrl.cluster import ClusterConfig, ResourcePool
from relayrl.config.schema import Config
from relayrl.workflows.grpo import GRPOWorkflow
from relayrl.workflows.relay import relay_weights
from relayrl.workflows.workers import collective, rollout_rng

__all__ = ["OffPolicyGRPO", "RolloutAhead"]


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
                    staged, self._staged = self._staged, None
                if staged is not None:
                    self._push(*staged)
                    self.rollout_version = staged[0]
                out = self._produce(j)
                with self._cond:
                    self._ready[j] = (out, self.rollout_version)
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised in the trainer by take()
            with self._cond:
                self._error = e
                self._cond.notify_all()

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
        if main.device_kind == "cuda":  # the last GPU (on a one-GPU machine the actor's, shared)
            ids = (torch.cuda.device_count() - 1,)
        return ResourcePool(name="rollout", devices=1, device_kind=main.device_kind, device_ids=ids)

    def run(self) -> Path:
        s = self.s
        self._steps = steps = self.begin()
        self._starts: dict[int, tuple[dict, list[int]]] = {}
        self._starts_cond = threading.Condition()
        self._relayed: dict[int, dict[str, float]] = {}  # relay metrics of each pushed version, logged once
        self._ahead = ahead = RolloutAhead(self._produce, self._push, steps, self.k, version=s.start_step)
        with s.interruptible():
            try:
                self._train(steps, ahead)
            except BaseException:
                ahead.close()
                self.shutdown()  # the ranks stop now, not at interpreter exit
                raise
            ahead.close()
            return self.finish()

    def _train(self, steps: range, ahead: "RolloutAhead") -> None:
        """The trainer's loop: take the batch the rollout thread made, learn, stage the weights, log."""
        s = self.s
        for step in steps:
            t0 = time.perf_counter()
            with s.span("wait_rollout", "actor", step):
                rolled, gen_version = ahead.take(step)
            waited = time.perf_counter() - t0
            with self._starts_cond:
                self._starts.pop(step, None)  # a checkpoint from now on records a later start
            metrics = self.learn(step, *rolled)
            with s.span("stage_weights", "actor", step):  # (unchanged weights after a skipped step)
                ahead.stage(step, _host_copy(collective(self.actor, "named_weights")))
            metrics = self.perf(metrics, t0, rolled.problems, rolled.comps, step)
            metrics.update({"async/staleness": float(step - 1 - gen_version), "async/wait_rollout_s": waited,
                            "async/rollout_version": float(gen_version), **self._relayed.pop(gen_version, {})})
            if self.end_step(step, metrics):
                break

    def evaluate(self, step: int) -> dict[str, float]:
        if step > 0:  # evaluate the trainer's weights, not the rollout's older ones
            self._push(step, _host_copy(collective(self.actor, "named_weights")))
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
