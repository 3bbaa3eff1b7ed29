"""Learned rewards on the demo's task: a reward model trained on preference pairs, then GRPO with that
reward model as the only reward (issue 19, items 1-3).

Workload: the demo's models (the tiny Qwen2 pretrained on 2-digit sums by ``recipes/arith_base.yaml``, then
SFT on the careless teacher who forgets to carry by ``recipes/arith_sft.yaml``; built once and cached,
or given with ``--sft``).

1. ``rm``: ``recipes/arith_rm.yaml`` from the SFT model: the Bradley-Terry loss on pairs that prefer the
   true sum of a 2-digit sum needing a carry to the careless one; pair accuracy on 200 held-out such pairs
   (sums never drawn for training).
2. ``rm_grpo``: ``recipes/arith_grpo_rm.yaml`` from the SFT model with that reward model as the only
   reward (``reward.verifier_weight=0``); the verifier is still computed and logged
   (``reward/verifier_mean`` per step), and held-out greedy accuracy (200 sums needing a carry) is the
   verifier's, before GRPO (the SFT model) and after.
3. ``lora_grpo``: LoRA and full GRPO from the SFT model side by side (``benchmarks/lora_grpo.py``,
   ``--lora-steps``; 0 skips it).

The last lines are::

    rm: pair accuracy X%
    rm_grpo: accuracy B% -> A% (verifier)
    lora_grpo: accuracy B% -> A%, optimizer memory L/F MiB (LoRA/full)

Run it with::

    .venv/bin/python benchmarks/reward_models.py                       # builds the demo models if needed
    .venv/bin/python benchmarks/reward_models.py --sft runs/demo/sft/model --grpo-steps 150   # reward over-optimisation shows
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for _p in (REPO, HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from demo_models import sft_model  # noqa: E402


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sft", type=Path, default=None, help="the demo's SFT model (default: build/cached)")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "reward_models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rm-steps", type=int, default=150)
    ap.add_argument("--grpo-steps", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=0, help="run.threads (0: torch's default)")
    ap.add_argument("--lora-steps", type=int, default=300, help="steps of LoRA and full GRPO side by side "
                    "(benchmarks/lora_grpo.py); 0 skips them")
    a = ap.parse_args(argv)

    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.registry import train_grpo
    from relayrl.workflows.rm import train_rm

    sft = a.sft or sft_model(a.seed)
    common = [f"run.seed={a.seed}", "run.overwrite=true", "telemetry.sinks=[jsonl]", f"trainer.init_from={sft}",
              f"run.threads={a.threads}"]

    t0 = time.perf_counter()
    rm_dir = a.out / "rm"
    rm_model = train_rm(load_config(Config, REPO / "recipes" / "arith_rm.yaml", [
        f"run.dir={rm_dir}", f"trainer.steps={a.rm_steps}", *common]))
    rm_last = [r for r in records(rm_dir) if "eval/pair_accuracy" in r][-1]
    rm_min = (time.perf_counter() - t0) / 60

    t0 = time.perf_counter()
    grpo_dir = a.out / "rm_grpo"
    train_grpo(load_config(Config, REPO / "recipes" / "arith_grpo_rm.yaml", [
        f"run.dir={grpo_dir}", f"reward.model={rm_model}", f"trainer.steps={a.grpo_steps}",
        f"eval.every={a.eval_every}", *common]))
    recs = records(grpo_dir)
    evals = [r for r in recs if "eval/accuracy" in r]
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    grpo_min = (time.perf_counter() - t0) / 60
    steps = [r for r in recs if "reward/model_mean" in r]

    def window(rs: list[dict], key: str) -> float:
        return sum(r[key] for r in rs) / max(1, len(rs))

    print(f"reward_models: reward model from {sft}: {rm_last['step']} steps in {rm_min:.1f} min, held-out pairs: "
          f"accuracy {100 * rm_last['eval/pair_accuracy']:.1f}%, mean margin {rm_last['eval/reward_margin']:.2f}")
    print(f"reward_models: GRPO with the reward model as the only reward, {len(steps)} steps in {grpo_min:.1f} "
          f"min; first/last 20 steps: reward/model_mean {window(steps[:20], 'reward/model_mean'):.2f} -> "
          f"{window(steps[-20:], 'reward/model_mean'):.2f}, reward/verifier_mean (not in the reward) "
          f"{window(steps[:20], 'reward/verifier_mean'):.2f} -> {window(steps[-20:], 'reward/verifier_mean'):.2f}")
    for r in evals:
        print(f"  step {r['step']:4d}: held-out greedy accuracy (verifier) {100 * r['eval/accuracy']:.1f}%")
    lora_line = None
    if a.lora_steps:
        import lora_grpo

        lora_line = lora_grpo.run([f"--steps={a.lora_steps}", f"--seed={a.seed}", f"--threads={a.threads}",
                                   f"--out={a.out / 'lora_grpo'}"], sft=sft)
    print(f"rm: pair accuracy {100 * rm_last['eval/pair_accuracy']:.1f}%")
    print(f"rm_grpo: accuracy {100 * before:.1f}% -> {100 * after:.1f}% (verifier)")
    if lora_line:
        print(lora_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
