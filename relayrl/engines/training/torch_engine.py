"""Single-process PyTorch training engine (CPU or one GPU).

Forward passes pad at the last moment: rows are sorted by length and cut into
micro-batches whose *padded* token count stays under ``token_budget``, so
padding is minimal and the micro-batch size adapts to sequence length (not a
fixed sample count). Logits are computed only at response positions (decoder
hidden states are gathered first, then the output head is applied), which
avoids materialising ``[B, L, V]`` logits for the prompt.

Gradients accumulate over micro-batches; the loss function normalises by the
mini-batch's global token/sequence counts, so accumulation is exact (seed 003,
section 3). With ``torch.distributed`` initialised, those counts are summed
over ranks, which is what data parallelism (FSDP2) needs as well.

A non-finite gradient norm skips the optimizer step (weights stay at the last
good state) and is reported as ``actor/nonfinite_grad``; the workflow decides
whether to stop or go on.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from relayrl.engines.training.base import LossFn, MicroBatch, OptimConfig, SequenceBatch

__all__ = ["TrainEngineConfig", "TorchTrainingEngine", "plan_microbatches", "make_scheduler"]


class TrainEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    optim: OptimConfig = OptimConfig()
    token_budget: int = Field(8192, ge=16, description="max padded tokens (prompt + response) per micro-batch")
    entropy_chunk: int = Field(1024, ge=1, description="positions per chunk when computing entropy")
    gradient_checkpointing: bool = False


def plan_microbatches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group row indexes into micro-batches of at most ``token_budget`` padded tokens.

    Rows are taken longest first, so each micro-batch holds rows of similar
    length. A single row longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    plans: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > token_budget:
            plans.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        plans.append(cur)
    return plans


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up, then constant / cosine / linear decay to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant" or total_steps <= cfg.warmup_steps:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        if cfg.schedule == "cosine":
            decay = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            decay = 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _pad_field(values: list, rows: list[int], width: int, device) -> torch.Tensor:
    first = values[rows[0]]
    if isinstance(first, torch.Tensor) and first.dim() == 1:
        out = torch.zeros(len(rows), width, dtype=first.dtype if first.is_floating_point() else torch.float32)
        for j, i in enumerate(rows):
            v = values[i]
            out[j, : v.numel()] = v
        return out.to(device)
    return torch.tensor([float(values[i]) for i in rows], dtype=torch.float32, device=device)


class TorchTrainingEngine:
    """See the module docstring. ``model`` is a Hugging Face causal LM."""

    def __init__(self, model, cfg: TrainEngineConfig, *, total_steps: int, device: str | torch.device = "cpu",
                 trainable: bool = True, metric_prefix: str = "actor") -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.cfg = cfg
        self.prefix = metric_prefix
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.optimizer = None
        self.scheduler = None
        if trainable:
            o = cfg.optim
            self.optimizer = torch.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad],
                lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                foreach=True,
            )
            self.scheduler = make_scheduler(self.optimizer, o, total_steps)
        else:
            self.model.requires_grad_(False).eval()

    # --------------------------------------------------------------- forward
    def _forward(self, batch: SequenceBatch, rows: list[int], temperature: float, with_entropy: bool):
        """Log-probs (and entropy) of the response tokens of ``rows``: [B, T] each, plus mask [B, T]."""
        lp_len = [int(batch.prompt_ids[i].numel()) for i in rows]
        rs_len = [int(batch.response_ids[i].numel()) for i in rows]
        total = [a + b for a, b in zip(lp_len, rs_len)]
        L, T = max(total), max(rs_len)
        ids = torch.zeros(len(rows), L, dtype=torch.long)
        attn = torch.zeros(len(rows), L, dtype=torch.long)
        for j, i in enumerate(rows):
            seq = torch.cat([batch.prompt_ids[i].long(), batch.response_ids[i].long()])
            ids[j, : seq.numel()] = seq
            attn[j, : seq.numel()] = 1
        ar = torch.arange(T)
        pos = (torch.tensor(lp_len)[:, None] - 1 + ar[None, :]).clamp(max=L - 1)  # position predicting token t
        mask = (ar[None, :] < torch.tensor(rs_len)[:, None]).float()
        targets = ids.gather(1, (pos + 1).clamp(max=L - 1)) * mask.long()
        ids, attn, pos, mask, targets = (t.to(self.device) for t in (ids, attn, pos, mask, targets))

        hidden = self.model.get_decoder()(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
        h = hidden.gather(1, pos[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [B, T, H]
        logits = self.model.get_output_embeddings()(h).float()
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, :, None]).squeeze(-1) * mask
        entropy = None
        if with_entropy:
            from relayrl.algorithms.entropy import entropy_from_logits

            # Gradient through the entropy only when a loss term uses it (an entropy bonus).
            entropy = entropy_from_logits(logits, mask, chunk_size=self.cfg.entropy_chunk,
                                          grad=with_entropy == "grad")
        return logprobs, mask, entropy

    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch, *, temperature: float = 1.0, with_entropy: bool = False):
        was_training = self.model.training
        self.model.eval()
        out: list[torch.Tensor | None] = [None] * len(batch)
        ent: list[torch.Tensor | None] = [None] * len(batch)
        lengths = [int(p.numel() + r.numel()) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        for rows in plan_microbatches(lengths, self.cfg.token_budget):
            lp, _, e = self._forward(batch, rows, temperature, with_entropy)
            for j, i in enumerate(rows):
                n = int(batch.response_ids[i].numel())
                out[i] = lp[j, :n].float().cpu()
                if e is not None:
                    ent[i] = e[j, :n].float().cpu()
        self.model.train(was_training)
        return out, (ent if with_entropy else None)

    # ---------------------------------------------------------------- update
    def _global(self, tokens: int, seqs: int) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([tokens, seqs], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            return int(t[0]), int(t[1])
        return tokens, seqs

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn, *, mini_batches: int = 1, epochs: int = 1,
                   temperature: float = 1.0, with_entropy: bool | str = False,
                   generator: torch.Generator | None = None) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("train_step on an engine built with trainable=False")
        if len(batch) == 0:
            raise ValueError("train_step got an empty batch")
        if mini_batches < 1 or mini_batches > len(batch):
            raise ValueError(f"mini_batches={mini_batches} must be in [1, {len(batch)}] (rows in the batch)")
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        steps = 0
        for _ in range(epochs):
            perm = torch.randperm(len(batch), generator=generator).tolist() if mini_batches > 1 else list(range(len(batch)))
            size = -(-len(batch) // mini_batches)
            for start in range(0, len(batch), size):
                metrics = self._optimizer_step(batch, perm[start:start + size], loss_fn, temperature, with_entropy)
                for k, v in metrics.items():
                    sums[k] += v
                steps += 1
        return {k: v / steps for k, v in sums.items()}

    def _optimizer_step(self, batch: SequenceBatch, rows: list[int], loss_fn: LossFn, temperature: float,
                        with_entropy: bool) -> dict[str, float]:
        tokens = sum(int(batch.response_ids[i].numel()) for i in rows)
        g_tokens, g_seqs = self._global(tokens, len(rows))
        lengths = [int(batch.prompt_ids[i].numel() + batch.response_ids[i].numel()) for i in rows]
        acc: dict[str, float] = defaultdict(float)
        for plan in plan_microbatches(lengths, self.cfg.token_budget):
            mb_rows = [rows[k] for k in plan]
            lp, mask, ent = self._forward(batch, mb_rows, temperature, with_entropy)
            fields = {k: _pad_field(v, mb_rows, lp.shape[1], self.device) for k, v in batch.fields.items()}
            mb = MicroBatch(lp, mask, fields, g_tokens, g_seqs, ent)
            loss, metrics = loss_fn(mb)
            loss.backward()
            weight = float(mask.sum()) / max(tokens, 1)
            for k, v in metrics.items():
                acc[k] += v * weight
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
        norm = float(norm)
        acc[f"{self.prefix}/grad_norm"] = norm
        acc[f"{self.prefix}/lr"] = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(norm):
            self.optimizer.step()
            acc[f"{self.prefix}/nonfinite_grad"] = 0.0
        else:
            acc[f"{self.prefix}/nonfinite_grad"] = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return dict(acc)

    # --------------------------------------------------------------- weights
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def state(self) -> dict:
        """Optimizer and scheduler state, for checkpoints."""
        return {
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
        }

    def load_state(self, state: dict) -> None:
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])


def pad_right(seqs: Sequence[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    """Stack 1-D tensors into [B, max_len], padded on the right."""
    width = max((int(s.numel()) for s in seqs), default=0)
    return torch.stack([F.pad(s, (0, width - s.numel()), value=value) for s in seqs]) if seqs else torch.empty(0, 0)
