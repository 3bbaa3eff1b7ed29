"""Native generation engine: a Hugging Face causal LM with a KV cache and a full batch.

The engine keeps up to ``max_batch`` sequences in flight. Prompts are
prefilled once and their cache is repeated for the ``n`` samples (the
prompt is shared, as in Periodic Asynchrony's shared-prompt idea, but on the generation
side). When rows finish, they leave the batch (``batch_select_indices``) and
waiting prompts are admitted into the freed slots: a new prompt is prefilled,
left-padded to the running cache length, and concatenated to the cache, so the
batch stays full without waiting for its slowest row (continuous batching on a
left-padded cache). Columns that are padding for every row are cropped.

On CUDA, Llama-family models decode instead on a static per-slot KV cache
whose decode step is replayed as a CUDA graph (:mod:`.static`, ``decode``
``auto``/``static``): a finished row frees its slot and a waiting prompt is
prefilled into it, so continuous batching is kept. ``release()`` frees that
cache (colocated training wants the memory back).

Sampling (:mod:`.sampling`): every token is drawn by inverse CDF from one uniform that hashes the row's key
(a seed drawn once per ``generate`` call from the generator, and the row's prompt and sample index) and the
row's token count. A sample's tokens therefore do not depend on batch composition, slots or chunking: both
decode paths give the same tokens for the same seed (up to the logits' rounding).

Partial rollout (``generate(..., between=...)``): before each decode step the engine asks ``between()``
whether the weights changed (a newer version was loaded while the batch was in flight). If so, every
in-flight row's context (its prompt and the tokens it has so far) is prefilled again with the new weights,
and decoding goes on from there; each token records the version that sampled it (``token_versions``). The
engine re-prefills rather than keep the old cache: keys and values computed by the old weights feeding the
new ones sample from neither policy, so the recorded behaviour log-probs would match no model the trainer
can recompute. The cost is one prefill of the in-flight rows per weight update.

Routing (``record_routing``, mixture-of-experts models on the dynamic cache): every forward pass keeps the
experts each token was routed to (:class:`relayrl.models.routing.Routing`), and a completion carries them for
its prompt and every token fed back (``Completion.routed_experts``) for the trainer to replay (R3). A partial
rollout's prefill again records its rows' context anew: the routes are those of the weights that continue.

Prompts may also arrive while generating (:meth:`NativeGenerationEngine.generate_feed`): a
:class:`~relayrl.engines.generation.base.PromptFeed` hands over new rows whenever slots are free, each with its own
token budget, and the loop waits on it when the batch is empty. Multi-turn episodes use this
(``relayrl.environments.episodes``): a finished turn leaves the batch, its environment step runs in another thread,
and the next turn rejoins the running batch as a new row whose whole context (prompt, earlier turns, observations)
is prefilled again; there is no prefix cache, so a rejoining turn pays that prefill. Fed rows decode on the dynamic
cache (the static one is sized for one prompt plus ``max_new_tokens``).

Departures from production engines (vLLM): no paged attention; the cache is a
dense tensor per layer (the static cache is sized for the longest prompt plus
``max_new_tokens``). The model runs in its loaded dtype (bf16 on GPUs); with ``head_fp32``
(``model.head_fp32``) its output head computes float32 logits from a float32 product on both decode paths,
in or out of the static path's CUDA graphs (:mod:`relayrl.models.head_precision`), so the recorded log-probs
come from float32 logits as the trainer's do.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from relayrl.engines.generation import cache_rows, static
from relayrl.engines.generation.base import (Completion, PromptFeed, SamplingParams, check_prompts,
                                             generate_from_feed, hits_stop_string, stop_token_ids)
from relayrl.engines.generation.kv_cache import check_takes_cache, forward_with_cache
from relayrl.engines.generation.sampling import draw_seed, row_key, row_uniforms, sample_next, seen_mask
from relayrl.models.eos import eos_ids

__all__ = ["NativeGenerationEngine", "RunningBatch", "sample_next"]


class RunningBatch:
    """Rows in flight on the dynamic cache: cache, attention mask and per-row bookkeeping.

    A row's key is ``(owner, sample_index)``: ``owner`` is the prompt's index for :meth:`generate`, or any
    hashable a caller driving the engine step by step chooses (the server's request ids, ``relayrl.serving``).
    """

    def __init__(self) -> None:
        self.cache = None
        self.mask: torch.Tensor | None = None  # [B, Lc] 1 on real tokens
        self.rows: list[tuple] = []  # (owner, sample_index)
        self.tokens: list[list[int]] = []
        self.logps: list[list[float]] = []
        self.versions: list[list[int]] = []
        self.prompts: list[Sequence[int]] = []  # each row's context before its first new token
        self.budget: list[int | None] = []  # max new tokens of each row (None: the sampling params')
        self.next_logits: torch.Tensor | None = None  # [B, V]
        self.seen: torch.Tensor | None = None  # [B, V] bool, the tokens of each row's context (repetition
        # penalty): built by seen_tokens on first use, then kept by admit, retain and advance
        self.routes: list[list[torch.Tensor]] = []  # record_routing: each row's [tokens, layers, k] chunks

    def __len__(self) -> int:
        return len(self.rows)


def finished_rows(tokens: torch.Tensor, slots: list[int], done: list[int], seen: list[int], lo: int, max_new: int,
                  stop_ids: set[int]) -> dict[int, tuple[int, str]]:
    """The rows that end among tokens read from the device: ``tokens`` [rows, W] holds token ``lo + j`` of the
    row in slot ``r`` at ``[r, j]``; the row in ``slots[i]`` had ``done[i]`` tokens before and the device has
    sampled ``seen[i]``. A row ends at its first token in ``stop_ids`` ("stop"), else at its ``max_new``-th
    ("length"). Returns ``{slot: (tokens it keeps in all, reason)}`` for the rows that end."""
    idx = torch.tensor(slots, dtype=torch.long)
    start = torch.tensor(done, dtype=torch.long)[:, None] - lo
    end = torch.tensor(seen, dtype=torch.long)[:, None] - lo
    col = torch.arange(tokens.shape[1])[None]
    rows = tokens[idx]
    stop = torch.isin(rows, torch.tensor(sorted(stop_ids), dtype=rows.dtype)) if stop_ids else torch.zeros_like(
        rows, dtype=torch.bool)
    ending = (col >= start) & (col < end) & (stop | (col == max_new - 1 - lo))  # or its max_new-th token
    hit = ending.any(1)
    first = ending.to(torch.int8).argmax(1)  # the first ending column (argmax gives the first maximum)
    by_stop = stop.gather(1, first[:, None])[:, 0]
    return {slots[i]: (lo + int(first[i]) + 1, "stop" if by_stop[i] else "length")
            for i in hit.nonzero()[:, 0].tolist()}


class NativeGenerationEngine:
    """Generation with a Hugging Face model; see the module docstring."""

    def __init__(self, model, tokenizer, *, max_batch: int = 256, device: str | torch.device = "cpu",
                 decode: str = "auto", decode_compile: bool = False, decode_chunk: int = 16, log=print,
                 head_fp32: bool = False, record_routing: bool = False) -> None:
        check_takes_cache(model)
        self.model = model.to(device).eval()
        if head_fp32:  # model.head_fp32: float32 logits from a float32 product on both decode paths
            from relayrl.models.head_precision import run_head_in_fp32

            run_head_in_fp32(self.model)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_batch = max_batch
        self._version = 0
        self.shared = False  # True once the weights are another engine's live tensors (share_weights)
        self._index_params()
        self.static = static.build(self.model, max_batch, decode, log, compile=decode_compile)
        self.routing = None  # record_routing: hooks on the model's routers (relayrl.models.routing)
        if record_routing:
            if self.static is not None:
                raise ValueError(f"record_routing records the routers of a mixture-of-experts model on the dynamic "
                                 f"cache; decode={decode!r} chose the static decoder (set rollout.decode=dynamic)")
            from relayrl.models.routing import Routing

            self.routing = Routing(self.model)
        self._routes: torch.Tensor | None = None  # the last forward's [B, T, layers, k] (record_routing)
        self.decode_chunk = decode_chunk  # static cache: decode steps between two reads on the host
        self.eos_ids = eos_ids(tokenizer, getattr(model, "generation_config", None))  # (and its turn ends)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def _index_params(self) -> None:
        self._params = dict(self.model.named_parameters())
        self._params.update(dict(self.model.named_buffers()))

    # ---------------------------------------------------------------- weights
    @property
    def weight_version(self) -> int:
        return self._version

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy weights in place; unknown names and shape mismatches raise before the version moves. With
        shared weights (:meth:`share_weights`) the engine already reads the new values: only the version moves."""
        if not self.shared:
            for name, t in named_tensors:
                p = self._params.get(name)
                if p is None:
                    raise KeyError(f"generation engine has no parameter {name!r}")
                if p.shape != t.shape:
                    raise ValueError(f"weight {name!r}: engine shape {tuple(p.shape)} != incoming {tuple(t.shape)}")
                p.copy_(t, non_blocking=True)
        if self.static is not None:
            self.static.refresh()  # its fused projection weights, if any, are copies
        self._version = version

    def share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Use ``named_tensors`` (another engine's live parameters, same dtype and device) as this engine's
        weights: no copy, so later in-place updates of those tensors are seen here at once (zero-redundancy
        relay between colocated roles). Tied parameters stay tied."""
        from torch import nn

        named = dict(named_tensors)
        swap: dict[int, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            t = named.get(name)
            if t is None:
                raise KeyError(f"share_weights: no tensor for parameter {name!r}")
            if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
                raise ValueError(f"share_weights: {name!r} is {tuple(t.shape)} {t.dtype} on {t.device}, the engine's "
                                 f"{tuple(p.shape)} {p.dtype} on {p.device}")
            swap[id(p)] = t
        for module in self.model.modules():
            for key, p in list(module._parameters.items()):
                if p is not None and id(p) in swap:
                    t = swap[id(p)]
                    module._parameters[key] = t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)
        self._index_params()
        self.release()  # recorded graphs point at the old tensors
        self.shared = True
        self._version = version

    def release(self) -> None:
        """Free the static KV cache and its graphs (rebuilt on the next ``generate``)."""
        if self.static is not None:
            self.static.release()

    # ------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None,
                 on_finish: Callable[[Completion], None] | None = None,
                 between: Callable[[], bool] | None = None) -> list[Completion]:
        """Sample ``params.n`` responses per prompt with continuous batching; completions in (prompt, sample)
        order. ``on_finish`` is called with each completion the moment it finishes (a streaming consumer,
        e.g. a rollout worker writing whole prompt groups into the dock while the rest still decode).
        ``between`` is called before every decode step and returns True when it loaded new weights: the
        in-flight rows are then prefilled again and continue with them (partial rollout)."""
        if not prompts:
            return []
        if self.static is None:
            return generate_from_feed(self.generate_feed, prompts, params, generator, on_finish, between)
        check_prompts(prompts)
        return self._generate_static(prompts, params, generator, self.stop_ids(params), on_finish, between)

    @torch.no_grad()
    def generate_feed(self, feed: PromptFeed, params: SamplingParams, generator: torch.Generator | None,
                      on_finish: Callable[[Completion], None], between: Callable[[], bool] | None = None) -> None:
        """Continuous batching over rows that arrive while generating (see :class:`PromptFeed`): each row
        gets ``params.n`` samples and its own token budget; ``on_finish`` gets each completion as it ends.
        Returns when the batch is empty and ``feed.wait()`` says nothing more will come."""
        stop_ids = self.stop_ids(params)
        self._generate_dynamic(feed, params, generator, stop_ids, on_finish, between)

    def _generate_dynamic(self, feed: PromptFeed, params: SamplingParams, generator: torch.Generator | None,
                          stop_ids: set[int], on_finish: Callable[[Completion], None],
                          between: Callable[[], bool] | None = None) -> None:
        """Continuous batching on a left-padded dynamic cache: free slots take the feed's rows."""
        batch = RunningBatch()
        per_prompt = max(1, min(params.n, self.max_batch))
        seed, serial = draw_seed(generator) if params.temperature > 0 else 0, 0  # (greedy draws nothing)
        keys: list[int] = []  # each row's sampling key (sampling.row_key of its admission's serial number)
        while True:
            if between is not None and between() and len(batch):
                self._refill(batch)
            free = self.max_batch - len(batch)
            admit: list[tuple[int, Sequence[int], int]] = []
            while free >= per_prompt:
                item = feed.take()
                if item is None:
                    break
                if len(item[1]) == 0:
                    raise ValueError(f"prompt {item[0]} is empty")
                admit.append(item)
                free -= params.n
            if admit:
                self.admit(batch, [p for _, p, _ in admit], [k for k, _, _ in admit], params.n,
                           [b for _, _, b in admit])
                keys += [row_key(seed, serial + j, s) for j in range(len(admit)) for s in range(params.n)]
                serial += len(admit)
            if not len(batch):
                if not feed.wait():
                    return
                continue
            counts = torch.tensor([len(t) for t in batch.tokens])
            seen = self.seen_tokens(batch) if params.repetition_penalty != 1.0 else None
            tok, logp = sample_next(batch.next_logits.float(), params,
                                    uniforms=row_uniforms(torch.tensor(keys), counts), seen=seen)
            done = []
            tok_l, logp_l = tok.tolist(), logp.tolist()
            for r in range(len(batch)):
                batch.tokens[r].append(tok_l[r])
                batch.logps[r].append(logp_l[r])
                batch.versions[r].append(self._version)
                reason = self.finish_reason(batch.tokens[r], params, stop_ids, batch.budget[r])
                if reason:
                    done.append(r)
                    on_finish(self.completion(batch.rows[r], batch.tokens[r], batch.logps[r], reason,
                                              batch.versions[r], batch.routes[r]))
            keep = [r for r in range(len(batch)) if r not in set(done)]
            if done:
                self.retain(batch, keep)
                keys = [keys[r] for r in keep]
                tok = tok[keep]
            if len(batch):
                self.advance(batch, tok)

    def _generate_static(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                         generator: torch.Generator | None, stop_ids: set[int],
                         on_finish: Callable[[Completion], None] | None = None,
                         between: Callable[[], bool] | None = None) -> list[Completion]:
        """Continuous batching on the static cache: each row owns a slot; freed slots take waiting prompts.

        The device decodes up to ``decode_chunk`` steps (sampling included) between two reads on the host,
        and the next chunk is queued before the host reads the last one, so the device is not idle while the
        host finishes rows: a row that stops inside a chunk decodes on through the next one, and those tokens
        are dropped (its slot takes a waiting prompt one chunk later). With ``between`` (partial rollout) the
        host reads after every step and queues the next only then, so new weights come in at once."""
        st = self.static
        if params.n > self.max_batch:
            raise ValueError(f"n={params.n} samples of one prompt need {params.n} cache slots, but max_batch="
                             f"{self.max_batch}; raise rollout.max_batch to at least rollout.n")
        st.ensure(max(len(p) for p in prompts) + params.max_new_tokens, params.max_new_tokens)
        seed = draw_seed(generator) if params.temperature > 0 else 0  # (greedy draws nothing)
        chunk = 1 if between is not None else self.decode_chunk
        n = params.n
        waiting = deque(range(len(prompts)))
        free = list(range(self.max_batch))  # kept sorted: rows take the lowest slots, so buckets stay small
        rows: dict[int, tuple[int, int]] = {}  # slot -> (prompt, sample)
        toks: dict[int, list[int]] = {}  # the tokens read to the host
        logps: dict[int, list[float]] = {}
        vers: dict[int, list[int]] = {}
        count: dict[int, int] = {}  # tokens sampled on the device (read, and not yet read)
        out: dict[tuple[int, int], Completion] = {}

        def start(slots: list[int], ctx: list[list[int]], repeat: int, done: list[int]) -> None:
            logits = st.prefill(ctx, torch.tensor(slots), repeat, self.pad_id)
            ctx_len = [len(c) for c in ctx for _ in range(repeat)]
            st.start(slots, logits, params, [row_key(seed, *rows[s]) for s in slots], done, ctx_len,
                     [c for c in ctx for _ in range(repeat)])
            for s, d in zip(slots, done):
                count[s] = d + 1

        def launch() -> None:
            """The next chunk of decode steps for the rows still short of their budget (a row that stopped
            inside the last chunk and is not read yet decodes on; its tokens are dropped when it is read)."""
            live = sorted(s for s in rows if count[s] < params.max_new_tokens)
            if not live:
                return
            steps = min(chunk, min(params.max_new_tokens - count[s] for s in live))
            # the last position a step feeds is the context length + count - 2 + steps; attend up to it
            last = max(len(prompts[rows[s][0]]) + count[s] - 2 + steps for s in live)
            st.run(live[-1] + 1, st.span(last), steps, params)
            for s in live:
                count[s] += steps

        while waiting or rows:
            if between is not None and between() and rows:  # new weights: prefill the in-flight contexts again
                busy = sorted(rows)
                start(busy, [list(prompts[rows[s][0]]) + toks[s] for s in busy], 1, [len(toks[s]) for s in busy])
            admit: list[int] = []
            new_slots: list[int] = []  # prompt-major, as prefill repeats each prompt n times
            while waiting and len(free) >= n:
                admit.append(waiting.popleft())
                take, free = free[:n], free[n:]
                for s_i, slot in enumerate(take):
                    rows[slot] = (admit[-1], s_i)
                    toks[slot], logps[slot], vers[slot] = [], [], []
                new_slots += take
            if admit:
                start(new_slots, [list(prompts[i]) for i in admit], n, [0] * len(new_slots))
            # copy what the device sampled since the last read; without ``between`` the next chunk is queued
            # behind the copy at once, so the device decodes while the host reads and finishes rows
            busy = sorted(rows)
            seen = {s: count[s] for s in busy}
            lo = min(len(toks[s]) for s in busy)
            copied = st.read(busy[-1] + 1, lo, max(seen.values()))
            if between is None:
                launch()
            tok_h, logp_h = copied()
            tok_l, logp_l = tok_h.tolist(), logp_h.tolist()
            if params.stop_strings:  # a stop string needs each token's text: row by row, token by token
                ends = self._stop_string_ends(busy, toks, seen, tok_l, lo, params, stop_ids)
            else:  # the first stop token or the last of the budget, for every row at once
                ends = finished_rows(tok_h, busy, [len(toks[s]) for s in busy], [seen[s] for s in busy], lo,
                                     params.max_new_tokens, stop_ids)
            for slot in busy:
                upto, reason = ends.get(slot, (seen[slot], None))
                a, b = len(toks[slot]) - lo, upto - lo
                toks[slot] += tok_l[slot][a:b]
                logps[slot] += logp_l[slot][a:b]
                vers[slot] += [self._version] * (b - a)
                if reason:
                    row = rows.pop(slot)
                    del count[slot]
                    out[row] = c_ = self.completion(row, toks.pop(slot), logps.pop(slot), reason, vers.pop(slot))
                    if on_finish is not None:
                        on_finish(c_)
                    free.append(slot)
            free.sort()
            if between is not None:
                launch()
        return [out[k] for k in sorted(out)]

    def _stop_string_ends(self, slots: list[int], toks: dict[int, list[int]], seen: dict[int, int],
                          tokens: list[list[int]], lo: int, params: SamplingParams,
                          stop_ids: set[int]) -> dict[int, tuple[int, str]]:
        """:func:`finished_rows` for sampling with stop strings, which need each new token's text: the row in
        slot ``s`` holds ``toks[s]`` on the host and the device has sampled ``seen[s]`` tokens of it, token
        ``lo + j`` read at ``tokens[s][j]``. Returns ``{slot: (tokens it keeps in all, reason)}`` for the rows
        that end."""
        ends = {}
        for slot in slots:
            seq = list(toks[slot])
            for c in range(len(seq), seen[slot]):
                seq.append(tokens[slot][c - lo])
                reason = self.finish_reason(seq, params, stop_ids)
                if reason:
                    ends[slot] = (c + 1, reason)
                    break
        return ends

    def stop_ids(self, params: SamplingParams) -> set[int]:
        """Token ids that end a row under ``params`` (:func:`~relayrl.engines.generation.base.stop_token_ids`,
        which the vLLM engine uses too)."""
        return stop_token_ids(params, self.eos_ids, self.tokenizer)

    def finish_reason(self, tokens: list[int], params: SamplingParams, stop_ids: set[int],
                      max_new: int | None = None) -> str | None:
        """Why a row stops after its newest token (``stop``/``length``), or None; ``max_new`` overrides
        ``params.max_new_tokens`` (a fed row's own budget)."""
        if tokens[-1] in stop_ids:
            return "stop"
        if params.stop_strings and hits_stop_string(self.tokenizer, tokens, params.stop_strings):
            return "stop"
        if len(tokens) >= (params.max_new_tokens if max_new is None else max_new):
            return "length"
        return None

    def completion(self, row: tuple[int, int], toks: list[int], logps: list[float], reason: str,
                   versions: list[int], routes: list[torch.Tensor] | None = None) -> Completion:
        return Completion(
            prompt_index=row[0],
            sample_index=row[1],
            token_ids=torch.tensor(toks, dtype=torch.long),
            logprobs=torch.tensor(logps, dtype=torch.float32),
            finish_reason=reason,  # type: ignore[arg-type]
            weight_version=self._version,
            text=self.tokenizer.decode(toks, skip_special_tokens=True),
            token_versions=torch.tensor(versions, dtype=torch.long),
            routed_experts=torch.cat(routes) if routes else None,
        )

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, cache):
        pos = (mask.long().cumsum(-1) - 1).clamp_min(0)[:, -ids.shape[1]:]
        if self.routing is None:
            out, cache = forward_with_cache(self.model, cache, input_ids=ids, attention_mask=mask, position_ids=pos)
            return out.logits[:, -1, :], cache
        with self.routing.record() as rec:
            out, cache = forward_with_cache(self.model, cache, input_ids=ids, attention_mask=mask, position_ids=pos)
        routes = rec.routes()  # [B * T, layers, k], the routers' token order
        self._routes = routes.to("cpu", torch.int16).reshape(*ids.shape, *routes.shape[1:])
        return out.logits[:, -1, :], cache

    # ------------------------------------------- step-level API (dynamic cache)
    # generate() and generate_feed() drive these; so does a caller that admits work while a batch runs
    # (relayrl.serving.batcher).
    def admit(self, batch: RunningBatch, prompts: list[Sequence[int]], indexes: list, n: int,
              budgets: list[int | None] | None = None) -> None:
        """Prefill new prompts once, repeat for n samples, and join them to the running batch as rows
        ``(indexes[i], 0..n-1)``; ``batch.next_logits`` then holds their first-token logits. ``budgets``:
        each prompt's own max new tokens (None: the sampling params')."""
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
        routes = [[self._routes[i, length - len(p):]] if self.routing is not None else []
                  for i, p in enumerate(prompts) for _ in range(n)]
        if n > 1:
            cache_rows.repeat_rows(cache, n)
            logits = logits.repeat_interleave(n, dim=0)
            mask = mask.repeat_interleave(n, dim=0)
        rows = [(i, s) for i in indexes for s in range(n)]
        if batch.cache is None:
            batch.cache, batch.mask, batch.next_logits = cache, mask, logits
        else:
            pad = length - batch.mask.shape[1]
            if pad:  # running rows are shorter than a new prompt: left-pad the running cache
                batch.mask = F.pad(batch.mask, (pad, 0))
            cache_rows.join_rows(batch.cache, cache, pad)
            batch.mask = torch.cat([batch.mask, mask], dim=0)
            batch.next_logits = torch.cat([batch.next_logits, logits], dim=0)
        if batch.seen is not None:
            added = seen_mask([p for p in prompts for _ in range(n)], logits.shape[-1], self.device)
            batch.seen = torch.cat([batch.seen, added], dim=0)
        batch.rows += rows
        batch.tokens += [[] for _ in rows]
        batch.logps += [[] for _ in rows]
        batch.versions += [[] for _ in rows]
        batch.routes += routes
        batch.prompts += [p for p in prompts for _ in range(n)]
        batch.budget += [b for b in (budgets or [None] * len(prompts)) for _ in range(n)]

    def _refill(self, batch: RunningBatch) -> None:
        """Partial rollout: rebuild the cache and next-token logits of every in-flight row from its context
        (prompt + tokens so far) with the weights now loaded (see the module docstring)."""
        from transformers import DynamicCache

        ctx = [list(p) + toks for p, toks in zip(batch.prompts, batch.tokens)]
        width = max(len(c) for c in ctx)
        ids = torch.full((len(ctx), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ctx), width), dtype=torch.long)
        for i, c in enumerate(ctx):
            ids[i, width - len(c):] = torch.as_tensor(c, dtype=torch.long)
            mask[i, width - len(c):] = 1
        mask = mask.to(self.device)
        batch.next_logits, batch.cache = self._forward(ids.to(self.device), mask,
                                                       DynamicCache(config=self.model.config))
        batch.mask = mask
        if self.routing is not None:  # the context's routes under the weights that continue
            batch.routes = [[self._routes[i, width - len(c):]] for i, c in enumerate(ctx)]

    def seen_tokens(self, batch: RunningBatch) -> torch.Tensor:
        """``[B, V]`` bool: the tokens of each row's prompt and response so far (what a repetition penalty
        acts on). Built from the rows' tokens on the first call; the batch keeps it up to date after that."""
        if batch.seen is None:
            batch.seen = seen_mask([list(p) + t for p, t in zip(batch.prompts, batch.tokens)],
                                   batch.next_logits.shape[-1], self.device)
        return batch.seen

    def retain(self, batch: RunningBatch, keep: list[int]) -> None:
        """Drop finished rows, then crop cache columns that are padding for every remaining row."""
        if not keep:
            batch.__init__()
            return
        idx = torch.tensor(keep, device=self.device)
        cache_rows.select_rows(batch.cache, idx)
        batch.mask = batch.mask[idx]
        batch.next_logits = batch.next_logits[idx]
        if batch.seen is not None:
            batch.seen = batch.seen[idx]
        batch.rows = [batch.rows[r] for r in keep]
        batch.tokens = [batch.tokens[r] for r in keep]
        batch.logps = [batch.logps[r] for r in keep]
        batch.versions = [batch.versions[r] for r in keep]
        batch.routes = [batch.routes[r] for r in keep]
        batch.prompts = [batch.prompts[r] for r in keep]
        batch.budget = [batch.budget[r] for r in keep]
        first = int(batch.mask.any(dim=0).long().argmax())
        if first > 0:
            batch.mask = batch.mask[:, first:]
            cache_rows.crop_columns(batch.cache, first)

    def advance(self, batch: RunningBatch, tok: torch.Tensor) -> None:
        """Feed each row its newest token ``tok`` [B]; ``batch.next_logits`` becomes the next position's."""
        batch.mask = F.pad(batch.mask, (0, 1), value=1)
        if batch.seen is not None:
            batch.seen[torch.arange(len(batch), device=self.device), tok.to(self.device)] = True
        batch.next_logits, batch.cache = self._forward(tok[:, None].to(self.device), batch.mask, batch.cache)
        if self.routing is not None:
            for r, chunks in enumerate(batch.routes):
                chunks.append(self._routes[r])
