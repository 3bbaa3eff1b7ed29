"""Supervised fine-tuning loss: masked token cross-entropy.

``loss = agg(-log p(target_t))`` over the valid target tokens, with the same
aggregation modes as the policy loss (:mod:`relayrl.algorithms.aggregation`),
so SFT is exact under micro-batching when given global counts. The caller
provides the log-probs of the target tokens (``relayrl.models`` computes them
from logits with packing and masks).

Departure from the usual ``F.cross_entropy(ignore_index=-100)``: it takes
target log-probs and a mask instead of logits and label ids, and its default
``"token-mean"`` over the global batch does not change with how the batch is
split.
"""

from __future__ import annotations

import math

import torch

from relayrl.algorithms._checks import check_batch, check_ndim, to_floats
from relayrl.algorithms._ops import masked_mean
from relayrl.algorithms.aggregation import aggregate

Tensor = torch.Tensor

PPL_CLAMP = 50.0
"""The NLL above which ``sft/ppl`` is reported as ``exp(50)`` (no overflow for a diverged model)."""


def sft_loss(
    token_logprobs: Tensor,
    mask: Tensor,
    *,
    agg: str = "token-mean",
    global_tokens: int | None = None,
    global_seqs: int | None = None,
    constant: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Negative log-likelihood of the target tokens.

    Args:
        token_logprobs: ``[B, T]`` log-probs of the target tokens (requires grad).
        mask: ``[B, T]`` 1 on tokens that are trained on (e.g. the response).
        agg, global_tokens, global_seqs, constant: see :func:`aggregate`.

    Returns:
        ``(loss, metrics)`` with ``sft/loss``, ``sft/nll`` (token-mean NLL of
        this call), ``sft/ppl`` (``exp`` of it) and ``sft/tokens``.
    """
    check_ndim("token_logprobs", token_logprobs, 2)
    check_batch(token_logprobs=token_logprobs, mask=mask)
    loss = aggregate(
        -token_logprobs, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs,
        constant=constant,
    )
    with torch.no_grad():
        nll = masked_mean(-token_logprobs.detach(), mask)
        metrics = to_floats(
            {
                "sft/loss": loss.detach(),
                "sft/nll": nll,
                "sft/ppl": torch.exp(nll.clamp(max=PPL_CLAMP)),
                "sft/tokens": mask.bool().sum().to(nll.dtype),
            }
        )
    return loss, metrics


def perplexity(nll: float) -> float:
    """``sft/ppl`` of a batch from its token-mean NLL ``sft/nll``: taken after the NLL is reduced over
    micro-batches, ranks and optimizer steps, since the token mean of the micro-batches' perplexities is
    not the batch's (``exp`` is convex: it reads higher, by more the more the micro-batches differ)."""
    return math.exp(min(nll, PPL_CLAMP))
