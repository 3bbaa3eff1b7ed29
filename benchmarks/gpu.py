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

from gpu_decode import bench_decode, profile_decode  # noqa: E402  (beside this file)
from gpu_flex import DEFAULT_PRESETS, PRESETS, bench_flex, kernel_options, parse_presets, random_groups  # noqa: E402
from gpu_profile import kernel_profile, sync_time, trace_update  # noqa: E402

PARTS = ("decode", "profile", "flex", "train", "grpo", "trl", "big")  # "profile": where a graphed decode step's time goes
# "flex": the training attention alone, per set of FlexAttention kernel options (gpu_flex.py)
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



def model_dir(cache: Path) -> Path:
    from relayrl.models.tiny import TinyModelConfig, build_tiny

    return build_tiny(TinyModelConfig(shape="qwen2-0.5b"), cache, verbose=True)


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
    "chunk4k": "engine.logprob_chunk=4096: a quarter as many head chunks (and float32 weight-gradient sums)",
    "vocabgrad": "engine.head_grad=vocab: the head's backward a vocabulary slice at a time (its weight's "
                 "gradient written once, no float32 sums over chunks)",
    "storedgrad": "engine.head_grad=stored: the head's logits kept from the forward pass in bf16, no recompute",
    "tritonhead": "with fusedhead: the head's float32 steps as relayrl's one-pass Triton kernels (head.FUSED)",
    "opt=NAME": "FlexAttention's kernel options of gpu_flex.PRESETS[NAME] over relayrl's (for example opt=bwd-n1-32)",
    "bf16": "pure bf16 weights, no float32 masters (a ceiling, not a training setting)",
}
TRAIN_VARIANTS = "sdpa,flex,sdpa+compile,flex+compile,flex+compile+fusedhead,flex+compile+fusedhead+copy"


def variant_features(variant: str) -> set[str]:
    feats = set(variant.split("+"))
    bad = {f for f in feats - set(FEATURES) if not (f.startswith("opt=") and f[4:] in PRESETS)}
    if bad or {"sdpa", "flex"} <= feats:
        sys.exit(f"gpu: training variant {variant!r}: join features of {', '.join(FEATURES)} with '+' (sdpa or flex)")
    return feats


def train_batch(groups: int = 8, n: int = 8, P: int = 128, R: int = 384):
    """``groups`` prompts of ``P`` tokens with ``n`` responses of ``R`` tokens each (random ids)."""
    from relayrl.engines.training.base import SequenceBatch

    g = torch.Generator().manual_seed(0)
    prompts, resp, gid = random_groups(groups, n, P, R, g)
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


def bench_train(path: Path, peak: float, variant: str = "sdpa", budget: int = 16384, profile: bool = False,
                trace: Path | None = None, label: str | None = None) -> dict:
    """One training variant (see ``FEATURES``): seconds per update of ``train_batch()``, tokens/s, MFU, peak."""
    import gc

    from relayrl.engines.training.base import OptimConfig
    from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
    from relayrl.models.load import load_model
    from relayrl.workflows.losses import PolicyLoss

    feats = variant_features(variant)
    opt = next((f[4:] for f in feats if f.startswith("opt=")), None)
    if opt is not None:  # kernel options of the flex path: set for this variant, restored after
        from relayrl.engines.training import flex

        saved = flex.CUDA_KERNEL_OPTIONS, flex.EXPAND_KV
        flex.CUDA_KERNEL_OPTIONS, flex.EXPAND_KV = kernel_options(PRESETS[opt])
        try:
            return bench_train(path, peak, "+".join(f for f in variant.split("+") if not f.startswith("opt=")),
                               budget, profile, trace, label=variant)
        finally:
            flex.CUDA_KERNEL_OPTIONS, flex.EXPAND_KV = saved
    if "tritonhead" in feats:  # the head's fused steps as Triton kernels: set for this variant, restored after
        from relayrl.engines.training import head

        if "fusedhead" not in feats:
            sys.exit(f"gpu: training variant {variant!r}: tritonhead needs fusedhead")
        saved_fused, head.FUSED = head.FUSED, "triton"
        try:
            return bench_train(path, peak, "+".join(f for f in variant.split("+") if f != "tritonhead"), budget,
                               profile, trace, label=label or variant)
        finally:
            head.FUSED = saved_fused
    attn = "flex_attention" if "flex" in feats else "sdpa"
    model = load_model(path, dtype="bfloat16" if "bf16" in feats else "float32", device="cuda",
                       attn_implementation=attn)
    cfg = TrainEngineConfig(token_budget=budget,
                            logprob_chunk=0 if "nochunk" in feats else 4096 if "chunk4k" in feats else 1024,
                            compile="compile" in feats, fused_head="fusedhead" in feats,
                            compute_copy="copy" in feats, cuda_graphs="graphs" in feats,
                            head_grad="vocab" if "vocabgrad" in feats else "stored" if "storedgrad" in feats
                            else "positions",
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
    variant = label or variant
    out = {"variant": variant, "tokens": tokens, "update_s": dt, "tokens_per_s": tokens / dt, "mfu": flops / dt / peak,
           "peak_gb": torch.cuda.max_memory_allocated() / 2**30}
    shown = variant_features(variant)
    what = "; ".join([FEATURES[f] for f in FEATURES if f in shown] +
                     [f"flex kernel options {f[4:]}" for f in sorted(shown) if f.startswith("opt=")])
    print(f"train {variant} ({what}): {tokens} tokens (budget {budget}/micro-batch) in {dt:.3f} s: "
          f"{out['tokens_per_s']:.0f} tok/s, MFU {out['mfu']:.1%}, peak {out['peak_gb']:.1f} GiB", flush=True)
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
    print(f"{'variant':48s} {'update s':>9s} {'MFU':>6s} {'speed-up':>8s} {'peak GiB':>8s}")
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
          f"colocated peak {out['colocated_peak_gb']:.2f} GiB (torch peak {out['device_peak_gb']:.2f} GiB; "
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
                    "summed by the host frame that was running; decode, with --compile-decode: the same for one "
                    "compiled generate (trace-decode.json.gz), after its top kernels")
    ap.add_argument("--no-decode-baselines", action="store_true", help="decode: relayrl only (no HF generate, "
                    "no dynamic-cache path)")
    ap.add_argument("--compile-decode", action="store_true", help="decode and profile: also the step compiled "
                    "(rollout.decode_compile)")
    ap.add_argument("--decode-unfused", action="store_true", help="decode, with --compile-decode: also the "
                    "compiled step with separate q/k/v and gate/up products (what the fusion gains)")
    ap.add_argument("--decode-flex", action="store_true", help="decode and profile, with --compile-decode: also "
                    "the compiled step with its attention as one FlexAttention call")
    ap.add_argument("--decode-triton", action="store_true", help="decode and profile: also the step with its "
                    "attention as one Triton kernel reading each row's own positions (eager graphs and, with "
                    "--compile-decode, compiled)")
    ap.add_argument("--decode-splitk", type=str, default="", help="decode, with --compile-decode: also the "
                    "compiled step with its q/k/v, o and down products as this many split-K partial products "
                    "(comma-separated counts, e.g. 4,8; with --decode-triton also beside the Triton attention)")
    ap.add_argument("--decode-bucket", type=int, default=None, help="decode, with --compile-decode: also the "
                    "compiled step attending over multiples of this many cache positions (16, 32 or 64; default 128)")
    ap.add_argument("--decode-autotune", action="store_true", help="decode, with --compile-decode: also the "
                    "step compiled with mode=max-autotune-no-cudagraphs (Triton matmul templates timed against cuBLAS)")
    ap.add_argument("--decode-prefill-compile", action="store_true", help="decode, with --compile-decode: also the "
                    "compiled step with each decoder layer's forward compiled (the prefill runs through them)")
    ap.add_argument("--decode-breakdown", action="store_true", help="decode, with --compile-decode: where one "
                    "more generate of the compiled path spends its time (prefill, replays, waits, host work)")
    ap.add_argument("--flex-presets", default=DEFAULT_PRESETS, help="flex: comma-separated kernel-option sets of "
                    "gpu_flex.PRESETS (" + ", ".join(PRESETS) + "), or ';'-separated name=JSON")
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
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
        res["decode"] = bench_decode(path, [int(x) for x in args.decode_sizes.split(",")], 128, new, bw, peak,
                                     baselines=not args.no_decode_baselines, compiled=args.compile_decode,
                                     unfused=args.decode_unfused, breakdown=args.decode_breakdown,
                                     trace=Path(args.trace) / "trace-decode.json.gz" if args.trace else None,
                                     flex=args.decode_flex, triton=args.decode_triton, bucket=args.decode_bucket,
                                     autotune=args.decode_autotune, prefill=args.decode_prefill_compile,
                                     split_k=[int(x) for x in args.decode_splitk.split(",") if x])

    def profile():
        eager = ["matmul"] + ["triton"] * args.decode_triton
        compiled = (["matmul"] + ["flex"] * args.decode_flex + ["triton"] * args.decode_triton) * args.compile_decode
        steps = [(False, a) for a in eager] + [(True, a) for a in compiled]
        for compiled, attention in steps:
            for line in profile_decode(path, 256, 384, 20, compile_step=compiled, attention=attention):
                print("  " + line, flush=True)

    def flex_part():
        res["flex"] = bench_flex(parse_presets(args.flex_presets))

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

    runs = {"decode": decode, "profile": profile, "flex": flex_part, "train": train, "grpo": grpo, "trl": trl, "big": big}
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
          f"{g.get('off', {}).get('colocated_peak_gb', float('nan')):.1f} GiB")
    b = res.get("big", {}).get("7b-lora", {})
    nan = float("nan")
    print(f"gpu: decode {d.get('roof_frac', nan):.0%} of roofline, {d.get('speedup', nan):.1f}x HF generate; "
          f"train MFU {best.get('mfu', nan):.1%}; relayrl/trl {res.get('trl', {}).get('ratio', nan):.2f} on GPU; "
          f"7B LoRA step {b.get('step_s', nan):.1f} s, peak {b.get('device_peak_gb', nan):.1f} GiB")


if __name__ == "__main__":
    main()
