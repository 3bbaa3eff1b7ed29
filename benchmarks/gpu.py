"""GPU benchmark (needs CUDA): decode speed against Hugging Face `generate` and the roofline, training MFU,
a colocated GRPO step's stage breakdown, and peak memory per phase with and without offload.

The model is Qwen2-0.5B's shape with random weights (``model.tiny.shape=qwen2-0.5b``), built locally: nothing
is downloaded. Figures are printed, not asserted. Run on a GPU machine::

    python benchmarks/gpu.py            # everything (about 4 minutes on an H100)
    python benchmarks/gpu.py --quick    # smaller decode runs

Roofline of a decode step: the larger of (bytes read: the weights once plus every row's KV cache so far) /
HBM bandwidth and (2 x parameters x rows + attention FLOPs) / peak bf16 rate; the figure is the sum of those
bounds over all steps divided by the measured time. MFU counts the model FLOPs of the update (6 x decoder
parameters per token, the output head on response positions only, and the attended query-key pairs of the
packed layout), over the device's dense bf16 peak.
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
    """Seconds the decode of ``new`` tokens for ``B`` rows needs at the roofline (see the module docstring)."""
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * 2
    head_dim = c.hidden_size // c.num_attention_heads
    kv_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2
    total = 0.0
    for t in range(new):
        ctx = prompt + t
        bytes_ = weight_bytes + B * ctx * kv_per_token
        flops = 2 * params * B + 4 * B * ctx * c.num_hidden_layers * c.num_attention_heads * head_dim
        total += max(bytes_ / bw, flops / peak)
    return total


def bench_decode(path: Path, sizes: list[int], prompt: int, new: int, bw: float, peak: float) -> dict:
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
        eng.generate(prompts[:B], SamplingParams(n=1, temperature=1.0, max_new_tokens=8, ignore_eos=True), gen)
        torch.cuda.reset_peak_memory_stats()
        comps, dt = sync_time(lambda: eng.generate(prompts, params, gen))
        assert all(len(c.token_ids) == new for c in comps)
        eng.release()
        roof = decode_roofline(model, B, prompt, new, bw, peak)
        row = {"relayrl_tok_s": B * new / dt, "relayrl_s": dt, "roofline_s": roof, "roof_frac": roof / dt}
        # Hugging Face generate on the same work (sampling, no early stop)
        x = ids.cuda()
        _, hf = sync_time(lambda: model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                                 min_new_tokens=new, do_sample=True, top_k=0, top_p=1.0,
                                                 pad_token_id=tok.pad_token_id))
        row.update({"hf_tok_s": B * new / hf, "hf_s": hf, "speedup": hf / dt})
        if B == sizes[-1]:  # the dynamic-cache path relayrl uses on CPU, on the same work
            dyn = NativeGenerationEngine(model, tok, max_batch=B, device="cuda", decode="dynamic")
            _, t_dyn = sync_time(lambda: dyn.generate(prompts, params, gen))
            row["dynamic_tok_s"] = B * new / t_dyn
        out[B] = row
        print(f"decode B={B}: relayrl {row['relayrl_tok_s']:.0f} tok/s ({dt:.2f} s, {row['roof_frac']:.0%} of "
              f"roofline {roof:.2f} s), HF generate {row['hf_tok_s']:.0f} tok/s ({hf:.2f} s): "
              f"{row['speedup']:.1f}x" + (f"; dynamic path {row['dynamic_tok_s']:.0f} tok/s" if "dynamic_tok_s" in row
                                         else ""), flush=True)
    return out


def profile_decode(path: Path, B: int, prompt: int, steps: int) -> list[str]:
    """Where a graphed decode step's time goes: the top CUDA kernels over a few replays."""
    from torch.profiler import ProfilerActivity, profile

    from relayrl.engines.generation.static import StaticDecoder
    from relayrl.models.load import load_model

    model = load_model(path, dtype="bfloat16", device="cuda").eval()
    dec = StaticDecoder(model, B, graphs=True)
    dec.ensure(prompt + steps + 1)
    tok = torch.randint(10, 300, (B,), device="cuda")
    pos = torch.full((B,), prompt, device="cuda")
    dec.step(tok, pos, B)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.step(tok, pos, B)
        torch.cuda.synchronize()
    _, dt = sync_time(lambda: [dec.step(tok, pos, B) for _ in range(steps)])
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60)
    return [f"graphed step at B={B}, context {prompt}: {dt / steps * 1e3:.2f} ms", *table.splitlines()]


# ------------------------------------------------------------------ training
def bench_train(path: Path, peak: float, budget: int = 16384, profile: bool = False, chunk: int = 1024,
                weights: str = "float32", label: str = "fp32 master weights, bf16 compute", compile: bool = False) -> dict:
    from relayrl.engines.training.base import OptimConfig, SequenceBatch
    from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
    from relayrl.models.load import load_model
    from relayrl.workflows.losses import PolicyLoss

    model = load_model(path, dtype=weights, device="cuda")
    eng = TorchTrainingEngine(model, TrainEngineConfig(token_budget=budget, logprob_chunk=chunk, compile=compile,
                                                       optim=OptimConfig(lr=1e-6)),
                              total_steps=10, device="cuda", compute_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    groups, n, P, R = 8, 8, 128, 384
    prompts, resp, gid = [], [], []
    for i in range(groups):
        p = torch.randint(10, 300, (P,), generator=g)
        for _ in range(n):
            prompts.append(p)
            resp.append(torch.randint(10, 300, (R,), generator=g))
            gid.append(i)
    fields = {"advantages": [torch.randn(R, generator=g) for _ in resp]}
    batch = SequenceBatch(prompts, resp, fields, gid)
    loss = PolicyLoss(agg="token-mean")
    eng.train_step(batch, loss)  # warm-up (and compilation)
    if compile:
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
    out = {"tokens": tokens, "update_s": dt, "tokens_per_s": tokens / dt, "mfu": flops / dt / peak,
           "peak_gb": torch.cuda.max_memory_allocated() / 2**30}
    if profile:  # where an update's time goes
        from torch.profiler import ProfilerActivity, profile as prof_

        with prof_(activities=[ProfilerActivity.CUDA]) as prof:
            eng.train_step(batch, loss)
            torch.cuda.synchronize()
        for line in prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                              max_name_column_width=70).splitlines():
            print("  " + line, flush=True)
    print(f"train ({label}, head chunk {chunk or 'off'}): {tokens} tokens (budget {budget}/micro-batch) in "
          f"{dt:.3f} s: {out['tokens_per_s']:.0f} tok/s, MFU {out['mfu']:.1%}, peak {out['peak_gb']:.1f} GB",
          flush=True)
    del eng, model
    torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------ GRPO step
def bench_grpo(cache: Path, offload: bool, steps: int = 2, new_tokens: int = 256, extra: tuple = ()) -> dict:
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.grpo import GRPOWorkflow

    os.environ["RELAYRL_CACHE"] = str(cache)
    run = Path(tempfile.mkdtemp(prefix="gpu-grpo-"))
    cfg = load_config(Config, Path(__file__).resolve().parents[1] / "recipes" / "arith_grpo.yaml", [
        "model.tiny.shape=qwen2-0.5b", "model.device=cuda", "model.dtype=bfloat16", f"run.dir={run}",
        "data.prompts_per_step=32", "rollout.n=8", f"rollout.max_new_tokens={new_tokens}", "algorithm.kl_coef=0.001",
        "engine.token_budget=16384", f"trainer.offload={str(offload).lower()}", f"trainer.steps={steps}",
        "eval.size=8", "eval.max_new_tokens=8", "telemetry.sinks=[jsonl]", "run.resume=never", *extra])
    import gc

    gc.collect()  # the previous run's pool gives its GPU back
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    wf = GRPOWorkflow(cfg)
    last: dict = {}
    for step in wf.begin():
        last = wf.step(step)
        last.update(wf.s.timeline.timing_metrics(step))
    wf.shutdown()
    keys = sorted(k for k in last if k.startswith(("memory/", "timing/")))
    out = {k: last[k] for k in keys}
    out["step_s"] = last["perf/step_time_s"]
    out["tokens_per_s_per_device"] = last["perf/tokens_per_s_per_device"]
    out["colocated_peak_gb"] = max(v for k, v in last.items() if k.startswith("memory/"))
    label = "with offload" if offload else "without offload"
    print(f"grpo step ({label}): {out['step_s']:.2f} s, {out['tokens_per_s_per_device']:.0f} tok/s/device, "
          f"colocated peak {out['colocated_peak_gb']:.2f} GB", flush=True)
    for k in keys:
        print(f"    {k:32s} {last[k]:.3f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="decode 128 new tokens instead of 512")
    ap.add_argument("--cache", default=None, help="where the random Qwen2-0.5B-shaped model is built")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: decode,profile,train,grpo")
    ap.add_argument("--profile-train", action="store_true", help="print the update's top CUDA kernels")
    ap.add_argument("--train-compiled-only", action="store_true", help="train part: only the compiled variant")
    ap.add_argument("--grpo-new-tokens", type=int, default=256, help="max_new_tokens of the GRPO steps")
    ap.add_argument("--grpo", nargs="*", default=[], help="extra config overrides of the GRPO steps")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu: no CUDA device (this benchmark measures a GPU)")
    skip = set(filter(None, args.skip.split(",")))
    bw, peak, name = peaks()
    cache = Path(args.cache or tempfile.mkdtemp(prefix="relayrl-gpu-"))
    print(f"gpu: {name}, HBM {bw / 1e12:.2f} TB/s, bf16 {peak / 1e12:.0f} TFLOP/s; torch {torch.__version__}", flush=True)
    path = model_dir(cache)
    res: dict = {"device": name}
    new = 128 if args.quick else 512
    if "decode" not in skip:
        res["decode"] = bench_decode(path, [64, 256], 128, new, bw, peak)
    if "profile" not in skip:
        for line in profile_decode(path, 256, 384, 20):
            print("  " + line, flush=True)
    if "train" not in skip and args.train_compiled_only:
        res["train_compiled"] = bench_train(path, peak, compile=True, label="compiled", profile=args.profile_train)
    elif "train" not in skip:
        res["train"] = bench_train(path, peak, profile=args.profile_train)
        res["train_unchunked"] = bench_train(path, peak, chunk=0)
        res["train_pure_bf16"] = bench_train(path, peak, weights="bfloat16", label="pure bf16 weights (ceiling)")
        res["train_compiled"] = bench_train(path, peak, compile=True, label="fp32 master, bf16, compiled layers")
    if "grpo" not in skip:
        kw = dict(new_tokens=args.grpo_new_tokens, extra=tuple(args.grpo))
        res["grpo"] = {"off": bench_grpo(cache, False, **kw), "on": bench_grpo(cache, True, **kw)}
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    d = res.get("decode", {}).get(256, {})
    g = res.get("grpo", {})
    print(f"gpu: decode {d.get('roof_frac', float('nan')):.0%} of roofline, {d.get('speedup', float('nan')):.1f}x HF "
          f"generate; train MFU {res.get('train', {}).get('mfu', float('nan')):.1%}; peak memory with/without "
          f"offload {g.get('on', {}).get('colocated_peak_gb', float('nan')):.1f}/"
          f"{g.get('off', {}).get('colocated_peak_gb', float('nan')):.1f} GB")


if __name__ == "__main__":
    main()
