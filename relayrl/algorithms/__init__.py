"""The math of RL post-training as pure tensor functions.

Tensors in, ``(value, metrics)`` out; no I/O, no distributed code, no engine.
Workflows compose these functions; nothing else reimplements them. One concern
per module:

* :mod:`~relayrl.algorithms.advantages` -- GAE, GRPO/Dr.GRPO, RLOO, REINFORCE++(-baseline), ReMax
* :mod:`~relayrl.algorithms.losses` -- clipped policy loss (PPO/GRPO/DAPO/GSPO)
* :mod:`~relayrl.algorithms.aggregation` -- token/sequence loss aggregation
* :mod:`~relayrl.algorithms.kl` -- KL estimators, penalties, controllers
* :mod:`~relayrl.algorithms.value` -- clipped value loss, explained variance
* :mod:`~relayrl.algorithms.entropy` -- chunked entropy from logits
* :mod:`~relayrl.algorithms.dapo` -- overlong shaping/filtering, dynamic sampling
* :mod:`~relayrl.algorithms.offpolicy` -- truncated importance weights
* :mod:`~relayrl.algorithms.dpo` -- DPO / IPO / hinge
* :mod:`~relayrl.algorithms.sft` -- masked token cross-entropy
* :mod:`~relayrl.algorithms.mismatch` -- train/generation logprob error

See ``docs/algorithms.md`` for config names and papers.
"""

from relayrl.algorithms import (
    advantages,
    aggregation,
    dapo,
    dpo,
    entropy,
    kl,
    losses,
    mismatch,
    offpolicy,
    sft,
    value,
)

__all__ = [
    "advantages",
    "aggregation",
    "dapo",
    "dpo",
    "entropy",
    "kl",
    "losses",
    "mismatch",
    "offpolicy",
    "sft",
    "value",
]
