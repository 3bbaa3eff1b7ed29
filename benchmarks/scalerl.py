"""ScaleRL's recipe (``recipes/arith_scalerl.yaml``) against GRPO's and DAPO's, and online DPO's
(``recipes/arith_online_dpo.yaml``), on the demo's task, from the same student, seed and schedule.

The student is the demo's SFT model (``relayrl demo`` stage 2, built once into the cache by :mod:`demo_models`).
Each run trains ``--steps`` steps of its recipe (8 prompts x 8 samples a step, the learning rate and warm-up of
``recipes/arith_grpo.yaml``) and is evaluated on the task's 200 held-out sums (those that need a carry) every
``--eval-every`` steps. Run it with::

    .venv/bin/python benchmarks/scalerl.py                 # 300 steps each, eval every 50
    .venv/bin/python benchmarks/scalerl.py --steps 100 --eval-every 25
    .venv/bin/python benchmarks/scalerl.py --only grpo online-dpo --steps 200   # online DPO against GRPO

The last line printed is
``scalerl: held-out accuracy at the end (N steps): grpo A%, dapo B%, scalerl C%, online-dpo D% (student S%); wall
grpo Xs, ...``.
One seed on a tiny model: a few points apart are within the seed spread (``tests/workflows/test_curves.py``).
ScaleRL's runs are 8 updates off-policy (their rollout on its own pool), GRPO's and DAPO's synchronous, so the
wall times compare the step modes too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from distill import _train, curve, final_accuracy, from_student, print_curves  # noqa: E402  (the shared helpers)

RECIPES: dict[str, str] = {"grpo": "arith_grpo", "dapo": "arith_dapo", "scalerl": "arith_scalerl",
                           "online-dpo": "arith_online_dpo"}
"""Each run's name and its recipe (``recipes/<recipe>.yaml``)."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps of each run from the student")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of every run (0: all cores)")
    p.add_argument("--only", nargs="*", choices=list(RECIPES), default=list(RECIPES), help="the runs to make")
    p.add_argument("--out", default="runs/bench-scalerl")
    a = p.parse_args(argv)

    out, shared = Path(a.out), from_student(a)
    acc, wall = {}, {}
    for name in a.only:
        print(f"scalerl: {name} ({RECIPES[name]}.yaml) from the student, {a.steps} steps ...", flush=True)
        wall[name] = _train(out / name, shared, RECIPES[name])
        acc[name] = curve(out / name)
    print_curves(acc, a.only)
    walls = ", ".join(f"{n} {wall[n]:.0f}s" for n in a.only)
    print(f"scalerl: held-out accuracy at the end ({a.steps} steps): {final_accuracy(acc, a.only)}; wall {walls}")


if __name__ == "__main__":
    main()
