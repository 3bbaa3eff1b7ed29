"""Native generation engine: a Hugging Face causal LM with a KV cache and a full batch.

The engine keeps up to ``max_batch`` sequences in flight. Prompts are
prefilled once and their cache is repeated for the ``n`` samples (the
prompt is shared, as in seed 003's shared-prompt idea, but on the generation
side). When rows finish, they leave the batch (``batch_select_indices``) and
waiting prompts are admitted into the freed slots: a new prompt is prefilled,
left-padded to the running cache length, and concatenated to the cache, so the
batch stays full without waiting for its slowest row (continuous batching on a
left-padded cache). Columns that are padding for every row are cropped.

Departures from production engines (vLLM): no paged attention and no
CUDA graphs; the cache is a dense tensor per layer. On CUDA the model runs in
its loaded dtype (bf16 recommended) with SDPA attention.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from relayrl.engines.generation.base import Completion, SamplingParams

__all__ = ["NativeGenerationEngine", "sample_next"]


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None):
    """Sample one token per row.

    Args:
        logits: [B, V] next-token logits (float32).
    Returns:
        tokens [B] int64 and their log-probs [B] under ``softmax(logits / T)``
        (greedy: under ``softmax(logits)``), before top-k/top-p filtering.
    """
    if params.temperature == 0.0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    filtered = scaled
    if params.top_k and params.top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(filtered, dim=-1)
    tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class _Batch:
    """Rows in flight: cache, attention mask and per-row bookkeeping."""

    def __init__(self) -> None:
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, Lc] 1 on real tokens
        self.rows: list[tuple[int, int]] = []  # (prompt_index, sample_index)
        self.tokens: list[list[int]] = []
        self.logps: list[list[float]] = []
        self.next_logits: torch.Tensor | None = None  # [B, V]

    def __len__(self) -> int:
        return len(self.rows)


class NativeGenerationEngine:
    """Generation with a Hugging Face model; see the module docstring."""

    def __init__(self, model, tokenizer, *, max_batch: int = 256, device: str | torch.device = "cpu") -> None:
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_batch = max_batch
        self._version = 0
        self._params = dict(self.model.named_parameters())
        self._params.update(dict(self.model.named_buffers()))
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    # ---------------------------------------------------------------- weights
    @property
    def weight_version(self) -> int:
        return self._version

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy weights in place; unknown names and shape mismatches raise before the version moves."""
        for name, t in named_tensors:
            p = self._params.get(name)
            if p is None:
                raise KeyError(f"generation engine has no parameter {name!r}")
            if p.shape != t.shape:
                raise ValueError(f"weight {name!r}: engine shape {tuple(p.shape)} != incoming {tuple(t.shape)}")
            p.copy_(t, non_blocking=True)
        self._version = version

    # ------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> list[Completion]:
        if not prompts:
            return []
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        stop_ids = self.eos_ids | set(params.stop_token_ids)
        waiting = deque(range(len(prompts)))
        out: dict[tuple[int, int], Completion] = {}
        batch = _Batch()
        per_prompt = max(1, min(params.n, self.max_batch))
        while waiting or len(batch):
            free = self.max_batch - len(batch)
            admit: list[int] = []
            while waiting and free >= per_prompt:
                admit.append(waiting.popleft())
                free -= params.n
            if admit:
                self._admit(batch, [prompts[i] for i in admit], admit, params.n)
            tok, logp = sample_next(batch.next_logits.float(), params, generator)
            done = []
            tok_l, logp_l = tok.tolist(), logp.tolist()
            for r in range(len(batch)):
                batch.tokens[r].append(tok_l[r])
                batch.logps[r].append(logp_l[r])
                reason = None
                if tok_l[r] in stop_ids:
                    reason = "stop"
                elif params.stop_strings and self._hit_stop_string(batch.tokens[r], params.stop_strings):
                    reason = "stop"
                elif len(batch.tokens[r]) >= params.max_new_tokens:
                    reason = "length"
                if reason:
                    done.append(r)
                    out[batch.rows[r]] = self._completion(batch, r, reason)
            keep = [r for r in range(len(batch)) if r not in set(done)]
            if done:
                self._select(batch, keep, tok)
                tok = tok[keep]
            if len(batch):
                self._decode(batch, tok)
        return [out[k] for k in sorted(out)]

    def _hit_stop_string(self, tokens: list[int], stops: tuple[str, ...]) -> bool:
        tail = self.tokenizer.decode(tokens[-8:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _completion(self, batch: _Batch, r: int, reason: str) -> Completion:
        toks = batch.tokens[r]
        return Completion(
            prompt_index=batch.rows[r][0],
            sample_index=batch.rows[r][1],
            token_ids=torch.tensor(toks, dtype=torch.long),
            logprobs=torch.tensor(batch.logps[r], dtype=torch.float32),
            finish_reason=reason,  # type: ignore[arg-type]
            weight_version=self._version,
            text=self.tokenizer.decode(toks, skip_special_tokens=True),
        )

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache):
        pos = (mask.long().cumsum(-1) - 1).clamp_min(0)[:, -ids.shape[1]:]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :], out.past_key_values

    def _admit(self, batch: _Batch, prompts: list[Sequence[int]], indexes: list[int], n: int) -> None:
        """Prefill new prompts once, repeat for n samples, and join them to the running batch."""
        from transformers import DynamicCache

        length = max(len(p) for p in prompts)
        if batch.mask is not None:
            length = max(length, batch.mask.shape[1])
        ids = torch.full((len(prompts), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, length - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, length - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits, cache = self._forward(ids, mask, DynamicCache(config=self.model.config))
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            mask = mask.repeat_interleave(n, dim=0)
        rows = [(i, s) for i in indexes for s in range(n)]
        if batch.cache is None:
            batch.cache, batch.mask, batch.next_logits = cache, mask, logits
        else:
            pad = length - batch.mask.shape[1]
            if pad:  # running rows are shorter than a new prompt: left-pad the running cache
                batch.mask = F.pad(batch.mask, (pad, 0))
            for old, new in zip(batch.cache.layers, cache.layers):
                if pad:
                    old.keys, old.values = F.pad(old.keys, (0, 0, pad, 0)), F.pad(old.values, (0, 0, pad, 0))
                old.keys = torch.cat([old.keys, new.keys], dim=0)
                old.values = torch.cat([old.values, new.values], dim=0)
            batch.mask = torch.cat([batch.mask, mask], dim=0)
            batch.next_logits = torch.cat([batch.next_logits, logits], dim=0)
        batch.rows += rows
        batch.tokens += [[] for _ in rows]
        batch.logps += [[] for _ in rows]

    def _select(self, batch: _Batch, keep: list[int], tok: torch.Tensor) -> None:
        """Drop finished rows, then crop cache columns that are padding for every remaining row."""
        if not keep:
            batch.__init__()
            return
        idx = torch.tensor(keep, device=self.device)
        batch.cache.batch_select_indices(idx)
        batch.mask = batch.mask[idx]
        batch.next_logits = batch.next_logits[idx]
        batch.rows = [batch.rows[r] for r in keep]
        batch.tokens = [batch.tokens[r] for r in keep]
        batch.logps = [batch.logps[r] for r in keep]
        first = int(batch.mask.any(dim=0).long().argmax())
        if first > 0:
            batch.mask = batch.mask[:, first:]
            for layer in batch.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def _decode(self, batch: _Batch, tok: torch.Tensor) -> None:
        batch.mask = F.pad(batch.mask, (0, 1), value=1)
        batch.next_logits, batch.cache = self._forward(tok[:, None].to(self.device), batch.mask, batch.cache)
