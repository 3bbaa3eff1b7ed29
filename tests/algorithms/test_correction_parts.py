"""The parts of :func:`relayrl.algorithms.correction.rollout_correction` add up to the single function they were
split from: its body before the split (commit fa78520, the argument checks left out) is kept here as the oracle,
and the two must agree bit for bit, the factor and every metric, on random inputs under every setting."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from relayrl.algorithms._checks import check_batch, to_floats
from relayrl.algorithms._ops import LOG_CLAMP, masked_max, masked_mean
from relayrl.algorithms.correction import (divergence_mask, kl_statistic, level_log_weights, log_ratios, mask_outside,
                                           rollout_correction, token_kl, truncate)


def _oracle(old_logprobs, rollout_logprobs, mask, advantages=None, *, level="token", mode="truncate", high=2.0,
            low=None, kl_threshold=None, kl_kind="k1", negative_only=False, kl_reduce="mean", kl_low=None):
    """rollout_correction's body as one function, before the split."""
    with torch.no_grad():
        lr, m = log_ratios(old_logprobs, rollout_logprobs, mask)
        if advantages is not None:
            check_batch(old_logprobs=old_logprobs, advantages=advantages)
        valid = m > 0
        n_tok = m.sum(dim=1)
        has_tok = n_tok > 0
        zero = torch.zeros((), dtype=m.dtype, device=m.device)

        if level is None or level == "token":
            log_w = lr
        else:
            seq = lr.sum(dim=1)
            if level == "geometric":
                seq = seq / n_tok.clamp(min=1.0)
            log_w = seq.clamp(-LOG_CLAMP, LOG_CLAMP).unsqueeze(1).expand_as(lr)
        ratio = torch.exp(log_w)
        capped = torch.zeros_like(valid)
        out = torch.zeros_like(valid)
        if level is None:
            weight = torch.ones_like(lr)
        elif mode == "truncate":
            capped = (log_w > math.log(high)) & valid
            weight = torch.exp(log_w.clamp(max=math.log(high)))
        else:
            lo = 1.0 / high if low is None else low
            log_lo = math.log(lo) if lo > 0 else -math.inf
            out = ((log_w > math.log(high)) | (log_w < log_lo)) & valid
            weight = torch.where(out, zero, ratio)

        k1, k3 = token_kl(lr, "k1"), token_kl(lr, "k3")
        per_tok = token_kl(lr, kl_kind)
        if kl_reduce == "token":  # stat [B, T]: each token's own estimate
            stat, kl_max = per_tok, masked_max(per_tok, valid)
        else:  # stat [B, 1]: the sequence's reduction over its valid tokens (0 without any)
            if kl_reduce == "max":
                seq_kl = torch.where(valid, per_tok, torch.full((), -math.inf, dtype=m.dtype, device=m.device))
                seq_kl = torch.where(has_tok, seq_kl.amax(dim=1), zero)
            else:
                seq_kl = (per_tok * m).sum(dim=1)
                if kl_reduce == "mean":
                    seq_kl = seq_kl / n_tok.clamp(min=1.0)
            stat, kl_max = seq_kl.unsqueeze(1), masked_max(seq_kl, has_tok)
        dropped = torch.zeros_like(valid)
        if kl_threshold is not None:
            over = stat > kl_threshold if kl_low is None else (stat > kl_threshold) | (stat < kl_low)
            dropped = over & valid
            if negative_only:
                dropped = dropped & (advantages.detach() < 0)

        factor = torch.where(dropped, zero, weight) * m
        masked = (out | dropped) & valid
        seqs = has_tok.to(m.dtype)
        seq_any_cap = capped.any(dim=1).to(m.dtype)
        seq_all_masked = ((masked.sum(dim=1) == n_tok) & has_tok).to(m.dtype)
        metrics = {
            "correction/ratio_mean": masked_mean(ratio, m),
            "correction/ratio_max": masked_max(ratio, valid, empty=1.0),
            "correction/weight_mean": masked_mean(factor, m),
            "correction/token_capped_frac": masked_mean(capped.to(m.dtype), m),
            "correction/token_masked_frac": masked_mean(masked.to(m.dtype), m),
            "correction/seq_capped_frac": (seq_any_cap * seqs).sum() / seqs.sum().clamp(min=1.0),
            "correction/seq_masked_frac": seq_all_masked.sum() / seqs.sum().clamp(min=1.0),
            "correction/kl_k1": masked_mean(k1, m),
            "correction/kl_k3": masked_mean(k3, m),
            "correction/seq_kl_max": kl_max,
            "correction/kl_masked_frac": masked_mean(dropped.to(m.dtype), m),
        }
    return factor, to_floats(metrics)


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    """Log-probs of a mismatched pair of policies, ragged masks with an empty row, some non-finite values."""
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    old = -torch.rand(b, t, generator=g) * 3
    mu = old + torch.randn(b, t, generator=g) * 0.6
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[seed % b] = 0
    mask = (torch.arange(t) < lengths[:, None]).to(torch.int64)
    old[0, 0], mu[1, 1], old[2, 2], mu[2, 2] = -math.inf, -math.inf, -math.inf, -math.inf
    adv = torch.randn(b, t, generator=g)
    return old, mu, mask, adv


SETTINGS = [dict(level=level, mode=mode, high=high, low=low)
            for level in ("token", "sequence", "geometric", None) for mode in ("truncate", "mask")
            for high, low in ((2.0, None), (1.3, 0.0), (1.5, 0.8)) if not (mode == "truncate" and low is not None)]
KL = [dict(), *(dict(kl_threshold=th, kl_kind=kind, kl_reduce=reduce, negative_only=neg)
                for th, kind, reduce, neg in itertools.product((0.0, 0.3), ("k1", "k2", "k3"),
                                                                ("mean", "sum", "max", "token"), (False, True))),
      dict(kl_threshold=0.3, kl_low=-0.2), dict(kl_threshold=0.1, kl_low=-0.5, kl_reduce="token")]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_parts_match_the_single_function(seed):
    old, mu, mask, adv = _inputs(seed)
    for setting, kl in itertools.product(SETTINGS, KL):
        kw = {**setting, **kl}
        got, got_m = rollout_correction(old, mu, mask, adv, **kw)
        want, want_m = _oracle(old, mu, mask, adv, **kw)
        assert torch.equal(got, want), kw
        assert got_m.keys() == want_m.keys() and all(
            got_m[k] == want_m[k] or (math.isnan(got_m[k]) and math.isnan(want_m[k])) for k in got_m), kw


def test_each_part_by_hand():
    lr = torch.tensor([[0.0, 1.0, 0.2], [-0.5, 0.1, 0.0]])  # row 1's last token is padding
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    valid = m > 0
    torch.testing.assert_close(level_log_weights(lr, m, "sequence"), torch.tensor([[1.2] * 3, [-0.4] * 3]))
    torch.testing.assert_close(level_log_weights(lr, m, "geometric"), torch.tensor([[0.4] * 3, [-0.2] * 3]))
    w, capped = truncate(lr, valid, 2.0)
    torch.testing.assert_close(w[0], torch.tensor([1.0, 2.0, math.exp(0.2)]))
    assert capped.tolist() == [[False, True, False], [False, False, False]]
    w, out = mask_outside(lr, valid, 2.0, None)  # keeps [1/2, 2]: e^1 is above, e^-0.5 = 0.61 inside
    assert out.tolist() == [[False, True, False], [False, False, False]] and w[0, 1] == 0
    stat, largest = kl_statistic(token_kl(lr, "k1"), m, "sum")  # k1 = -l: sums -1.2 and 0.4
    torch.testing.assert_close(stat, torch.tensor([[-1.2], [0.4]]))
    assert float(largest) == pytest.approx(0.4)
    dropped = divergence_mask(stat, valid, 0.3, None, torch.tensor([[1.0] * 3, [1.0, -1.0, -1.0]]))
    assert dropped.tolist() == [[False, False, False], [False, True, False]]  # A < 0 and valid only
