"""Packed layouts for training forwards: shared-prompt attention (Periodic Asynchrony §4.2) and sequence packing.

A GRPO group is n responses to one prompt. Padded per-row training repeats the
prompt n times and pads every row to the longest one. Periodic Asynchrony (§4.2) instead
packs a group as **one** sequence ``[prompt, response_1, ..., response_n]``
with

1. labels only on response tokens,
2. position ids that restart at the prompt length for every response, so each
   response sits right after the prompt as in its own sequence,
3. a *shared-prompt mask*: a response token attends to the prompt and to the
   earlier tokens of its own response, never to another response,
4. log-probs taken on response tokens only; the first token of every response
   is predicted from the last prompt position.
5. each response's last token left out of the input: it predicts nothing in
   the pack (:attr:`PackUnit.feed_last`; routing replay keeps it).

The result is exactly the per-row computation (same positions, same visible
keys), with the prompt computed once and no padding inside a group.

Here a *unit* (:class:`PackUnit`) is one prompt with one or more responses.
Sequence packing is the same layout with one response per unit, and several
units share a packed row with a block-diagonal mask, so the same code serves
the reference / old-policy log-prob passes and SFT. Units are bin-packed into
rows, rows are right-padded to a common length ``L``; padding tokens attend
only to themselves (a fully masked query row would give NaN in SDPA, and NaN
activations poison weight gradients even where the loss ignores them).

Where this departs from Periodic Asynchrony:

* Periodic Asynchrony runs the mask inside a Megatron-style NPU kernel. We hand a dense
  4-D mask to PyTorch's ``scaled_dot_product_attention`` through the Hugging
  Face model (``attn_implementation="sdpa"``; an additive float mask for
  ``"eager"``). That is exact on CPU and GPU, but a dense mask costs
  ``P * L * L`` bytes (bool) -- and the kernel still computes the masked
  blocks. On CUDA, ``attn_implementation="flex_attention"`` runs the same
  predicate (:func:`shared_prompt_mask_mod`, index-based) as a FlexAttention
  ``BlockMask`` that skips the empty 128 x 128 tiles
  (:mod:`relayrl.engines.training.flex`); flash-attention varlen
  (``cu_seqlens`` from position ids) handles plain sequence packing but cannot
  express a prompt shared across segments. FlexAttention has no backward pass
  on CPU, which is why SDPA is the default.
* Periodic Asynchrony packs a whole micro-batch of one group; we also split a group whose
  packed length exceeds the micro-batch token budget into several units (each
  repeats the prompt) and bin-pack small units together, so one token budget
  bounds every forward.
* Rows are grouped by the caller's group ids **and** verified to have equal
  prompts (``torch.equal``); rows of one group id whose prompts differ are
  packed as separate units (correct, just no sharing).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Literal, Sequence

import torch

Tensor = torch.Tensor

__all__ = [
    "PackUnit", "PackedBatch", "fed_tokens", "plan_units", "cut_group", "pack_units", "plan_microbatches",
    "build_packed_batch",
    "shared_prompt_mask", "shared_prompt_mask_mod", "additive_mask", "to_device",
]


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """``t`` on ``device``. A host tensor bound for a GPU goes through pinned memory without blocking the host:
    a copy from pageable memory waits for every kernel queued before it, so a training pass that uploads its
    next micro-batch that way leaves the GPU idle while the host prepares it."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def fed_tokens(response_len: int, feed_last: bool) -> int:
    """Tokens of a response of ``response_len`` a training pass feeds: all of them with ``feed_last``, else all but
    the last, which predicts nothing (the engine's packed and padded passes, and the planner, count by this)."""
    return response_len if feed_last else max(response_len - 1, 0)


@dataclass(frozen=True)
class PackUnit:
    """One packed document: a prompt once, then the responses of ``rows`` in that order."""

    rows: tuple[int, ...]
    """Batch row index of each response (all rows share the prompt of ``rows[0]``)."""
    prompt_len: int
    response_lens: tuple[int, ...]
    feed_last: bool = True
    """Whether each response's last token is fed to the model. It predicts nothing inside the response, so a pass
    that only needs the log-probs (or values) of response tokens drops it (False); a pass that needs every
    token's hidden state -- MoE routes recorded or replayed for the whole sequence, a load-balancing loss over
    its tokens -- keeps it."""

    def fed(self, response_len: int) -> int:
        """Tokens of a response of ``response_len`` that enter the pack."""
        return fed_tokens(response_len, self.feed_last)

    @property
    def length(self) -> int:
        """Packed tokens: the prompt once plus every response (without its last token unless ``feed_last``)."""
        return self.prompt_len + sum(self.fed(n) for n in self.response_lens)

    @property
    def unpacked_length(self) -> int:
        """Tokens the same rows take one per row (prompt repeated), without padding."""
        return self.prompt_len * len(self.rows) + sum(self.fed(n) for n in self.response_lens)


@dataclass(frozen=True)
class PackedBatch:
    """A packed forward: ``P`` rows of length ``L`` holding ``B`` responses (``N`` response tokens in all).

    Response ``b`` (batch row ``rows[b]``) token ``t`` is predicted by the hidden
    state at ``[token_pack[i], token_src[i]]`` for the flat index ``i`` with
    ``token_row[i] == b`` and ``token_col[i] == t``.
    """

    input_ids: Tensor
    """[P, L] long, 0 on padding."""
    position_ids: Tensor
    """[P, L] long: 0..Lp-1 on a prompt, Lp..Lp+Lr-1 on each of its responses, 0 on padding."""
    doc_ids: Tensor
    """[P, L] long: unit index within its packed row, -1 on padding."""
    segment_ids: Tensor
    """[P, L] long: 0 on the prompt, j >= 1 on the j-th response of the unit, -1 on padding."""
    rows: tuple[int, ...]
    """[B] the batch row of each response, in output order."""
    response_lens: tuple[int, ...]
    """[B] tokens per response; ``T = max(response_lens)``."""
    token_pack: Tensor
    """[N] packed row of the position predicting each response token."""
    token_src: Tensor
    """[N] column of the position predicting each response token."""
    token_row: Tensor
    """[N] output row b of each response token."""
    token_col: Tensor
    """[N] index t of each response token within its response."""
    targets: Tensor
    """[N] the response token ids (labels)."""
    seq_row: Tensor | None = None
    """[P, L] long: the batch row each packed token comes from (a shared prompt: its unit's first row), -1 on
    padding; with :attr:`seq_pos`, where per-token data of the rows' prompt + response sequences (recorded
    routing) goes in the pack."""
    seq_pos: Tensor | None = None
    """[P, L] long: the token's index in that row's prompt + response, 0 on padding."""

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """T, the longest response."""
        return max(self.response_lens, default=0)

    def response_mask(self) -> Tensor:
        """[B, T] float, 1 on valid response tokens."""
        ar = torch.arange(self.width)
        return (ar[None, :] < torch.tensor(self.response_lens)[:, None]).float()

    def to_rows(self, flat: Tensor) -> Tensor:
        """Scatter per-token values ``[N]`` into response-aligned ``[B, T]`` (zeros elsewhere; keeps grad)."""
        if flat.shape[0] != self.token_row.numel():
            raise ValueError(f"flat has {flat.shape[0]} entries, expected {self.token_row.numel()} (response tokens)")
        out = flat.new_zeros(self.num_rows, self.width)
        return out.index_put((self.token_row.to(flat.device), self.token_col.to(flat.device)), flat)

    def pad_to(self, multiple: int, at_least: int = 0) -> "PackedBatch":
        """The same batch with ``L`` rounded up to a multiple of ``multiple`` (and to ``at_least``): padding
        columns (token 0, position 0, doc and segment -1) that attend only to themselves. Response tokens keep
        their indexes."""
        if multiple < 1:
            raise ValueError(f"multiple={multiple} must be >= 1")
        L = self.input_ids.shape[1]
        extra = max(L, at_least) + (-max(L, at_least) % multiple) - L
        if extra == 0:
            return self

        def pad(t: Tensor, value: int) -> Tensor:
            return torch.nn.functional.pad(t, (0, extra), value=value)

        return replace(self, input_ids=pad(self.input_ids, 0), position_ids=pad(self.position_ids, 0),
                       doc_ids=pad(self.doc_ids, -1), segment_ids=pad(self.segment_ids, -1),
                       seq_row=None if self.seq_row is None else pad(self.seq_row, -1),
                       seq_pos=None if self.seq_pos is None else pad(self.seq_pos, 0))

    def to(self, device: torch.device | str) -> "PackedBatch":
        moved = {k: (to_device(v, device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return PackedBatch(**moved)


def plan_units(prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor], groups: Sequence[int] | None = None,
               *, mode: Literal["sequences", "shared_prompt"] = "shared_prompt",
               max_len: int | None = None, feed_last: bool = True) -> list[PackUnit]:
    """Cut rows into units.

    ``mode="sequences"`` (or ``groups=None``): one unit per row. ``"shared_prompt"``:
    rows with the same group id **and** an identical prompt (``torch.equal``)
    form one unit, in row order; a unit whose packed length would exceed
    ``max_len`` is split into several (each repeating the prompt; a single
    prompt + response longer than ``max_len`` stays whole).

    Args:
        prompt_ids, response_ids: ``[Lp_i]`` and ``[Lr_i]`` token ids per row.
        groups: prompt-group id per row, or None.
        feed_last: each unit's :attr:`PackUnit.feed_last` (``max_len`` bounds the tokens fed).
    Returns: units covering every row exactly once, ordered by their first row.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"prompt_ids has {len(prompt_ids)} rows but response_ids has {len(response_ids)}")
    if groups is not None and len(groups) != len(prompt_ids):
        raise ValueError(f"groups has {len(groups)} rows, expected {len(prompt_ids)}")
    if mode not in ("sequences", "shared_prompt"):
        raise ValueError(f"mode={mode!r}; use 'sequences' or 'shared_prompt'")
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len={max_len} must be >= 1")
    for i, p in enumerate(prompt_ids):
        if p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"row {i}: prompt_ids must be a non-empty 1-D tensor (the last prompt token predicts "
                             f"the first response token), got shape {tuple(p.shape)}")
        if response_ids[i].dim() != 1:
            raise ValueError(f"row {i}: response_ids must be 1-D, got shape {tuple(response_ids[i].shape)}")
    rlen = [int(r.numel()) for r in response_ids]
    if mode == "sequences" or groups is None:
        return [PackUnit((i,), int(p.numel()), (rlen[i],), feed_last) for i, p in enumerate(prompt_ids)]
    # Clusters of rows with one group id and an equal prompt, in order of first appearance.
    clusters: list[list[int]] = []
    by_group: dict[int, list[int]] = {}  # group id -> indexes into clusters
    for i, p in enumerate(prompt_ids):
        for c in by_group.setdefault(int(groups[i]), []):
            q = prompt_ids[clusters[c][0]]
            if q.numel() == p.numel() and torch.equal(q, p):
                clusters[c].append(i)
                break
        else:
            by_group[int(groups[i])].append(len(clusters))
            clusters.append([i])
    units = []
    for rows in clusters:
        lp = int(prompt_ids[rows[0]].numel())
        fed = [fed_tokens(rlen[i], feed_last) for i in rows]
        for part in cut_group(lp, fed, max_len):
            units.append(PackUnit(tuple(rows[k] for k in part), lp, tuple(rlen[rows[k]] for k in part), feed_last))
    return units


def cut_group(prompt_len: int, response_lens: Sequence[int], max_len: int | None) -> list[list[int]]:
    """How a shared-prompt group is cut into units: indexes into ``response_lens`` per unit, in order, each unit's
    prompt + responses at most ``max_len`` tokens (None: one unit); a single prompt + response longer stays
    whole. The training engine (:func:`plan_units`) and the planner's simulator cut groups by this."""
    parts: list[list[int]] = []
    cur: list[int] = []
    total = prompt_len
    for k, n in enumerate(response_lens):
        if cur and max_len is not None and total + n > max_len:
            parts.append(cur)
            cur, total = [], prompt_len
        cur.append(k)
        total += n
    return parts + [cur] if cur else parts


def pack_units(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of unit lengths into rows of at most ``capacity`` tokens.

    Returns unit indexes per row, longest rows first; a unit longer than ``capacity`` gets a row of its own.
    """
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


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


def build_packed_batch(prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor],
                       packs: Sequence[Sequence[PackUnit]]) -> PackedBatch:
    """Lay out ``packs`` (units per packed row) as token ids, positions, doc/segment ids and label indexes.

    Shapes: ``P = len(packs)``, ``L`` = the longest packed row, ``B`` = responses
    in all units (output rows in unit order), ``N`` = their tokens. CPU tensors.
    A unit without :attr:`PackUnit.feed_last` leaves each response's last token out of the input; it stays a
    target, predicted from the token before it.
    """
    if not packs or any(len(p) == 0 for p in packs):
        raise ValueError("packs must be a non-empty list of non-empty unit lists")
    lengths = [sum(u.length for u in p) for p in packs]
    P, L = len(packs), max(lengths)
    # A loop over units and responses gathers per-segment and per-response facts; the per-token columns are then
    # a few whole-batch tensor operations (writing each slice into [P, L] costs a dispatch per segment, which for
    # many short responses took as long as the forward pass it feeds).
    pieces: list[Tensor] = []  # the token ids of each segment (a prompt, or a response's fed tokens), in order
    seg_meta: list[tuple[int, int, int, int, int]] = []  # (tokens, first position id, doc, segment, batch row)
    rows: list[int] = []
    rlens: list[int] = []
    resp_meta: list[tuple[int, int, int, int]] = []  # per non-empty response: (pack, first column, source of t=0, b)
    targets: list[Tensor] = []
    for pi, units in enumerate(packs):
        off = 0
        for d, u in enumerate(units):
            lp = u.prompt_len
            pieces.append(prompt_ids[u.rows[0]])
            seg_meta.append((lp, 0, d, 0, u.rows[0]))
            last_prompt = off + lp - 1
            off += lp
            for j, (i, lr) in enumerate(zip(u.rows, u.response_lens)):
                r = response_ids[i]
                if int(r.numel()) != lr:
                    raise ValueError(f"row {i}: response has {r.numel()} tokens but its unit records {lr}")
                rows.append(i)
                rlens.append(lr)
                if lr == 0:
                    continue
                resp_meta.append((pi, off, last_prompt, len(rows) - 1))
                targets.append(r)
                n = u.fed(lr)
                if n:
                    pieces.append(r[:n])
                    seg_meta.append((n, lp, d, j + 1, i))
                    off += n

    seg_len, pos0, doc0, seg0, row0 = (torch.tensor(c, dtype=torch.long) for c in zip(*seg_meta))
    row_len = torch.tensor(lengths, dtype=torch.long)
    at = torch.repeat_interleave(torch.arange(P), row_len) * L + _within(row_len)  # flat [P * L] index of each token

    def grid(flat: Tensor, fill: int) -> Tensor:
        return torch.full((P * L,), fill, dtype=torch.long).index_copy_(0, at, flat).view(P, L)

    pos = torch.repeat_interleave(pos0, seg_len) + _within(seg_len)
    position_ids = grid(pos, 0)
    return PackedBatch(grid(torch.cat(pieces).long(), 0), position_ids,
                       grid(torch.repeat_interleave(doc0, seg_len), -1),
                       grid(torch.repeat_interleave(seg0, seg_len), -1), tuple(rows), tuple(rlens),
                       *_token_index(resp_meta, [r for r in rlens if r]),
                       torch.cat(targets).long() if targets else torch.zeros(0, dtype=torch.long),
                       grid(torch.repeat_interleave(row0, seg_len), -1), position_ids.clone())


def _spread(values: Sequence[int], counts: Tensor) -> Tensor:
    """Each of ``values`` repeated its ``counts``."""
    return torch.repeat_interleave(torch.tensor(values, dtype=torch.long), counts)


def _within(counts: Tensor) -> Tensor:
    """Each element's index inside its run, for runs of ``counts`` elements laid end to end."""
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)


def _token_index(resp_meta: list[tuple[int, int, int, int]], lens: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``token_pack``, ``token_src``, ``token_row``, ``token_col`` of :class:`PackedBatch` from each non-empty
    response's (pack, first column, column predicting its first token, output row) and length: token ``t >= 1``
    is predicted by the column of token ``t - 1``."""
    if not resp_meta:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, empty, empty
    pack, first, src0, out_row = zip(*resp_meta)
    counts = torch.tensor(lens, dtype=torch.long)
    col = _within(counts)
    src = _spread([f - 1 for f in first], counts) + col
    src[torch.cumsum(counts, 0) - counts] = torch.tensor(src0, dtype=torch.long)
    return _spread(pack, counts), src, _spread(out_row, counts), col


def _allowed(q: Tensor, k: Tensor, doc_q: Tensor, doc_k: Tensor, seg_q: Tensor, seg_k: Tensor,
             pos_q: Tensor, pos_k: Tensor, sliding_window: int | None) -> Tensor:
    """The shared-prompt predicate (broadcasting): may query ``q`` attend to key ``k``?"""
    ok = (k <= q) & (doc_q == doc_k) & (doc_k >= 0) & ((seg_k == 0) | (seg_k == seg_q))
    if sliding_window is not None:
        ok = ok & (pos_q - pos_k < sliding_window)
    return ok | (q == k)  # padding attends to itself only; real tokens already see themselves


def shared_prompt_mask(doc_ids: Tensor, segment_ids: Tensor, position_ids: Tensor | None = None, *,
                       sliding_window: int | None = None, queries: slice | None = None) -> Tensor:
    """Dense boolean attention mask ``[P, 1, L, L]`` (True = attend) for a packed batch; with ``queries`` only
    those query rows, ``[P, 1, len(queries), L]``.

    Query ``q`` sees key ``k <= q`` of the same unit when ``k`` is on the prompt
    or on q's own response; padding sees only itself. With ``sliding_window``
    (Qwen2/Mistral-style sliding layers) a key is also dropped when its position
    id is ``>= sliding_window`` behind the query's, as it would be unpacked.

    Args:
        doc_ids, segment_ids: ``[P, L]`` from :class:`PackedBatch`.
        position_ids: ``[P, L]``; needed only with ``sliding_window``.
    Memory: ``P * L * L`` bytes; see the module docstring for block-sparse alternatives.
    """
    if doc_ids.shape != segment_ids.shape or doc_ids.dim() != 2:
        raise ValueError(f"doc_ids {tuple(doc_ids.shape)} and segment_ids {tuple(segment_ids.shape)} "
                         "must both be [P, L]")
    if sliding_window is not None and position_ids is None:
        raise ValueError("sliding_window needs position_ids")
    L = doc_ids.shape[1]
    ar = torch.arange(L, device=doc_ids.device)
    q = queries or slice(0, L)
    pq = pk = None
    if position_ids is not None:
        pq, pk = position_ids[:, q, None], position_ids[:, None, :]
    ok = _allowed(ar[None, q, None], ar[None, None, :], doc_ids[:, q, None], doc_ids[:, None, :],
                  segment_ids[:, q, None], segment_ids[:, None, :], pq, pk, sliding_window)
    return ok[:, None]


def shared_prompt_mask_mod(doc_ids: Tensor, segment_ids: Tensor, position_ids: Tensor | None = None, *,
                           sliding_window: int | None = None) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The same predicate as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` (index-based).

    Pass it to ``torch.nn.attention.flex_attention.create_block_mask(mask_mod, P, None, L, L)`` to get a
    ``BlockMask`` that skips empty blocks (CUDA; FlexAttention backward does not run on CPU).
    """
    if sliding_window is not None and position_ids is None:
        raise ValueError("sliding_window needs position_ids")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        pq = pk = None
        if position_ids is not None:
            pq, pk = position_ids[b, q_idx], position_ids[b, kv_idx]
        return _allowed(q_idx, kv_idx, doc_ids[b, q_idx], doc_ids[b, kv_idx], segment_ids[b, q_idx],
                        segment_ids[b, kv_idx], pq, pk, sliding_window)

    return mask_mod


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean mask (True = attend) -> additive float mask: 0 where allowed, the dtype's minimum elsewhere.

    The form ``attn_implementation="eager"`` adds to the attention scores.
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be boolean, got {mask.dtype}")
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)
