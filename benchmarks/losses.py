"""The policy losses side by side on the demo's task: PPO (GRPO's clip), CISPO, SAPO, VESPO, PPO on the
high-entropy 20% of tokens, Clip-Cov, KL-Cov, GMPO and GPG (its own advantage too), and PPO with the Optimal
Token Baseline's advantage (``otb``), from the same student, prompts, seed and learning rate.

The student is the demo's SFT model (``relayrl demo`` stage 2, built once into the cache by
:mod:`demo_models`: about 10-20% greedy accuracy on held-out sums that need a carry). Each run trains
``--steps`` GRPO steps of ``recipes/arith_grpo.yaml`` (group advantages, verifier reward) with one policy loss
changed, and evaluates greedy held-out accuracy every ``--eval-every`` steps.

With one optimizer step per batch the ratio pi / pi_old is 1 and PPO, CISPO, SAPO and VESPO give the same
gradient (tested in ``tests/algorithms/test_sapo_vespo.py``): the runs would repeat each other. So each batch
trains ``--mini-batches`` optimizer steps (4 by default: after the first, the ratio leaves 1 and the losses
differ). ``--off-policy K`` runs rollouts up to K updates stale (``trainer.off_policy_steps``) with pi_old the
rollout's log-probs (``algorithm.old_logprobs=rollout``: the ratio carries the staleness; VESPO's W is pi / mu;
``otb`` keeps the trainer's pi_old pass, whose statistics it reads). Run it with::

    .venv/bin/python benchmarks/losses.py                          # 40 steps each, eval every 10
    .venv/bin/python benchmarks/losses.py --steps 80 --off-policy 2

The last line printed is
``losses: held-out accuracy after N steps, M mini-batches: ppo A%, cispo B%, ... (student S%)``.
On the tiny model a few points apart are within the seed spread (``tests/workflows/test_curves.py``
measured about 5 points of reward); the run shows every loss learns from the same start, not a ranking.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from distill import _records, _train, curve, final_accuracy, from_student, print_curves  # noqa: E402  (the shared helpers)

VARIANTS: dict[str, list[str]] = {
    "ppo": [],
    "cispo": ["algorithm.policy_loss=cispo", "algorithm.clip_high=0.28"],
    "sapo": ["algorithm.policy_loss=sapo"],
    "vespo": ["algorithm.policy_loss=vespo", "algorithm.loss_agg=token-mean"],
    "ppo-top20": ["algorithm.top_entropy_quantile=0.2"],
    "clip_cov": ["algorithm.policy_loss=clip_cov"],
    "kl_cov": ["algorithm.policy_loss=kl_cov"],
    "gmpo": ["algorithm.policy_loss=gmpo", "algorithm.clip_low=0.4", "algorithm.clip_high=0.4"],
    "gpg": ["algorithm.advantage=gpg", "algorithm.policy_loss=gpg"],
    "otb": ["algorithm.advantage=otb", "algorithm.old_logprobs=auto"],  # (off-policy too: OTB reads the pi_old pass)
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="steps of each run from the student")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--off-policy", type=int, default=0, help="K: rollouts up to K updates stale (0: on-policy)")
    p.add_argument("--mini-batches", type=int, default=4, help="optimizer steps per batch (1: every loss is PPO)")
    p.add_argument("--only", nargs="*", choices=list(VARIANTS), help="run these variants only")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every run (0: all cores)")
    p.add_argument("--out", default="runs/bench-losses")
    a = p.parse_args(argv)

    common = [*from_student(a), f"trainer.mini_batches={a.mini_batches}",
              *([f"trainer.off_policy_steps={a.off_policy}", "algorithm.old_logprobs=rollout"] if a.off_policy
                else [])]
    names = a.only or list(VARIANTS)
    acc, wall, extra = {}, {}, {}
    for name in names:
        over = list(VARIANTS[name])
        print(f"losses: {name} from the student, {a.steps} steps ...", flush=True)
        run = Path(a.out) / (name + (f"-k{a.off_policy}" if a.off_policy else ""))
        wall[name] = _train(run, [*common, *over])
        acc[name] = curve(run)
        recs = [r for r in _records(run) if r["step"] > 0]
        key = {"sapo": "actor/soft_gate_mean", "vespo": "actor/vespo_weight_mean",
               "ppo-top20": "actor/entropy_kept_frac", "clip_cov": "actor/cov_frac",
               "kl_cov": "actor/cov_frac", "gmpo": "actor/seq_ratio_mean"}.get(name, "actor/clip_frac")
        vals = [r[key] for r in recs if key in r]
        extra[name] = f"{key} {sum(vals) / max(len(vals), 1):.3f}"
    print_curves(acc, names)
    for n in names:
        print(f"losses: {n:<10} {wall[n]:6.0f} s ({wall[n] / wall[names[0]]:.2f}x {names[0]}); mean {extra[n]}")
    mode = f", {a.mini_batches} mini-batches" + (f", off-policy k={a.off_policy}" if a.off_policy else "")
    print(f"losses: held-out accuracy after {a.steps} steps{mode}: {final_accuracy(acc, names)}")


if __name__ == "__main__":
    main()
