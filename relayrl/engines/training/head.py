"""Log-probs of chosen tokens straight from hidden states, the output head applied a chunk at a time.

A policy pass needs ``log softmax(h W^T / T)[target]`` at every response
position. Materialising the logits costs ``positions x vocab`` floats several
times over (the head's output, its float32 copy, the log-softmax, and their
gradients): for Qwen2-0.5B's 151,936-token vocabulary, 12k positions make
7 GB per copy, which set the peak of a 16k-token update (60 GB) on an H100.
:class:`ChunkedTokenLogprobs` keeps only the hidden states, the head weight
and one log-sum-exp per position; each chunk's logits are computed, reduced
and dropped, and recomputed in the backward pass (as fused linear-cross-entropy
kernels do, e.g. Liger's; here in plain PyTorch). The entropy of each position
comes out of the same chunks, without a gradient.

The matrix products run in the hidden states' dtype (bf16 under mixed
precision), the softmax in float32; the weight's gradient accumulates in
float32 and is returned in the weight's dtype.
"""

from __future__ import annotations

import torch

__all__ = ["ChunkedTokenLogprobs", "chunked_token_logprobs"]


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``(hidden [N, d], weight [V, d], targets [N]) -> (logprobs [N], entropy [N])``; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool):
        w = weight.to(hidden.dtype)
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            logits = (hidden[s:s + chunk] @ w.T).float()
            if temperature != 1.0:
                logits /= temperature
            z = torch.logsumexp(logits, dim=-1)
            lse[s:s + chunk] = z
            logp[s:s + chunk] = logits.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - z
            if with_entropy:  # H = logsumexp - sum p * logits
                ent[s:s + chunk] = z - torch.softmax(logits, dim=-1).mul_(logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_ent: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        w = weight.to(hidden.dtype)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        rows = torch.arange(min(chunk, hidden.shape[0]), device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            g = grad_logp[s:s + chunk].float()
            dlogits = (h @ w.T).float()
            if T != 1.0:
                dlogits /= T
            # d logp[target] / d logits = onehot(target) - softmax, then / T for the temperature (in place:
            # one float32 chunk alive at a time)
            dlogits.sub_(lse[s:s + chunk, None]).exp_().mul_(-g[:, None])
            dlogits[rows[: h.shape[0]], targets[s:s + chunk]] += g
            if T != 1.0:
                dlogits /= T
            dlogits = dlogits.to(hidden.dtype)
            if grad_h is not None:
                grad_h[s:s + chunk] = dlogits @ w
            if grad_w is not None:
                grad_w += (dlogits.T @ h).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                           temperature: float = 1.0, chunk: int = 4096, with_entropy: bool = False):
    """Log-probs of ``targets`` [N] under ``softmax(hidden [N, d] @ weight [V, d]^T / temperature)``, and the
    entropy of each position (no gradient) when ``with_entropy``; each ``[N, V]``-sized step is ``chunk``
    positions at a time."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):  # the residual stream is float32 under autocast; the head runs in bf16
        hidden = hidden.to(torch.get_autocast_dtype(kind))
    logp, ent = ChunkedTokenLogprobs.apply(hidden, weight, targets.long(), float(temperature), int(chunk),
                                           bool(with_entropy))
    return logp, (ent if with_entropy else None)
