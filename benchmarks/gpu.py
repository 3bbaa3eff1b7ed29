"""GPU benchmark (needs CUDA): decode speed against Hugging Face `generate` and the roofline, training MFU,
a colocated GRPO step's stage breakdown, and peak memory per phase with and without offload.

The model is Qwen2-0.5B's shape with random weights (``model.tiny.shape=qwen2-0.5b``), built locally: nothing
is downloaded. Figures are printed, not asserted. Run on a GPU machine::

    python benchmarks/gpu.py            # everything (several minutes on an H100)
    python benchmarks/gpu.py --quick    # smaller decode runs
    python benchmarks/gpu.py --only train                  # training MFU: sdpa and flex variants side by side
    python benchmarks/gpu.py --only train --profile        # ... and the top CUDA kernels of one update each
    python benchmarks/gpu.py --only train --train-variants sdpa,flex+compile+fusedhead+copy

Roofline of a ``generate``: its prefill, the larger of (the weights and the prompts' keys and values) / HBM
bandwidth and (2 x decoder parameters x prompt tokens + causal attention FLOPs + the head at the last position) /
peak bf16 rate, plus each decode step, the larger of (bytes read: the weights once plus every row's KV cache so
far) / HBM bandwidth and (2 x parameters x rows + attention FLOPs) / peak bf16 rate; the figure is that sum
divided by the measured time of the ``generate`` (which includes its prefill). Until 2026-11-26 the prefill
was left out of the sum while its time was measured (figures 1.4 points lower at batch 256 on an H100). MFU counts the model FLOPs of the update (6 x decoder
parameters per token, the output head on response positions only, and the attended query-key pairs of the
packed layout), over the device's dense bf16 peak: the same count for every training variant, whatever pairs
its attention kernel computes (SDPA the whole packed square, FlexAttention the non-empty 128 x 128 tiles).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARTS = ("decode", "profile", "train", "grpo", "trl", "big")  # "profile": where a graphed decode step's time goes
# "trl": benchmarks/grpo_vs_trl.py on the GPU; "big": GRPO steps of billion-parameter shapes (BIG below)
BIG = {  # name: (model.tiny.shape, config overrides)
    "7b-lora": ("qwen2.5-7b", ["model.lora.enabled=true"]),
    "3b-full": ("qwen2.5-3b", []),
    "1.5b-full": ("qwen2.5-1.5b", []),
}
# (HBM bytes/s, dense bf16 FLOP/s) from the vendors' data sheets
PEAKS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12), "A100": (2.0e12, 312e12)}


def peaks() -> tuple[float, float, str]:
    name = torch.cuda.get_device_name()
    for key, (bw, flops) in PEAKS.items():
        if key in name:
            return bw, flops, name
    return 3.35e12, 989e12, name + " (H100 figures assumed)"


def sync_time(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def model_dir(cache: Path) -> Path:
    from relayrl.models.tiny import TinyModelConfig, build_tiny

    return build_tiny(TinyModelConfig(shape="qwen2-0.5b"), cache, verbose=True)


# ------------------------------------------------------------------ decode
def decode_roofline(model, B: int, prompt: int, new: int, bw: float, peak: float) -> float:
    """Seconds a ``generate`` of ``new`` tokens for ``B`` rows of ``prompt`` tokens needs at the roofline: the
    prefill, then every decode step (see the module docstring)."""
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    weight_bytes = params * 2
    head_dim = c.hidden_size // c.num_attention_heads
    kv_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2
    attn = 4 * c.num_hidden_layers * c.num_attention_heads * head_dim  # FLOPs per attended (query, key) pair
    # prefill: every prompt token through the layers (the embedding is a lookup), the head at the last
    # position only, causal attention; it reads the weights once and writes the prompt's keys and values
    flops = 2 * (params - embed) * B * prompt + 2 * embed * B + attn * B * prompt * (prompt + 1) / 2
    total = max((weight_bytes + B * prompt * kv_per_token) / bw, flops / peak)
    for t in range(new):
        ctx = prompt + t
        bytes_ = weight_bytes + B * ctx * kv_per_token
        flops = 2 * params * B + attn * B * ctx
        total += max(bytes_ / bw, flops / peak)
    return total


def decode_breakdown(eng, prompts, params, gen) -> str:
    """Where one ``generate`` of the static engine spends its time, measured on the host: the prefills (waited
    for), the first tokens' sampling, queueing the graph replays, waiting for the device at each read, the
    completions, and the rest of the host's work (reading and finishing rows while the device decodes)."""
    st = eng.static
    spent = {"prefill": 0.0, "start": 0.0, "queue": 0.0, "wait": 0.0, "completion": 0.0}

    def timed(name, fn, sync=False):
        def call(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if sync:
                torch.cuda.synchronize()
            spent[name] += time.perf_counter() - t0
            return out
        return call

    def read(*a):
        return timed("wait", st_read(*a))

    st_read = st.read
    st.prefill, st.start, st.run = timed("prefill", st.prefill, True), timed("start", st.start, True), \
        timed("queue", st.run)
    st.read, eng.completion = read, timed("completion", eng.completion)
    try:
        _, total = sync_time(lambda: eng.generate(prompts, params, gen))
    finally:
        for name in ("prefill", "start", "run", "read"):
            delattr(st, name)
        del eng.completion
    rest = total - sum(spent.values())
    return f"{total:.3f} s: " + ", ".join(f"{k} {v:.3f}" for k, v in {**spent, "host rest": rest}.items())


def bench_decode(path: Path, sizes: list[int], prompt: int, new: int, bw: float, peak: float,
                 baselines: bool = True, compiled: bool = False, unfused: bool = False,
                 breakdown: bool = False) -> dict:
    """relayrl's static decode (and, ``compiled``, the same with ``rollout.decode_compile``: its first generate,
    compilation included, is timed apart; ``unfused``, also compiled with separate q/k/v and gate/up products)
    against the roofline, HF ``generate`` and the dynamic-cache path."""
    from relayrl.engines.generation.base import SamplingParams
    from relayrl.engines.generation.native import NativeGenerationEngine
    from relayrl.models.load import load_model, load_tokenizer

    tok = load_tokenizer(path)
    model = load_model(path, dtype="bfloat16", device="cuda").eval()
    out = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for B in sizes:
        ids = torch.randint(10, len(tok), (B, prompt), generator=torch.Generator().manual_seed(B))
        prompts = ids.tolist()
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=new, ignore_eos=True)
        eng = NativeGenerationEngine(model, tok, max_batch=B, device="cuda", decode="static")
        eng.generate(prompts, params, gen)  # warm-up: the graphs of every cache length get recorded
        torch.cuda.reset_peak_memory_stats()
        comps, dt = sync_time(lambda: eng.generate(prompts, params, gen))
        assert all(len(c.token_ids) == new for c in comps)
        eng.release()
        roof = decode_roofline(model, B, prompt, new, bw, peak)
        row = {"relayrl_tok_s": B * new / dt, "relayrl_s": dt, "roofline_s": roof, "roof_frac": roof / dt,
               "step_ms": dt / new * 1e3}
        hf = float("nan")
        if baselines:  # Hugging Face generate on the same work (sampling, no early stop)
            x = ids.cuda()
            _, hf = sync_time(lambda: model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                                     min_new_tokens=new, do_sample=True, top_k=0, top_p=1.0,
                                                     pad_token_id=tok.pad_token_id))
        row.update({"hf_tok_s": B * new / hf, "hf_s": hf, "speedup": hf / dt})
        if baselines and B == sizes[-1]:  # the dynamic-cache path relayrl uses on CPU, on the same work
            dyn = NativeGenerationEngine(model, tok, max_batch=B, device="cuda", decode="dynamic")
            _, t_dyn = sync_time(lambda: dyn.generate(prompts, params, gen))
            row["dynamic_tok_s"] = B * new / t_dyn
        for fuse in ([True, False] if unfused else [True]) if compiled else []:
            # the same work with the layer step, the head and the sampler's reductions compiled (decode_compile)
            cmp = NativeGenerationEngine(model, tok, max_batch=B, device="cuda", decode="static", decode_compile=True)
            if not fuse:
                from relayrl.engines.generation.static import StaticDecoder

                cmp.static = StaticDecoder(model, B, graphs=True, compile=True, fuse=False)
            name = "compiled" if fuse else "compiled_unfused"
            _, first = sync_time(lambda: cmp.generate(prompts, params, gen))
            _, t_cmp = sync_time(lambda: cmp.generate(prompts, params, gen))
            if breakdown:
                print(f"decode B={B}, {name.replace('_', ', ')}, one generate: "
                      f"{decode_breakdown(cmp, prompts, params, gen)}", flush=True)
            cmp.release()
            row.update({f"{name}_first_s": first, f"{name}_tok_s": B * new / t_cmp, f"{name}_s": t_cmp,
                        f"{name}_step_ms": t_cmp / new * 1e3, f"{name}_roof_frac": roof / t_cmp})
            print(f"decode B={B}, {name.replace('_', ', ')}: {B * new / t_cmp:.0f} tok/s ({t_cmp:.2f} s, "
                  f"{t_cmp / new * 1e3:.2f} ms/step, {roof / t_cmp:.1%} of roofline; first generate with "
                  f"compilation {first:.1f} s)", flush=True)
        out[B] = row
        print(f"decode B={B}: relayrl {row['relayrl_tok_s']:.0f} tok/s ({dt:.2f} s, {row['step_ms']:.2f} ms/step, "
              f"{row['roof_frac']:.1%} of "
              f"roofline {roof:.2f} s), HF generate {row['hf_tok_s']:.0f} tok/s ({hf:.2f} s): "
              f"{row['speedup']:.1f}x" + (f"; dynamic path {row['dynamic_tok_s']:.0f} tok/s" if "dynamic_tok_s" in row
                                         else ""), flush=True)
    return out


def profile_decode(path: Path, B: int, prompt: int, steps: int, compile_step: bool = False) -> list[str]:
    """Where a graphed decode step's time goes (sampling included): the top CUDA kernels over a few replays.
    ``compile_step``: the step compiled by Inductor (fused element-wise kernels) before recording."""
    from torch.profiler import ProfilerActivity, profile

    from relayrl.engines.generation.base import SamplingParams
    from relayrl.engines.generation.static import StaticDecoder
    from relayrl.models.load import load_model

    model = load_model(path, dtype="bfloat16", device="cuda").eval()
    t0 = time.perf_counter()
    dec = StaticDecoder(model, B, graphs=True, compile=compile_step, fuse=compile_step)  # as decode_compile builds it
    dec.ensure(prompt + 3 * steps + 8, 3 * steps + 8)
    dec.tokens.random_(10, 300)
    dec.positions.fill_(prompt)
    params = SamplingParams(temperature=1.0)
    L = -(-(prompt + 3 * steps + 1) // 128) * 128
    dec.run(B, L, 1, params)  # records the graph
    torch.cuda.synchronize()
    ready = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.run(B, L, steps, params)
        torch.cuda.synchronize()
    _, dt = sync_time(lambda: dec.run(B, L, steps, params))
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60)
    kernels = sum(e.count for e in prof.key_averages()) / steps
    return [f"graphed step{' (compiled)' if compile_step else ''} at B={B}, context {prompt}, attending {L}: "
            f"{dt / steps * 1e3:.2f} ms, {kernels:.0f} kernels per step (record{' + compile' if compile_step else ''} "
            f"{ready:.1f} s)", *table.splitlines()]


# ------------------------------------------------------------------ training
# A training variant is "+"-joined features; each maps to load / engine settings. The MFU formula is the same for
# every variant (it counts the attended pairs of the packed layout, not what a kernel computes).
FEATURES = {
    "sdpa": "dense shared-prompt mask through SDPA (the default)",
    "flex": "model.attn_implementation=flex_attention: block-sparse FlexAttention",
    "compile": "engine.compile=true: each decoder layer compiled",
    "fusedhead": "engine.fused_head=true: the chunked head's float32 steps compiled",
    "copy": "engine.compute_copy=true: passes on a bf16 copy of the weights, no autocast",
    "graphs": "engine.cuda_graphs=true: each compiled layer replayed as CUDA graphs (needs compile)",
    "nochunk": "engine.logprob_chunk=0: full [positions, vocab] logits",
    "bf16": "pure bf16 weights, no float32 masters (a ceiling, not a training setting)",
}
TRAIN_VARIANTS = "sdpa,flex,sdpa+compile,flex+compile,flex+compile+fusedhead,flex+compile+fusedhead+copy"


def variant_features(variant: str) -> set[str]:
    feats = set(variant.split("+"))
    if feats - set(FEATURES) or {"sdpa", "flex"} <= feats:
        sys.exit(f"gpu: training variant {variant!r}: join features of {', '.join(FEATURES)} with '+' (sdpa or flex)")
    return feats


def train_batch(groups: int = 8, n: int = 8, P: int = 128, R: int = 384):
    """``groups`` prompts of ``P`` tokens with ``n`` responses of ``R`` tokens each (random ids)."""
    from relayrl.engines.training.base import SequenceBatch

    g = torch.Generator().manual_seed(0)
    prompts, resp, gid = [], [], []
    for i in range(groups):
        p = torch.randint(10, 300, (P,), generator=g)
        for _ in range(n):
            prompts.append(p)
            resp.append(torch.randint(10, 300, (R,), generator=g))
            gid.append(i)
    return SequenceBatch(prompts, resp, {"advantages": [torch.randn(R, generator=g) for _ in resp]}, gid)


def pair_fractions(batch) -> tuple[float, float]:
    """(attended pairs, pairs of the tiles FlexAttention computes) of one packed group, as fractions of the
    dense ``L x L`` square SDPA computes."""
    from relayrl.engines.training import flex
    from relayrl.models.packing import build_packed_batch, plan_units, shared_prompt_mask

    units = plan_units(batch.prompt_ids, batch.response_ids, batch.groups)
    pb = build_packed_batch(batch.prompt_ids, batch.response_ids, [units[:1]])
    L = pb.input_ids.shape[1]
    useful = float(shared_prompt_mask(pb.doc_ids, pb.segment_ids).float().mean())
    pb = pb.pad_to(flex.BLOCK)
    tiles = flex.block_mask(pb.doc_ids, pb.segment_ids).to_dense().sum().item() * flex.BLOCK ** 2
    return useful, tiles / L ** 2


def kernel_profile(fn, top: int = 15) -> list[str]:
    """The ``top`` CUDA kernels of one call of ``fn`` by total time, and the time by kind of kernel."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    if not events:
        return [f"no CUDA kernels recorded in a {wall:.3f} s update"]
    key = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    lines = events.table(sort_by=key, row_limit=top, max_name_column_width=80).splitlines()
    kinds = {  # by kernel name, first match (a heuristic on cuDNN/cuBLAS/Triton naming)
        "attention (SDPA)": ("flash", "fmha", "cudnn", "attention", "sdpa"),
        "triton template (flex attention)": ("triton_tem", "flex"),
        "matmul": ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "sm90_", "sm80_"),
        "triton fused (compiled)": ("triton_poi", "triton_red", "triton_per"),
        "optimizer": ("adam", "multi_tensor", "foreach"),
        "elementwise / copies / reductions": ("elementwise", "vectorized", "reduce", "copy", "fill", "index",
                                              "scatter", "gather", "embedding", "cat", "softmax", "memcpy", "memset"),
    }
    spent: dict[str, float] = {}
    for e in events:
        us = getattr(e, key)
        name = e.key.lower()
        kind = next((k for k, marks in kinds.items() if any(m in name for m in marks)), "other")
        spent[kind] = spent.get(kind, 0.0) + us
    busy = max(sum(spent.values()) / 1e6, 1e-9)
    lines.append(f"kernels {busy:.3f} s in a {wall:.3f} s update (GPU busy {busy / wall:.0%}); by kind: " + ", ".join(
        f"{k} {v / 1e6 / busy:.0%}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])))
    return lines


def idle_gaps(trace: dict, top: int = 20, min_us: float = 20.0) -> list[str]:
    """Where the GPU waits in a Chrome trace of CPU and CUDA events: the gaps between kernels (the union of
    kernel, copy and memset intervals) of at least ``min_us``, summed by the innermost relayrl (else any)
    Python frame running on the host when each gap began: the host work the GPU is waiting for."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    dev = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not dev:
        return ["no device events in the trace"]
    host = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in ev
                  if e.get("cat") in ("python_function", "cpu_op"))
    gaps, end = [], dev[0][1]
    for a, b in dev[1:]:
        if a - end >= min_us:
            gaps.append((end, a))
        end = max(end, b)
    span = dev[-1][1] - dev[0][0]
    by: dict[str, list[float]] = {}
    for a, b in gaps:
        inner = [h for h in host if h[0] <= a <= h[1]]
        ours = [h for h in inner if "relayrl" in h[2]] or inner
        name = min(ours, key=lambda h: h[1] - h[0])[2] if ours else "(no host event)"
        by.setdefault(name[:110], []).append(b - a)
    idle = sum(b - a for a, b in gaps)
    lines = [f"GPU idle {idle / 1e3:.1f} ms of {span / 1e3:.1f} ms in {len(gaps)} gaps >= {min_us:.0f} us; by the "
             f"host frame running when each began:"]
    for name, ds in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{sum(ds) / 1e3:8.2f} ms {len(ds):5d} gaps  {name}")
    return lines


def trace_update(fn, out: Path) -> list[str]:
    """One call of ``fn`` under the profiler with host events and Python frames: the Chrome trace gzipped to
    ``out``, and :func:`idle_gaps` of it."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        fn()
        torch.cuda.synchronize()
    raw = out.with_suffix("")
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with gzip.open(out, "wt") as f:
        json.dump(trace, f)
    raw.unlink()
    return idle_gaps(trace)


def bench_train(path: Path, peak: float, variant: str = "sdpa", budget: int = 16384, profile: bool = False,
                trace: Path | None = None) -> dict:
    """One training variant (see ``FEATURES``): seconds per update of ``train_batch()``, tokens/s, MFU, peak."""
    import gc

    from relayrl.engines.training.base import OptimConfig
    from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
    from relayrl.models.load import load_model
    from relayrl.workflows.losses import PolicyLoss

    feats = variant_features(variant)
    attn = "flex_attention" if "flex" in feats else "sdpa"
    model = load_model(path, dtype="bfloat16" if "bf16" in feats else "float32", device="cuda",
                       attn_implementation=attn)
    cfg = TrainEngineConfig(token_budget=budget, logprob_chunk=0 if "nochunk" in feats else 1024,
                            compile="compile" in feats, fused_head="fusedhead" in feats,
                            compute_copy="copy" in feats, cuda_graphs="graphs" in feats,
                            optim=OptimConfig(lr=1e-6))
    eng = TorchTrainingEngine(model, cfg, total_steps=10, device="cuda", compute_dtype=torch.bfloat16)
    groups, n, P, R = 8, 8, 128, 384
    batch = train_batch(groups, n, P, R)
    loss = PolicyLoss(agg="token-mean")
    for _ in range(3 if feats & {"compile", "flex", "fusedhead"} else 1):  # warm-up (compilation, graph records)
        eng.train_step(batch, loss)
    torch.cuda.reset_peak_memory_stats()
    reps = 3
    _, dt = sync_time(lambda: [eng.train_step(batch, loss) for _ in range(reps)])
    dt /= reps
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    decoder = sum(p.numel() for n_, p in model.named_parameters() if "embed_tokens" not in n_)
    head = c.vocab_size * c.hidden_size
    tokens = groups * (P + n * R)  # the prompt is computed once per group (shared-prompt packing)
    pairs = groups * (P * (P + 1) // 2 + n * (R * P + R * (R + 1) // 2))
    flops = 6 * decoder * tokens + 6 * head * groups * n * R + 12 * pairs * c.num_hidden_layers * c.num_attention_heads * hd
    out = {"variant": variant, "tokens": tokens, "update_s": dt, "tokens_per_s": tokens / dt, "mfu": flops / dt / peak,
           "peak_gb": torch.cuda.max_memory_allocated() / 2**30}
    what = "; ".join(FEATURES[f] for f in FEATURES if f in feats)
    print(f"train {variant} ({what}): {tokens} tokens (budget {budget}/micro-batch) in {dt:.3f} s: "
          f"{out['tokens_per_s']:.0f} tok/s, MFU {out['mfu']:.1%}, peak {out['peak_gb']:.1f} GB", flush=True)
    if profile:  # where one update's time goes
        for line in kernel_profile(lambda: eng.train_step(batch, loss)):
            print("  " + line, flush=True)
    if trace is not None:  # where the GPU waits on the host
        for line in trace_update(lambda: eng.train_step(batch, loss), trace):
            print("  " + line, flush=True)
    del eng, model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def bench_train_variants(path: Path, peak: float, variants: list[str], profile: bool = False,
                         budget: int = 16384, trace: Path | None = None) -> dict:
    """Every variant in one run, then the ratios to the first."""
    useful, computed = pair_fractions(train_batch())
    print(f"train: one packed group attends {useful:.1%} of its L x L pairs; SDPA computes all of them, "
          f"FlexAttention the {computed:.1%} in non-empty 128 x 128 tiles", flush=True)
    res = {v: bench_train(path, peak, v, budget, profile=profile,
                          trace=trace.with_name(f"trace-{v.replace('+', '-')}.json.gz") if trace else None)
           for v in variants}
    base = res[variants[0]]
    print(f"{'variant':48s} {'update s':>9s} {'MFU':>6s} {'speed-up':>8s} {'peak GB':>8s}")
    for v, r in res.items():
        print(f"{v:48s} {r['update_s']:9.3f} {r['mfu']:6.1%} {base['update_s'] / r['update_s']:7.2f}x "
              f"{r['peak_gb']:8.1f}", flush=True)
    return res


# ------------------------------------------------------------------ GRPO step
def bench_grpo(cache: Path, offload: bool, steps: int = 2, new_tokens: int = 256, extra: tuple = (),
               shape: str = "qwen2-0.5b", label: str = "") -> dict:
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.pipeline import GRPOPipeline

    os.environ["RELAYRL_CACHE"] = str(cache)
    run = Path(tempfile.mkdtemp(prefix="gpu-grpo-"))
    cfg = load_config(Config, Path(__file__).resolve().parents[1] / "recipes" / "arith_grpo.yaml", [
        f"model.tiny.shape={shape}", "model.device=cuda", "model.dtype=bfloat16", f"run.dir={run}",
        "data.prompts_per_step=32", "rollout.n=8", f"rollout.max_new_tokens={new_tokens}", "algorithm.kl_coef=0.001",
        "engine.token_budget=16384", f"trainer.offload={str(offload).lower()}", f"trainer.steps={steps}",
        "eval.size=8", "eval.max_new_tokens=8", "telemetry.sinks=[jsonl]", "run.resume=never", *extra])
    import gc

    gc.collect()  # the previous run's pool gives its GPU back
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    wf = GRPOPipeline(cfg)
    start_s = time.perf_counter() - t0
    last: dict = {}
    for step in wf.begin():
        last = wf.step(step)
        last.update(wf.s.timeline.timing_metrics(step))
    wf.shutdown()
    last["start_s"] = start_s
    keys = sorted(k for k in last if k.startswith(("memory/", "timing/")))
    out = {k: last[k] for k in keys}
    out["step_s"] = last["perf/step_time_s"]
    out["tokens_per_s_per_device"] = last["perf/tokens_per_s_per_device"]
    out["colocated_peak_gb"] = max(v for k, v in last.items() if k.startswith("memory/"))
    out["device_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    out["start_s"] = last["start_s"]
    label = label or ("with offload" if offload else "without offload")
    print(f"grpo step ({label}): {out['step_s']:.2f} s, {out['tokens_per_s_per_device']:.0f} tok/s/device, "
          f"colocated peak {out['colocated_peak_gb']:.2f} GB (torch peak {out['device_peak_gb']:.2f} GiB; "
          f"start-up {out['start_s']:.0f} s)", flush=True)
    for k in keys:
        print(f"    {k:32s} {last[k]:.3f}", flush=True)
    return out


def bench_big(cache: Path, names: list[str], new_tokens: int, extra: tuple = ()) -> dict:
    """GRPO steps of billion-parameter shapes with offload (``BIG``), one after another; a shape that does not
    fit is reported, not fatal."""
    out = {}
    for name in names:
        shape, over = BIG[name]
        try:
            out[name] = bench_grpo(cache, True, steps=2, new_tokens=new_tokens, shape=shape, label=name,
                                   extra=("data.prompts_per_step=16", "engine.gradient_checkpointing=true", *over,
                                          *extra))
        except torch.OutOfMemoryError as e:
            print(f"grpo step ({name}): out of GPU memory: {str(e).splitlines()[0]}", flush=True)
            out[name] = {"oom": True}
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    return out


def bench_trl(steps: int, warmup: int, prompts: int, new_tokens: int) -> dict:
    """TRL's GRPOTrainer (HF generate) against relayrl on the GPU: ``benchmarks/grpo_vs_trl.py``, interleaved."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import grpo_vs_trl

    res = grpo_vs_trl.main(["--device", "cuda", "--shape", "qwen2-0.5b", "--steps", str(steps), "--warmup",
                            str(warmup), "--prompts", str(prompts), "--n", "8", "--max-new-tokens", str(new_tokens)])
    r, t = res["relayrl"], res["trl"]
    return {"ratio": r.tokens_per_s / t.tokens_per_s, "steps_ratio": sum(t.times) / sum(r.times),
            "relayrl_tok_s": r.tokens_per_s, "trl_tok_s": t.tokens_per_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="decode 128 new tokens instead of 512")
    ap.add_argument("--cache", default=None, help="where the random Qwen2-0.5B-shaped model is built")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--only", default="", help="comma-separated parts to run (default all): " + ",".join(PARTS))
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: " + ",".join(PARTS))
    ap.add_argument("--profile", action="store_true", help="train: print the top CUDA kernels of one update per "
                    "variant, and the time by kind of kernel")
    ap.add_argument("--train-variants", default=TRAIN_VARIANTS, help="comma-separated training variants, each "
                    "features joined by '+': " + "; ".join(f"{k}: {v}" for k, v in FEATURES.items()) +
                    ". Ratios are to the first")
    ap.add_argument("--budget", type=int, default=16384, help="train: tokens per micro-batch")
    ap.add_argument("--trace", default=None, help="train: a folder; each variant's update is traced (host and "
                    "CUDA events, Python frames) into trace-VARIANT.json.gz there, and the GPU's idle gaps are "
                    "summed by the host frame that was running")
    ap.add_argument("--no-decode-baselines", action="store_true", help="decode: relayrl only (no HF generate, "
                    "no dynamic-cache path)")
    ap.add_argument("--compile-decode", action="store_true", help="decode and profile: also the step compiled "
                    "(rollout.decode_compile)")
    ap.add_argument("--decode-unfused", action="store_true", help="decode, with --compile-decode: also the "
                    "compiled step with separate q/k/v and gate/up products (what the fusion gains)")
    ap.add_argument("--decode-breakdown", action="store_true", help="decode, with --compile-decode: where one "
                    "more generate of the compiled path spends its time (prefill, replays, waits, host work)")
    ap.add_argument("--grpo-new-tokens", type=int, default=256, help="max_new_tokens of the GRPO steps")
    ap.add_argument("--grpo", nargs="*", default=[], help="extra config overrides of the GRPO steps")
    ap.add_argument("--decode-sizes", default="64,256", help="decode: comma-separated batch sizes")
    ap.add_argument("--big", default="7b-lora,3b-full", help="big: comma-separated, of " + ", ".join(BIG))
    ap.add_argument("--big-new-tokens", type=int, default=256, help="big: max_new_tokens")
    ap.add_argument("--trl", default="3,2,16,128", help="trl: measured steps, warm-up steps, prompts (x8 "
                    "samples), max new tokens")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu: no CUDA device (this benchmark measures a GPU)")
    only = set(filter(None, args.only.split(","))) or set(PARTS)
    parts = only - set(filter(None, args.skip.split(",")))
    if not parts <= set(PARTS):
        sys.exit(f"gpu: parts are {', '.join(PARTS)}; got {', '.join(sorted(parts - set(PARTS)))}")
    variants = [v for v in args.train_variants.split(",") if v]
    for v in variants:
        variant_features(v)
    bw, peak, name = peaks()
    cache = Path(args.cache or tempfile.mkdtemp(prefix="relayrl-gpu-"))
    print(f"gpu: {name}, HBM {bw / 1e12:.2f} TB/s, bf16 {peak / 1e12:.0f} TFLOP/s; torch {torch.__version__}", flush=True)
    path = model_dir(cache)
    res: dict = {"device": name}
    new = 128 if args.quick else 512
    def decode():
        res["decode"] = bench_decode(path, [int(x) for x in args.decode_sizes.split(",")], 128, new, bw, peak,
                                     baselines=not args.no_decode_baselines, compiled=args.compile_decode,
                                     unfused=args.decode_unfused, breakdown=args.decode_breakdown)

    def profile():
        for compiled in (False, True) if args.compile_decode else (False,):
            for line in profile_decode(path, 256, 384, 20, compile_step=compiled):
                print("  " + line, flush=True)

    def train():
        trace = Path(args.trace) / "trace.json.gz" if args.trace else None
        if trace:
            trace.parent.mkdir(parents=True, exist_ok=True)
        res["train"] = bench_train_variants(path, peak, variants, profile=args.profile, budget=args.budget,
                                            trace=trace)

    def grpo():
        kw = dict(new_tokens=args.grpo_new_tokens, extra=tuple(args.grpo))
        res["grpo"] = {"off": bench_grpo(cache, False, **kw), "on": bench_grpo(cache, True, **kw)}

    def trl():
        steps, warm, prompts, new_t = (int(x) for x in args.trl.split(","))
        res["trl"] = bench_trl(steps, warm, prompts, new_t)

    def big():
        res["big"] = bench_big(cache, [b for b in args.big.split(",") if b], args.big_new_tokens)

    runs = {"decode": decode, "profile": profile, "train": train, "grpo": grpo, "trl": trl, "big": big}
    for part in PARTS:
        if part in parts:
            try:  # one part's failure is reported; the others still run
                runs[part]()
            except Exception:
                import traceback

                traceback.print_exc()
                print(f"gpu: part {part} FAILED (traceback above)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    d = dict(res.get("decode", {}).get(256, {}))
    if d.get("compiled_roof_frac", 0) > d.get("roof_frac", 0):  # the faster decode path counts (named in detail)
        d.update(roof_frac=d["compiled_roof_frac"], speedup=d.get("hf_s", float("nan")) / d["compiled_s"],
                 path="compiled")
    g = res.get("grpo", {})
    t = res.get("train", {})
    best = max(t.values(), key=lambda r: r["mfu"], default={})
    print(f"gpu detail: decode {d.get('roof_frac', float('nan')):.0%} of roofline ({d.get('path', 'static')} step), "
          f"{d.get('speedup', float('nan')):.1f}x HF generate; "
          f"train MFU {next(iter(t.values()), {}).get('mfu', float('nan')):.1%} "
          f"(best {best.get('mfu', float('nan')):.1%}: {best.get('variant', '-')}); peak memory with/without "
          f"offload {g.get('on', {}).get('colocated_peak_gb', float('nan')):.1f}/"
          f"{g.get('off', {}).get('colocated_peak_gb', float('nan')):.1f} GB")
    b = res.get("big", {}).get("7b-lora", {})
    nan = float("nan")
    print(f"gpu: decode {d.get('roof_frac', nan):.0%} of roofline, {d.get('speedup', nan):.1f}x HF generate; "
          f"train MFU {best.get('mfu', nan):.1%}; relayrl/trl {res.get('trl', {}).get('ratio', nan):.2f} on GPU; "
          f"7B LoRA step {b.get('step_s', nan):.1f} s, peak {b.get('device_peak_gb', nan):.1f} GB")


if __name__ == "__main__":
    main()
