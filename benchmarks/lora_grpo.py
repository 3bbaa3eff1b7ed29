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
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    p.add_argument("override", nargs="*", help="dotted overrides for both runs (e.g. rollout.n=4)")
    a = p.parse_args(argv)
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
