"""The training attention alone (``benchmarks/gpu.py --only flex``): FlexAttention's forward and backward on
one micro-batch of the training benchmark's packed layout, for several sets of kernel options side by side.

Why: on an H100 (2026-11-27) the backward kernel took 52 ms of a 277 ms update, eight times its forward's
6.5 ms, where dense attention's backward costs about 2.5 forwards. The shared-prompt layout makes the work
uneven: the key tile that holds a group's prompt is attended by every response of the group, and the
backward's key/value pass gives each key tile to one program, which walks all of those queries for all
seven query heads of its key/value head while the programs of response tiles walk a few hundred. Smaller
key tiles in that pass (``BLOCK_N1``) split the prompt's work over more programs. ``IS_DIVISIBLE``: the
packed length is a multiple of 128, which the dynamically shaped compilation cannot know, so its loads are
bounds-checked unless told.

``EXPAND_KV`` (relayrl's, not torch's): the key/value heads repeated to the query heads before the kernel, so
that pass has a program per query head rather than one per key/value head walking its group's seven.

Each set of options is compiled afresh (``torch._dynamo.reset()``); a set the installed torch rejects is
reported and skipped. Figures: milliseconds per call (forward; forward and backward) and TFLOP/s over the
attended query-key pairs (4 x head dim FLOPs a pair forward, 2.5 times that backward)."""

from __future__ import annotations

import json

import torch

from gpu_profile import sync_time

# name -> kernel options, applied over relayrl's own (relayrl.engines.training.flex.CUDA_KERNEL_OPTIONS, which
# the training engine passes, and flex.EXPAND_KV; None: relayrl's as they are; an empty set: torch's defaults).
# BLOCK_M1/BLOCK_N1 tile the backward's key/value pass (N1 keys a program), BLOCK_M2/BLOCK_N2 its query pass;
# torch needs N1 % M1 == 0, M2 % N2 == 0 and 128 divisible by each. EXPAND_KV is not torch's: the key/value
# heads repeated to the query heads (relayrl's flex.EXPAND_KV); False hands the kernel the shared heads.
PRESETS = {
    "relayrl": None,
    "torch-default": {},
    "tiles-64": {"IS_DIVISIBLE": False, "EXPAND_KV": False},  # relayrl's options until 2026-11-27
    "divisible": {"IS_DIVISIBLE": True, "EXPAND_KV": False},
    "bwd-n1-64": {"IS_DIVISIBLE": True, "EXPAND_KV": False, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64,
                  "BLOCK_N2": 32},
    "bwd-n1-32": {"IS_DIVISIBLE": True, "EXPAND_KV": False, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 64,
                  "BLOCK_N2": 32},
    "bwd-n1-32-m2-128": {"IS_DIVISIBLE": True, "EXPAND_KV": False, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 128,
                         "BLOCK_N2": 64},
    "bwd-n1-16": {"IS_DIVISIBLE": True, "EXPAND_KV": False, "BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 64,
                  "BLOCK_N2": 16},
    "expand-kv": {"IS_DIVISIBLE": True, "EXPAND_KV": True},  # relayrl's default since 2026-11-27
    "expand-kv-n1-64": {"IS_DIVISIBLE": True, "EXPAND_KV": True, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64,
                        "BLOCK_N2": 32},
}
DEFAULT_PRESETS = "relayrl,tiles-64,divisible,bwd-n1-64,bwd-n1-32,bwd-n1-32-m2-128,bwd-n1-16,expand-kv,expand-kv-n1-64"


def kernel_options(preset: dict | None) -> tuple[dict, bool]:
    """A preset (a value of :data:`PRESETS`) -> (the kernel options to pass, whether to repeat the key/value
    heads): None gives relayrl's own, ``{}`` torch's defaults, anything else the preset's over relayrl's."""
    from relayrl.engines.training import flex

    if preset == {}:
        return {}, False
    opts = {**flex.CUDA_KERNEL_OPTIONS, "EXPAND_KV": flex.EXPAND_KV, **(preset or {})}
    return opts, bool(opts.pop("EXPAND_KV"))


def random_groups(groups: int, n: int, P: int, R: int, g: torch.Generator):
    """(prompts, responses, group ids): ``groups`` prompts of ``P`` random tokens, each with ``n`` responses of
    ``R`` (the training benchmark's batch)."""
    prompts, resp, gid = [], [], []
    for i in range(groups):
        p = torch.randint(10, 300, (P,), generator=g)
        for _ in range(n):
            prompts.append(p)
            resp.append(torch.randint(10, 300, (R,), generator=g))
            gid.append(i)
    return prompts, resp, gid


def packed_layout(groups: int = 4, n: int = 8, P: int = 128, R: int = 384):
    """(doc ids, segment ids, attended pairs) of one packed row of ``groups`` shared-prompt groups, as the
    training benchmark's 16k-token micro-batch lays them out (padded to the flex tile)."""
    from relayrl.engines.training import flex
    from relayrl.models.packing import build_packed_batch, plan_units, shared_prompt_mask

    prompts, resp, gid = random_groups(groups, n, P, R, torch.Generator().manual_seed(0))
    units = plan_units(prompts, resp, gid)
    pb = build_packed_batch(prompts, resp, [units]).pad_to(flex.BLOCK, at_least=2 * flex.BLOCK)
    pairs = int(shared_prompt_mask(pb.doc_ids, pb.segment_ids).sum())
    return pb.doc_ids, pb.segment_ids, pairs


def parse_presets(spec: str) -> dict[str, dict | None]:
    """``name,name,...`` of :data:`PRESETS`, or ``name=JSON`` for a set of options of one's own."""
    out: dict[str, dict | None] = {}
    for item in filter(None, (s.strip() for s in spec.split(";" if "=" in spec else ","))):
        if "=" in item:
            name, raw = item.split("=", 1)
            out[name] = json.loads(raw)
        elif item in PRESETS:
            out[item] = PRESETS[item]
        else:
            raise SystemExit(f"gpu: flex preset {item!r}: one of {', '.join(PRESETS)}, or name=JSON (';'-separated)")
    return out


def bench_flex(presets: dict[str, dict | None], heads: tuple[int, int] = (14, 2), head_dim: int = 64,
               reps: int = 10, device: str = "cuda", groups: int = 4) -> dict:
    """Forward, and forward + backward, of the compiled FlexAttention per set of kernel options (``device`` and
    ``groups`` other than the benchmark's for a smoke run)."""
    from torch.nn.attention.flex_attention import flex_attention

    from relayrl.engines.training import flex

    doc, seg, pairs = packed_layout(groups)
    L = doc.shape[1]
    mask = flex.block_mask(doc.to(device), seg.to(device))
    hq, hkv = heads
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, hq, L, head_dim, device=device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, hkv, L, head_dim, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, hkv, L, head_dim, device=device, dtype=torch.bfloat16, generator=g)
    dout = torch.randn_like(q)
    fwd_flops = 4 * pairs * head_dim * hq
    print(f"flex: one packed row of {L} tokens, {hq}/{hkv} heads of {head_dim}; attended pairs {pairs / L**2:.1%} "
          f"of L x L; {mask.sparsity():.1f}% of the 128 x 128 tiles empty", flush=True)
    out = {}
    for name, opts in presets.items():
        opts, expand = kernel_options(opts)
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, dynamic=True)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def call(q_, k_, v_):  # as flex.flex_attention_forward calls it (the repeat timed with the kernel)
            if expand:
                k_, v_ = (t.repeat_interleave(hq // hkv, dim=1) for t in (k_, v_))
            return fn(q_, k_, v_, block_mask=mask, enable_gqa=not expand, kernel_options=opts)

        def fwd():
            with torch.no_grad():
                return call(q, k, v)

        def both():
            o = call(qg, kg, vg)
            o.backward(dout)
            return o

        try:
            _, first = sync_time(lambda: (fwd(), both()))  # compilation
            _, tf = sync_time(lambda: [fwd() for _ in range(reps)])
            _, tb = sync_time(lambda: [both() for _ in range(reps)])
        except Exception as e:  # a set of options this torch rejects
            print(f"flex {name}: FAILED ({type(e).__name__}: {str(e).splitlines()[0][:160]})", flush=True)
            continue
        tf, tb = tf / reps, tb / reps
        row = {"options": {**opts, "EXPAND_KV": True} if expand else opts,
               "fwd_ms": tf * 1e3, "fwd_bwd_ms": tb * 1e3, "bwd_ms": (tb - tf) * 1e3,
               "fwd_tflops": fwd_flops / tf / 1e12, "bwd_tflops": 2.5 * fwd_flops / max(tb - tf, 1e-9) / 1e12,
               "compile_s": first}
        out[name] = row
        print(f"flex {name:18s} forward {row['fwd_ms']:6.3f} ms ({row['fwd_tflops']:4.0f} TFLOP/s), backward "
              f"{row['bwd_ms']:6.3f} ms ({row['bwd_tflops']:4.0f} TFLOP/s), both {row['fwd_bwd_ms']:6.3f} ms; "
              f"compiled in {first:.0f} s; options {json.dumps(row['options'])}", flush=True)
    if out:
        base = next(iter(out.values()))
        best = min(out, key=lambda n: out[n]["fwd_bwd_ms"])
        print(f"flex: fastest forward + backward {best} ({out[best]['fwd_bwd_ms']:.3f} ms, "
              f"{base['fwd_bwd_ms'] / out[best]['fwd_bwd_ms']:.2f}x the first)", flush=True)
    return out
