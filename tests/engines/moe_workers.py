"""Helpers of the MoE tests on several ranks (routing replay, expert parallelism): a MoE model directory and
workers that return the routing their old-policy pass records and how their experts are laid out (worker
classes must be importable by the rank processes)."""

from __future__ import annotations

from relayrl.engines.training.base import SequenceBatch
from relayrl.workflows.trainer_workers import PolicyWorker
from tests.models.architectures import build


class RoutesWorker(PolicyWorker):
    """A policy worker that hands back the routing its old-policy pass records (R2)."""

    def routes(self, batch: SequenceBatch) -> list:
        return self.engine.logprobs_with_routes(batch)[1]


class ExpertsWorker(RoutesWorker):
    """A policy worker that also says how its experts modules are laid out: ``(name, dispatching, local shapes)``
    for each (``dispatching``: expert parallelism's forward is installed)."""

    def experts(self) -> list:
        from relayrl.engines.training.expert_parallel import dispatch_of, expert_modules

        return [(n, dispatch_of(m) is not None,
                 [tuple(getattr(p, "to_local", lambda p=p: p)().shape) for p in m.parameters(recurse=False)])
                for n, m in expert_modules(self.engine.model)]


def moe_dir(tokenizer, where, arch: str = "qwen3_moe"):
    """A tiny mixture of experts (``arch`` of tests/models/architectures.py; Qwen3-MoE: 2 layers, 4 experts, 2 per
    token) with ``tokenizer``, saved under ``where``."""
    build(arch, vocab=len(tokenizer)).save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


def with_routes(batch: SequenceBatch, routes: list) -> SequenceBatch:
    return SequenceBatch(batch.prompt_ids, batch.response_ids, batch.fields, batch.groups, routes)
