"""Helpers of the routing-replay tests on several ranks: a MoE model directory and a worker that returns the
routing its old-policy pass records (worker classes must be importable by the rank processes)."""

from __future__ import annotations

from relayrl.engines.training.base import SequenceBatch
from relayrl.workflows.trainer_workers import PolicyWorker
from tests.models.architectures import build


class RoutesWorker(PolicyWorker):
    """A policy worker that hands back the routing its old-policy pass records (R2)."""

    def routes(self, batch: SequenceBatch) -> list:
        return self.engine.logprobs_with_routes(batch)[1]


def moe_dir(tokenizer, where):
    """A tiny Qwen3-MoE model (2 layers, 4 experts, 2 per token) with ``tokenizer``, saved under ``where``."""
    build("qwen3_moe", vocab=len(tokenizer)).save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


def with_routes(batch: SequenceBatch, routes: list) -> SequenceBatch:
    return SequenceBatch(batch.prompt_ids, batch.response_ids, batch.fields, batch.groups, routes)
