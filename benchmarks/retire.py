"""Retiring solved prompts (``data.retire_solved``, ScaleRL's no-positive-resampling) against training on every
row, on a fixed set of the demo's sums, from the same student, seed and learning rate.

The student is the demo's SFT model (``relayrl demo`` stage 2, built once into the cache by :mod:`demo_models`).
The training set is ``--rows`` two-digit sums drawn from the demo's task (``data.path``: a JSONL file written
here), the held-out set the task's own 200 sums that need a carry (``data.eval_path``), scored by exact match.
Each run trains ``--steps`` GRPO steps of ``recipes/arith_grpo.yaml`` (8 prompts x 8 samples a step), so
``--steps`` x 8 / ``--rows`` passes over the rows; ``retire-0.9`` stops drawing a row once its 8 samples were at
least 90% correct in a step. Run it with::

    .venv/bin/python benchmarks/retire.py                  # 64 rows, 64 steps each (8 passes), eval every 16
    .venv/bin/python benchmarks/retire.py --rows 128 --steps 96

The last line printed is
``retire: held-out accuracy at the end (all N steps, retire-0.9 K steps): all A%, retire-0.9 B% (student S%);
rows retired R of M`` (a run whose every row is retired stops early, at step K).
One seed on a tiny model: a few points apart are within the seed spread (``tests/workflows/test_curves.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from distill import _records, _train, curve, final_accuracy, from_student, print_curves  # noqa: E402  (the shared helpers)

VARIANTS: dict[str, list[str]] = {
    "all": [],
    "retire-0.9": ["data.retire_solved=0.9"],  # ScaleRL's threshold
}


def write_sums(out: Path, rows: int, seed: int) -> tuple[Path, Path]:
    """``train.jsonl`` (``rows`` sums of the demo's task, none of them held out) and ``held.jsonl`` (the task's
    held-out sums, which need a carry) under ``out``."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.data.tasks import make_task

    d = load_config(Config, HERE.parent / "recipes" / "arith_grpo.yaml", []).data
    held = make_task(d.task, **{**d.task_options, **(d.eval_task_options or {})}).eval_set()
    task, rng, seen = make_task(d.task, **d.task_options), random.Random(seed), {p.prompt for p in held}
    train = []
    while len(train) < rows:
        p = task.sample(rng)
        if p.prompt not in seen:
            seen.add(p.prompt)
            train.append(p)
    out.mkdir(parents=True, exist_ok=True)
    for name, problems in (("train.jsonl", train), ("held.jsonl", held)):
        (out / name).write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems))
    return out / "train.jsonl", out / "held.jsonl"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64, help="training rows (sums)")
    p.add_argument("--steps", type=int, default=64, help="steps of each run from the student")
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of every run (0: all cores)")
    p.add_argument("--out", default="runs/bench-retire")
    a = p.parse_args(argv)

    out = Path(a.out)
    train, held = write_sums(out / "data", a.rows, a.seed)
    shared = [*from_student(a), "data.task=null", f"data.path={train}", f"data.eval_path={held}",
              "reward.verifier=exact"]
    acc, wall, retired, ran = {}, {}, {}, {}
    for name, over in VARIANTS.items():
        print(f"retire: {name} from the student, {a.steps} steps over {a.rows} rows ...", flush=True)
        wall[name] = _train(out / name, [*shared, *over])
        acc[name] = curve(out / name)
        last = [r for r in _records(out / name) if "data/retired" in r]
        retired[name] = int(last[-1]["data/retired"]) if last else 0
        ran[name] = max(r["step"] for r in _records(out / name))  # (retire-0.9 stops once every row is retired)
    names = list(VARIANTS)
    print_curves(acc, names)
    for n in names:
        print(f"retire: {n:<11} {ran[n]} steps, wall {wall[n]:.0f} s, rows retired {retired[n]} of {a.rows}")
    print(f"retire: held-out accuracy at the end ({', '.join(f'{n} {ran[n]} steps' for n in names)}): "
          f"{final_accuracy(acc, names)}; rows retired {retired['retire-0.9']} of {a.rows}")


if __name__ == "__main__":
    main()
