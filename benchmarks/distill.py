"""On-policy distillation (OPD) against GRPO from the same student, on the built-in arithmetic task.

The models are the demo's (``relayrl demo``, built once into the cache by :mod:`demo_models`):

* the **student** is the demo's SFT model (stage 2: the careless teacher's habit of forgetting the carry,
  about 20% greedy accuracy on held-out sums that need one);
* the **teacher** is that SFT model after GRPO with the verifier (stage 3, ``recipes/arith_grpo.yaml``; it
  stops once held-out accuracy reaches ``--teacher-stop``).

From the student, two runs of ``--steps`` steps with the same recipe, prompts, seed and learning rate:

* ``opd``: ``algorithm.distill.teacher=<teacher>``, the advantage of every sampled token the negative
  per-token reverse KL ``-(log pi_student - log pi_teacher)`` (no verifier reward in the update; add one
  with ``--reward-weight``);
* ``grpo``: the verifier's reward alone, GRPO's group advantages (the demo's stage 3 itself).

Both evaluate greedy held-out accuracy every ``--eval-every`` steps. Run it with::

    .venv/bin/python benchmarks/distill.py                       # 60 steps, eval every 15 (a few minutes)
    .venv/bin/python benchmarks/distill.py --steps 200 --eval-every 20

The last line printed is
``distill: opd A_o% vs grpo A_g% after N steps (teacher A_t%); steps to 90% of teacher: opd S_o, grpo S_g``
(``>N`` when a run does not get there within its steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _train(run_dir: Path, overrides: list[str], recipe: str = "arith_grpo") -> float:
    """A run of ``recipes/<recipe>.yaml`` (its workflow: GRPO's by default) with ``overrides``; its wall
    seconds."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.registry import train

    cfg = load_config(Config, REPO / "recipes" / f"{recipe}.yaml", [
        f"run.dir={run_dir}", "run.overwrite=true", "telemetry.sinks=[jsonl]", "run.save_every=0", *overrides])
    t0 = time.perf_counter()
    train(cfg)
    return time.perf_counter() - t0


def teacher_model(seed: int, steps: int, stop: float, threads: tuple[str, ...] = ()) -> tuple[Path, float]:
    """The demo's GRPO model (cached) and its last held-out accuracy."""
    from relayrl.models.tiny import default_cache_dir

    from demo_models import sft_model

    run = default_cache_dir() / f"demo-seed{seed}" / f"grpo-teacher-{steps}-{stop}"
    if not (run / "model" / "config.json").is_file():
        sft = sft_model(seed, threads)
        print(f"distill: GRPO teacher from the demo's SFT model into {run} ...", flush=True)
        _train(run, [f"trainer.init_from={sft}", f"run.seed={seed}", f"trainer.steps={steps}", "eval.every=25",
                     f"eval.stop_at={stop}", *threads])
    acc = [r["eval/accuracy"] for r in _records(run) if "eval/accuracy" in r]
    return run / "model", acc[-1]


def curve(run_dir: Path) -> dict[int, float]:
    """Held-out accuracy by step (step 0: the student)."""
    return {r["step"]: r["eval/accuracy"] for r in _records(run_dir) if "eval/accuracy" in r}


def from_student(a) -> list[str]:
    """The overrides every run of a side-by-side benchmark shares, from its arguments ``a`` (``seed``, ``threads``,
    ``steps``, ``eval_every``, ``eval_size``): the demo's SFT model (built into the cache once) as the start."""
    from demo_models import sft_model

    threads = (f"run.threads={a.threads}",)
    return [*threads, f"trainer.init_from={sft_model(a.seed, threads)}", f"run.seed={a.seed}",
            f"trainer.steps={a.steps}", f"eval.every={a.eval_every}", f"eval.size={a.eval_size}"]


def print_curves(acc: dict[str, dict[int, float]], names: list[str]) -> None:
    """The held-out accuracy of each run by step, one column a run (11 characters, or its name's length + 2)."""
    width = {n: max(11, len(n) + 2) for n in names}
    print(f"{'step':>6}" + "".join(f"{n:>{width[n]}}" for n in names))
    for s in sorted(set().union(*(acc[n] for n in names))):
        print(f"{s:>6}" + "".join(f"{100 * acc[n].get(s, float('nan')):>{width[n] - 1}.1f}%" for n in names))


def final_accuracy(acc: dict[str, dict[int, float]], names: list[str]) -> str:
    """``a 89.0%, b 90.5% (student 9.0%)``: each run's last held-out accuracy, and the start's."""
    student = acc[names[0]].get(0, float("nan"))
    return ", ".join(f"{n} {100 * acc[n][max(acc[n])]:.1f}%" for n in names) + f" (student {100 * student:.1f}%)"


def steps_to(acc: dict[int, float], target: float, steps: int) -> str:
    hit = [s for s, a in sorted(acc.items()) if a >= target]
    return str(hit[0]) if hit else f">{steps}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="steps of each run from the student")
    p.add_argument("--eval-every", type=int, default=15)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--teacher-steps", type=int, default=300, help="at most this many GRPO steps for the teacher")
    p.add_argument("--teacher-stop", type=float, default=0.95, help="the teacher's GRPO stops at this accuracy")
    p.add_argument("--reward-weight", type=float, default=0.0, help="opd: weight of the verifier's GRPO advantages "
                   "added to the distillation advantage")
    p.add_argument("--lr", type=float, default=None, help="both runs' learning rate (default: the recipe's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every run (0: all cores; on a "
                   "shared CPU, 1 avoids oversubscription: 0.26 s per base-model step against 8-10 s measured "
                   "beside other jobs on 2 cores)")
    p.add_argument("--out", default="runs/bench-distill")
    a = p.parse_args(argv)

    from demo_models import sft_model

    threads = (f"run.threads={a.threads}",)
    teacher, teacher_acc = teacher_model(a.seed, a.teacher_steps, a.teacher_stop, threads)
    student = sft_model(a.seed, threads)
    out = Path(a.out)
    common = [*threads, f"trainer.init_from={student}", f"run.seed={a.seed}", f"trainer.steps={a.steps}",
              f"eval.every={a.eval_every}", f"eval.size={a.eval_size}",
              *([f"engine.optim.lr={a.lr}"] if a.lr else [])]
    runs = {"opd": [f"algorithm.distill.teacher={teacher}", f"algorithm.distill.reward_weight={a.reward_weight}"],
            "grpo": []}
    wall, acc = {}, {}
    for name, extra in runs.items():
        print(f"distill: {name} from the student, {a.steps} steps ...", flush=True)
        wall[name] = _train(out / name, [*common, *extra])
        acc[name] = curve(out / name)
    target = 0.9 * teacher_acc
    print(f"{'step':>6} {'opd':>8} {'grpo':>8}")
    for s in sorted(set(acc["opd"]) | set(acc["grpo"])):
        print(f"{s:>6} {100 * acc['opd'].get(s, float('nan')):>7.1f}% {100 * acc['grpo'].get(s, float('nan')):>7.1f}%")
    kl = [r["distill/reverse_kl"] for r in _records(out / "opd") if "distill/reverse_kl" in r]
    print(f"distill: wall opd {wall['opd']:.0f} s, grpo {wall['grpo']:.0f} s; reverse KL to the teacher "
          f"{kl[0]:.3f} -> {kl[-1]:.3f} nats/token; teacher {teacher}")
    last = max(acc["opd"])
    print(f"distill: opd {100 * acc['opd'][last]:.1f}% vs grpo {100 * acc['grpo'][max(acc['grpo'])]:.1f}% after "
          f"{a.steps} steps (teacher {100 * teacher_acc:.1f}%); steps to 90% of teacher: "
          f"opd {steps_to(acc['opd'], target, a.steps)}, grpo {steps_to(acc['grpo'], target, a.steps)}")


if __name__ == "__main__":
    main()
