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
comes out of the same chunks, without a gradient; so does, when asked (``with_sum_sq``), the sum of the
squared probabilities ``S = sum_v p_v^2 = exp(logsumexp(2x) - 2 logsumexp(x))`` (``x = logits / T``; the
Optimal Token Baseline's per-token statistic, :mod:`relayrl.algorithms.otb`): one more reduction per chunk,
in the chunk's own float32 step (eager, or compiled with ``fused``; the Triton kernels do not compute it,
so with :data:`FUSED` ``= "triton"`` this reduction runs eagerly beside them).

The matrix products run in the hidden states' dtype (bf16 under mixed
precision), the softmax in float32; the weight's gradient accumulates in
float32 and is returned in the weight's dtype. With ``head_dtype=torch.float32``
(``model.head_fp32``, :mod:`relayrl.models.head_precision`) the products run in
float32 instead, under autocast disabled: the weight is cast once per pass (a
float32 ``[V, d]`` copy when it is stored in bf16, as under FSDP2 or
``engine.compute_copy``; none for float32 master weights under autocast), the
hidden states a chunk at a time (all ``[N, d]`` of them at once in the
``"vocab"`` backward, which multiplies every position by each slice), and
``"stored"`` keeps its logits in float32 (twice the bytes of bf16). The fused
steps take float32 logits as they take bf16 ones.

The backward pass recomputes the logits in one of two orders (``grad_by``):

- ``"positions"``: ``chunk`` positions against the whole vocabulary at a time.
  Each chunk adds its ``[V, d]`` share of the weight's gradient into a float32
  sum, so for N positions the gradient is read and written ``N / chunk`` times
  (on Qwen2-0.5B's head, 136M values: about 0.4 ms an add on an H100, 13 ms of a
  0.29 s update).
- ``"vocab"``: every position against a slice of the vocabulary at a time, the
  slice sized so that ``positions x slice`` is no more than ``chunk x V`` (the
  same memory). Each slice of the weight's gradient is then one matrix product
  over all N positions, written once and rounded once; the hidden states'
  gradient (``[N, d]``, small) is what accumulates, in float32, over slices.
- ``"stored"``: no recompute. The forward pass keeps every position's logits
  in the compute dtype (``N x V`` values: 7.5 GB in bf16 for 24.6k positions of
  a 152k vocabulary), and the backward pass turns them into their gradient in
  place, a chunk at a time; then the hidden states' and the weight's gradients
  are one matrix product each over all positions. It saves the third of the
  head's matrix products that recomputes the logits. One backward pass per
  forward pass (the stored logits are spent); passes without a gradient
  (reference and old log-probs) store nothing.

With ``fused=True`` (``engine.fused_head``, for GPUs) the float32 steps of a
chunk -- the log-sum-exp, the target's logit and the entropy, and in the
backward pass the softmax gradient -- are two functions compiled with
``torch.compile``: each reads the chunk's logits in the compute dtype once and
writes per-position values (or the compute-dtype gradient), instead of
materialising float32 ``[chunk, vocab]`` copies and several element-wise passes
over them. The same formulas; the rounding differs in the last bits. With
:data:`FUSED` ``= "triton"`` they are relayrl's own one-pass Triton kernels
instead (:mod:`relayrl.engines.training.head_kernels`).
"""

from __future__ import annotations

import torch

from relayrl.models.logits import softcap as _softcap, softcap_grad

__all__ = ["ChunkedTokenLogprobs", "chunked_token_logprobs", "GRAD_ORDERS"]

GRAD_ORDERS = ("positions", "vocab", "stored")
"""How the backward pass slices its ``[positions, vocab]`` recompute (see the module docstring)."""

_NO_GRADS = (None,) * 9  # the gradients of forward's arguments after hidden and weight (none)

_compiled: dict[str, object] = {}


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """``logits [c, V]`` -> float32 (log-sum-exp, log-prob of the target, entropy or empty) of
    ``softmax(logits / temperature)``, each ``[c]``."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    z = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, targets[:, None]).squeeze(-1) - z
    ent = z - (torch.softmax(x, dim=-1) * x).sum(-1) if with_entropy else z.new_empty(0)
    return z, logp, ent


def _chunk_sum_sq(logits: torch.Tensor, lse: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits [c, V]`` and their log-sum-exp ``lse [c]`` (of ``logits / temperature``) -> float32
    ``sum_v softmax(logits / temperature)_v^2 = exp(logsumexp(2x) - 2 lse)``, ``[c]``."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    return torch.exp(torch.logsumexp(2.0 * x, dim=-1) - 2.0 * lse)


def _chunk_grad(logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor,
                temperature: float) -> torch.Tensor:
    """``grad [c] x d logp[target] / d logits = grad * (onehot(target) - softmax) / temperature``, ``[c, V]``
    in the logits' dtype."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    onehot = torch.arange(x.shape[-1], device=x.device)[None, :] == targets[:, None]
    d = (onehot.float() - torch.exp(x - lse[:, None])) * grad[:, None]
    if temperature != 1.0:
        d = d / temperature
    return d.to(logits.dtype)


def _chunk_grad_eager(logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor,
                      temperature: float) -> torch.Tensor:
    """:func:`_chunk_grad` for the eager path, on one float32 ``[c, V]`` tensor (steps in place; ``logits``, a
    product made for this call, may be overwritten). A target outside ``[0, V)`` (a vocabulary slice without
    it) adds nothing."""
    d = logits.float()
    if temperature != 1.0:
        d /= temperature
    d.sub_(lse[:, None]).exp_().mul_(-grad[:, None])  # - grad * softmax
    inside = (targets >= 0) & (targets < d.shape[1])
    d[torch.arange(d.shape[0], device=d.device)[inside], targets[inside]] += grad[inside]
    if temperature != 1.0:
        d /= temperature
    return d.to(logits.dtype)


def _chunk_grad_inplace(logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor,
                        temperature: float) -> None:
    """:func:`_chunk_grad` written over ``logits`` (compiled, one kernel reads and rewrites the chunk)."""
    logits.copy_(_chunk_grad(logits, lse, grad, targets, temperature))


def _vocab_slice(chunk: int, vocab: int, positions: int) -> int:
    """Vocabulary entries per slice of the ``"vocab"`` backward: ``positions x slice <= chunk x vocab`` (at least
    one entry), a multiple of 128 once it is that large (aligned matrix-product shapes)."""
    width = max(1, min(vocab, chunk * vocab // max(1, positions)))
    return width - width % 128 if 128 <= width < vocab else width


FUSED = "compile"
"""How ``fused=True`` (``engine.fused_head``) fuses a chunk's float32 steps: ``"compile"`` (``torch.compile``
of :func:`_chunk_stats` and :func:`_chunk_grad`) or ``"triton"`` (the one-pass kernels of
:mod:`relayrl.engines.training.head_kernels`; CUDA, or Triton's interpreter). ``benchmarks/gpu.py``'s
``tritonhead`` variant times the second."""


def _fused(fn):
    """``fn``'s fused version: compiled once per process (dynamic shapes: the last chunk is shorter), or its
    Triton kernel (:data:`FUSED`)."""
    if FUSED == "triton":
        from relayrl.engines.training import head_kernels

        if fn is _chunk_stats:
            return head_kernels.chunk_stats
        if fn is _chunk_grad:
            return head_kernels.chunk_grad
        assert fn is _chunk_grad_inplace, fn
        return lambda logits, lse, grad, targets, temperature: head_kernels.chunk_grad(
            logits, lse, grad, targets, temperature, out=logits)
    if FUSED != "compile":
        raise ValueError(f"head.FUSED={FUSED!r} must be 'compile' or 'triton'")
    name = fn.__name__
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True)
    return _compiled[name]


def _product_grad(ctx, grad_fn, product: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                  targets: torch.Tensor) -> torch.Tensor:
    """``grad x d logp[target] / d product`` for a recomputed chunk (or slice) of the head's product, in its
    dtype: through the soft cap first when the model caps its logits (``ctx.softcap``), recomputed as the
    forward pass computed it (float32 on the eager path, the products' dtype on the fused one)."""
    if ctx.softcap is None:
        return grad_fn(product, lse, grad, targets, ctx.temperature)
    capped = _softcap(product if ctx.fused else product.float(), ctx.softcap)
    factor = softcap_grad(capped, ctx.softcap)  # (before grad_fn, which may write over its input)
    return grad_fn(capped, lse, grad, targets, ctx.temperature).float().mul_(factor).to(product.dtype)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``(hidden [N, d], weight [V, d], targets [N]) -> (logprobs [N], entropy [N], sum_sq [N])`` (the last two
    empty unless asked, neither with a gradient); see the module docstring."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool, fused: bool = False, grad_by: str = "positions",
                with_sum_sq: bool = False, head_dtype: torch.dtype | None = None, softcap: float | None = None):
        dt = head_dtype or hidden.dtype  # the products' dtype
        w = weight.to(dt)  # (once per pass; no copy when the weight is stored in dt)
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        sq = torch.empty(n if with_sum_sq else 0, dtype=torch.float32, device=hidden.device)
        sum_sq = _fused(_chunk_sum_sq) if fused and FUSED == "compile" else _chunk_sum_sq  # (no Triton kernel)
        stats = _fused(_chunk_stats) if fused else None
        kept = torch.empty(n, w.shape[0], dtype=w.dtype, device=hidden.device) if grad_by == "stored" else None
        if kept is not None and stats is None:
            stats = _chunk_stats  # the eager steps below work in place on the logits, which are kept here
        for s in range(0, n, chunk):
            if stats is not None:
                h = hidden[s:s + chunk].to(dt)
                logits = h @ w.T if kept is None else torch.matmul(h, w.T, out=kept[s:s + chunk])
                if softcap is not None:  # (in the products' dtype, as the model's forward caps; kept capped)
                    logits = _softcap(logits, softcap) if kept is None else logits.copy_(_softcap(logits, softcap))
                z, lp, e = stats(logits, targets[s:s + chunk], temperature, with_entropy)
                lse[s:s + chunk], logp[s:s + chunk] = z, lp
                if with_entropy:
                    ent[s:s + chunk] = e
                if with_sum_sq:
                    sq[s:s + chunk] = sum_sq(logits, z, temperature)
                continue
            logits = (hidden[s:s + chunk].to(dt) @ w.T).float()  # (a fresh product: scaled in place below)
            if softcap is not None:
                logits = _softcap(logits, softcap)
            if temperature != 1.0:
                logits /= temperature
            z = torch.logsumexp(logits, dim=-1)
            lse[s:s + chunk] = z
            logp[s:s + chunk] = logits.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - z
            if with_entropy:  # H = logsumexp - sum p * logits
                ent[s:s + chunk] = z - torch.softmax(logits, dim=-1).mul_(logits).sum(-1)
            if with_sum_sq:  # (the logits are already scaled by the temperature)
                sq[s:s + chunk] = _chunk_sum_sq(logits, z, 1.0)
        ctx.save_for_backward(hidden, weight, targets, lse, *([] if kept is None else [kept]))
        ctx.temperature, ctx.chunk, ctx.fused, ctx.grad_by, ctx.dtype = temperature, chunk, fused, grad_by, dt
        ctx.softcap = softcap
        ctx.spent = False
        ctx.mark_non_differentiable(ent, sq)
        return logp, ent, sq

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_ent: torch.Tensor, _grad_sq: torch.Tensor):
        # the products in ctx.dtype, as in the forward pass: an autocast around the backward call must not recast them
        with torch.autocast(grad_logp.device.type, enabled=False):
            if ctx.grad_by == "vocab":
                return ChunkedTokenLogprobs._backward_by_vocab(ctx, grad_logp)
            if ctx.grad_by == "stored":
                return ChunkedTokenLogprobs._backward_stored(ctx, grad_logp)
            return ChunkedTokenLogprobs._backward_by_positions(ctx, grad_logp)

    @staticmethod
    def _backward_by_positions(ctx, grad_logp: torch.Tensor):
        """The backward pass ``chunk`` positions at a time (``grad_by="positions"``)."""
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk = ctx.chunk
        w = weight.to(ctx.dtype)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_fn = _fused(_chunk_grad) if ctx.fused else _chunk_grad_eager
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk].to(ctx.dtype)
            dlogits = _product_grad(ctx, grad_fn, h @ w.T, lse[s:s + chunk], grad_logp[s:s + chunk].float(),
                                    targets[s:s + chunk])
            if grad_h is not None:
                grad_h[s:s + chunk] = dlogits @ w
            if grad_w is not None:  # the product in the compute dtype, summed in float32 by one kernel (no copy)
                grad_w.add_(dlogits.T @ h)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), *_NO_GRADS

    @staticmethod
    def _backward_stored(ctx, grad_logp: torch.Tensor):
        """The backward pass on the forward pass's kept logits (``grad_by="stored"``), rewritten in place into
        their gradient."""
        if ctx.spent:
            raise RuntimeError("the chunked head's stored logits were spent by a first backward pass "
                               "(engine.head_grad=stored takes one backward pass per forward pass)")
        ctx.spent = True
        hidden, weight, targets, lse, kept = ctx.saved_tensors
        g = grad_logp.float()
        grad_fn = _fused(_chunk_grad_inplace) if ctx.fused else _chunk_grad_inplace
        for s in range(0, hidden.shape[0], ctx.chunk):
            capped = kept[s:s + ctx.chunk]
            factor = None if ctx.softcap is None else softcap_grad(capped, ctx.softcap)  # (before it is overwritten)
            grad_fn(capped, lse[s:s + ctx.chunk], g[s:s + ctx.chunk], targets[s:s + ctx.chunk], ctx.temperature)
            if factor is not None:  # through the cap: d softcap(x) / dx
                capped.copy_(capped.float().mul_(factor))
        grad_h = (kept @ weight.to(ctx.dtype)).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (kept.T @ hidden.to(ctx.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, *_NO_GRADS

    @staticmethod
    def _backward_by_vocab(ctx, grad_logp: torch.Tensor):
        """The backward pass a vocabulary slice at a time (``grad_by="vocab"``; see the module docstring)."""
        hidden, weight, targets, lse = ctx.saved_tensors
        n, vocab = hidden.shape[0], weight.shape[0]
        w = weight.to(ctx.dtype)
        g = grad_logp.float()
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) \
            if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        grad_fn = _fused(_chunk_grad) if ctx.fused else _chunk_grad_eager
        step = _vocab_slice(ctx.chunk, vocab, n)
        hidden_t = hidden.to(ctx.dtype)  # (every position meets every slice; [N, d] is small)
        for v in range(0, vocab, step):
            wv = w[v:v + step]
            # the target's column in this slice; outside [0, width) it is not in the slice
            dlogits = _product_grad(ctx, grad_fn, hidden_t @ wv.T, lse, g, targets - v)
            if grad_h is not None:
                grad_h.add_(dlogits @ wv)
            if grad_w is not None:  # this slice's whole gradient: one product over every position
                grad_w[v:v + step] = dlogits.T @ hidden_t
        return None if grad_h is None else grad_h.to(hidden.dtype), grad_w, *_NO_GRADS


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                           temperature: float = 1.0, chunk: int = 4096, with_entropy: bool = False,
                           fused: bool = False, grad_by: str = "positions", with_sum_sq: bool = False,
                           head_dtype: torch.dtype | None = None, softcap: float | None = None):
    """Log-probs of ``targets`` [N] under ``softmax(hidden [N, d] @ weight [V, d]^T / temperature)``, and the
    entropy of each position (no gradient) when ``with_entropy``, or None: ``(logprobs, entropy)``; with
    ``with_sum_sq`` also each position's ``sum_v p_v^2`` (no gradient): ``(logprobs, entropy, sum_sq)``.
    Each ``[N, V]``-sized step is ``chunk`` positions at a time (in the backward pass, with ``grad_by="vocab"``,
    as many values a vocabulary slice at a time; with ``"stored"``, on logits kept by the forward pass), its
    float32 steps compiled into fused kernels when ``fused``. ``head_dtype``: the matrix products' dtype
    (``torch.float32`` for ``model.head_fp32``); None: the hidden states' (under autocast, the autocast dtype).
    ``softcap``: the logits are ``softcap * tanh(h W^T / softcap)`` before the temperature divides them (Gemma's
    ``final_logit_softcapping``, :mod:`relayrl.models.logits`); None: ``h W^T``."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    if grad_by not in GRAD_ORDERS:
        raise ValueError(f"grad_by={grad_by!r} must be one of {GRAD_ORDERS}")
    if grad_by == "stored" and not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        grad_by = "positions"  # no backward pass will come: nothing to store
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind) and head_dtype is None:  # the residual stream is float32 under autocast;
        hidden = hidden.to(torch.get_autocast_dtype(kind))  # the head runs in bf16
    with torch.autocast(kind, enabled=False):  # the products in the dtype chosen here, not recast
        logp, ent, sq = ChunkedTokenLogprobs.apply(hidden, weight, targets.long(), float(temperature), int(chunk),
                                                   bool(with_entropy), bool(fused), grad_by, bool(with_sum_sq),
                                                   head_dtype, None if softcap is None else float(softcap))
    return (logp, ent if with_entropy else None) + ((sq,) if with_sum_sq else ())
