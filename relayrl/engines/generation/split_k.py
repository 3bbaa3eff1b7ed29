"""Split-K matrix products for the decode step's small-batch projections (``StaticDecoder(split_k=S)``).

A decode step multiplies ``B`` rows (one new token each, B = 256 at most per bucket) by each weight. With few
output columns the product has few output tiles: at B = 256, Qwen2-0.5B's ``o_proj`` and ``down_proj`` (896
outputs) have 14 tiles of 128 x 128 and the fused q/k/v product (1,152) has 18, so 14-18 of an H100's 132
multiprocessors read the weight while the rest idle; on an H100 (2026-11-26) the MLP's two products ran at
about 35% of the bandwidth their weights need. Split-K cuts the input width ``K`` into ``S`` slices and runs
the ``S`` partial products as one batched product (``S`` times the thread blocks), then sums the partials in
float32: ``x W^T = sum_s x[:, s] W[:, s]^T``. On CUDA the partials come out of the product in float32
(``torch.bmm(..., out_dtype=float32)``), so the only rounding to the weight's dtype is the last one, as in the
single product. Elsewhere (the CPU tests) the partials are in the inputs' dtype (float32 and float64 there).
"""

from __future__ import annotations

import torch

__all__ = ["split_k_linear", "split_k_reason"]


def split_k_reason(weight: torch.Tensor, splits: int) -> str | None:
    """Why ``weight`` [N, K] cannot run as ``splits`` partial products (None when it can)."""
    if splits < 1:
        return f"split_k={splits} must be >= 1"
    if weight.shape[1] % splits:
        return (f"the input width {weight.shape[1]} of a [{weight.shape[0]}, {weight.shape[1]}] weight is not a "
                f"multiple of split_k={splits}")
    if weight.is_cuda and not hasattr(torch.ops.aten.bmm, "dtype"):
        return f"this torch ({torch.__version__}) has no float32 output for bf16 batched products (bmm out_dtype)"
    return None


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [..., K] and ``weight`` [N, K] as ``splits`` partial products over
    slices of ``K``, summed in float32 (see the module docstring; :func:`split_k_reason` says whether it runs)."""
    if splits == 1:
        return torch.nn.functional.linear(x, weight, bias)
    N, K = weight.shape
    k = K // splits
    xs = x.reshape(-1, splits, k).transpose(0, 1)  # [S, M, k]: slice s of every row
    ws = weight.view(N, splits, k).permute(1, 2, 0)  # [S, k, N]: slice s of the weight, transposed (a view)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        part = torch.bmm(xs, ws, out_dtype=torch.float32)
    else:  # float32 or float64 products already; a CPU's bf16 partials are rounded before the float32 sum
        part = torch.bmm(xs, ws)
        part = part.to(torch.promote_types(part.dtype, torch.float32))
    out = part.sum(0)
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).view(*x.shape[:-1], N)
