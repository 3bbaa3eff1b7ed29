"""Checks of the decode step's Triton attention under Triton's interpreter, run by
``tests/engines/test_decode_attention.py`` in a process of their own: ``TRITON_INTERPRET=1`` must be set
before triton is first imported (its own library functions are compiled or interpreted at that import), which
a pytest worker cannot promise. Each check raises on a mismatch; the script prints one line per check."""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from relayrl.engines.generation.base import SamplingParams  # noqa: E402
from relayrl.engines.generation.decode_attention import decode_attention  # noqa: E402
from relayrl.engines.generation.attend import attend as _attend  # noqa: E402
from relayrl.engines.generation.static import StaticDecoder  # noqa: E402


def kernel_matches_the_matmul_path() -> None:
    """Grouped query heads (7 per key/value head, as Qwen2-0.5B's), a head size that is not a power of two,
    rows at positions on and around the 64-key blocks' edges; the cache holds garbage past each row's position
    (as a static cache does) and one row more than the batch. float32 and float16 (no bfloat16 in the
    interpreter)."""
    for dtype, heads, kv, dim in ((torch.float32, 14, 2, 64), (torch.float16, 4, 4, 32), (torch.float32, 6, 2, 80)):
        g = torch.Generator().manual_seed(0)
        B, S = 5, 200
        k = torch.randn(B + 1, kv, S, dim, generator=g).to(dtype)
        v = torch.randn(B + 1, kv, S, dim, generator=g).to(dtype)
        q = torch.randn(B, heads, 1, dim, generator=g).to(dtype)
        pos = torch.tensor([0, 63, 64, 129, 199])
        valid = torch.arange(S)[None, :] <= pos[:, None]
        want = _attend(q.float(), k[:B].float(), v[:B].float(), valid, 0.125)
        got = decode_attention(q, k[:B], v[:B], pos, 0.125)
        assert got.shape == (B, heads, dim) and got.dtype == dtype, (got.shape, got.dtype)
        torch.testing.assert_close(got.float(), want, atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=1e-4)


def decode_step_samples_the_matmul_steps_tokens(model_dir: str) -> None:
    """The whole decode step with the kernel as its attention samples the matmul step's tokens and log-probs,
    with rows at different positions and batch buckets."""
    from relayrl.models.load import load_model

    torch.manual_seed(0)
    model = load_model(model_dir)
    with torch.no_grad():  # outputs far from uniform (as the tests' tiny_model fixture does)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = []
    for attention in ("matmul", "triton"):
        dec = StaticDecoder(model, 8, graphs=False, attention=attention)
        dec.ensure(300, 20)
        dec.tokens.copy_(torch.arange(8) * 5 + 11)
        dec.positions.copy_(torch.tensor([5, 5, 40, 127, 3, 60, 5, 9]))
        dec.row_keys.copy_(torch.arange(8) * 7 + 1)
        for B, L in ((8, 256), (3, 384)):
            dec.run(B, L, 2, SamplingParams(temperature=1.0))
        out.append((dec.hist_tokens.clone(), dec.hist_logprobs.clone()))
    assert torch.equal(out[0][0], out[1][0]), "the sampled tokens differ"
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    kernel_matches_the_matmul_path()
    print("kernel: ok", flush=True)
    if len(sys.argv) > 1:
        decode_step_samples_the_matmul_steps_tokens(sys.argv[1])
        print("decode step: ok", flush=True)
