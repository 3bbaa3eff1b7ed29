"""Static-cache decoding with CUDA graphs for Llama-family decoders (Llama, Qwen2, Qwen3, Mistral).

The dynamic path of :mod:`relayrl.engines.generation.native` calls the Hugging
Face model once per decode step. On a GPU that step is bound by Python and
kernel launches, not by the GPU: a Qwen2-0.5B step at batch 256 took 28 ms
eagerly on an H100, where reading the weights and the KV cache takes about
1 ms. This module runs the decode step on fixed buffers so that it can be
recorded once as a CUDA graph and replayed (6.2 ms a step at batch 256 on an
H100, sampling included; with ``compile``, the layer step, the head and the
sampler's reductions compiled by Inductor first, 3.2 ms, after 18-21 s of
compilation):

* the KV cache is one ``[slots, kv_heads, max_len, head_dim]`` buffer per layer
  (``slots`` = the engine's ``max_batch``); a sequence owns a slot from
  admission to its last token, and token ``t`` of it sits at index ``t``;
* a decode step takes one token and one position per slot, writes the new key
  and value at that position, attends over the slot's first ``position + 1``
  entries (a length mask over the first ``L`` positions of the buffer, ``L`` the
  step's bucket, a multiple of 128 above every slot's position), and samples the next
  token inside the step (:mod:`.sampling`: one counter-based uniform per row, so
  there is no generator state to carry between replays); the token goes into a
  per-slot history and becomes the next input;
* the step is captured once per (batch bucket of 2, 4, 8, ... slots, ``L``,
  sampling settings) and replayed up to ``decode_chunk`` times in a row before
  the host reads the new tokens once (the engine's loop, which queues the next
  chunk before it reads, so the device decodes while the host finishes rows);
  a row that stopped inside a chunk decodes on through the next one and those
  tokens are dropped. Slots
  past the highest busy one are not computed; free slots below it compute
  garbage that stays inside the cache and the history.

With ``rollout.decode_compile`` the step is compiled by Inductor before it is
recorded (one compilation of the layer step for every layer, batch bucket and
cache length), each layer's q/k/v projections run as one matrix product and
its gate/up projections as another (on a copy of those weights, refreshed at
every ``generate`` and weight update), and sampling reads the logits in two
compiled reductions (:func:`.sampling.sample_from_logits`).

Prefill is not graphed: new prompts run through the Hugging Face model
(right-padded, so that every prompt's tokens start at index 0), and their keys
and values are copied into their slots, repeated for the ``n`` samples.

The step reuses the model's own modules (projections, norms, MLP, rotary
embedding, ``apply_rotary_pos_emb``); only the attention over the cache is
written here, as two batched matrix products with the query heads of a
key/value head grouped (no key/value repetition), or (``attention``) one
FlexAttention call or one Triton kernel (:mod:`.decode_attention`). Models whose layers do not
have that structure, or use sliding-window attention, are refused with the
reason (:func:`.static_fit.unsupported_reason`), and the engine keeps its dynamic path. A structure can match while the
model computes something the step does not (Granite's residual and attention multipliers, GLM-4's extra
norms, SmolLM3's layers without rotary embeddings), so :func:`build` also decodes one token of a short probe
with the step and with the model's own forward and refuses the model when their next-token log-probs differ
(:func:`step_mismatch`). The output head's product goes through the model's logit transform
(:mod:`relayrl.models.logits`: Gemma's soft-capping, Cohere's and Granite's scales).
On CPU the same step runs eagerly (that is how it is tested against the
dynamic path); graphs need CUDA.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable

import torch
from torch import nn

from relayrl.engines.generation.attend import ATTENTION, attend, attend_flex, attend_triton, load_triton, triton_reason
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.kv_cache import forward_with_cache
from relayrl.engines.generation.sampling import block_mass, row_uniforms, sample_next, sample_with, seen_mask
from relayrl.engines.generation.split_k import split_k_linear, split_k_reason
from relayrl.engines.generation.static_fit import StaticDecodeError, fuse_reason, unsupported_reason
from relayrl.models.logits import LogitTransform

__all__ = ["StaticDecoder", "build", "step_mismatch"]

def _decoder(model: nn.Module) -> nn.Module:
    return model.get_decoder()


def _buckets(slots: int) -> list[int]:
    """Batch buckets 2, 4, 8, ... up to ``slots`` (no bucket of 1: a compiled step would compile again for it)."""
    out, b = [], min(2, slots)
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


class _Fused:
    """One layer's q/k/v weights as one [q + 2 kv, hidden] matrix and its gate/up weights as one [2 I, hidden]
    matrix (copies, refreshed from the layer by :meth:`refresh`), so a decode step runs two matrix products where
    the layer runs five."""

    @torch.no_grad()
    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.gate_up = [mlp.gate_proj, mlp.up_proj]
        self.split = tuple(m.out_features for m in self.qkv)
        self.w_qkv = torch.cat([m.weight for m in self.qkv])
        self.b_qkv = torch.cat([m.bias for m in self.qkv]) if attn.q_proj.bias is not None else None
        self.w_gu = torch.cat([m.weight for m in self.gate_up])
        self.b_gu = torch.cat([m.bias for m in self.gate_up]) if mlp.gate_proj.bias is not None else None

    @torch.no_grad()
    def refresh(self) -> None:
        torch.cat([m.weight for m in self.qkv], out=self.w_qkv)
        torch.cat([m.weight for m in self.gate_up], out=self.w_gu)
        if self.b_qkv is not None:
            torch.cat([m.bias for m in self.qkv], out=self.b_qkv)
        if self.b_gu is not None:
            torch.cat([m.bias for m in self.gate_up], out=self.b_gu)

    def tensors(self) -> tuple:
        return self.w_qkv, self.b_qkv, self.w_gu, self.b_gu


def _layer_step(layer: nn.Module, x: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, pos: torch.Tensor,
                valid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Callable,
                fused: tuple | None = None, split: tuple[int, int, int] | None = None,
                attention: str = "matmul", split_k: int = 1) -> torch.Tensor:
    """One decoder layer of the decode step: ``x`` [B, 1, hidden] holds the new token of slots ``[0, B)``, at
    ``pos`` [B]; its key and value go into the layer's cache ``k_buf``/``v_buf`` [slots, KV, max_len, D] at
    ``pos``, and it attends over the first ``L`` positions, those ``valid`` [B, L] marks. The layer's own modules
    do the rest, or, with ``fused`` (:meth:`_Fused.tensors`, ``split`` the q/k/v widths), one product for q/k/v
    and one for gate/up, with ``split_k`` > 1 the q/k/v, o and down products as that many partial products
    (:mod:`relayrl.engines.generation.split_k`); ``attention`` (:data:`ATTENTION`) picks :func:`.attend.attend`,
    :func:`.attend.attend_flex` or :func:`.attend.attend_triton`. One function for every layer, so
    that ``compile`` compiles it once (dynamic shapes) and every layer reuses it."""
    attn = layer.self_attn
    B, D = x.shape[0], k_buf.shape[-1]
    h = layer.input_layernorm(x)
    shape = (B, 1, -1, D)
    if fused is None:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    else:
        q, k, v = split_k_linear(h, fused[0], fused[1], split_k).split(split, dim=-1)
    q, k, v = q.view(shape), k.view(shape), v.view(shape)
    if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotary embedding
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, 1, D]
    q, k = rope(q, k, cos, sin)
    rows = torch.arange(B, device=x.device)
    k_buf[rows, :, pos] = k[:, :, 0].to(k_buf.dtype)
    v_buf[rows, :, pos] = v[:, :, 0].to(v_buf.dtype)
    L = valid.shape[1]
    if attention == "flex":
        o = attend_flex(q, k_buf[:B, :, :L], v_buf[:B, :, :L], pos, attn.scaling)
    elif attention == "triton":
        o = attend_triton(q, k_buf[:B], v_buf[:B], pos, attn.scaling)
    else:
        o = attend(q, k_buf[:B, :, :L], v_buf[:B, :, :L], valid, attn.scaling)
    o = o.reshape(B, 1, -1)
    x = x + (attn.o_proj(o) if split_k == 1 else split_k_linear(o, attn.o_proj.weight, attn.o_proj.bias, split_k))
    h = layer.post_attention_layernorm(x)
    if fused is None:
        return x + layer.mlp(h)
    gate, up = torch.nn.functional.linear(h, fused[2], fused[3]).chunk(2, dim=-1)
    down = layer.mlp.down_proj
    return x + split_k_linear(layer.mlp.act_fn(gate) * up, down.weight, down.bias, split_k)


def _no_duck_shapes(on: bool):
    """Compilation without duck sizing: the batch and the cache length get a symbol each even when their sizes
    happen to be equal (B = L = 128, or B = slots), so that a later call where they differ compiles nothing."""
    return torch.fx.experimental._config.patch(use_duck_shape=False) if on else contextlib.nullcontext()


class StaticDecoder:
    """A KV cache of ``slots`` x ``max_len`` positions and a decode step over it (graphed on CUDA).

    ``prefill`` fills slots from new prompts; ``step`` decodes one token for the first ``B`` slots.
    ``release`` frees the cache and the graphs (the engine calls it when weights move or memory is
    wanted back); the next use builds them again.
    """

    def __init__(self, model: nn.Module, slots: int, *, graphs: bool, compile: bool = False,
                 fuse: bool = False, attention: str = "matmul", bucket: int = 128,
                 compile_mode: str | None = None, split_k: int = 1) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"static decoding: {reason}")
        if attention not in ATTENTION:
            raise ValueError(f"static decoding: attention {attention!r}: one of " + "; ".join(
                f"{k}: {v}" for k, v in ATTENTION.items()))
        if attention == "flex" and not compile:
            raise ValueError("static decoding: attention 'flex' needs compile (eager FlexAttention materialises "
                             "every score, slower than the default)")
        self.attention = attention
        if bucket not in (16, 32, 64, 128):
            raise ValueError(f"static decoding: bucket {bucket}: the attended length is a multiple of 16, 32, 64 or "
                             "128 cache positions (a divisor of the cache's 128-position rounding)")
        if attention == "flex" and bucket != 128:
            raise ValueError("static decoding: attention 'flex' reads the cache in 128-position blocks: bucket 128")
        # a step attends over the cache's first ``span`` positions, a multiple of ``bucket``: one graph per
        # multiple; a smaller bucket reads fewer positions past the rows' own, for more graphs to record
        self.bucket = bucket
        self.model = model
        self.dec = _decoder(model)
        self.layers = list(self.dec.layers)
        attn = self.layers[0].self_attn
        self.rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb")
        conf = model.config
        self.head_dim = attn.head_dim
        self.kv_heads = getattr(conf, "num_key_value_heads", None) or conf.num_attention_heads
        self.slots = slots
        self.graphs = graphs
        self.device = next(model.parameters()).device
        if attention == "triton":
            if (why := triton_reason(self.device)) is not None:
                raise ValueError(f"static decoding: attention 'triton': {why}")
            load_triton()
        self.dtype = next(model.parameters()).dtype
        self.transform = LogitTransform.of(conf)  # what the model's forward does to the head's product
        self.max_len = self.width = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        # compile: the layer step, the head and the sampler's two reductions over the vocabulary (block_mass) are
        # compiled by Inductor (dynamic batch and cache length) before any graph is recorded: fused element-wise
        # kernels; one compilation of the layer serves every layer. The sampler's search stays eager (compiled
        # with dynamic shapes it took minutes); it reads [B, V / 128] block masses and one block per row.
        # compile_mode: torch.compile's mode for the layer and the head (for example "max-autotune-no-cudagraphs":
        # Inductor times Triton templates against cuBLAS for each product; the graphs here are recorded apart)
        self.compiled = compile
        self._layer_fn = torch.compile(_layer_step, mode=compile_mode) if compile else _layer_step
        self._head_fn = torch.compile(self._head, mode=compile_mode) if compile else self._head
        self._mass_fn = torch.compile(block_mass) if compile else None
        # fuse: each layer's q/k/v and gate/up weights also kept concatenated (two products where there were
        # five), at the cost of a copy of those weights; refreshed at every generate and weight update.
        self.fuse = fuse
        self._fused: list[_Fused] = []
        if fuse and (why := next(filter(None, map(fuse_reason, self.layers)), None)) is not None:
            raise ValueError(f"static decoding with fused projections: {why}")
        # split_k: the fused q/k/v, o and down products as split_k partial products each (few output tiles at a
        # decode step's batch; relayrl.engines.generation.split_k)
        if split_k != 1:
            if not fuse:
                raise ValueError(f"static decoding: split_k={split_k} needs fuse (the step's own products)")
            if any(type(layer.self_attn.o_proj) is not nn.Linear for layer in self.layers):
                raise ValueError("static decoding: split_k needs o_proj to be a plain nn.Linear")
            weights = [m.weight for layer in self.layers  # q/k/v share q_proj's input width
                       for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj)]
            if (why := next(filter(None, (split_k_reason(w, split_k) for w in weights)), None)) is not None:
                raise ValueError(f"static decoding: {why}")
        self.split_k = split_k

    # ------------------------------------------------------------- buffers
    def ensure(self, max_len: int, width: int = 1) -> None:
        """A cache of at least ``max_len`` positions per slot (rounded up to 128) and room for ``width`` sampled
        tokens per slot; graphs are recorded again when either grows."""
        if self.fuse:
            if self._fused:
                self.refresh()
            else:
                self._fused = [_Fused(layer) for layer in self.layers]
        if max_len <= self.max_len and width <= self.width:
            return
        self._drop_cache()
        self.max_len = -(-max_len // 128) * 128
        self.width = max(width, 1)
        shape = (self.slots, self.kv_heads, self.max_len, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        slot = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.zeros(self.slots, **slot)  # each slot's newest sampled token, the next input
        self.positions = torch.zeros(self.slots, **slot)  # ... and the position it goes in at
        self.row_keys = torch.zeros(self.slots, **slot)  # sampling.row_key of the row in the slot
        self.counts = torch.zeros(self.slots, **slot)  # tokens the row has sampled
        self.hist_tokens = torch.zeros(self.slots, self.width, **slot)  # token t of the row at [slot, t]
        self.hist_logprobs = torch.zeros(self.slots, self.width, dtype=torch.float32, device=self.device)
        self.seen: torch.Tensor | None = None  # [slots, V] bool, each row's context tokens (repetition penalty)

    def release(self) -> None:
        """Free the KV cache, the seen-token mask, the recorded graphs and the fused weight copies."""
        self._drop_cache()
        self.seen = None
        self._fused = []
        self.max_len = self.width = 0

    def _drop_cache(self) -> None:
        self._graphs.clear()
        self._pool = None
        self.keys, self.values = [], []

    def refresh(self) -> None:
        """Copy the layers' weights into the fused copies again (after an in-place weight update)."""
        for f in self._fused:
            f.refresh()

    def span(self, last: int) -> int:
        """The cache positions a step attends over when the furthest position it feeds is ``last``."""
        return min(self.max_len, -(-(last + 1) // self.bucket) * self.bucket)

    # ------------------------------------------------------------- prefill
    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], slots: torch.Tensor, repeat: int, pad_id: int) -> torch.Tensor:
        """Run ``prompts`` through the model and copy their keys/values into ``slots`` (``repeat`` consecutive
        slots per prompt). Returns the next-token logits of each slot, ``[len(slots), V]``."""
        from transformers import DynamicCache

        lengths = torch.tensor([len(p) for p in prompts])
        width = int(lengths.max())
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        ids = ids.to(self.device)
        pos = torch.arange(width, device=self.device)[None].expand(len(prompts), -1)
        # Right-padded, so the causal mask alone is exact for every prompt token (none sees a pad after it) and
        # the attention runs without a padding mask (SDPA's fused causal kernels, no key/value repetition for
        # grouped heads); what the pads compute lands past each prompt in the cache, where a decode step
        # writes its own key and value before it attends there. The head runs at the prompts' last positions
        # only (at batch 256 x 128 tokens, every position's logits would be 10 GB in bf16 for a 152k vocabulary).
        keep, which = torch.unique(lengths - 1, return_inverse=True)
        out, cache = forward_with_cache(self.model, DynamicCache(config=self.model.config), input_ids=ids,
                                        position_ids=pos, logits_to_keep=keep.to(self.device))
        logits = out.logits[torch.arange(len(prompts), device=self.device), which.to(self.device)]  # [P, V]
        src = torch.arange(len(prompts), device=self.device).repeat_interleave(repeat)
        slots = slots.to(self.device)
        for layer, k_buf, v_buf in zip(cache.layers, self.keys, self.values):
            k_buf[slots, :, :width] = layer.keys[src].to(self.dtype)
            v_buf[slots, :, :width] = layer.values[src].to(self.dtype)
        return logits[src].float()

    # ---------------------------------------------------------------- step
    def _logits(self, B: int, L: int) -> torch.Tensor:
        """The next-token logits [B, V] (the model's dtype) of slots ``[0, B)``: each slot's ``tokens`` goes in at
        its ``positions``, attending over the first ``L`` cache positions (``L`` above every slot's position)."""
        tokens, pos = self.tokens[:B], self.positions[:B]
        x = self.dec.embed_tokens(tokens[:, None])  # [B, 1, H]
        cos, sin = self.dec.rotary_emb(x, pos[:, None])
        valid = torch.arange(L, device=self.device)[None, :] <= pos[:, None]  # [B, L]
        if self.compiled:  # one compilation for every batch bucket and cache length (B = 1 aside)
            for t in (x, pos, valid, cos, sin):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(valid, 1)
        with _no_duck_shapes(self.compiled):
            for i, (layer, k_buf, v_buf) in enumerate(zip(self.layers, self.keys, self.values)):
                f = self._fused[i] if self._fused else None
                x = self._layer_fn(layer, x, k_buf, v_buf, pos, valid, cos, sin, self.rope,
                                   f and f.tensors(), f and f.split, self.attention, self.split_k)
            return self._head_fn(x)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] in the model's dtype (the sampler takes its sums in float32/64), or float32 when the head
        was set to run in float32 (``model.head_fp32``: its forward does the product, captured in the graph)."""
        return self.transform(self.model.get_output_embeddings()(self.dec.norm(x)[:, 0]))

    @torch.no_grad()
    def probe_error(self, prompt: list[int], token: int) -> tuple[float, float]:
        """How far this decoder's next-token log-probs after ``prompt + [token]`` (the prompt prefilled,
        ``token`` decoded by one step) are from the model's own forward over the whole sequence, and, for
        scale, how far the model's own cached step (the dynamic path's) is from it: ``(step error, rounding)``,
        each the largest difference over the vocabulary. The cache is released after."""
        from transformers import DynamicCache

        ids = torch.tensor([[*prompt, token]], device=self.device)
        whole = torch.log_softmax(self.model(input_ids=ids, use_cache=False).logits[0, -1].float(), -1)
        out = self.model(input_ids=ids[:, :-1], past_key_values=DynamicCache(config=self.model.config), use_cache=True)
        cached = self.model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits[0, -1]
        rounding = float((torch.log_softmax(cached.float(), -1) - whole).abs().max())
        self.ensure(len(prompt) + 2)
        try:
            self.prefill([prompt], torch.tensor([0]), 1, pad_id=token)
            self.tokens[0], self.positions[0] = token, len(prompt)
            ours = torch.log_softmax(self._logits(1, self.span(len(prompt))).float()[0], -1)
        finally:
            self.release()
        return float((ours - whole).abs().max()), rounding

    def _decode(self, B: int, L: int, params: SamplingParams):
        """The step's tensor work: logits of slots ``[0, B)`` and a token sampled from them with each row's
        counter-based uniform; returns (tokens, log-probs)."""
        logits = self._logits(B, L)
        if self.compiled:
            torch._dynamo.maybe_mark_dynamic(logits, 0)
        uniforms = row_uniforms(self.row_keys[:B], self.counts[:B])
        seen = self.seen[:B] if params.repetition_penalty != 1.0 else None
        with _no_duck_shapes(self.compiled):
            return sample_with(logits, params.temperature, params.top_k, params.top_p, uniforms, mass=self._mass_fn,
                               min_p=params.min_p, penalty=params.repetition_penalty, seen=seen)

    def _record_token(self, idx, tok: torch.Tensor, logp: torch.Tensor) -> None:
        """Slots ``idx`` (a slice or an index tensor) sampled ``tok``: into the history at each row's count,
        and the next input."""
        counts = self.counts[idx]
        at = counts.clamp_max(self.width - 1)  # free slots decoding garbage never write past the history
        rows = torch.arange(self.slots, device=self.device)[idx]
        self.hist_tokens[rows, at] = tok
        self.hist_logprobs[rows, at] = logp.float()
        self.tokens[idx] = tok
        self.counts[idx] = counts + 1

    def _step(self, B: int, L: int, params: SamplingParams) -> None:
        """One decode step of slots ``[0, B)``: logits, a sampled token per slot, positions one further (free
        slots decoding garbage stay inside the cache)."""
        tok, logp = self._decode(B, L, params)
        self._record_token(slice(0, B), tok, logp)
        if params.repetition_penalty != 1.0:  # (a scatter of a scalar: nothing crosses from the host in a graph)
            self.seen[:B].scatter_(1, tok[:, None], True)
        self.positions[:B] = (self.positions[:B] + 1).clamp_max(self.max_len - 1)

    @torch.no_grad()
    def start(self, slots: list[int], logits: torch.Tensor, params: SamplingParams, keys: list[int],
              counts: list[int], positions: list[int], contexts: list[list[int]] | None = None) -> None:
        """Rows enter ``slots`` after a prefill: ``logits`` [len(slots), V] are their next-token logits; each has
        its sampling key (``sampling.row_key``), the number of tokens it sampled before (0 for a new row), the
        position its next token goes in at and its context (prompt and tokens so far: what a repetition penalty
        acts on; needed only then). Their first token is sampled here, on the device."""
        idx = torch.tensor(slots, device=self.device)
        self.row_keys[idx] = torch.tensor(keys, dtype=torch.long, device=self.device)
        self.counts[idx] = torch.tensor(counts, dtype=torch.long, device=self.device)
        self.positions[idx] = torch.tensor(positions, dtype=torch.long, device=self.device)
        seen = None
        if params.repetition_penalty != 1.0:
            if contexts is None:
                raise ValueError("a repetition penalty needs the contexts of the rows that start")
            if self.seen is None:  # (kept until the cache is rebuilt, which drops the graphs that read it)
                self.seen = torch.zeros(self.slots, logits.shape[-1], dtype=torch.bool, device=self.device)
            self.seen[idx] = seen = seen_mask(contexts, logits.shape[-1], self.device)
        tok, logp = sample_next(logits.float(), params, uniforms=row_uniforms(self.row_keys[idx], self.counts[idx]),
                                seen=seen)
        self._record_token(idx, tok, logp)
        if seen is not None:
            self.seen[idx, tok] = True

    @torch.no_grad()
    def run(self, B: int, L: int, steps: int, params: SamplingParams) -> None:
        """``steps`` decode steps of slots ``[0, B)`` with no host synchronisation: each samples one token per
        slot into the history (on CUDA, replays of the graph recorded for the batch bucket, ``L`` and ``params``;
        slots past ``B`` in the bucket decode garbage)."""
        if not self.graphs:
            for _ in range(steps):
                self._step(B, L, params)
            return
        bucket = next(b for b in _buckets(self.slots) if b >= B)
        key = (bucket, L, params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty)
        graph = self._graphs.get(key) or self._record(key, params)
        for _ in range(steps):
            graph.replay()

    def read(self, B: int, lo: int, hi: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Start copying tokens ``lo..hi-1`` of the rows in slots ``[0, B)`` and their log-probs to the host;
        returns the function that waits for the copy and gives them. The copy is queued on the device's stream,
        so steps queued after this call do not change what it reads."""
        tok, logp = self.hist_tokens[:B, lo:hi], self.hist_logprobs[:B, lo:hi]
        if tok.device.type != "cuda":  # eager steps run at once: copy before the next one
            tok, logp = tok.clone(), logp.clone()
            return lambda: (tok, logp)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (tok, logp)]
        host[0].copy_(tok, non_blocking=True)
        host[1].copy_(logp, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> tuple[torch.Tensor, torch.Tensor]:
            done.synchronize()
            return host[0], host[1]

        return wait

    def _record(self, key: tuple, params: SamplingParams) -> torch.cuda.CUDAGraph:
        """Record the step for ``key`` = (slots, L, sampling) as a CUDA graph. The warm-up CUDA asks for runs on
        a side stream, on copies of the slot state, which is put back after: recording changes nothing."""
        B, L = key[0], key[1]
        live = (self.tokens, self.positions, self.counts, self.hist_tokens, self.hist_logprobs)  # what a step writes
        live += (self.seen,) if params.repetition_penalty != 1.0 else ()
        state = [t.clone() for t in live]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(B, L, params)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(B, L, params)
        for t, saved in zip(live, state):
            t.copy_(saved)
        self._graphs[key] = graph
        return graph


def step_mismatch(model: nn.Module) -> str | None:
    """Why the static step does not compute ``model``'s next-token distribution (None when it does): one token
    of a short probe decoded eagerly by the step and by the model's forward, their log-probs compared within
    four times the rounding the model's own cached step shows, and at least 1e-3 in float32 or 0.5 in half
    precision (where the step's own attention rounds differently: 0.06-0.1 measured on Llama-family models,
    against 8-10 for a missed multiplier or norm)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = [(7 * i + 3) % vocab for i in range(7)]
    was_training = model.training
    model.eval()
    try:
        err, rounding = StaticDecoder(model, 1, graphs=False).probe_error(prompt, (7 * 7 + 3) % vocab)
    finally:
        model.train(was_training)
    tol = max(1e-3 if next(model.parameters()).dtype == torch.float32 else 0.5, 4 * rounding)
    if err <= tol:
        return None
    return (f"its decode step differs from {type(model).__name__}'s forward by {err:.3g} in a next-token "
            f"log-prob, where the model's own cached step differs by {rounding:.2g}: the model computes something "
            f"the static step does not")


def build(model: nn.Module, slots: int, mode: str, log: Callable[[str], None] | None = None,
          compile: bool = False) -> StaticDecoder | None:
    """The static decoder for ``mode`` (``auto``: on CUDA for supported models; ``static``: always, graphed on
    CUDA; ``dynamic``: never). ``static`` on an unsupported model raises; ``auto`` says why it stays dynamic.
    ``compile``: on CUDA, the step is compiled by Inductor before its graphs are recorded, with each layer's
    q/k/v and gate/up projections fused where the layers allow it (:func:`fuse_reason`)."""
    if mode == "dynamic":
        return None
    cuda = next(model.parameters()).device.type == "cuda"
    if mode != "static" and not cuda:
        return None
    reason = unsupported_reason(model) or step_mismatch(model)
    if mode == "static":
        if reason is not None:
            raise StaticDecodeError(f"rollout.decode=static: {reason}; use rollout.decode=dynamic")
        compile = compile and cuda
        return StaticDecoder(model, slots, graphs=cuda, compile=compile, fuse=_fuse(model, compile, log))
    if reason is not None:
        if log is not None:
            log(f"relayrl: rollout.decode=auto keeps the dynamic decode path ({reason})")
        return None
    return StaticDecoder(model, slots, graphs=True, compile=compile, fuse=_fuse(model, compile, log))


def _fuse(model: nn.Module, compile: bool, log: Callable[[str], None] | None) -> bool:
    """Whether the compiled step fuses the projections: when compiled and every layer allows it (said if not)."""
    if not compile:
        return False
    layers = list(_decoder(model).layers)
    why = next(filter(None, map(fuse_reason, layers)), None)
    if log is not None and why is not None:
        log(f"relayrl: rollout.decode_compile keeps separate q/k/v and gate/up projections ({why})")
    elif log is not None:
        size = 0
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                size += sum(p.numel() * p.element_size() for p in m.parameters())
        log(f"relayrl: rollout.decode_compile runs q/k/v and gate/up as one product each, on a copy of those "
            f"weights ({size / 2**30:.2f} GiB)")
    return why is None
