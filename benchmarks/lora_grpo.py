"""LoRA GRPO against full fine-tuning GRPO on the demo, side by side (issue 19, item 4).

Both runs start from the demo's SFT model (the tiny Qwen2 pretrained on 2-digit sums, then SFT on a careless
teacher who forgets to carry in 70% of sums: stages 1-2 of ``relayrl demo``, built once and cached) and train
GRPO on fresh sums with the verifier as the only reward (``recipes/arith_grpo.yaml``), same seed, prompts and
steps. The LoRA run is ``recipes/arith_grpo_lora.yaml``: rank-8 adapters on every projection, the base
frozen, a learning rate 10x the full run's.

The two workflows live in one process and take their steps in turn (LoRA step k, then full step k), so both
see the same load on a shared machine. Figures:

* held-out greedy accuracy (200 sums that need a carry) before and after, for both;
* trainable parameters, and the actor's optimizer state in bytes (AdamW's two moments and step counts, read
  from the optimizer after the last step);
* mean step time (generate, score, update, relay) and update time, over the steps after ``--warmup``,
  excluding evaluations; the LoRA/full ratio of each.

The last line is::

    lora_grpo: accuracy B% -> A%, optimizer memory L/F MiB (LoRA/full)

Run it with::

    .venv/bin/python benchmarks/lora_grpo.py                # 300 steps each (~3 min on 2 cores, more when busy)
    .venv/bin/python benchmarks/lora_grpo.py --steps 100    # shorter

``--vllm-sync`` measures instead what a weight sync of a LoRA run costs on ``rollout.engine=vllm`` with
``rollout.lora_sync=merged`` (every weight, ``W + (alpha / r) B @ A``) against ``adapter`` (the adapters alone,
loaded as a vLLM LoRA): a GRPO run of each on a tiny but wide random model (``--width``, 4 layers, r=8 on every
projection; the same seed, prompts and steps), one after the other, each in a process of its own (``relayrl
train``). Per route, over the steps after the first: bytes a sync carries (``relay/bytes``), sync time
(``timing/relay_s``), generation time (``timing/generate_s``: vLLM's LoRA decode runs extra kernels), engine
start-up; then the merged/adapter ratios. Its last line::

    lora_sync: a sync carries M/A MB (merged/adapter, Rx fewer bytes), takes Ts/Us; generation Gs/Hs

    .venv/bin/python benchmarks/lora_grpo.py --vllm-sync --steps 6 --width 1024
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for _p in (REPO, HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from demo_models import sft_model  # noqa: E402


def workflow(recipe: str, model: Path, out: Path, a: argparse.Namespace):
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.pipeline import GRPOPipeline

    return GRPOPipeline(load_config(Config, REPO / "recipes" / recipe, [
        f"trainer.init_from={model}", f"run.dir={out}", f"run.seed={a.seed}", "run.overwrite=true",
        f"trainer.steps={a.steps}", f"eval.every={a.eval_every}", f"eval.size={a.eval_size}", "run.save_every=0",
        "telemetry.sinks=[jsonl]", f"run.threads={a.threads}", *a.override]))


def last_accuracy(wf) -> float:
    lines = (wf.s.dir / "metrics.jsonl").read_text().splitlines()
    return next(r["eval/accuracy"] for r in map(json.loads, reversed(lines)) if "eval/accuracy" in r)


def summary(wf, times: list[float], a: argparse.Namespace) -> dict:
    from relayrl.workflows.trainer_workers import PolicyWorker

    recs = [json.loads(line) for line in (wf.s.dir / "metrics.jsonl").read_text().splitlines()]
    acc = [r["eval/accuracy"] for r in recs if "eval/accuracy" in r]
    steady = [r for r in recs if r["step"] > a.warmup and "actor/loss" in r]
    return {"before": acc[0], "after": acc[-1], "curve": [(r["step"], r["eval/accuracy"]) for r in recs
                                                          if "eval/accuracy" in r],
            "step_s": statistics.mean(times[a.warmup:]),
            "update_s": statistics.mean(r["timing/update_s"] for r in steady),
            **wf.actor.one(PolicyWorker.footprint)}


def sync_route(route: str, out: Path, a: argparse.Namespace) -> dict:
    """One GRPO run with ``rollout.lora_sync=route`` on the wide tiny model; its mean figures after step 1."""
    w = a.width
    cmd = [sys.executable, "-m", "relayrl", "train", str(REPO / "recipes" / "arith_grpo.yaml"), f"run.dir={out}",
           "run.overwrite=true", f"trainer.steps={a.steps}", "eval.every=0", "run.save_every=0",
           "telemetry.sinks=[jsonl]", f"run.threads={a.threads}", f"run.seed={a.seed}", "data.prompts_per_step=8",
           "rollout.n=4", "rollout.max_new_tokens=16", "rollout.engine=vllm", "rollout.vllm.memory_utilization=0.1",
           f"rollout.lora_sync={route}", "model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16",
           "engine.optim.lr=3e-4", f"model.tiny.hidden_size={w}", f"model.tiny.intermediate_size={4 * w}",
           f"model.tiny.num_heads={w // 64}", *a.override]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if r.returncode:
        raise SystemExit(f"lora_sync: the {route} run failed:\n{r.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [x for x in recs if x["step"] > 1 and "relay/bytes" in x]
    started = next((float(m) for m in re.findall(r"init engine .*? took ([0-9.]+) s", r.stdout + r.stderr)), 0.0)
    mean = lambda k: statistics.mean(x[k] for x in steady)  # noqa: E731
    return {"bytes": mean("relay/bytes"), "relay_s": mean("timing/relay_s"), "generate_s": mean("timing/generate_s"),
            "error": max(abs(x["rollout/logprob_error"] - 1) for x in steady), "engine_start_s": started,
            "wall_s": wall}


def sync_routes(a: argparse.Namespace) -> str:
    """``--vllm-sync``: the merged and the adapter route side by side (module docstring); returns the last line."""
    if a.steps < 2:
        raise SystemExit("lora_sync: --steps must be >= 2 (the first step's figures are left out)")
    res = {route: sync_route(route, Path(a.out) / f"sync-{route}", a) for route in ("merged", "adapter")}
    me, ad = res["merged"], res["adapter"]
    print(f"\nlora_sync: rollout.lora_sync on vLLM, width {a.width} (4 layers, r=8), {a.steps} GRPO steps, "
          f"means over steps 2-{a.steps}")
    print(f"{'':28}{'merged':>12}{'adapter':>12}{'merged/adapter':>16}")
    rows = [("bytes a sync (MB)", me["bytes"] / 1e6, ad["bytes"] / 1e6, "{:.3f}"),
            ("sync time (s)", me["relay_s"], ad["relay_s"], "{:.4f}"),
            ("generation time (s)", me["generate_s"], ad["generate_s"], "{:.3f}"),
            ("max |logprob_error - 1|", me["error"], ad["error"], "{:.1e}"),
            ("vLLM engine start (s)", me["engine_start_s"], ad["engine_start_s"], "{:.2f}"),
            ("whole run (s)", me["wall_s"], ad["wall_s"], "{:.1f}")]
    for name, x, y, fmt in rows:
        print(f"{name:28}{fmt.format(x):>12}{fmt.format(y):>12}{(x / y if y else float('nan')):>16.2f}")
    line = (f"lora_sync: a sync carries {me['bytes'] / 1e6:.2f}/{ad['bytes'] / 1e6:.3f} MB (merged/adapter, "
            f"{me['bytes'] / ad['bytes']:.0f}x fewer bytes), takes {me['relay_s']:.3f}s/{ad['relay_s']:.3f}s; "
            f"generation {me['generate_s']:.3f}s/{ad['generate_s']:.3f}s")
    print(line)
    return line


def run(argv: list[str] | None = None, sft: Path | None = None) -> str:
    """Both runs and the table; returns the ``lora_grpo:`` line (printed last). ``sft``: the demo's SFT model
    when the caller has it."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="runs/lora_grpo")
    p.add_argument("--vllm-sync", action="store_true", help="compare rollout.lora_sync=merged and adapter on vLLM "
                   "instead (module docstring)")
    p.add_argument("--width", type=int, default=1024, help="--vllm-sync: the model's hidden size (a multiple of 64)")
    p.add_argument("override", nargs="*", help="dotted overrides for both runs (e.g. rollout.n=4)")
    a = p.parse_args(argv)
    if a.vllm_sync:
        return sync_routes(a)
    if a.steps <= a.warmup:
        raise SystemExit(f"lora_grpo: --steps ({a.steps}) must exceed --warmup ({a.warmup})")
    model = sft or sft_model(a.seed)
    out = Path(a.out)
    runs = {"lora": workflow("arith_grpo_lora.yaml", model, out / "lora", a),
            "full": workflow("arith_grpo.yaml", model, out / "full", a)}
    steps = {k: wf.begin() for k, wf in runs.items()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for step in range(1, a.steps + 1):
        for k, wf in runs.items():  # in turn, so both see the same machine load
            t0 = time.perf_counter()
            metrics = wf.step(step)
            times[k].append(time.perf_counter() - t0)
            wf.s.end_step(step, metrics, evaluate=wf.evaluate, save=wf.save)
        if step % a.eval_every == 0:
            print(f"lora_grpo: step {step}: " + ", ".join(f"{k} accuracy {100 * last_accuracy(wf):.1f}%"
                                                          for k, wf in runs.items()), flush=True)
    assert all(list(s) == list(range(1, a.steps + 1)) for s in steps.values())
    res = {k: summary(wf, times[k], a) for k, wf in runs.items()}
    for wf in runs.values():
        wf.shutdown()

    lo, fu = res["lora"], res["full"]
    mib = 2 ** 20
    print(f"\nlora_grpo: {a.steps} GRPO steps from the demo's SFT model ({model}), seed {a.seed}")
    print(f"{'':24}{'LoRA':>14}{'full':>14}{'LoRA/full':>12}")
    rows = [("trainable parameters", lo["params/trainable"], fu["params/trainable"], "{:,.0f}"),
            ("total parameters", lo["params/total"], fu["params/total"], "{:,.0f}"),
            ("optimizer state (MiB)", lo["optimizer/state_bytes"] / mib, fu["optimizer/state_bytes"] / mib, "{:.2f}"),
            ("step time (s)", lo["step_s"], fu["step_s"], "{:.3f}"),
            ("update time (s)", lo["update_s"], fu["update_s"], "{:.3f}"),
            ("accuracy before (%)", 100 * lo["before"], 100 * fu["before"], "{:.1f}"),
            ("accuracy after (%)", 100 * lo["after"], 100 * fu["after"], "{:.1f}")]
    for name, x, y, fmt in rows:
        print(f"{name:24}{fmt.format(x):>14}{fmt.format(y):>14}{(x / y if y else float('nan')):>12.3f}")
    print("accuracy curves: " + "; ".join(f"{k} " + " ".join(f"{s}:{100 * v:.0f}" for s, v in r["curve"])
                                          for k, r in res.items()))
    print(f"step-time ratio {lo['step_s'] / fu['step_s']:.2f} (LoRA/full), update-time ratio "
          f"{lo['update_s'] / fu['update_s']:.2f}")
    line = (f"lora_grpo: accuracy {100 * lo['before']:.1f}% -> {100 * lo['after']:.1f}%, optimizer memory "
            f"{lo['optimizer/state_bytes'] / mib:.2f}/{fu['optimizer/state_bytes'] / mib:.2f} MiB (LoRA/full)")
    print(line)
    return line


def main() -> int:
    run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
