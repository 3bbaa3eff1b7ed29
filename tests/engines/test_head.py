"""The chunked output head: the same log-probs, entropies and gradients as materialised logits."""

import pytest
import torch

from relayrl.engines.training.base import OptimConfig
from relayrl.engines.training.head import _vocab_slice, chunked_token_logprobs
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.models.load import load_model
from relayrl.workflows.losses import PolicyLoss

from tests.engines.head_compare import fused_matches_eager
from tests.engines.test_precision import _batch


@pytest.mark.parametrize("grad_by", ["positions", "vocab", "stored"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_match_materialised_logits(temperature, grad_by):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 30, (11,), generator=g)
    t[:3] = torch.tensor([0, 29, 10])  # the first and last entry, and a slice's first (slices of 4 * 30 // 11 = 10)
    up = torch.randn(11, generator=g, dtype=torch.float64)
    lp, ent = chunked_token_logprobs(h, w, t, temperature=temperature, chunk=4, with_entropy=True, grad_by=grad_by)
    (lp * up).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logp = torch.log_softmax(h @ w.T / temperature, -1)
    ref = logp.gather(-1, t[:, None]).squeeze(-1)
    (ref * up).sum().backward()
    torch.testing.assert_close(lp.double(), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent.double(), -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, h.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gw, w.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("grad_by", ["positions", "vocab", "stored"])
def test_a_soft_capped_head_matches_capped_materialised_logits(grad_by, cap=3.0, temperature=0.7):
    """Gemma's final_logit_softcapping (relayrl.models.logits): the chunked head's log-probs, entropy, sum p^2 and
    gradients are those of ``log_softmax(cap * tanh(h W^T / cap) / T)``, in every backward order."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = (2 * torch.randn(30, 8, generator=g, dtype=torch.float64)).requires_grad_()  # logits past the cap
    t = torch.randint(0, 30, (13,), generator=g)
    up = torch.randn(13, generator=g, dtype=torch.float64)
    lp, ent, sq = chunked_token_logprobs(h, w, t, temperature=temperature, chunk=4, with_entropy=True,
                                         with_sum_sq=True, grad_by=grad_by, softcap=cap)
    (lp * up).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    raw = h @ w.T
    assert float(raw.abs().max()) > 2 * cap  # the cap acts
    logp = torch.log_softmax(cap * torch.tanh(raw / cap) / temperature, -1)
    ref = logp.gather(-1, t[:, None]).squeeze(-1)
    (ref * up).sum().backward()
    torch.testing.assert_close(lp.double(), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent.double(), -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sq.double(), logp.exp().pow(2).sum(-1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gh, h.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gw, w.grad, atol=1e-6, rtol=1e-6)
    uncapped = chunked_token_logprobs(h.detach(), w.detach(), t, temperature=temperature, chunk=4)[0]
    assert float((uncapped.double() - ref).abs().max()) > 0.1  # without the cap: another distribution


def test_vocab_slices_hold_no_more_values_than_a_chunk():
    assert _vocab_slice(1024, 151936, 12800) == 12032  # 12155 rounded down to a multiple of 128
    assert _vocab_slice(1024, 151936, 500) == 151936  # fewer positions than a chunk: one slice
    assert _vocab_slice(4, 30, 11) == 10 and _vocab_slice(1, 30, 1000) == 1
    for chunk, vocab, n in [(1024, 151936, 12800), (7, 1000, 333), (1024, 512, 5000)]:
        assert 1 <= _vocab_slice(chunk, vocab, n) * n <= max(n, chunk * vocab)
    with pytest.raises(ValueError, match="grad_by='rows' must be one of"):
        chunked_token_logprobs(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2), chunk=1, grad_by="rows")


def test_stored_logits_serve_one_backward_and_no_grad_passes_store_none():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(9, 8, generator=g, requires_grad=True)
    w = torch.randn(20, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 20, (9,), generator=g)
    lp, _ = chunked_token_logprobs(h, w, t, chunk=4, grad_by="stored")
    assert len(lp.grad_fn.saved_tensors) == 5  # hidden, weight, targets, log-sum-exp and the [9, 20] logits
    assert lp.grad_fn.saved_tensors[-1].shape == (9, 20)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="stored logits were spent by a first backward pass"):
        lp.sum().backward()
    with torch.no_grad():
        ref, _ = chunked_token_logprobs(h, w, t, chunk=4, grad_by="stored")
    torch.testing.assert_close(ref, lp.detach())
    frozen, _ = chunked_token_logprobs(h.detach(), w.detach(), t, chunk=4, grad_by="stored")
    assert frozen.grad_fn is None


@pytest.mark.parametrize("packing,head_grad", [
    ("none", "positions"), ("shared_prompt", "positions"), ("shared_prompt", "vocab"), ("shared_prompt", "stored"),
    pytest.param("none", "vocab", marks=pytest.mark.slow), pytest.param("none", "stored", marks=pytest.mark.slow),
])
def test_engine_update_is_the_same_with_the_chunked_head(tiny_dir, tiny_tokenizer, packing, head_grad):
    batch = _batch(tiny_tokenizer)
    batch.groups = [0, 1, 2, 3]
    out = []
    for chunk in (0, 3):
        torch.manual_seed(0)
        eng = TorchTrainingEngine(load_model(tiny_dir), TrainEngineConfig(
            logprob_chunk=chunk, packing=packing, head_grad=head_grad,
            optim=OptimConfig(lr=1e-3, max_grad_norm=None)), total_steps=1)
        assert eng._chunked(True) == (chunk > 0)
        lps, ents = eng.logprobs(batch, temperature=0.8, with_entropy=True)
        m = eng.train_step(batch, PolicyLoss(agg="token-mean"), temperature=0.8, with_entropy=True)
        out.append((lps, ents, m, [p.detach().clone() for p in eng.model.parameters()]))
    (a_lp, a_ent, a_m, a_w), (b_lp, b_ent, b_m, b_w) = out
    for x, y in zip(a_lp + a_ent, b_lp + b_ent):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert a_m["actor/grad_norm"] == pytest.approx(b_m["actor/grad_norm"], rel=1e-4)
    for x, y in zip(a_w, b_w):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("grad_by", ["positions", "vocab", "stored"])
def test_fused_head_gives_the_same_logprobs_entropy_and_gradients(grad_by, temperature=0.7):
    """engine.fused_head: the float32 steps compiled (here for CPU, ~5 s) give the eager chunks' numbers."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (37,), generator=g)
    up = torch.randn(37, generator=g)
    fused_matches_eager(h, w, t, up, chunk=16, temperature=temperature, grad_by=grad_by)
    fused_matches_eager(h, w, t, up, chunk=16, temperature=temperature, grad_by=grad_by, softcap=2.0)  # Gemma's cap


@pytest.mark.parametrize("compute_copy", [False, True])
def test_every_backward_order_gives_the_bf16_gradients(tiny_dir, tiny_tokenizer, compute_copy):
    """Mixed precision on CPU (autocast, or a bf16 compute copy): the three orders of the head's backward give
    the same gradients up to bf16 rounding, and the stored logits are kept in bf16."""
    batch = _batch(tiny_tokenizer)
    batch.groups = [0, 1, 2, 3]
    grads = {}
    for order in ("positions", "vocab", "stored"):
        torch.manual_seed(0)
        eng = TorchTrainingEngine(load_model(tiny_dir), TrainEngineConfig(
            logprob_chunk=5, head_grad=order, compute_copy=compute_copy,
            optim=OptimConfig(lr=1e-3, max_grad_norm=None)), total_steps=1, compute_dtype=torch.bfloat16)
        got = []
        eng.optimizer.step = lambda: got.extend(p.grad.float().flatten().clone() for p in eng.model.parameters())
        eng.train_step(batch, PolicyLoss(agg="token-mean"))
        grads[order] = torch.cat(got)
    for order in ("vocab", "stored"):
        rel = (grads[order] - grads["positions"]).norm() / grads["positions"].norm()
        assert 0 < rel < 2e-2, (order, float(rel))  # another order of sums: not bit-equal, close
    h = torch.randn(6, 8, dtype=torch.bfloat16, requires_grad=True)
    lp, _ = chunked_token_logprobs(h, torch.randn(20, 8), torch.zeros(6, dtype=torch.long), chunk=4,
                                   grad_by="stored")
    assert lp.grad_fn.saved_tensors[-1].dtype == torch.bfloat16


@pytest.mark.parametrize("grad_by", ["positions", "stored"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_sum_of_squared_probabilities_matches_full_logits(temperature, grad_by):
    """``with_sum_sq``: each position's sum_v p_v^2 of softmax(z / T), computed from the full logits as
    exp(logsumexp(2z/T) - 2 logsumexp(z/T)); the log-probs and their gradient are unchanged by asking for it."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, generator=g, dtype=torch.float64)
    t = torch.randint(0, 30, (11,), generator=g)
    lp, ent, sq = chunked_token_logprobs(h, w, t, temperature=temperature, chunk=4, with_sum_sq=True, grad_by=grad_by)
    assert ent is None and not sq.requires_grad
    z = (h @ w.T).detach() / temperature
    torch.testing.assert_close(sq.double(), torch.exp(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)),
                               atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sq.double(), (torch.softmax(z, -1) ** 2).sum(-1), atol=1e-6, rtol=1e-6)
    lp.sum().backward()
    gh = h.grad.clone()
    h.grad = None
    lp2, _ = chunked_token_logprobs(h, w, t, temperature=temperature, chunk=4, grad_by=grad_by)
    lp2.sum().backward()
    torch.testing.assert_close(lp, lp2)
    torch.testing.assert_close(gh, h.grad)
    with torch.no_grad():  # the no-grad pass (pi_old) that OTB reads
        _, _, sq_ng = chunked_token_logprobs(h, w, t, temperature=temperature, chunk=3, with_sum_sq=True)
    torch.testing.assert_close(sq_ng, sq)


@pytest.mark.parametrize("packing", ["none", "sequences"])
def test_the_engine_gives_logprobs_and_sum_sq_from_one_pass(tiny_model, tiny_tokenizer, packing):
    """``logprobs_with_sum_sq``: per-row log-probs equal to ``logprobs``' and sum p^2 of softmax(logits / T) from
    a plain forward, on the chunked head and on materialised logits (``logprob_chunk=0``)."""
    batch = _batch(tiny_tokenizer)
    batch.groups = [0, 1, 2, 3]
    for chunk in (0, 5):
        eng = TorchTrainingEngine(tiny_model, TrainEngineConfig(token_budget=24, packing=packing, logprob_chunk=chunk),
                                  total_steps=1, trainable=False)
        lps, sqs = eng.logprobs_with_sum_sq(batch, temperature=0.8)
        for p, r, lp, sq, lp_plain in zip(batch.prompt_ids, batch.response_ids, lps, sqs,
                                         eng.logprobs(batch, temperature=0.8)[0]):
            with torch.no_grad():
                z = tiny_model(torch.cat([p, r])[None]).logits[0, len(p) - 1:-1].float() / 0.8
            assert sq.shape == r.shape
            torch.testing.assert_close(lp, lp_plain)
            torch.testing.assert_close(sq, (torch.softmax(z, -1) ** 2).sum(-1), atol=1e-5, rtol=1e-4)
