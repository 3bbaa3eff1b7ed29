"""The sampler's inverse CDF: the blockwise path from logits against explicit probabilities."""

import pytest
import torch

from relayrl.engines.generation.sampling import block_mass, inverse_cdf, sample_from_logits, sample_with


def _logits(B: int, V: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("V", [256, 1000, 5])  # whole blocks, a partial last block, less than one block
def test_from_logits_draws_the_tokens_of_the_explicit_probabilities(V):
    logits = _logits(64, V)
    u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tok, logp = sample_from_logits(logits, 0.7, u)
    assert torch.equal(tok, inverse_cdf(torch.softmax(logits / 0.7, -1), u))
    torch.testing.assert_close(logp, torch.log_softmax(logits / 0.7, -1).gather(1, tok[:, None]).squeeze(1))


def test_a_grid_of_uniforms_lands_on_each_token_in_proportion_to_its_probability():
    logits = _logits(1, 300, seed=3)
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tok, _ = sample_from_logits(logits.expand(n, -1), 1.0, u)
    counts = torch.bincount(tok, minlength=300).double()
    want = torch.softmax(logits[0].double(), -1) * n
    assert (counts - want).abs().max() <= 1.0  # an evenly spaced grid: each token's share within one draw


def test_zero_probability_tokens_are_never_drawn():
    logits = _logits(8, 1000)
    logits[:, 900:] = float("-inf")  # the tail, the partial last block included
    logits[:, 0] = float("-inf")
    u = torch.tensor([0.0, 1e-12, 0.5, 1 - 1e-12, 0.999999, 0.25, 0.75, 0.9999999999], dtype=torch.float64)
    tok, logp = sample_from_logits(logits, 1.0, u)
    assert ((tok > 0) & (tok < 900)).all() and torch.isfinite(logp).all()


def test_model_dtype_logits_sample_as_their_float32_copy():
    logits = _logits(32, 1000).bfloat16()
    u = torch.rand(32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    tok, logp = sample_with(logits, 1.0, 0, 1.0, u)
    tok32, logp32 = sample_with(logits.float(), 1.0, 0, 1.0, u)
    assert logp.dtype == torch.float32 and torch.equal(tok, tok32) and torch.equal(logp, logp32)
    greedy, glogp = sample_with(logits, 0.0, 0, 1.0, None)
    assert torch.equal(greedy, logits.float().argmax(-1))
    torch.testing.assert_close(glogp, torch.log_softmax(logits.float(), -1).gather(1, greedy[:, None]).squeeze(1))


def test_block_mass_is_the_softmax_summed_by_blocks_of_128():
    logits = _logits(4, 300)
    lse, mass = block_mass(logits, 2.0)
    probs = torch.nn.functional.pad(torch.softmax(logits.double() / 2.0, -1), (0, 84)).view(4, 3, 128).sum(-1)
    torch.testing.assert_close(mass, probs)
    torch.testing.assert_close(lse, torch.logsumexp(logits / 2.0, -1))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_compiled_steps_sampler_draws_the_eager_samplers_tokens(temperature):
    """``mass`` (what the compiled decode step passes) takes the blockwise path; without it the eager path keeps
    the probabilities. Same tokens, same log-probs to float32 rounding."""
    logits = _logits(64, 1000, seed=4)
    u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    tok, logp = sample_with(logits, temperature, 0, 1.0, u, mass=block_mass)
    ref_tok, ref_logp = sample_with(logits, temperature, 0, 1.0, u)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(logp, ref_logp)
