"""The decode parts of the GPU benchmark (``benchmarks/gpu.py --only decode,profile``): relayrl's static-cache
decode, plain and compiled, against the roofline, Hugging Face ``generate`` and the dynamic-cache path; where
one ``generate``'s time goes; the kernels of one graphed step. The roofline is defined in ``gpu.py``'s
docstring."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from gpu_profile import kernel_profile, sync_time, trace_update


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
                 breakdown: bool = False, trace: Path | None = None, flex: bool = False, triton: bool = False,
                 bucket: int | None = None, autotune: bool = False, prefill: bool = False,
                 split_k: list[int] = ()) -> dict:
    """relayrl's static decode (and, ``compiled``, the same with ``rollout.decode_compile``: its first generate,
    compilation included, is timed apart; ``unfused``, also compiled with separate q/k/v and gate/up products;
    ``flex``, ``bucket``, ``autotune``: the compiled step with FlexAttention, another bucket, max-autotune;
    ``triton``: the step with the Triton attention kernel, graphed eagerly and, ``compiled``, compiled;
    ``prefill``: also each decoder layer's forward compiled, which the prefill runs through; ``split_k``: the
    compiled step with split-K q/k/v, o and down products, per count, and with ``triton`` also beside it)
    against the roofline, HF ``generate`` and the dynamic-cache path."""
    from relayrl.engines.generation.base import SamplingParams
    from relayrl.engines.generation.native import NativeGenerationEngine
    from relayrl.engines.generation.static import StaticDecoder, _decoder
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
        if triton:  # the default (uncompiled) graphed step with the Triton attention, beside the matmul one above
            tri = NativeGenerationEngine(model, tok, max_batch=B, device="cuda", decode="static")
            tri.static = StaticDecoder(model, B, graphs=True, attention="triton")
            tri.generate(prompts, params, gen)
            _, t_tri = sync_time(lambda: tri.generate(prompts, params, gen))
            tri.release()
            row.update({"triton_tok_s": B * new / t_tri, "triton_roof_frac": roof / t_tri})
            print(f"decode B={B}, triton attention (not compiled): {B * new / t_tri:.0f} tok/s ({t_tri:.2f} s, "
                  f"{t_tri / new * 1e3:.2f} ms/step, {roof / t_tri:.1%} of roofline; matmul {dt:.2f} s)", flush=True)
        variants = {"compiled": None}
        if unfused:
            variants["compiled_unfused"] = dict(fuse=False)
        if flex:
            variants["compiled_flex"] = dict(attention="flex")
        if triton:
            variants["compiled_triton"] = dict(attention="triton")
        if bucket:
            variants[f"compiled_bucket{bucket}"] = dict(bucket=bucket)
        for splits in split_k:  # the small-batch products over slices of their input width
            variants[f"compiled_splitk{splits}"] = dict(split_k=splits)
            if triton:
                variants[f"compiled_triton_splitk{splits}"] = dict(attention="triton", split_k=splits)
        if prefill:  # the decoder layers' forward compiled too: the prefill runs through them (an experiment)
            variants["compiled_prefill"] = dict(compile_layers=True)
        if autotune:  # Inductor times its Triton matmul templates against cuBLAS (the small-M products); last,
            variants["compiled_autotune"] = dict(compile_mode="max-autotune-no-cudagraphs")  # the slowest to compile
        for name, kw in variants.items() if compiled else ():
            kw = dict(kw or {})
            layers = list(_decoder(model).layers) if kw.pop("compile_layers", False) else []
            try:
                for layer in layers:
                    layer.compile(dynamic=True)
                # the same work with the layer step, the head and the sampler's reductions compiled (decode_compile)
                cmp = NativeGenerationEngine(model, tok, max_batch=B, device="cuda", decode="static",
                                             decode_compile=True)
                if kw:  # a variant of the compiled step that no setting names (yet)
                    cmp.static = StaticDecoder(model, B, graphs=True, compile=True, **{"fuse": True, **kw})
                _, first = sync_time(lambda: cmp.generate(prompts, params, gen))
                _, t_cmp = sync_time(lambda: cmp.generate(prompts, params, gen))
                if breakdown and name in ("compiled", "compiled_prefill"):
                    print(f"decode B={B}, {name.replace('_', ', ')}, one generate: "
                          f"{decode_breakdown(cmp, prompts, params, gen)}", flush=True)
                if trace is not None and name == "compiled":  # the kernels of one generate, the GPU's idle gaps
                    for line in [*kernel_profile(lambda: cmp.generate(prompts, params, gen)),
                                 *trace_update(lambda: cmp.generate(prompts, params, gen), trace)]:
                        print(f"  {line}", flush=True)
            except Exception as e:  # an experiment's failure is reported; the figures already taken stand
                print(f"decode B={B}, {name.replace('_', ', ')}: FAILED ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160] if str(e) else ''})", flush=True)
                continue
            finally:
                for layer in layers:  # the model's own forward again for what follows
                    layer._compiled_call_impl = None
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


def profile_decode(path: Path, B: int, prompt: int, steps: int, compile_step: bool = False,
                   attention: str = "matmul") -> list[str]:
    """Where a graphed decode step's time goes (sampling included): the top CUDA kernels over a few replays.
    ``compile_step``: the step compiled by Inductor (fused element-wise kernels) before recording;
    ``attention``: the step's attention (``StaticDecoder``'s)."""
    from torch.profiler import ProfilerActivity, profile

    from relayrl.engines.generation.base import SamplingParams
    from relayrl.engines.generation.static import StaticDecoder
    from relayrl.models.load import load_model

    model = load_model(path, dtype="bfloat16", device="cuda").eval()
    t0 = time.perf_counter()
    dec = StaticDecoder(model, B, graphs=True, compile=compile_step, fuse=compile_step,  # as decode_compile builds it
                        attention=attention)
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
    kind = (" (compiled)" if compile_step else "") + (f" ({attention})" if attention != "matmul" else "")
    return [f"graphed step{kind} at B={B}, context {prompt}, attending {L}: "
            f"{dt / steps * 1e3:.2f} ms, {kernels:.0f} kernels per step (record{' + compile' if compile_step else ''} "
            f"{ready:.1f} s)", *table.splitlines()]
