"""Rules across config sections about what a run's rewards, environments and reference model allow: a step's
reward settings against its estimator, its workflow and its episodes; the reference's updates and its
precomputed log-probs; the preference losses' options. :class:`~relayrl.config.schema.Config` applies them when a
config is validated; each refusal names the keys and the fix."""

from __future__ import annotations

from typing import Any

from relayrl.algorithms.estimators import ESTIMATORS, estimator
from relayrl.algorithms.names import GROUP_AGG_MODES, REFERENCE_FREE_KINDS, SMOOTHED_KINDS

Config = Any
"""A :class:`relayrl.config.schema.Config` (not imported: the schema imports these rules)."""

__all__ = ["check_env", "check_decoupled_rewards", "check_ref_sync", "check_precompute_ref", "check_dpo", "check_kto",
           "check_workflow_sections", "WORKFLOW_SECTIONS", "check_critic", "check_placed_roles",
           "check_algorithm_read", "check_reward_read", "scores_responses", "check_total_epochs",
           "check_retire_solved", "check_loss_agg", "check_vllm_eval_sampling", "check_vllm_model_len",
           "check_routing_replay"]


def check_env(self: Config) -> None:
    """Multi-turn episodes (``env.name``) run in GRPO (every mode and placement) and train SFT; refuse the
    options that assume single-turn responses."""
    e, a = self.env, self.algorithm
    if not e.enabled:
        return
    if self.workflow in ("dpo", "kto", "rm"):
        raise ValueError(f"env.name sets up multi-turn episodes, which workflow {self.workflow} does not generate; "
                         "set env.name=null")
    if e.own_rewards:  # the environment's rewards are the episodes': a learned or user reward would be ignored
        r = self.reward
        unused = [k for k, on in (("reward.user_fn", r.user_fn), ("reward.model", r.model),
                                  ("reward.judge.path", r.judge.path), ("reward.format_regex", r.format_regex)) if on]
        if unused:
            raise ValueError(f"env.name={e.name!r} gives each episode its reward (StepResult.reward), so "
                             f"{', '.join(unused)} would score nothing: unset {'it' if len(unused) == 1 else 'them'}, "
                             f"or score inside the environment")
        shaping = [k for k, on in ((f"reward.normalize={r.normalize}", r.normalize != "none"),
                                   (f"reward.clip={r.clip}", r.clip is not None)) if on]
        if shaping:  # (they act in the reward engine, which a user environment's episodes never reach)
            raise ValueError(f"env.name={e.name!r} gives each episode its reward (StepResult.reward), which "
                             f"{', '.join(shaping)} would leave as it is (the reward engine normalises and clips, and "
                             f"these rewards never pass through it): unset {'it' if len(shaping) == 1 else 'them'}, "
                             f"or normalise or clip inside the environment")
    if e.name == "tools" and e.tool_results == "tags" and e.stop_string not in self.rollout.stop_strings:
        raise ValueError(f"env.name=tools: a turn that calls a tool must end at its closing tag; add "
                         f"{e.stop_string!r} to rollout.stop_strings (or env.tool_results=chat, whose turns end "
                         f"at the model's end-of-turn token)")
    if self.workflow == "sft":
        return  # the task's tool-using demonstrations train with their loss mask; evaluation runs episodes
    if a.overlong_shaping:
        raise ValueError("algorithm.overlong_shaping penalises a response's length against rollout.max_new_tokens; "
                         "an episode's length is bounded by env.max_tokens instead: drop overlong_shaping")
    if estimator(a.advantage).baseline:
        others = ", ".join(n for n, e in ESTIMATORS.items() if not e.baseline)
        raise ValueError(f"algorithm.advantage={a.advantage} needs a greedy single-turn baseline; use one of "
                         f"{others} with env.name")


def check_decoupled_rewards(self: Config) -> None:
    """``reward.user_aggregation=normalize_then_sum`` (GDPO): the advantages come from each user function's
    scores normalised within its group, so the step must be a GRPO-family step whose estimator compares a
    reward with its group's (``Estimator.group_baseline``), and no reward term outside the functions may
    shape it."""
    if not self.reward.decoupled:
        return
    key = f"reward.user_aggregation={self.reward.user_aggregation}"
    if self.workflow != "grpo":
        raise ValueError(f"{key} combines reward functions into advantages, which workflow {self.workflow} does "
                         f"not compute: drop reward.user_aggregation")
    a = self.algorithm
    if not estimator(a.advantage).group_baseline:
        fits = ", ".join(n for n, e in ESTIMATORS.items() if e.group_baseline)
        raise ValueError(f"{key} gives each response a reward that means something only beside the other "
                         f"responses to its prompt (each function normalised within the group), but "
                         f"algorithm.advantage={a.advantage} does not compare a reward with its group's: use one "
                         f"of {fits} (grpo-batch-std is TRL's and the GDPO paper's), or "
                         f"reward.user_aggregation=sum")
    if a.overlong_shaping:
        raise ValueError(f"{key} computes the advantages from each reward function's scores alone, so "
                         f"algorithm.overlong_shaping's length penalty would not reach them: drop "
                         f"algorithm.overlong_shaping (a length penalty can be one more function of reward.user_fn)")
    if self.env.enabled:
        raise ValueError(f"{key} normalises each reward function's scores, but env.name={self.env.name!r} gives "
                         f"each episode one reward from its environment: drop reward.user_aggregation")


def check_ref_sync(self: Config) -> None:
    """``trainer.ref_sync_every`` moves a reference model: there must be one (grpo with a KL to it or an estimator
    that reads one, online DPO; dpo, kto), and
    it must be a model of its own (not the base under LoRA adapters)."""
    t = self.trainer
    if not t.ref_sync_every:
        if "ref_sync_alpha" in t.model_fields_set:
            raise ValueError("trainer.ref_sync_alpha weighs the policy in the reference's updates, which "
                             "trainer.ref_sync_every turns on: set trainer.ref_sync_every (e.g. 100) or drop "
                             "trainer.ref_sync_alpha")
        return
    key = f"trainer.ref_sync_every={t.ref_sync_every}"
    if self.workflow not in ("grpo", "dpo", "kto"):
        raise ValueError(f"{key} moves the reference model, which workflow {self.workflow} has none of: drop it")
    if self.workflow == "dpo" and self.dpo.kind in REFERENCE_FREE_KINDS:
        raise ValueError(f"{key} moves the reference model, and dpo.kind={self.dpo.kind} is reference-free: it "
                         f"loads none; drop trainer.ref_sync_every (or use a kind with a reference, e.g. sigmoid)")
    if self.workflow == "grpo" and self.algorithm.kl_coef == 0 and not estimator(self.algorithm.advantage).reference:
        raise ValueError(f"{key} moves the reference model, and algorithm.kl_coef=0 loads none: set "
                         f"algorithm.kl_coef > 0 or drop trainer.ref_sync_every")
    if self.model.lora.enabled:
        raise ValueError(f"{key}: with model.lora.enabled the reference is the base model under the adapters, "
                         f"which the policy shares; set model.lora.enabled=false or drop trainer.ref_sync_every")


def check_precompute_ref(self: Config) -> None:
    """``trainer.precompute_ref`` stores a fixed reference's log-probs of rows known before training: workflow dpo
    (with a reference) and kto, whose reference never moves."""
    if not self.trainer.precompute_ref:
        return
    key = "trainer.precompute_ref=true"
    if self.workflow not in ("dpo", "kto"):
        what = ("workflow grpo's reference scores the responses the policy samples, unknown before training"
                if self.workflow == "grpo" else f"workflow {self.workflow} has no reference model")
        raise ValueError(f"{key} computes the reference log-probs of workflow dpo or kto before training; {what}: "
                         f"drop trainer.precompute_ref")
    if self.workflow == "dpo" and self.dpo.kind in REFERENCE_FREE_KINDS:
        raise ValueError(f"{key}: dpo.kind={self.dpo.kind} is reference-free, there is no reference model to "
                         f"precompute: drop trainer.precompute_ref (or use a kind with a reference, e.g. sigmoid)")
    if self.trainer.ref_sync_every:
        raise ValueError(f"{key} keeps the reference's log-probs from before training, and trainer.ref_sync_every="
                         f"{self.trainer.ref_sync_every} moves the reference during it (TR-DPO), which would make "
                         f"them stale: drop one of the two")


def check_dpo(self: Config) -> None:
    """``dpo.*`` options that only some ``dpo.kind`` values read."""
    d = self.dpo
    if d.label_smoothing and d.kind not in SMOOTHED_KINDS:
        raise ValueError(f"dpo.label_smoothing is defined for dpo.kind={' and '.join(SMOOTHED_KINDS)} only (got "
                         f"{d.kind!r}): drop dpo.label_smoothing")
    if "gamma" in d.model_fields_set and d.kind != "simpo":
        raise ValueError(f"dpo.gamma is SimPO's target reward margin, read by dpo.kind=simpo only (got "
                         f"{d.kind!r}): drop dpo.gamma or set dpo.kind=simpo")
    if d.kind == "orpo" and d.nll_weight:
        raise ValueError(f"dpo.nll_weight={d.nll_weight}: dpo.kind=orpo's loss holds the chosen answers' NLL already "
                         f"(weight 1; dpo.beta weighs its odds-ratio term): set dpo.nll_weight=0")


WORKFLOW_SECTIONS = ("dpo", "kto", "rm")
"""Config sections that the workflow of their name alone reads (``relayrl.workflows.dpo`` reads ``cfg.dpo``, ``.kto``
``cfg.kto``, ``.rm`` ``cfg.rm``; workflow rm's Bradley-Terry loss reads no ``dpo.*`` key)."""


def check_workflow_sections(self: Config) -> None:
    """A key set in a section that only another workflow reads would be ignored (``dpo.beta=0.5`` in workflow
    rm trained without it, a GRPO recipe's ``algorithm.*`` and ``rollout.n`` run with ``workflow=dpo``, TRL's
    habit ``trainer.batch_size`` in workflow grpo, whose steps take ``data.prompts_per_step``, and that key in
    the offline workflows): refuse it, naming the workflow that reads it (every such key of workflow grpo at
    once, as a GRPO recipe sets several).
    ``algorithm.distill`` has its own message (:meth:`relayrl.config.schema.Config._cross`)."""
    for section in WORKFLOW_SECTIONS:
        given = getattr(self, section).model_fields_set
        if given and self.workflow != section:
            raise ValueError(f"{section}.{sorted(given)[0]} is read by workflow {section} only (this run is "
                             f"workflow {self.workflow}): drop it or set workflow={section}")
    if self.workflow == "grpo":
        if "batch_size" in self.trainer.model_fields_set:
            raise ValueError("trainer.batch_size is read by workflows sft, dpo, kto and rm only (this run is workflow "
                             "grpo, whose steps take data.prompts_per_step prompts, each answered rollout.n times): "
                             "set data.prompts_per_step instead, or drop trainer.batch_size")
        return
    keys = [k for k in set_keys("algorithm", self.algorithm) if not k.startswith("algorithm.distill.")]
    keys += ["rollout.n"] if "n" in self.rollout.model_fields_set else []
    keys += ["data.prompts_per_step"] if "prompts_per_step" in self.data.model_fields_set else []
    if keys:
        one = len(keys) == 1
        own = f"; its options are {self.workflow}.*" if self.workflow in WORKFLOW_SECTIONS else ""
        raise ValueError(f"{', '.join(keys)} {'is' if one else 'are'} read by workflow grpo only (this run is "
                         f"workflow {self.workflow}, which would train without {'it' if one else 'them'}{own}): drop "
                         f"{'it' if one else 'them'} from the recipe"
                         + (" (algorithm={} on the command line empties that section)" if self.algorithm.model_fields_set
                            else "") + " or set workflow=grpo")


def set_keys(prefix: str, section: Any) -> list[str]:
    """The dotted keys given in ``section`` (a config section), each in full (``algorithm.sapo.tau_pos``), sorted;
    none for a section given empty (``algorithm={}``)."""
    if not hasattr(section, "model_fields_set"):
        return [prefix]  # (a value)
    return [k for name in sorted(section.model_fields_set) for k in set_keys(f"{prefix}.{name}", getattr(section, name))]


def check_critic(self: Config) -> None:
    """``critic.*`` shapes PPO's critic, which a run trains only for an estimator that reads values (``gae``); set
    for another estimator or workflow, a key there would be ignored (``critic.optim.lr`` tuned, no critic built),
    so it is refused, naming the estimator that reads it."""
    given = set_keys("critic", self.critic)  # each in full (critic.optim.lr)
    if not given or (self.workflow == "grpo" and estimator(self.algorithm.advantage).values):
        return
    key = given[0]
    users = " or ".join(n for n, e in ESTIMATORS.items() if e.values)
    if self.workflow != "grpo":
        raise ValueError(f"{key} shapes PPO's critic, which workflow {self.workflow} does not train (workflow grpo "
                         f"with algorithm.advantage={users} does): drop {key}")
    raise ValueError(f"{key} shapes PPO's critic, which only algorithm.advantage={users} trains: set "
                     f"algorithm.advantage={users} (got {self.algorithm.advantage!r}) or drop {key}")


def check_placed_roles(self: Config) -> None:
    """``placement.reference``, ``critic`` and ``teacher`` place a role of the GRPO step; one the run does not build
    (no KL and no estimator that reads a reference, an estimator without a critic, no distillation) would be
    placed nowhere, its pool left idle (and the step taken through the placed dataflow): refuse it."""
    a, pl = self.algorithm, self.placement
    placed = [r for r in ("reference", "critic", "teacher") if getattr(pl, r) != "main"]
    if self.workflow != "grpo" or not placed or self.trainer.tri_model:
        return  # (placement in another workflow, or the tri-model reference: refused by the placement rules)
    from relayrl.config.plan import step_plan

    built = step_plan(self).roles  # (the plan decides which roles a step has)
    why = {"reference": f"algorithm.kl_coef=0 and advantage={a.advantage} reads no reference",
           "critic": f"advantage={a.advantage} has none; gae has one", "teacher": "algorithm.distill.teacher is not set"}
    for role in placed:
        if role not in built:
            raise ValueError(f"placement.{role}={getattr(pl, role)} places the {role}, which this run does not build "
                             f"({why[role]}): drop placement.{role}")


def scores_responses(workflow: str) -> bool:
    """Whether ``workflow`` scores responses with the ``reward`` section: grpo its rollouts, sft, dpo and kto their
    greedy held-out answers (eval/accuracy); rm generates nothing (its evaluation is the reward model's pair
    accuracy on held-out pairs)."""
    return workflow != "rm"


def check_reward_read(self: Config) -> None:
    """A workflow that scores nothing (:func:`scores_responses`) reads no ``reward.*`` key: the section's rules
    (``reward.verifier=task`` needs a built-in data.task) do not apply to it at their defaults, and a key set
    there would be ignored, so it is refused."""
    if scores_responses(self.workflow) or not self.reward.model_fields_set:
        return
    key = sorted(self.reward.model_fields_set)[0]
    raise ValueError(f"reward.{key} scores responses, and workflow {self.workflow} generates none (it evaluates the "
                     f"reward model on held-out pairs): drop reward.{key}")


def check_kto(self: Config) -> None:
    """Workflow kto needs labelled examples and, with ``kto.loss=kto``, a batch to estimate its KL on (its keys
    in another workflow: :func:`check_workflow_sections`)."""
    if self.workflow != "kto":
        return
    if self.data.task not in (None, "arith"):
        raise ValueError(f"workflow=kto needs completions labelled desirable or undesirable: the built-in arith "
                         f"task has them (the true sum desirable, the careless one undesirable); "
                         f"data.task={self.data.task!r} has none, give data.path with data.answer_key (the "
                         f"completion) and data.label_key (true or false) columns")
    if self.kto.loss == "kto" and self.trainer.batch_size < 2:
        raise ValueError(f"trainer.batch_size={self.trainer.batch_size}: kto.loss=kto estimates its KL term z0 on the "
                         f"batch's mismatched (prompt, completion) pairs, which one example does not have: set "
                         f"trainer.batch_size >= 2 (or kto.loss=apo_zero_unpaired, which estimates none)")
    if self.data.task == "arith" and self.trainer.batch_size < 2:
        raise ValueError(f"trainer.batch_size={self.trainer.batch_size}: workflow kto splits the arith task's pairs "
                         f"by their position in the batch (even: the true sum, desirable; odd: the careless one, "
                         f"undesirable), so one example a step is always desirable: set trainer.batch_size >= 2, or "
                         f"give a labelled dataset (data.path with data.label_key)")


def check_total_epochs(self: Config) -> None:
    """``trainer.total_epochs`` counts passes over a dataset; a built-in task has none (it draws problems without
    end), so its run's length is ``trainer.steps``."""
    epochs = self.trainer.total_epochs
    if epochs is not None and self.data.task is not None:
        raise ValueError(f"trainer.total_epochs={epochs:g} counts passes over a training dataset, and data.task="
                         f"{self.data.task} draws problems without end: give a dataset (data.path or "
                         f"data.hf_name, with data.task=null), or set the run's length with trainer.steps")


def check_retire_solved(self: Config) -> None:
    """``data.retire_solved`` retires the dataset rows a GRPO step's groups solve: workflow grpo only."""
    threshold = self.data.retire_solved
    if threshold is not None and self.workflow != "grpo":
        raise ValueError(f"data.retire_solved={threshold:g} retires a prompt once the responses a GRPO step samples "
                         f"to it are solved; workflow {self.workflow} samples none: drop data.retire_solved")


def check_loss_agg(self: Config) -> None:
    """A prompt-level ``algorithm.loss_agg`` (ScaleRL's) weighs the prompt groups of a GRPO-family step: it needs
    groups of several responses."""
    agg = self.algorithm.loss_agg
    if agg not in GROUP_AGG_MODES:
        return
    if self.rollout.n < 2:  # (another workflow reads no algorithm.* key: check_workflow_sections)
        raise ValueError(f"algorithm.loss_agg={agg} averages over the tokens of each prompt's responses, then over "
                         f"prompts; with rollout.n={self.rollout.n} a prompt has one response and it is "
                         f"seq-mean-token-mean: set algorithm.loss_agg=seq-mean-token-mean, or rollout.n >= 2")


def check_vllm_eval_sampling(self: Config) -> None:
    """Evaluation samples its ``eval.k`` answers on the rollout's engine: vLLM's temperatures stop at 2, one below
    0.01 it raises to 0.01 (:func:`~relayrl.engines.generation.vllm_sampling.temperature_refusal`), and it applies
    ``eval.min_p`` before ``eval.top_p`` (``MIN_P_ORDER``). Only these sampling refusals: evaluation does not read
    the log-probs (its ``SamplingParams`` say ``logprobs=False``), so the log-prob ones (a filter on an engine
    started with processed log-probs, a temperature other than 1 on one started with raw log-probs) do not apply."""
    from types import SimpleNamespace

    from relayrl.engines.generation.vllm_sampling import sampling_refusal, temperature_refusal

    ev = self.eval
    if self.rollout.engine != "vllm" or ev.k == 1:
        return
    if ev.temperature is not None and (why := temperature_refusal("eval.temperature", ev.temperature,
                                                                  greedy=False, logprobs=False)) is not None:
        raise ValueError(f"the eval.k answers are sampled on the rollout's vLLM engine: {why}")
    sampled = SimpleNamespace(temperature=ev.temperature or self.rollout.temperature or 1.0, top_p=ev.top_p,
                              top_k=ev.top_k, min_p=ev.min_p, repetition_penalty=1.0, logprobs=False)
    if (why := sampling_refusal(sampled, "eval.")) is not None:
        raise ValueError(f"the eval.k answers are sampled on the rollout's vLLM engine: {why}")


def check_vllm_model_len(self: Config) -> None:
    """``rollout.vllm.max_model_len`` holds a prompt and every token budget after it: vLLM ends a request at that
    length (finish reason ``length``), before the budget the native engine would fill."""
    r = self.rollout
    cap = r.vllm.max_model_len if r.engine == "vllm" else None
    if cap is None:
        return
    budgets = [("rollout.max_new_tokens", r.max_new_tokens), ("eval.max_new_tokens", self.eval.max_new_tokens)]
    if self.env.enabled:
        budgets.append(("env.max_tokens", self.env.max_tokens))
    for key, budget in budgets:
        if budget is not None and budget >= cap:
            raise ValueError(f"{key}={budget} new tokens leave no room for a prompt in rollout.vllm.max_model_len="
                             f"{cap} (vLLM ends a request there, before its budget): raise "
                             f"rollout.vllm.max_model_len above {budget} plus the longest prompt, or lower {key}")


def check_routing_replay(self: Config) -> None:
    """``algorithm.routing_replay``: ``rollout`` records routing in the native engine's dynamic decoder, each
    response's (or episode's, its last turn's) whole; ``old`` in the trainer's pi_old pass. Refuse the settings
    that cannot record it (``relayrl.models.routing``)."""
    if self.algorithm.routing_replay == "none":
        return
    key = f"algorithm.routing_replay={self.algorithm.routing_replay}"  # (workflow grpo: check_workflow_sections)
    if self.engine.cuda_graphs:
        raise ValueError(f"{key} replays other routes into the routers every micro-batch; engine.cuda_graphs=true "
                         "replays recorded graphs: set engine.cuda_graphs=false")
    if self.algorithm.routing_replay == "old":
        from relayrl.config.plan import step_plan

        if not step_plan(self).recompute_old:
            raise ValueError(f"{key} replays the routing of the pi_old pass, which this step does not run "
                             f"(algorithm.old_logprobs={self.algorithm.old_logprobs}"
                             + (" with one optimizer step per batch, whose update is pi_old itself"
                                if self.algorithm.old_logprobs == "auto" else "") +
                             "): set algorithm.old_logprobs=recompute (it changes the update when trainer.mini_batches "
                             "or trainer.epochs > 1), or use algorithm.routing_replay=rollout")
        return
    r = self.rollout
    if r.engine != "native":
        why = ("vLLM 0.32 returns routed experts (enable_return_routed_experts) from its GPU model runner only, and "
               "relayrl does not read them yet" if r.engine == "vllm" else
               "an OpenAI-compatible server returns no routing")
        raise ValueError(f"{key} records the experts each token was routed to in the native rollout engine; "
                         f"{why}: set rollout.engine=native")
    if r.decode == "static":
        raise ValueError(f"{key} records routing on the dynamic decoder; rollout.decode=static decodes "
                         "Llama-shaped (dense) models only: set rollout.decode=auto or dynamic")

