"""The preference losses of workflow dpo side by side from the demo's SFT model: DPO with the recipe's NLL term
(RPO), SimPO, CPO-SimPO, ORPO, CPO, APO-zero and APO-down, on the same pairs, seed and learning rate; and workflow
kto (``recipes/arith_kto.yaml``: the same sums split into unpaired examples, half the true sums desirable, half
the careless ones undesirable, no prompt seen with both) with its two losses, KTO and unpaired APO-zero.

The student is the demo's SFT model (``relayrl demo`` stage 2, built once into the cache by
:mod:`demo_models`), which imitated a careless teacher who forgets to carry. Each run trains ``--steps`` steps of
``recipes/arith_dpo.yaml`` (32 pairs a step: the true sum chosen over the careless one) with the loss changed,
and evaluates greedy held-out accuracy every ``--eval-every`` steps. SimPO, ORPO and CPO load no reference model
and run no reference pass, which the s/step column shows (as does ``dpo-precompute``, DPO with
``trainer.precompute_ref``: one reference pass over every pair before the first step, then none); KTO runs a reference pass and a KL pass of the actor
(no gradient) over the batch's mismatched rows, unpaired APO-zero the reference pass only. Run it with::

    .venv/bin/python benchmarks/pref_losses.py                # 100 steps each, eval every 50
    .venv/bin/python benchmarks/pref_losses.py --only dpo simpo --steps 40

The last line printed is ``pref_losses: held-out accuracy after N steps: dpo A%, simpo B%, ... (student S%)``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from distill import _records, _train, final_accuracy, from_student, print_curves  # noqa: E402  (the shared helpers)

VARIANTS: dict[str, list[str]] = {
    "dpo": [],  # the recipe: sigmoid, beta 0.1, nll_weight 1 (RPO)
    "dpo-precompute": ["trainer.precompute_ref=true"],  # the same run, the reference scored once before step 1
    "simpo": ["dpo.kind=simpo", "dpo.beta=2.0", "dpo.gamma=1.0", "dpo.nll_weight=0"],  # the paper's range
    "cpo-simpo": ["dpo.kind=simpo", "dpo.beta=2.0", "dpo.gamma=1.0", "dpo.nll_weight=1.0"],  # TRL's cpo_alpha=1
    "orpo": ["dpo.kind=orpo", "dpo.nll_weight=0"],  # lambda = beta = 0.1 (TRL's default); its NLL is built in
    "cpo": ["dpo.kind=cpo", "dpo.nll_weight=1.0"],  # TRL's CPOConfig(loss_type="sigmoid"): beta 0.1, cpo_alpha 1
    "apo_zero": ["dpo.kind=apo_zero", "dpo.nll_weight=0"],
    "apo_down": ["dpo.kind=apo_down", "dpo.nll_weight=0"],
    "kto": [],  # recipes/arith_kto.yaml: beta 0.1, weights 1 (TRL's defaults)
    "kto-apo_zero_unpaired": ["kto.loss=apo_zero_unpaired"],  # the same, against no KL estimate
}
RECIPES: dict[str, str] = {"kto": "arith_kto", "kto-apo_zero_unpaired": "arith_kto"}
"""The recipe of a variant that is not ``arith_dpo``'s (its overrides apply to that recipe)."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="steps of each run from the student")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", choices=list(VARIANTS), help="run these variants only")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every run (0: all cores)")
    p.add_argument("--out", default="runs/bench-pref")
    a = p.parse_args(argv)

    common = from_student(a)
    names = a.only or list(VARIANTS)
    acc, rows = {}, {}
    for name in names:
        print(f"pref_losses: {name} from the student, {a.steps} steps ...", flush=True)
        run = Path(a.out) / name
        wall = _train(run, [*common, *VARIANTS[name]], recipe=RECIPES.get(name, "arith_dpo"))
        recs = _records(run)
        acc[name] = {r["step"]: r["eval/accuracy"] for r in recs if "eval/accuracy" in r}
        kto = name in RECIPES
        steps = [r for r in recs if ("kto/loss" if kto else "dpo/loss") in r]
        last = steps[-1]
        per_step = [r["perf/step_time_s"] for r in steps[1:]]  # (the first step warms up)
        kl = f", kl {last['kto/kl']:.2f}" if "kto/kl" in last else ""  # (unpaired APO-zero estimates none)
        figures = (f"reward desirable - undesirable {last['kto/reward_margin']:.2f}{kl}, "
                   f"logps_desirable {steps[0]['kto/logps_desirable']:.2f} -> {last['kto/logps_desirable']:.2f}"
                   if kto else f"reward_accuracy {last['dpo/reward_accuracy']:.2f}, logps_chosen "
                   f"{steps[0]['dpo/logps_chosen']:.2f} -> {last['dpo/logps_chosen']:.2f}")
        rows[name] = (f"{sum(per_step) / len(per_step):.3f} s/step (wall {wall:.0f} s), {figures}, reference "
                      f"pass: {'yes' if 'timing/ref_logprob_s' in last else 'none'}")
    print_curves(acc, names)
    for n in names:
        print(f"pref_losses: {n:<21} {rows[n]}")
    print(f"pref_losses: held-out accuracy after {a.steps} steps: {final_accuracy(acc, names)}")


if __name__ == "__main__":
    main()
