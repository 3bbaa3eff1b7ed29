"""Row operations on a Hugging Face cache for the native engine's continuous batching, on every kind of layer.

The dynamic decode path keeps one ``DynamicCache`` for its running rows and changes which rows it holds: a
prompt prefilled once is repeated for its ``n`` samples, new prompts join the running rows, finished rows leave,
and columns that are padding for every row left are cut. A decoder's cache layers come in two kinds:

- **attention layers** hold keys and values ``[B, heads, T, D]``, with a sequence axis: joining rows left-pads
  the shorter side's columns (the rows are left-padded), and the padding columns can be cut. A sliding-window
  layer (Gemma 2 and 3, Mistral) keeps only its last ``window - 1`` columns and counts the columns seen
  (``cumulative_length``, which its masks are cut by): its two sides are padded to the longer one's columns,
  which may be fewer than the whole width, and its count follows the width;
- **linear-attention and state-space layers** (Qwen3.5's and Qwen3-Next's Gated DeltaNet, Mamba-style layers)
  hold a convolution state and a recurrent state per row (``conv_states`` / ``recurrent_states``, ``[B, ...]``),
  with no sequence axis: a row's state already summarises its whole context (a left-padded prompt's padding is
  masked out of it by the model), so rows are only repeated, selected and concatenated.

transformers' own ``batch_repeat_interleave`` and ``batch_select_indices`` reach the keys and values only
(transformers 5.19 has neither for ``LinearAttentionLayer``); these functions do both parts of every layer (a
hybrid layer class holding both too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["repeat_rows", "select_rows", "join_rows", "crop_columns"]


def _states(layer) -> list[dict]:
    """The per-row state dicts of a linear-attention layer (none for an attention layer)."""
    return [d for d in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None))
            if isinstance(d, dict)]


def _has_kv(layer) -> bool:
    return isinstance(getattr(layer, "keys", None), torch.Tensor)


def _map_states(layer, fn) -> None:
    for d in _states(layer):
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                d[k] = fn(v)


def repeat_rows(cache, n: int) -> None:
    """Each row ``n`` times in a row (row ``i`` becomes rows ``i n .. i n + n - 1``), in place."""
    for layer in cache.layers:
        if _has_kv(layer):
            layer.keys, layer.values = layer.keys.repeat_interleave(n, 0), layer.values.repeat_interleave(n, 0)
        _map_states(layer, lambda t: t.repeat_interleave(n, 0))


def select_rows(cache, idx: torch.Tensor) -> None:
    """Keep the rows ``idx`` (in that order), in place."""
    for layer in cache.layers:
        if _has_kv(layer):
            layer.keys, layer.values = layer.keys[idx], layer.values[idx]
        _map_states(layer, lambda t: t[idx])


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(t, (0, 0, width - t.shape[-2], 0)) if t.shape[-2] < width else t


def join_rows(cache, new, pad: int) -> None:
    """Append ``new``'s rows after ``cache``'s, in place; ``cache``'s attention columns are left-padded by ``pad``
    first (its rows are shorter than the new prompts: ``new``'s width is ``cache``'s plus ``pad``)."""
    for old, add in zip(cache.layers, new.layers):
        if _has_kv(old):
            if hasattr(old, "cumulative_length"):  # a sliding window: the last columns only, on either side
                width = max(old.keys.shape[-2], add.keys.shape[-2])
                old.keys, old.values, add.keys, add.values = (_left_pad(t, width) for t in
                                                              (old.keys, old.values, add.keys, add.values))
                old.cumulative_length = max(old.cumulative_length + pad, add.cumulative_length)
            elif pad:
                old.keys, old.values = _left_pad(old.keys, old.keys.shape[-2] + pad), \
                    _left_pad(old.values, old.values.shape[-2] + pad)
            old.keys = torch.cat([old.keys, add.keys], dim=0)
            old.values = torch.cat([old.values, add.values], dim=0)
        for d_old, d_new in zip(_states(old), _states(add)):
            for k, v in d_old.items():
                if isinstance(v, torch.Tensor):
                    d_old[k] = torch.cat([v, d_new[k]], dim=0)


def crop_columns(cache, first: int) -> None:
    """Drop the attention layers' first ``first`` columns (padding for every row left), in place; states are
    per row and keep nothing per column."""
    for layer in cache.layers:
        if not _has_kv(layer):
            continue
        if hasattr(layer, "cumulative_length"):  # a sliding window holds the last columns: cut what it has
            layer.cumulative_length -= first
            keep = min(layer.keys.shape[-2], layer.cumulative_length)
            layer.keys, layer.values = layer.keys[:, :, layer.keys.shape[-2] - keep:], \
                layer.values[:, :, layer.values.shape[-2] - keep:]
        else:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
