"""Token sampling for the native engine: one uniform per row, counter-based, by inverse CDF.

Each sampled token takes one uniform number ``u`` in [0, 1) and returns the token
where the cumulative distribution first exceeds ``u`` (inverse-CDF sampling;
a repetition penalty, top-k, top-p and min-p narrow the distribution first). Where ``u`` comes from:

* :func:`sample_next` without ``uniforms``: from the ``torch.Generator`` given (the
  serving batcher, a request's own seed);
* from :func:`row_uniforms`: a hash of the row's key and how many tokens the row
  has sampled so far. A row's key is :func:`row_key` of a seed drawn once per
  ``generate`` call from the run's generator and the row's (prompt, sample)
  index. The token a sample draws at step ``t`` therefore depends on the seed,
  its prompt and sample index, ``t`` and the logits, and not on which other rows
  share the batch, on the slot it runs in, or on how many decode steps run
  between two reads on the host: the dynamic and the static decode paths sample
  the same tokens, and the static path samples inside its CUDA graph, with no
  generator state to carry between replays.

The hash is a 32-bit integer mixer (two multiply-xorshift rounds per input word)
written with operators that mean the same on Python integers and on int64
tensors, with every product below 2**60 so that nothing overflows. Its 2**32
levels are far finer than any token's probability that matters in practice;
the cumulative sums run in float64, so the last of 152k tokens is placed as
exactly as the first, and in two levels (blocks of 128 tokens, then one block),
so no scan runs over the whole vocabulary: on a GPU a 152k-long float64 scan
per row took 0.37 ms of a 3.3 ms decode step.

In the compiled decode step (``rollout.decode_compile``), without top-k or
top-p (the usual RL rollout), no probability tensor of the vocabulary's size
is written (:func:`sample_from_logits`): :func:`block_mass`, compiled, reads
the logits for the row's log-sum-exp and its blocks' masses (two reductions),
the chosen block's 128 probabilities are computed again from its logits, and
the token's log-prob is its scaled logit less the log-sum-exp. Run eagerly
that takes more passes than ``log_softmax``, so eager sampling keeps the
probabilities. The logits may come in the model's dtype (bf16 on a GPU);
every sum is taken in float32 or float64.
"""

from __future__ import annotations

import math

import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.config import MIN_SCALE

__all__ = ["mix32", "row_key", "row_uniforms", "draw_seed", "sample_next", "sample_with", "inverse_cdf", "block_mass",
           "sample_from_logits", "penalize", "seen_mask"]

_PENALIZED_BOUND = float(torch.finfo(torch.float32).max) * MIN_SCALE / 2
"""The largest |logit| a repetition penalty leaves (divided by a temperature >= MIN_SCALE it stays finite)."""
_M = 0x45D9F3B  # the multiplier of a well-tested 32-bit integer hash (< 2**27)
_MASK = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash of ``x`` in [0, 2**32): an int or an int64 tensor, same result for both."""
    x = (((x >> 16) ^ x) * _M) & _MASK
    x = (((x >> 16) ^ x) * _M) & _MASK
    return (x >> 16) ^ x


def row_key(seed: int, prompt: int, sample: int) -> int:
    """The key of row ``(prompt, sample)`` under ``seed`` (a Python int in [0, 2**32))."""
    return mix32(mix32(mix32(seed & _MASK) ^ (prompt & _MASK)) ^ (sample & _MASK))


def row_uniforms(keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The uniform in [0, 1) of each row's next token: ``keys`` [B] int64 (:func:`row_key`), ``counts`` [B]
    int64 (tokens the row has sampled so far). float64, [B]."""
    h = mix32(mix32(keys) ^ (counts & _MASK))
    return (h.double() + 0.5) / 2.0 ** 32


def draw_seed(generator: torch.Generator | None) -> int:
    """One seed for a ``generate`` call, drawn from ``generator`` (the default one when None)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2 ** 32, (1,), generator=generator, device=device, dtype=torch.int64))


_BLOCK = 128  # tokens per block of the two-level search in inverse_cdf


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row of the non-decreasing ``cdf`` [B, N]: the first index whose value exceeds ``target`` [B], and never
    past the first index that reaches the row's total (so an index of zero mass is never returned, even when
    rounding puts ``target`` at or above the total)."""
    above = torch.searchsorted(cdf, target[:, None], right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(above, last).squeeze(-1)


def block_mass(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` [B, V] (any float dtype): the log-sum-exp of ``logits / temperature`` (float32 [B])
    and the probability mass of each block of 128 tokens under ``softmax(logits / temperature)`` (float64
    [B, ceil(V / 128)]; the last block padded with zero mass). Two reductions over the logits and nothing of
    size [B, V] kept, once compiled."""
    scaled = logits.float() / temperature
    lse = torch.logsumexp(scaled, dim=-1)
    B, V = scaled.shape
    pad = -V % _BLOCK
    probs = (scaled - lse[:, None]).exp()
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    return lse, probs.view(B, -1, _BLOCK).sum(-1, dtype=torch.float64)


def sample_from_logits(logits: torch.Tensor, temperature: float, u: torch.Tensor, mass=block_mass):
    """A token per row of ``softmax(logits / temperature)`` by inverse CDF at ``u`` [B], and its log-prob, with no
    [B, V] probability tensor: ``mass`` (:func:`block_mass`, or a compiled copy of it) gives the log-sum-exp and
    the blocks' masses; the chosen block's probabilities are computed again from its 128 logits."""
    B, V = logits.shape
    lse, sums = mass(logits, temperature)
    cdf = sums.cumsum(-1)  # [B, V / 128] float64
    target = u.to(torch.float64) * cdf[:, -1]
    block = _first_above(cdf, target)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp_min(0)[:, None]).squeeze(1), 0.0)
    idx = block[:, None] * _BLOCK + torch.arange(_BLOCK, device=logits.device)  # [B, 128]
    inside = idx < V
    vals = logits.gather(1, idx.clamp_max(V - 1)).float() / temperature
    inner = torch.where(inside, (vals - lse[:, None]).exp(), 0.0).double().cumsum(-1)
    tok = (block * _BLOCK + _first_above(inner, target - before)).clamp_max(V - 1)
    return tok, logits.gather(1, tok[:, None]).squeeze(1).float() / temperature - lse


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row of ``probs`` [B, V] where its cumulative sum first exceeds ``u`` [B] (scaled by the
    row's total); tokens of probability zero are never returned.

    Two levels, so that no scan runs over the whole vocabulary: the sums of blocks of 128 tokens (one read of
    ``probs``), their cumulative sum in float64 to find the block, then the cumulative sum of that block alone.
    """
    B, V = probs.shape
    pad = -V % _BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(B, -1, _BLOCK)
    cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, V / 128]
    target = u.to(torch.float64) * cdf[:, -1]
    block = _first_above(cdf, target)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp_min(0)[:, None]).squeeze(1), 0.0)
    inner = blocks.gather(1, block[:, None, None].expand(B, 1, _BLOCK)).squeeze(1).double().cumsum(-1)
    return (block * _BLOCK + _first_above(inner, target - before)).clamp_max(V - 1)


def seen_mask(contexts: Sequence[Sequence[int]], vocab: int, device: str | torch.device) -> torch.Tensor:
    """``[len(contexts), vocab]`` bool, True at ``[i, t]`` when token ``t`` occurs in ``contexts[i]``."""
    out = torch.zeros(len(contexts), vocab, dtype=torch.bool, device=device)
    rows = [i for i, c in enumerate(contexts) for _ in c]
    if rows:
        cols = torch.tensor([t for c in contexts for t in c], dtype=torch.long, device=device)
        out[torch.tensor(rows, device=device), cols] = True
    return out


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty of CTRL (Keskar et al. 2019) as Hugging Face ``generate`` and vLLM apply it: the
    logit of every token in ``seen`` (the row's prompt or response so far) is divided by ``penalty`` where it is
    positive and multiplied by it where it is negative, so ``penalty`` > 1 makes a seen token less likely.

    Args:
        logits: [B, V] (any float dtype; the result is float32).
        seen: [B, V] bool, True on the tokens the row's context holds.
    """
    x = logits.float()
    # a penalized logit is kept finite, and finite still once divided by a temperature down to MIN_SCALE: a
    # penalty past MAX_PENALTY (given around the checks) made a row whose tokens were all seen -inf everywhere,
    # NaN once softmaxed. (The unseen tokens' logits are the model's, as they are without a penalty.)
    hit = torch.where(x > 0, x / penalty, x * penalty).clamp(-_PENALIZED_BOUND, _PENALIZED_BOUND)
    return torch.where(seen, hit, x)


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                uniforms: torch.Tensor | None = None, seen: torch.Tensor | None = None):
    """Sample one token per row.

    Args:
        logits: [B, V] next-token logits (float32, or the model's dtype: sums are taken in float32/64).
        uniforms: [B] one uniform per row (:func:`row_uniforms`); None draws them from ``generator``.
        seen: [B, V] bool, the tokens of each row's context (needed when ``params.repetition_penalty`` != 1).
    Returns:
        tokens [B] int64 and their log-probs [B] under ``softmax(logits / T)``
        (greedy: under ``softmax(logits)``), before the penalty and the top-k/top-p/min-p filters.
    """
    if uniforms is None and params.temperature > 0:
        uniforms = torch.rand(logits.shape[0], generator=generator, dtype=torch.float64,
                              device=generator.device if generator is not None else logits.device)
    return sample_with(logits, params.temperature, params.top_k, params.top_p, uniforms, min_p=params.min_p,
                       penalty=params.repetition_penalty, seen=seen)


def sample_with(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, uniforms: torch.Tensor | None,
                mass=None, *, min_p: float = 0.0, penalty: float = 1.0, seen: torch.Tensor | None = None):
    """:func:`sample_next` on plain arguments (what the static decoder records into its step); ``logits`` may be
    in the model's dtype. ``mass``: a compiled :func:`block_mass`, for :func:`sample_from_logits` when nothing
    filters (the compiled decode step); None keeps the eager path (fewer passes run eagerly).

    The order is Hugging Face's: the repetition penalty on the logits, the temperature, then top-k, top-p and
    min-p (keep the tokens whose probability is at least ``min_p`` times the row's most likely one's)."""
    if penalty != 1.0 and seen is None:
        raise ValueError("a repetition penalty needs each row's seen tokens (seen=[B, V] bool)")
    if temperature == 0.0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = (logp if penalty == 1.0 else penalize(logits, seen, penalty)).argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    V = logits.shape[-1]
    plain = (not top_k or top_k >= V) and top_p >= 1.0 and min_p <= 0.0 and penalty == 1.0
    if mass is not None and plain:
        return sample_from_logits(logits, temperature, uniforms.to(logits.device), mass)
    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    filtered = scaled if penalty == 1.0 else penalize(logits, seen, penalty) / temperature
    if top_k and top_k < V:
        kth = torch.topk(filtered, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        drop[:, 0] = False  # (and always the most likely: a top_p below float32's range compares as 0 >= 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    if min_p > 0.0:  # p >= min_p * p_max  <=>  logit >= max logit + log(min_p)
        floor = filtered.max(dim=-1, keepdim=True).values + math.log(min_p)
        filtered = filtered.masked_fill(filtered < floor, float("-inf"))
    probs = logp.exp() if filtered is scaled else torch.softmax(filtered, dim=-1)
    tok = inverse_cdf(probs, uniforms.to(logits.device))
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
