"""The training engine's state outside its passes: the compute copy's gradients and refresh, host offload
of what an idle role does not need, and the weights and full state for relays and checkpoints.

A mixin of :class:`relayrl.engines.training.torch_engine.TorchTrainingEngine` (it reads the engine's
``model``, ``runner``, ``optimizer``, ``scheduler``, ``reference_model`` and sharding flags).
"""

from __future__ import annotations

import time

import torch

from relayrl.engines.training import fsdp

__all__ = ["EngineState"]


class EngineState:
    """Gradient hand-over of the compute copy, offload/reload, weights and checkpoint state."""

    def _master_grads(self) -> None:
        """compute_copy: add the copy's gradients into the master weights' (float32) and free them."""
        if self.runner is self.model:
            return
        for master, comp in zip(self.model.parameters(), self.runner.parameters()):
            if comp.grad is not None:
                if master.grad is None:
                    master.grad = comp.grad.to(master.dtype)
                else:
                    master.grad.add_(comp.grad)
                comp.grad = None

    @torch.no_grad()
    def _refresh_copy(self) -> None:
        """compute_copy: the copy takes the master weights' new values."""
        if self.runner is not self.model:
            for master, comp in zip(self.model.parameters(), self.runner.parameters()):
                comp.copy_(master)

    # --------------------------------------------------------------- memory
    def offload(self, weights: bool = True) -> float:
        """Move the idle state to host memory: the optimizer state, the reference copy, and the weights unless
        ``weights=False`` (e.g. a colocated rollout engine reads them). Gradients need nothing: each step frees
        them (not during an open accumulation, which refuses). Returns the seconds it took."""
        from relayrl.weights import offload as swap

        if self._accumulation is not None:
            raise RuntimeError("offload during an open accumulation (its gradients live on the device): "
                               "finish_accumulation() first")
        t0 = time.perf_counter()
        if self.reference_model is not None and not self._ref_offloaded:
            if self.sharded:
                self.reference_model.to("cpu")
            else:
                swap.offload_module(self.reference_model)
            self._ref_offloaded = True
        if self.optimizer is not None and self.optimizer.state:
            swap.offload_optimizer(self.optimizer)
        if weights:
            if self.sharded:  # FSDP2: each rank's shards move with the module
                self.model.to("cpu")
            else:
                swap.offload_module(self.model)
                if self.runner is not self.model:
                    swap.offload_module(self.runner)
            self._weights_offloaded = True
        return time.perf_counter() - t0

    def reload(self) -> float:
        """Undo :meth:`offload` (a no-op for what was not offloaded); returns the seconds it took."""
        from relayrl.weights import offload as swap

        t0 = time.perf_counter()
        if self._ref_offloaded:
            if self.sharded:
                self.reference_model.to(self.device)
            else:
                swap.reload_module(self.reference_model)
            self._ref_offloaded = False
        if self.optimizer is not None and swap.is_offloaded(self.optimizer):
            swap.reload_optimizer(self.optimizer)
        if self._weights_offloaded:
            if self.sharded:
                self.model.to(self.device)
            else:
                swap.reload_module(self.model)
                if self.runner is not self.model:
                    swap.reload_module(self.runner, restore=False)  # refreshed from the master weights
                    self._refresh_copy()
            self._weights_offloaded = False
        return time.perf_counter() - t0

    def footprint(self) -> dict[str, float]:
        """The model's parameter counts and this rank's optimizer state in bytes (``params/total``,
        ``params/trainable``: the whole model's, sharded or not; ``optimizer/state_bytes``: Adam's two moments
        and step counts held by this rank, 0 before the first step, which creates them)."""
        local = [t.to_local() if hasattr(t, "to_local") else t  # a DTensor's numel is the whole tensor's
                 for s in (self.optimizer.state.values() if self.optimizer else ()) for t in s.values()
                 if isinstance(t, torch.Tensor)]
        return {"params/total": float(sum(p.numel() for p in self.model.parameters())),
                "params/trainable": float(sum(p.numel() for p in self.model.parameters() if p.requires_grad)),
                "optimizer/state_bytes": float(sum(t.numel() * t.element_size() for t in local))}

    # --------------------------------------------------------------- weights
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def mix_weights(self, named, alpha: float) -> None:
        """This model <- ``alpha`` x ``named`` (full tensors by parameter name) + (1 - ``alpha``) x itself: a
        reference moved toward the policy (TR-DPO's soft update; ``alpha=1``: ProRL's reset)."""
        fsdp.mix_weights(self.model, named, alpha)
        self._refresh_copy()

    def mix_reference(self, alpha: float) -> None:
        """Tri-model: the frozen reference copy <- ``alpha`` x the trained model + (1 - ``alpha``) x itself
        (both in this engine's layout). Collective when sharded."""
        if self.reference_model is None:
            raise ValueError("mix_reference: this engine holds no reference copy (tri-model)")
        fsdp.mix_weights(self.reference_model, fsdp.full_model_state_everywhere(self.model), alpha)

    def state(self, trainable_only: bool = False) -> dict:
        """Full model, optimizer (keyed by parameter name) and scheduler state, for checkpoints; the same
        at every world size. A collective when sharded: rank 0 gets the state, other ranks ``{}`` entries.
        ``trainable_only``: the model state of the parameters that train (LoRA's adapters), the frozen ones
        neither gathered nor copied."""
        return {
            "model": fsdp.full_model_state(self.model, trainable_only=trainable_only),
            "optimizer": fsdp.full_optimizer_state(self.model, self.optimizer) if self.optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
        }

    def load_state(self, state: dict) -> tuple[list[str], list[str]]:
        """Load what :meth:`state` returned (any entry may be missing); returns the model's
        (missing, unexpected) parameter names."""
        opt = state.get("optimizer") if self.optimizer is not None else None
        out = fsdp.load_full_state(self.model, state.get("model"), self.optimizer, opt)
        self._refresh_copy()
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.optimizer is not None:
            self._apply_optim_config()
        return out

    def _apply_optim_config(self) -> None:
        """After a checkpoint's optimizer and scheduler state: the run's own ``engine.optim`` settings, so a run
        resumed with another lr, schedule, warm-up, weight decay or betas trains with them (and its config.json
        tells the truth) from the resumed step on. The checkpoint keeps Adam's moments and the step count. With
        the same settings every value is the one the checkpoint holds."""
        o, groups = self.cfg.optim, self.optimizer.param_groups
        for g in groups:
            g.update(betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, initial_lr=o.lr)
        sched = self.scheduler  # (made with the optimizer: make_scheduler's LambdaLR)
        sched.base_lrs = [o.lr] * len(groups)
        for g, base, factor in zip(groups, sched.base_lrs, sched.lr_lambdas):
            g["lr"] = base * factor(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in groups]
