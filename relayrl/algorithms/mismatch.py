"""Train/generation mismatch: the "logprob error" metric of NeMo RL.

On-policy RL assumes the generation engine samples from the same distribution
the trainer computes. The metric is the mean over valid tokens of
``exp(|logp_generation - logp_train|)``: 1.0 is a perfect match and values
above about 1.05 call for investigation (the NeMo RL talk, "Motivation for tracking
logprob error"). The maximum and a per-sequence version localise a bad token
or sample.

Departures: a sequence with no valid token has per-sequence error 1.0 (the
neutral value) rather than NaN; differences are clamped at 20 nats before
``exp``.
"""

from __future__ import annotations

import torch

from relayrl.algorithms._checks import as_float_mask, check_batch, check_ndim, to_floats
from relayrl.algorithms._ops import LOG_CLAMP, masked_mean

Tensor = torch.Tensor



def _token_error(gen_logprobs: Tensor, train_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    check_ndim("gen_logprobs", gen_logprobs, 2)
    check_batch(gen_logprobs=gen_logprobs, train_logprobs=train_logprobs, mask=mask)
    m = as_float_mask(mask, train_logprobs)
    diff = (gen_logprobs.detach().to(m.dtype) - train_logprobs.detach()).abs().clamp(max=LOG_CLAMP)
    err = torch.where(m > 0, torch.exp(diff), torch.ones_like(diff))
    return err, m


def logprob_error_per_seq(gen_logprobs: Tensor, train_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence mean of ``exp(|gen - train|)``: ``[B]`` (1.0 for empty rows)."""
    with torch.no_grad():
        err, m = _token_error(gen_logprobs, train_logprobs, mask)
        n = m.sum(dim=1)
        per_seq = ((err - 1.0) * m).sum(dim=1) / n.clamp(min=1.0) + 1.0
    return per_seq


def logprob_error(gen_logprobs: Tensor, train_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """Batch logprob error metrics for ``[B, T]`` log-probs of the sampled tokens.

    Returns:
        ``rollout/logprob_error`` (mean over valid tokens),
        ``rollout/logprob_error_max`` (worst token),
        ``rollout/logprob_error_seq_max`` (worst per-sequence mean),
        ``rollout/logprob_diff_mean`` (mean signed ``gen - train``).
    """
    with torch.no_grad():
        err, m = _token_error(gen_logprobs, train_logprobs, mask)
        per_seq = logprob_error_per_seq(gen_logprobs, train_logprobs, mask)
        signed = gen_logprobs.detach().to(m.dtype) - train_logprobs.detach()
        return to_floats(
            {
                "rollout/logprob_error": masked_mean(err, m),
                "rollout/logprob_error_max": err.max(),
                "rollout/logprob_error_seq_max": per_seq.max(),
                "rollout/logprob_diff_mean": masked_mean(signed, m),
            }
        )
