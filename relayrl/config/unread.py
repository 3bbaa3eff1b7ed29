"""Keys that the run a config describes never reads: set away from their defaults they would change nothing, so
they are refused, each naming the key, its value, why nothing reads it and what to set instead.

Which workflow reads what (grep where each key is read before adding one here: a key read only at evaluation, at
resume or by telemetry is read):

* the offline workflows (sft, dpo, kto, rm) train on their data, so the keys of workflow grpo's rollout and
  reward shaping are idle there: ``trainer.stream_groups`` (streaming stages' prompt groups), ``dock.*`` (the
  sample store between the stages), ``telemetry.samples_per_step`` (each step's sampled responses), the
  rollout's filters (``rollout.top_p``, ``top_k``, ``min_p``, ``repetition_penalty``: evaluation answers greedily,
  its ``eval.k`` samples take ``eval.*``'s), ``rollout.temperature`` unless it is the ``eval.k`` answers'
  temperature, and the training reward's terms (``reward.normalize``, ``clip``, ``model``, ``verifier_weight``,
  ``judge.*``: held-out answers are scored with the verifier and the format term alone,
  :meth:`relayrl.engines.reward.engine.RewardEngine.verify`; not with ``env.name=tools``, whose held-out
  episodes are scored with the whole reward). Workflow rm generates nothing: of the rollout it
  reads only ``max_new_tokens`` and ``stop_strings`` (the held-out prompts' length and turn-end checks).
* a reward term that is off (no ``reward.model``, no ``reward.judge.path``, no ``reward.format_regex``) reads none
  of its options.
* ``data.rejected_key`` is read by workflows dpo and rm, ``data.label_key`` by kto.
* ``env.*`` is read only with ``env.name`` (multi-turn episodes); ``engine.optim.min_lr_ratio`` (and the
  critic's) only with a decaying schedule; ``run.nonfinite_skip_limit`` only with ``run.on_nonfinite=skip``;
  ``cluster.ray_address`` and ``cluster.num_cpus`` only with ``cluster.backend=ray``.
* ``trainer.stream_groups`` in workflow grpo is read by the stages that stream per chunk of prompt groups
  (:func:`relayrl.config.plan.stage_graph`); the sequential colocated step has none.

Refusals of the same kind that live elsewhere: :func:`relayrl.config.rules.check_workflow_sections` (whole
sections and ``algorithm.*``), ``check_critic``, ``check_reward_read`` (workflow rm), ``check_retire_solved``.
Sub-options of a feature of the ``algorithm`` section that is off are named at start, not refused
(:meth:`relayrl.config.algorithm.AlgorithmConfig.idle_options`: turning a recipe's feature off is an ablation).
Left for the same reason: ``data.hf_config`` beside ``data.path`` (``gsm8k_grpo.yaml data.hf_name=null
data.path=...``, a documented switch to a local copy, keeps the recipe's), the telemetry sinks' options when a
sink is dropped (``telemetry.sinks=[jsonl]`` for a quick run), ``model.tiny.*`` beside ``trainer.init_from``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

__all__ = ["OFFLINE_WORKFLOWS", "changed", "check_unread"]

Config = Any
"""A :class:`relayrl.config.schema.Config` (not imported: the schema imports these rules)."""

OFFLINE_WORKFLOWS = ("sft", "dpo", "kto", "rm")
"""The workflows that train on their data: no rollout, no prompt groups, no dock, no training reward."""

_TRAINING_REWARD = ("normalize", "clip", "model", "model_weight", "model_batch", "verifier_weight")
"""``reward.*`` keys that shape only the reward a GRPO step trains on (with ``reward.judge.*``)."""

_FILTERS = ("top_p", "top_k", "min_p", "repetition_penalty")
"""The rollout's sampling filters: workflow grpo's rollout alone applies them (never evaluation)."""

_RM_READS = ("n", "partial", "max_new_tokens", "stop_strings")
"""``rollout.*`` keys workflow rm reads (``max_new_tokens``, ``stop_strings``: the held-out prompts' checks) or
that other rules refuse (``n``, ``partial``)."""


def changed(prefix: str, section: BaseModel) -> list[str]:
    """The dotted keys of ``section`` whose values differ from their defaults, each in full (``reward.judge.weight``),
    in the section's field order."""
    out = []
    for name, field in type(section).model_fields.items():
        value, default = getattr(section, name), field.get_default(call_default_factory=True)
        if isinstance(value, BaseModel) and isinstance(default, BaseModel) and type(value) is type(default):
            out += changed(f"{prefix}.{name}", value) if value != default else []
        elif value != default:
            out.append(f"{prefix}.{name}")
    return out


def _value(cfg: Config, key: str) -> str:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"


def check_unread(cfg: Config) -> None:
    """Refuse a key at another value than its default that this run never reads (module docstring)."""
    _check_reward_terms(cfg)
    _check_data_columns(cfg)
    if not cfg.env.enabled and (idle := changed("env", cfg.env)):
        raise ValueError(f"{_value(cfg, idle[0])} shapes multi-turn episodes, and env.name is null (single-turn "
                         f"responses), so nothing reads it: set env.name (tools, or your environment) or drop "
                         f"{idle[0]} (env={{}} on the command line empties the section)")
    _check_switched_off(cfg)
    if cfg.workflow in OFFLINE_WORKFLOWS:
        _check_offline(cfg)
    else:
        _check_streaming(cfg)


def _check_switched_off(cfg: Config) -> None:
    """Options of the run's machinery that another key turns off: the optimizers' decay floor under a constant
    schedule, the skip limit of non-finite updates that stop the run, the Ray options of the local backend."""
    for key, optim in (("engine.optim", cfg.engine.optim), ("critic.optim", cfg.critic.optim)):
        if optim.schedule == "constant" and optim.min_lr_ratio != type(optim).model_fields["min_lr_ratio"].default:
            raise ValueError(f"{key}.min_lr_ratio={optim.min_lr_ratio:g} is the floor of a cosine or linear decay, "
                             f"and {key}.schedule=constant keeps the learning rate at {key}.lr after warm-up, so "
                             f"nothing reads it: set {key}.schedule=cosine (or linear) or drop {key}.min_lr_ratio")
    run = cfg.run
    if run.on_nonfinite == "stop" and "run.nonfinite_skip_limit" in changed("run", run):
        raise ValueError(f"run.nonfinite_skip_limit={run.nonfinite_skip_limit} counts the updates "
                         f"run.on_nonfinite=skip skips in a row, and run.on_nonfinite=stop stops at the first, so "
                         f"nothing reads it: set run.on_nonfinite=skip or drop run.nonfinite_skip_limit")
    c = cfg.cluster
    if c.backend != "ray":
        for key, what in (("ray_address", "joins that Ray cluster"), ("num_cpus", "sizes the Ray the driver starts")):
            if getattr(c, key) is not None:
                raise ValueError(f"cluster.{key}={getattr(c, key)} is read by the Ray backend only (it {what}), and "
                                 f"cluster.backend={c.backend}: set cluster.backend=ray or drop cluster.{key}")


def _check_streaming(cfg: Config) -> None:
    """``trainer.stream_groups`` sizes the calls of the stages that stream per chunk of prompt groups; a step whose
    every stage waits for the whole batch (the sequential colocated step) reads it nowhere."""
    t = cfg.trainer
    if t.stream_groups == type(t).model_fields["stream_groups"].default:
        return
    from relayrl.config.plan import step_plan

    plan = step_plan(cfg)
    if not any(stage.per == "chunk" for stage in plan.stages):
        raise ValueError(f"trainer.stream_groups={t.stream_groups} is how many prompt groups a streaming stage takes "
                         f"per call, and every stage of this step ({plan.describe()}) takes the whole batch at once, "
                         f"so nothing reads it: stages stream with a role on a pool of its own, trainer.mode=periodic, "
                         f"trainer.off_policy_steps or algorithm.dynamic_sampling (docs/step-modes.md); else drop "
                         f"trainer.stream_groups")


def _check_reward_terms(cfg: Config) -> None:
    """A reward term that is off reads none of its options."""
    r = cfg.reward
    if r.judge.path is None and (idle := changed("reward.judge", r.judge)):
        raise ValueError(f"{_value(cfg, idle[0])} shapes the LLM judge, and reward.judge.path is null (no judge), "
                         f"so nothing reads it: set reward.judge.path (a local causal LM) or drop {idle[0]}")
    for key, on, what, switch in (
            ("model_weight", r.model is not None, "weighs the reward model's score", "reward.model is null"),
            ("model_batch", r.model is not None, "sets the rows of a reward-model pass", "reward.model is null"),
            ("model_device", r.model is not None or r.judge.path is not None, "places the reward model and the "
             "judge", "reward.model and reward.judge.path are null"),
            ("format_on", r.format_regex is not None, "is what reward.format_regex is searched in",
             "reward.format_regex is null")):
        if not on and f"reward.{key}" in changed("reward", r):
            fix = "reward.model" if key.startswith("model_") else "reward.format_regex"
            raise ValueError(f"{_value(cfg, 'reward.' + key)} {what}, and {switch} (no such term), so nothing reads "
                             f"it: set {fix} or drop reward.{key}")


def _check_data_columns(cfg: Config) -> None:
    """The columns of preference pairs and of labelled completions are read by their workflows only."""
    for key, readers, what in (("rejected_key", ("dpo", "rm"), "a preference pair's rejected answer"),
                               ("label_key", ("kto",), "whether a completion is desirable")):
        if f"data.{key}" in changed("data", cfg.data) and cfg.workflow not in readers:
            raise ValueError(f"{_value(cfg, 'data.' + key)} names the field with {what}, read by workflow"
                             f"{'s' if len(readers) > 1 else ''} {' and '.join(readers)} only (this run is workflow "
                             f"{cfg.workflow}): drop data.{key}")


def _check_offline(cfg: Config) -> None:
    """Workflow grpo's rollout, dock, streaming and training-reward keys in a workflow that trains on its data."""
    wf = cfg.workflow
    this = f"workflow {wf} trains on its data"
    t = cfg.trainer
    if t.stream_groups != type(t).model_fields["stream_groups"].default:
        raise ValueError(f"trainer.stream_groups={t.stream_groups} is how many prompt groups workflow grpo's "
                         f"streaming stages take per call; {this} (trainer.batch_size rows a step), with no rollout "
                         f"and no prompt groups, so nothing reads it: drop trainer.stream_groups")
    if idle := changed("dock", cfg.dock):
        raise ValueError(f"{_value(cfg, idle[0])} shapes the dock, the sample store between workflow grpo's "
                         f"stages; {this} and builds none, so nothing reads it: drop {idle[0]}")
    if cfg.telemetry.samples_per_step:
        raise ValueError(f"telemetry.samples_per_step={cfg.telemetry.samples_per_step} writes each step's sampled "
                         f"responses to RUN_DIR/samples.jsonl; {this} and samples none"
                         + (" (its held-out answers are in the evaluation reports, RUN_DIR/eval)" if wf != "rm" else "")
                         + ": set telemetry.samples_per_step=0")
    if wf == "rm":  # (every reward key: check_reward_read)
        given = [k for k in changed("rollout", cfg.rollout) if k.split(".")[1] not in _RM_READS]
        if given:
            raise ValueError(f"{_value(cfg, given[0])} shapes the rollout, and workflow rm trains a reward model on "
                             f"pairs and generates nothing (it evaluates pair accuracy), so nothing reads it: drop "
                             f"{given[0]}")
        return
    idle = [k for k in changed("reward", cfg.reward) if k.split(".")[1] in _TRAINING_REWARD + ("judge",)]
    if idle and not cfg.env.enabled:  # (the tool environment's episodes are scored with the whole reward)
        raise ValueError(f"{_value(cfg, idle[0])} shapes the reward a GRPO step trains on; {this} and scores only "
                         f"its held-out answers, with the verifier and the format term (reward.format_weight) alone "
                         f"(eval/accuracy), so nothing reads it: drop {idle[0]}")
    r, ev = cfg.rollout, cfg.eval
    for key in _FILTERS:
        if f"rollout.{key}" in changed("rollout", r):
            instead = (f"for the eval.k answers set eval.{key} (with eval.k > 1)" if key != "repetition_penalty"
                       else "evaluation has no repetition penalty")
            raise ValueError(f"{_value(cfg, 'rollout.' + key)} filters what workflow grpo's rollout samples; {this} "
                             f"and generates only its held-out answers, greedy (and with eval.k > 1 sampled with "
                             f"eval.top_p, eval.top_k and eval.min_p), so nothing reads it: drop rollout.{key} "
                             f"({instead})")
    if "rollout.temperature" in changed("rollout", r) and (ev.k == 1 or ev.temperature is not None):
        why = (f"eval.temperature={ev.temperature:g} samples its eval.k answers" if ev.temperature is not None
               else "eval.k=1")
        raise ValueError(f"{_value(cfg, 'rollout.temperature')} is the temperature of workflow grpo's rollout; {this} "
                         f"and generates only its held-out answers, greedy ({why}), so nothing reads it: drop "
                         f"rollout.temperature (eval.temperature, with eval.k > 1, samples held-out answers)")
