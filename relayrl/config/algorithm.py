"""The ``algorithm`` section of the config: the advantage estimator, the policy loss and its options, checked
against each other; its sub-sections (the rollout correction ``algorithm.correction``, on-policy distillation
``algorithm.distill``, the options of particular losses) are :mod:`relayrl.config.algorithm_sections`'s, and
re-exported here.

Each key's description is the config reference; a refusal names the key and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, StrictBool, StrictInt, ValidationInfo, field_validator, model_validator

from relayrl.algorithms.estimators import ESTIMATORS, estimator
from relayrl.algorithms.names import AGG_MODES, POLICY_LOSS_NAMES, RATIO_FREE_LOSSES
from relayrl.config.algorithm_sections import (CorrectionConfig, CovConfig, DistillConfig, OnlineDPOConfig,
                                               SapoConfig, Section, VespoConfig)
from relayrl.plugins import absolute_file, is_path

if TYPE_CHECKING:  # torch: imported when a loss asks for its correction, not while a recipe is validated
    from relayrl.algorithms.correction import Correction
    from relayrl.algorithms.estimators import Estimator

IDLE_OPTIONS = (  # (the switch, whether it is off, the options it gates, what they do, the fix)
    ("kl_coef", lambda a: a.kl_coef == 0, ("kl_kind",), "is the estimate of the KL to the reference, which "
     "algorithm.kl_coef=0 leaves out (no KL term, no KL reward)", "set algorithm.kl_coef > 0 (e.g. 0.001)"),
    ("overlong_shaping", lambda a: not a.overlong_shaping, ("overlong_cache", "overlong_penalty"), "shapes DAPO's "
     "overlong penalty, which algorithm.overlong_shaping turns on (it is off)", "set algorithm.overlong_shaping=true"),
    ("dynamic_sampling", lambda a: not a.dynamic_sampling, ("max_resample_rounds",), "counts dynamic sampling's "
     "refills, which is off (every group is kept after one round)", "set algorithm.dynamic_sampling=true"),
)
"""Options that only a feature turned on by another key reads (:meth:`AlgorithmConfig.idle_options`)."""

__all__ = ["AlgorithmConfig", "CorrectionConfig", "CovConfig", "DistillConfig", "OnlineDPOConfig", "SapoConfig",
           "VespoConfig"]


class AlgorithmConfig(Section):
    """GRPO by default; DAPO is GRPO with clip_high > clip_low, token-mean, dynamic sampling, overlong shaping."""

    advantage: str = Field("grpo", description=f"one of {', '.join(ESTIMATORS)}; or your own estimator by path, "
                           f"path/to/file.py:NAME or package.module:NAME, NAME an Estimator record or a function "
                           f"fn(x: EstimatorInputs) -> Advantages (docs/algorithms.md, 'Your own estimator or loss'; "
                           f"a file's path is made absolute when the config loads)")
    normalize_std: bool = Field(True, description="group-relative estimators: divide by the group's reward std "
                                "(false: Dr. GRPO's unscaled advantages; grpo-loo: the other responses' std, false "
                                "is RLOO). Read by grpo, grpo-loo, grpo-passk, gpg; set for another estimator, "
                                "refused")
    loss_agg: str = Field("seq-mean-token-mean", description=f"how token losses (policy loss, KL term, entropy "
                          f"bonus) become one: one of {', '.join(AGG_MODES)}. token-mean: DAPO's token level; "
                          f"seq-mean-token-mean: GRPO's per-response mean; seq-mean-token-sum-norm: Dr.GRPO's; "
                          f"prompt-mean-token-mean: ScaleRL's prompt level, every prompt group weighs the same and "
                          f"every token inside it too (workflow grpo, rollout.n >= 2)")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="the ratio's lower bound is 1 - clip_low (see "
                            "clip_high)")
    clip_high: float = Field(0.2, ge=0.0, description="ratio bounds [1 - clip_low, 1 + clip_high]: PPO's clip "
                             "(DAPO's clip-higher when clip_high > clip_low), or CISPO's clip of the weight")
    dual_clip: float | None = Field(None, gt=1.0, description="dual-clip PPO (Ye et al. 2020): a negative-advantage "
                                    "token's loss is at most dual_clip x |advantage| (null: off)")
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="token: PPO's per-token ratio; sequence: GSPO's (Zheng et al. 2025) length-normalised "
        "sequence ratio, one per response")
    kl_coef: float = Field(0.0, ge=0.0, description="KL to the reference model (0: no reference model is loaded); "
                           "with algorithm.kl_target, the adaptive coefficient's starting value")
    kl_target: float | None = Field(None, gt=0.0, description="adaptive KL coefficient (Ziegler et al. 2019, as "
                                    "TRL's and verl's kl_ctrl=adaptive): after each step coef *= 1 + clip(KL / "
                                    "kl_target - 1, -0.2, 0.2) x samples / kl_horizon, KL the step's mean KL "
                                    "estimate (algorithm.kl_kind; actor/kl_loss, or actor/reward_kl with "
                                    "kl_in_reward); logged as actor/kl_coef and checkpointed. null: kl_coef fixed")
    kl_horizon: int = Field(10_000, ge=1, description="adaptive KL: samples (responses) over which the "
                            "coefficient moves by the clipped relative error (Ziegler et al.: 10000)")
    kl_kind: Literal["k1", "k2", "k3", "abs", "mse", "low_var_kl", "k1+", "k3+", "abs+", "low_var_kl+"] = Field(
        "k3", description="per-token estimator of KL(pi || pi_ref), Schulman's: with d = log pi - log pi_ref, "
        "k1 = d, k2 = d^2 / 2, k3 = e^-d - 1 + d, abs = |d|; mse and low_var_kl are verl's names for k2 and k3. "
        "A + (k3+, verl's low_var_kl+): the value of that estimate with k2's gradient, d * grad log pi (straight "
        "through), the KL's own gradient, which k1's and k3's are not in expectation; a loss term only")
    kl_in_reward: bool = Field(False, description="KL as a per-token reward penalty instead of a loss term")
    entropy_coef: float = Field(0.0, ge=0.0, description="entropy bonus: the loss subtracts entropy_coef x the "
                                "policy's token entropy (actor/entropy is logged either way); with "
                                "algorithm.entropy_target, the adaptive coefficient's starting value")
    entropy_target: float | None = Field(
        None, gt=0.0, description="adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy): the bonus "
        "applies only while the last step's actor/entropy is <= entropy_target (nats per token), and its "
        "coefficient rises by entropy_coef_delta after each step below the target, falls after each step above, "
        "within [entropy_coef_min, entropy_coef_max]; logged as actor/entropy_coef and checkpointed. null: "
        "entropy_coef fixed")
    entropy_coef_delta: float = Field(0.005, gt=0.0, description="adaptive entropy control: the coefficient's "
                                      "step")
    entropy_coef_min: float = Field(0.0, ge=0.0, description="adaptive entropy control: the coefficient's floor")
    entropy_coef_max: float = Field(1.0, gt=0.0, description="adaptive entropy control: the coefficient's ceiling")
    overlong_shaping: bool = Field(False, description="DAPO's soft overlong punishment: a reward penalty rising "
                                   "linearly over the last algorithm.overlong_cache tokens before "
                                   "rollout.max_new_tokens")
    overlong_cache: int = Field(4, ge=1, description="tokens before max_new_tokens where the soft penalty starts")
    overlong_penalty: float = Field(1.0, gt=0.0, description="overlong_shaping: the penalty at max_new_tokens (it "
                                    "rises linearly to this over overlong_cache tokens; DAPO's 1, verl's "
                                    "overlong_buffer.penalty_factor)")
    overlong_filter: bool = Field(False, description="mask truncated responses out of the loss")
    dynamic_sampling: bool = Field(False, description="drop groups whose scores (dynamic_sampling_metric) are all "
                                   "equal (and resample prompts); needs rollout.n >= 2")
    dynamic_sampling_metric: Literal["score", "reward"] = Field(
        "score", description="the value dynamic sampling compares within a group: score (the verifier's or reward "
        "functions' score before shaping; verl's filter_groups.metric=acc) or reward (after overlong_shaping's "
        "length penalty, what the advantages read; verl's seq_reward)")
    max_resample_rounds: int = Field(3, ge=0, description="dynamic sampling: generation rounds after the first, on "
                                     "fresh prompts, until data.prompts_per_step groups are kept; then the step "
                                     "trains on the groups it has (dapo/missing_prompts)")
    old_logprobs: Literal["auto", "recompute", "rollout"] = Field(
        "auto", description="pi_old of the PPO ratio. auto: recomputed by the trainer when a batch is used more than "
        "once (by a policy loss with a ratio, or with algorithm.correction: not gpg alone) or the advantage "
        "estimator reads that pass (otb), else the current policy detached (one update per "
        "batch: the same weights, also off-policy and with a rollout correction); recompute: always; "
        "rollout: the generation engine's log-probs (no extra forward pass; the ratio then also carries staleness "
        "and engine mismatch)")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="advantage=gae or reinforce++: discount of the "
                         "token returns")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="advantage=gae: GAE lambda (1: Monte-Carlo returns)")
    tis_cap: float | None = Field(None, gt=0.0, description="truncated importance sampling: weight each token's "
                                  "policy loss by min(pi_old / mu, tis_cap), mu the rollout engine's log-probs. "
                                  "The same as algorithm.correction.level=token, mode=truncate, high=tis_cap "
                                  "(which also has sequence weights, masking and divergence masking)")
    policy_loss: Literal[POLICY_LOSS_NAMES] | str = Field(  # type: ignore[valid-type]
        "ppo", description="one of the names, or your own loss by path (path/to/file.py:fn or "
        "package.module:fn, called as the built-in ones are: fn(logprobs, old_logprobs, advantages, mask, "
        "**common) -> (loss, metrics), docs/algorithms.md, 'Your own estimator or loss'). ppo: the clipped "
        "surrogate (PPO, GRPO, DAPO; GSPO with ratio_level=sequence; LUSPO with ratio_level=sequence and "
        "loss_agg=seq-mean-token-sum); cispo: MiniMax-M1's CISPO, "
        "-sg(clip(r, 1-clip_low, 1+clip_high)) * A * log pi, which clips the importance weight and keeps every "
        "token's gradient (MiniMax-M1 uses loss_agg=token-mean and a large clip_low); sapo: Qwen's SAPO, a "
        "smooth gate (4/tau) sigmoid(tau (r - 1)) in place of the clip (algorithm.sapo); vespo: VESPO, the "
        "policy gradient weighted by a Gamma kernel of the sequence ratio, for off-policy training "
        "(algorithm.vespo; W = pi / mu with old_logprobs=rollout); clip_cov and kl_cov: the entropy "
        "mechanism's Clip-Cov (PPO's clip, and a few high-covariance tokens' gradients removed) and KL-Cov (no "
        "clip; a |log ratio| penalty on the highest-covariance tokens) (algorithm.cov); gmpo: GMPO, the "
        "geometric mean of the token ratios, each log-ratio clipped to [-clip_low, clip_high] (the paper: 0.4 "
        "each), a sequence-level surrogate (loss_agg=seq-mean-token-mean); gpg: GPG's plain policy gradient "
        "-A * log pi, no ratio and no clip (with advantage=gpg; one update per batch keeps it on-policy)")
    policy_loss_options: dict[str, StrictBool | StrictInt | float | str] = Field(
        {}, description="policy_loss=path/to/file.py:fn: your loss's own options, passed to fn by keyword at "
        "every call ({beta: 0.1, mode: soft}); each must be a keyword parameter fn names (not one of the common "
        "keywords: set those by their own keys, algorithm.clip_low, ...). Refused beside a built-in loss, whose "
        "options have sections of their own (algorithm.sapo, vespo, cov)")
    sapo: SapoConfig = Field(SapoConfig(), description="policy_loss=sapo: the gate's temperatures")
    cov: CovConfig = Field(CovConfig(), description="policy_loss=clip_cov or kl_cov: which tokens, and the penalty")
    vespo: VespoConfig = Field(VespoConfig(), description="policy_loss=vespo: the kernel's shape")
    top_entropy_quantile: float = Field(
        1.0, ge=0.0, le=1.0, description="train the policy loss (and the entropy bonus) on the top fraction of "
        "tokens by entropy only, the quantile taken over each micro-batch's tokens (Wang et al. 2025, 'Beyond the "
        "80/20 rule': 0.2; TRL's top_entropy_quantile); 1: every token")
    kl_bias_correction: bool = Field(
        False, description="weigh the KL term's tokens by pi / pi_old, making the estimate of KL(pi || pi_ref) "
        "unbiased for tokens sampled from pi_old (DeepSeek-V3.2; TRL's use_bias_correction_kl)")
    correction: CorrectionConfig = Field(CorrectionConfig(), description="rollout correction between the "
                                         "rollout engine's policy mu and pi_old")
    routing_replay: Literal["none", "measure", "rollout", "old"] = Field(
        "none", description="mixture-of-experts models: rollout (R3, Ma et al. 2025, 'Stabilizing MoE RL by "
        "Aligning Training and Inference Routers') records the experts the rollout routed every token to and "
        "makes the policy's routers choose the same ones in its old log-prob and update passes (their gate "
        "weights stay the trainer's own, with their gradient; native rollout engine, dynamic decode; multi-turn "
        "episodes and thinking budgets too); old (R2, GSPO's routing replay) records the trainer's own choice in "
        "the pi_old pass and replays it in the update passes, so later mini-batches route as pi_old did (any "
        "rollout engine; needs the pi_old pass); measure records as rollout does and only compares: the policy "
        "routes on its own and reports how often it chose the rollout's experts (whether rollout is worth it). "
        "The reference routes on its own. Reports actor/routing_agreement, the share of recorded picks the trainer "
        "makes (or would have made) itself")
    distill: DistillConfig = Field(DistillConfig(), description="on-policy distillation from a teacher model")
    online_dpo: OnlineDPOConfig = Field(OnlineDPOConfig(), description="advantage=online-dpo: the DPO loss on each "
                                        "prompt group's best and worst response")

    @property
    def loss_uses_ratio(self) -> bool:
        """Whether the policy loss reads pi_old (its ratio): not gpg, nor a user's loss that declares
        ``fn.uses_ratio = False``."""
        if self.policy_loss in POLICY_LOSS_NAMES:
            return self.policy_loss not in RATIO_FREE_LOSSES
        from relayrl.algorithms.plugins import load_policy_loss

        return load_policy_loss(self.policy_loss).uses_ratio

    @property
    def routes_from_rollout(self) -> bool:
        """Whether the rollout records each token's experts (``routing_replay`` rollout or measure)."""
        return self.routing_replay in ("rollout", "measure")

    @field_validator("advantage", "policy_loss")
    @classmethod
    def _plugin_file(cls, v: str, info: ValidationInfo) -> str:
        """A user's estimator or loss in a file: its path made absolute (every process opens the same file)."""
        return absolute_file(v, f"algorithm.{info.field_name}") if is_path(v) else v

    @model_validator(mode="after")
    def _names(self) -> "AlgorithmConfig":
        if self.advantage not in ESTIMATORS and not is_path(self.advantage):
            from relayrl.config.foreign_keys import advantage_hint

            hint = advantage_hint(self.advantage)  # verl's or OpenRLHF's name for one of relayrl's
            raise ValueError(f"algorithm.advantage={self.advantage!r} is not one of {', '.join(ESTIMATORS)}{hint} "
                             f"(or your own by path: path/to/file.py:NAME, package.module:NAME)")
        if self.policy_loss not in POLICY_LOSS_NAMES:
            if not is_path(self.policy_loss):
                raise ValueError(f"algorithm.policy_loss={self.policy_loss!r} is not one of "
                                 f"{', '.join(POLICY_LOSS_NAMES)} (or your own by path: path/to/file.py:fn, "
                                 f"package.module:fn)")
            from relayrl.algorithms.plugins import load_policy_loss

            load_policy_loss(self.policy_loss).check_options(self.policy_loss_options)  # (its signature, now: a
            # rank would meet a wrong one mid-step)
        elif self.policy_loss_options:
            key = sorted(self.policy_loss_options)[0]
            section = {"sapo": "algorithm.sapo", "vespo": "algorithm.vespo", "clip_cov": "algorithm.cov",
                       "kl_cov": "algorithm.cov"}.get(self.policy_loss)
            raise ValueError(f"algorithm.policy_loss_options.{key} is an option of your own loss "
                             f"(algorithm.policy_loss=path/to/file.py:fn), and algorithm.policy_loss="
                             f"{self.policy_loss} is built in: "
                             + (f"its options are {section}" if section else "it takes no options of its own")
                             + "; drop algorithm.policy_loss_options")
        if self.loss_agg not in AGG_MODES:
            raise ValueError(f"algorithm.loss_agg={self.loss_agg!r} is not one of {', '.join(AGG_MODES)}")
        est = estimator(self.advantage)  # (a user's: loaded now, so its record answers the checks below)
        for name, section in (("online_dpo", self.online_dpo),):  # estimator options in sections of their own
            if section.model_fields_set and name not in est.params:
                key = sorted(section.model_fields_set)[0]
                users = " or ".join(n for n, e in ESTIMATORS.items() if name in e.params)
                raise ValueError(f"algorithm.{name}.{key} is read by algorithm.advantage={users} only (got "
                                 f"{self.advantage!r}): set algorithm.advantage={users} or drop algorithm.{name}")
        if est.own_loss is not None:
            self._check_own_loss(est)
        if self.kl_in_reward and not est.reads_token_rewards:
            readers = " or ".join(n for n, e in ESTIMATORS.items() if e.reads_token_rewards)
            raise ValueError(f"algorithm.kl_in_reward=true puts the KL into per-token rewards, which only the "
                             f"token-level estimators read; set algorithm.advantage={readers} (got "
                             f"{self.advantage!r}) or use the KL as a loss term (kl_in_reward=false)")
        if est.token_stats and self.old_logprobs == "rollout":
            raise ValueError(f"algorithm.advantage={self.advantage} reads the trainer's per-token log-probs and sum "
                             f"of squared probabilities from its pass before the update, which "
                             f"algorithm.old_logprobs=rollout skips: use old_logprobs=auto (the pass then runs)")
        if est.old_logprobs and self.old_logprobs == "rollout":
            raise ValueError(f"algorithm.advantage={self.advantage} reads the trainer's log-probs from its pass before "
                             f"the update, which algorithm.old_logprobs=rollout skips: use old_logprobs=auto (the "
                             f"pass then runs)")
        if self.kl_in_reward and self.kl_kind.endswith("+"):
            raise ValueError(f"algorithm.kl_kind={self.kl_kind} changes the gradient of the KL loss term; with "
                             f"kl_in_reward=true the KL is a reward, which has none: use algorithm.kl_kind="
                             f"{self.kl_kind[:-1]}")
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("algorithm.kl_in_reward=true needs algorithm.kl_coef > 0")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ValueError("algorithm.kl_target adapts the KL coefficient from algorithm.kl_coef, which is 0 (no "
                             "reference model, and 0 stays 0): set algorithm.kl_coef > 0, e.g. 0.05")
        if self.kl_target is None and self.kl_horizon != 10_000:
            raise ValueError(f"algorithm.kl_horizon={self.kl_horizon} paces the adaptive KL coefficient, which "
                             f"algorithm.kl_target turns on: set algorithm.kl_target or drop kl_horizon")
        for key, what in (("lam", "GAE's lambda"), ("gamma", "the discount of token returns")):
            if getattr(self, key) != 1.0 and key not in est.params:
                users = " and ".join(n for n, e in ESTIMATORS.items() if key in e.params)
                verb = "use" if " and " in users else "uses"
                raise ValueError(f"algorithm.{key}={getattr(self, key)} is {what}, which only advantage={users} "
                                 f"{verb}; {self.advantage!r} ignores it: set algorithm.{key}=1.0")
        if "normalize_std" in self.model_fields_set and "normalize_std" not in est.params:
            users = ", ".join(n for n, e in ESTIMATORS.items() if "normalize_std" in e.params)
            raise ValueError(f"algorithm.normalize_std={str(self.normalize_std).lower()} chooses whether to divide "
                             f"by the group's reward std, which only advantage={users} reads; {self.advantage!r} ignores it: drop "
                             f"algorithm.normalize_std" + ("; the leave-one-out baseline over the others' std is "
                                                            "advantage=grpo-loo (NeMo-RL's default)"
                                                            if self.advantage == "rloo" and self.normalize_std else ""))
        if "dynamic_sampling_metric" in self.model_fields_set and not self.dynamic_sampling:
            raise ValueError(f"algorithm.dynamic_sampling_metric={self.dynamic_sampling_metric} is the value dynamic "
                             f"sampling compares, which is off: set algorithm.dynamic_sampling=true or drop "
                             f"dynamic_sampling_metric")
        if self.dynamic_sampling_metric == "reward" and not self.overlong_shaping:
            raise ValueError("algorithm.dynamic_sampling_metric=reward differs from the score only by "
                             "algorithm.overlong_shaping's length penalty, which is off: drop "
                             "dynamic_sampling_metric (score) or set algorithm.overlong_shaping=true")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ValueError(f"algorithm.tis_cap={self.tis_cap:g}: truncated importance sampling (Yao et al. 2025) "
                             f"caps the weight pi_old / mu, which is 1 on average under the rollout policy, to bound "
                             f"its rare large values; a cap below 1 cuts every token's weight, those where the two "
                             f"policies agree too, and scales the whole policy loss down (a smaller step, not a "
                             f"correction): set algorithm.tis_cap >= 1 (the paper's is 2)")
        if self.tis_cap is not None and self.correction.enabled:
            raise ValueError(f"algorithm.tis_cap={self.tis_cap} is algorithm.correction.level=token, mode=truncate, "
                             f"high={self.tis_cap}, and algorithm.correction is set too: drop algorithm.tis_cap")
        corrected = "algorithm.tis_cap" if self.tis_cap is not None else "algorithm.correction"
        if (self.tis_cap is not None or self.correction.enabled) and self.old_logprobs == "rollout":
            raise ValueError(f"{corrected} weighs pi_old / mu with mu the rollout's log-probs; with "
                             "old_logprobs=rollout that ratio is 1. Use old_logprobs=auto or recompute")
        for name, section, users in (("sapo", self.sapo, ("sapo",)), ("vespo", self.vespo, ("vespo",)),
                                     ("cov", self.cov, ("clip_cov", "kl_cov"))):
            if section.model_fields_set and self.policy_loss not in users:
                key = sorted(section.model_fields_set)[0]
                raise ValueError(f"algorithm.{name}.{key} shapes the {' and '.join(users)} loss, and "
                                 f"algorithm.policy_loss={self.policy_loss}: set algorithm.policy_loss={users[0]} or "
                                 f"drop algorithm.{name}")
        if self.policy_loss == "gmpo" and self.loss_agg != "seq-mean-token-mean":
            raise ValueError(f"algorithm.policy_loss=gmpo averages its sequence-level objective over sequences; "
                             f"loss_agg={self.loss_agg} would weigh them otherwise: set "
                             f"algorithm.loss_agg=seq-mean-token-mean")
        if self.policy_loss == "gpg":
            fields = type(self).model_fields
            clipped = [k for k in ("clip_low", "clip_high") if getattr(self, k) != fields[k].default]
            if clipped:
                raise ValueError(f"algorithm.{clipped[0]}={getattr(self, clipped[0])} is PPO's clip, and "
                                 f"algorithm.policy_loss=gpg has no ratio to clip: drop algorithm.{clipped[0]}")
        if self.policy_loss in ("clip_cov", "kl_cov", "gmpo", "gpg") and (self.dual_clip is not None
                                                                  or self.ratio_level != "token"):
            what = {"gpg": "has no ratio", "gmpo": "has no dual clip and takes token ratios (its sequence ratio is "
                    "their geometric mean)"}.get(self.policy_loss, "has no dual clip and takes token ratios")
            fix = " and ".join(f for f, on in (("drop algorithm.dual_clip", self.dual_clip is not None),
                                               ("set algorithm.ratio_level=token", self.ratio_level != "token")) if on)
            raise ValueError(f"algorithm.policy_loss={self.policy_loss} {what}: {fix}")
        unclipped = {"sapo": ("SAPO", "sapo"), "vespo": ("VESPO", "vespo"), "kl_cov": ("KL-Cov", "cov")}
        if self.policy_loss in unclipped:
            fields = type(self).model_fields
            clipped = [k for k in ("clip_low", "clip_high", "dual_clip") if getattr(self, k) != fields[k].default]
            if clipped:
                k, (name, section) = clipped[0], unclipped[self.policy_loss]
                raise ValueError(f"algorithm.{k}={getattr(self, k)} is PPO's clip, which {name} replaces (its "
                                 f"shape: algorithm.{section}): drop algorithm.{k} or set it to its default, "
                                 f"algorithm.{k}={fields[k].default}".replace("None", "null"))
        if self.policy_loss == "vespo" and self.ratio_level == "sequence":
            raise ValueError("algorithm.policy_loss=vespo weighs each sequence by a kernel of its own ratio (the "
                             "product of the token ratios); ratio_level=sequence is GSPO's: set "
                             "algorithm.ratio_level=token")
        adaptive = [k for k in ("entropy_coef_delta", "entropy_coef_min", "entropy_coef_max") if k in self.model_fields_set]
        if self.entropy_target is None and adaptive:
            raise ValueError(f"algorithm.{adaptive[0]} shapes the adaptive entropy coefficient, which "
                             f"algorithm.entropy_target turns on: set algorithm.entropy_target (e.g. 0.2) or drop "
                             f"algorithm.{adaptive[0]}")
        if self.entropy_target is not None and self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"algorithm.entropy_coef_min={self.entropy_coef_min} is above algorithm.entropy_coef_max="
                             f"{self.entropy_coef_max}: the adaptive coefficient is kept in [min, max]; set "
                             f"entropy_coef_min <= entropy_coef_max")
        if self.entropy_target is not None and not (self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max):
            raise ValueError(f"algorithm.entropy_coef={self.entropy_coef} starts the adaptive coefficient outside "
                             f"[entropy_coef_min, entropy_coef_max] = [{self.entropy_coef_min}, "
                             f"{self.entropy_coef_max}]: set it within them")
        if self.kl_bias_correction and (self.kl_coef == 0 or self.kl_in_reward):
            raise ValueError("algorithm.kl_bias_correction weighs the KL loss term, and there is none ("
                             + ("the KL is in the rewards, kl_in_reward=true" if self.kl_in_reward else "kl_coef=0")
                             + "): set algorithm.kl_coef > 0 with kl_in_reward=false, or drop kl_bias_correction")
        if self.policy_loss == "cispo":
            if self.ratio_level == "sequence":
                raise ValueError("algorithm.policy_loss=cispo weighs each token by its own clipped ratio; "
                                 "ratio_level=sequence is GSPO's (a ppo loss): set algorithm.ratio_level=token")
            if self.dual_clip is not None:
                raise ValueError("algorithm.dual_clip bounds PPO's surrogate for negative advantages; CISPO's weight "
                                 "is already clipped on both sides: drop algorithm.dual_clip")
        return self

    def idle_options(self) -> list[tuple[str, str, str, str]]:
        """The options set away from their defaults (a base recipe's too) that shape a feature that is off, so
        that nothing reads them: ``(key, its switch, what it does, the fix)`` for each (:data:`IDLE_OPTIONS`). They
        are not refused: turning a recipe's feature off is an ablation (``algorithm.overlong_shaping=false`` on
        DAPO's recipe), and a run's saved config, where a switch at its default reads as unset, must load again;
        the run's first lines name them (:func:`relayrl.config.plan.step_plan`'s notes)."""
        fields, out = type(self).model_fields, []
        for switch, off, keys, what, fix in IDLE_OPTIONS:
            if off(self):
                out += [(k, switch, what, fix) for k in keys if getattr(self, k) != fields[k].default]
        return out

    def _check_own_loss(self, est: Estimator) -> None:
        """An estimator whose advantages are its own loss's gradient (``Estimator.own_loss``, online DPO) needs the
        loss that turns them into that gradient, and nothing that changes it."""
        key, what = f"algorithm.advantage={est.name}", f"{est.own_loss}'s gradient"
        if self.policy_loss != "gpg" or self.loss_agg != "seq-mean-token-sum":
            raise ValueError(f"{key} writes each response's coefficient of {what} as its advantage, which a "
                             f"ratio-free -A log pi summed over each response's tokens turns into that gradient: set "
                             f"algorithm.policy_loss=gpg and algorithm.loss_agg=seq-mean-token-sum (got "
                             f"policy_loss={self.policy_loss}, loss_agg={self.loss_agg})")
        if self.kl_coef > 0 or self.kl_in_reward:
            what_kl = "algorithm.kl_in_reward=true" if self.kl_in_reward else f"algorithm.kl_coef={self.kl_coef}"
            raise ValueError(f"{what_kl} adds a KL to the reference beside {key}'s loss, which keeps the policy near "
                             f"the reference itself ({est.own_loss}'s beta, algorithm.online_dpo.beta): set "
                             f"algorithm.kl_coef=0" + (" and kl_in_reward=false" if self.kl_in_reward else ""))
        if self.tis_cap is not None or self.correction.enabled:
            which = "algorithm.tis_cap" if self.tis_cap is not None else "algorithm.correction"
            raise ValueError(f"{which} weighs each token's loss by pi_old / mu; {est.own_loss}'s loss is taken on the "
                             f"sampled pairs as they are, with no importance weight: drop {which}")
        if self.top_entropy_quantile < 1.0:
            raise ValueError(f"algorithm.top_entropy_quantile={self.top_entropy_quantile} trains some of each "
                             f"response's tokens only, and {what} is that of the whole response's log-prob: set "
                             f"algorithm.top_entropy_quantile=1")
        if self.overlong_filter:
            raise ValueError(f"algorithm.overlong_filter drops truncated responses from the update, which would "
                             f"leave a pair of {key} with one side: drop it (algorithm.overlong_shaping penalises "
                             f"them in the reward instead, before the pairs are chosen)")
        if self.distill.enabled:
            raise ValueError(f"algorithm.distill.teacher adds a teacher's reverse KL to the advantages, which are "
                             f"{what} with {key}: drop algorithm.distill.teacher")

    def entropy_controller(self):
        """The entropy bonus's coefficient, step by step (:class:`~relayrl.algorithms.entropy.EntropyController`):
        fixed at ``entropy_coef``, or adaptive toward ``entropy_target``."""
        from relayrl.algorithms.entropy import EntropyController

        return EntropyController(self.entropy_coef, self.entropy_target, self.entropy_coef_delta,
                                 self.entropy_coef_min, self.entropy_coef_max)

    def loss_options(self) -> tuple[tuple[str, float], ...]:
        """The chosen policy loss's own options (``algorithm.sapo``'s, ``vespo``'s or ``cov``'s; a user's loss:
        ``algorithm.policy_loss_options``), by keyword."""
        if self.policy_loss_options:
            return tuple(sorted(self.policy_loss_options.items()))
        if self.policy_loss in ("clip_cov", "kl_cov"):
            c = self.cov
            return (("cov_ratio", c.ratio), ("cov_low", c.low), ("cov_high", c.high), ("kl_coef", c.kl_coef))
        section = {"sapo": self.sapo, "vespo": self.vespo}.get(self.policy_loss)
        return tuple(section.model_dump().items()) if section is not None else ()

    def rollout_correction(self) -> Correction | None:
        """The loss's rollout correction: ``correction``'s, or ``tis_cap``'s (token-level truncation), or None."""
        if self.tis_cap is not None:
            from relayrl.algorithms.correction import Correction

            return Correction(level="token", mode="truncate", high=self.tis_cap)
        return self.correction.spec() if self.correction.enabled else None
