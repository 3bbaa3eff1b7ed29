"""The math of RL post-training as pure tensor functions.

Tensors in, ``(value, metrics)`` out; no I/O, no distributed code, no engine.
Workflows compose these functions; nothing else reimplements them. One concern
per module:

* :mod:`~relayrl.algorithms.advantages` -- GAE, GRPO/Dr.GRPO, RLOO, REINFORCE++(-baseline), ReMax
* :mod:`~relayrl.algorithms.otb` -- the Optimal Token Baseline: a per-token group baseline weighted by energy
* :mod:`~relayrl.algorithms.losses` -- clipped policy loss (PPO/GRPO/DAPO/GSPO/LUSPO)
* :mod:`~relayrl.algorithms.ratio` -- the importance ratio (token or sequence level) every policy loss takes
* :mod:`~relayrl.algorithms.aggregation` -- token/sequence loss aggregation
* :mod:`~relayrl.algorithms.kl` -- KL estimators, penalties, controllers
* :mod:`~relayrl.algorithms.value` -- clipped value loss, explained variance
* :mod:`~relayrl.algorithms.entropy` -- chunked entropy from logits
* :mod:`~relayrl.algorithms.dapo` -- overlong shaping/filtering, dynamic sampling
* :mod:`~relayrl.algorithms.gdpo` -- GDPO's decoupled reward: several reward functions normalised one by one
* :mod:`~relayrl.algorithms.correction` -- rollout correction: token/sequence IS weights, truncated or
  masked, divergence masking (TIS, IcePop, DeepSeek-V3.2)
* :mod:`~relayrl.algorithms.offpolicy` -- truncated importance weights (the correction's upper-bound case)
* :mod:`~relayrl.algorithms.cispo` -- CISPO's clipped-weight policy loss (MiniMax-M1)
* :mod:`~relayrl.algorithms.sapo` -- SAPO's soft-gated policy loss (Qwen)
* :mod:`~relayrl.algorithms.vespo` -- VESPO's Gamma-kernel sequence weight for off-policy training
* :mod:`~relayrl.algorithms.covariance` -- Clip-Cov and KL-Cov: entropy control on high-covariance tokens
* :mod:`~relayrl.algorithms.gmpo` -- GMPO: the geometric mean of clipped token ratios
* :mod:`~relayrl.algorithms.distill` -- on-policy distillation advantages (GKD; Thinking Machines)
* :mod:`~relayrl.algorithms.dpo` -- DPO / IPO / hinge / APO (with a reference model)
* :mod:`~relayrl.algorithms.online_dpo` -- online DPO: each group's best-worst pair, DPO's gradient as advantages
* :mod:`~relayrl.algorithms.simpo` -- SimPO: length-normalised, reference-free preference loss
* :mod:`~relayrl.algorithms.orpo` -- ORPO: NLL plus an odds-ratio preference term, reference-free
* :mod:`~relayrl.algorithms.cpo` -- CPO: DPO's sigmoid loss on summed log-probs, reference-free
* :mod:`~relayrl.algorithms.kto` -- KTO and its unpaired APO-zero: unpaired desirable / undesirable examples
* :mod:`~relayrl.algorithms.sft` -- masked token cross-entropy
* :mod:`~relayrl.algorithms.mismatch` -- train/generation logprob error

See ``docs/algorithms.md`` for config names and papers.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# The submodules (torch) are imported when first asked for: the config reads the estimator registry and the
# names in :mod:`~relayrl.algorithms.names` while a recipe is validated, before torch is imported.


def __getattr__(name: str) -> ModuleType:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f".{name}", __name__)


__all__ = [
    "advantages",
    "aggregation",
    "cispo",
    "correction",
    "covariance",
    "cpo",
    "dapo",
    "distill",
    "dpo",
    "entropy",
    "gdpo",
    "gmpo",
    "kl",
    "kto",
    "losses",
    "mismatch",
    "offpolicy",
    "online_dpo",
    "orpo",
    "otb",
    "ratio",
    "sapo",
    "sft",
    "simpo",
    "value",
    "vespo",
]
