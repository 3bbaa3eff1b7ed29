"""A recipe's :class:`~relayrl.planner.workload.Workload`: the batch shape from its config, the model's shape
from its config file, response lengths given or measured by generating from the run's model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from relayrl.engines.training import flex
from relayrl.planner.workload import LatencyDist, LengthDist, ModelShape, Workload

__all__ = ["workload_from_config", "measure_lengths", "plan_passes", "unmodelled"]


def _model_dir(cfg) -> str | None:
    if cfg.trainer.init_from:
        return cfg.trainer.init_from
    if cfg.model.path:
        return cfg.model.path
    if cfg.model.tiny.shape == "tiny":
        from relayrl.models.tiny import build_tiny

        return str(build_tiny(cfg.model.tiny, verbose=False))
    return None


def sample_prompts(cfg, n: int, *, rows_for_mean: int = 512) -> tuple[list[list[int]], float]:
    """``n`` of the recipe's prompts as its run encodes them (:class:`~relayrl.workflows.problems.RunProblems`:
    the model's tokenizer and chat template, a dataset's rows fitted to the context, held-out rows carved out,
    ``data.max_rows``), drawn with ``run.seed``: fresh problems of a built-in task, or a sample of a dataset's
    training rows; and the mean prompt length in tokens over up to ``rows_for_mean`` of them (a dataset's
    prompts differ in length; the ``n`` alone are what the response lengths are measured on)."""
    import random

    from relayrl.workflows.problems import RunProblems

    run = RunProblems(cfg, training=True, log=lambda line: None)
    rng = random.Random(cfg.run.seed)
    if run.task is not None:
        problems = [run.task.sample(rng) for _ in range(max(n, rows_for_mean))]
    else:
        rows = run.train_problems or []
        if not rows:
            raise ValueError(f"{cfg.data.path or cfg.data.hf_name}: no training rows left to measure prompts on")
        problems = [rows[i] for i in rng.sample(range(len(rows)), min(len(rows), max(n, rows_for_mean)))]
    encoded = [run.encode(p) for p in problems]
    return encoded[:n], sum(map(len, encoded)) / len(encoded)


def _packing(cfg, hf) -> str:
    """``engine.packing``, or ``none`` for a model whose linear-attention layers the training engine will not pack
    (their recurrent state would run from one packed sequence into the next: Qwen3.5, Qwen3-Next)."""
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    return "none" if "linear_attention" in (getattr(text, "layer_types", None) or ()) else cfg.engine.packing


def _lengths(spec: str, cfg, model_dir: str | None, prompts: list[list[int]] | None) -> LengthDist:
    cap = cfg.rollout.max_new_tokens
    if spec == "max":
        return LengthDist(kind="mixture", short=cap, max_new_tokens=cap)
    if spec.startswith("mixture:"):
        try:
            short, p_long, mean = spec.split(":", 1)[1].split(",")
            return LengthDist(kind="mixture", short=int(short), p_long=float(p_long), long_mean=float(mean),
                              max_new_tokens=cap)
        except ValueError:
            raise ValueError(f"--lengths {spec!r}: write mixture:SHORT,P_LONG,LONG_MEAN, e.g. mixture:4,0.25,24") from None
    if spec == "measure":
        if model_dir is None or prompts is None:
            raise ValueError("--lengths measure samples the recipe's model, which is not on this machine: give "
                             "--lengths max or --lengths mixture:SHORT,P_LONG,LONG_MEAN")
        return LengthDist(kind="empirical", max_new_tokens=cap, samples=tuple(
            measure_lengths(model_dir, prompts, sampling=cfg.rollout.sampling())))
    raise ValueError(f"--lengths {spec!r}: one of measure, max, mixture:SHORT,P_LONG,LONG_MEAN")


def unmodelled(cfg) -> list[str]:
    """What the recipe runs that the simulator does not time, one line each (``relayrl plan`` prints them before
    its table, so a plan is not read as covering them): a multi-turn environment's later turns, tool calls and
    observations (each response is planned as one generation of up to ``rollout.max_new_tokens``), a reward
    model's and an LLM judge's passes (the reward cost is the profile's reward function's), a reference, critic
    or teacher the recipe places off ``main`` (every candidate runs them on ``main``), a reward placed off the
    driver."""
    notes = []
    e = cfg.env
    if e.name is not None:
        notes.append(f"env.name={e.name}: each episode is planned as one generation of up to rollout.max_new_tokens="
                     f"{cfg.rollout.max_new_tokens} tokens; its further turns (up to env.max_turns={e.max_turns}, "
                     f"env.max_tokens={e.max_tokens} tokens with the observations), the environment's steps "
                     f"(env.workers={e.workers} threads) and the prefill of each turn are not simulated, so the "
                     f"step times are a lower bound: measure a short run (relayrl plan "
                     f"--from-run reads single-turn runs only)")
    from relayrl.config.plan import step_plan

    roles, pl = step_plan(cfg).roles, cfg.placement
    for role in ("reference", "critic", "teacher"):
        pool = getattr(pl, role)
        if role in roles and pool == "gen":  # (the candidates' rollout pool)
            notes.append(f"placement.{role}=gen: the plan runs the {role} on the actor's pool main in every "
                         f"candidate; the search does not try it on the rollout's pool gen")
        elif role in roles and pool != "main":
            notes.append(f"placement.{role}={pool}: the plan runs the {role} on the actor's pool main, as every "
                         f"candidate does; pool {pool}'s {pl.pools.get(pool, '?')} device(s) are not in --devices "
                         f"and the 'best:' overrides keep placement.{role}={pool}: plan with "
                         f"placement.{role}=main to compare like with like")
    if pl.reward != "driver":
        notes.append(f"placement.reward={pl.reward}: the reward is planned on the driver's threads")
    r = cfg.reward
    for key, on in (("reward.model", r.model), ("reward.judge.path", r.judge.path)):
        if on is not None:
            notes.append(f"{key}={on}: its passes over the responses are not timed (the reward's cost is the "
                         f"profile's reward function and --reward-latency); give its time per prompt group "
                         f"as --reward-latency LOW,HIGH, or plan --from-run a short run, which measures it")
    return notes


def plan_passes(cfg) -> dict:
    """What the simulator needs of the pipeline's step plan (:func:`relayrl.config.plan.step_plan`) besides the
    placement: the forward-only stages of its stage graph, whether the actor runs the reference inside the
    update (tri-model), a critic, how the advantages stream, and whether the update may accumulate per chunk
    in an overlapped mode."""
    from relayrl.config.plan import FORWARD_STAGES, step_plan

    plan = step_plan(cfg)
    overlapped = step_plan(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"mode": "periodic"})}))
    return {"forward": tuple(s.name for s in plan.stages if s.name in FORWARD_STAGES),
            "ref_in_update": plan.tri_model and cfg.algorithm.kl_coef > 0, "critic": "critic" in plan.roles,
            "kl_in_reward": cfg.algorithm.kl_in_reward, "group_relative": plan.estimator.group_relative,
            "accumulate": overlapped.update == "accumulate", "group_filter": plan.group_filter,
            "baseline": plan.baseline, "token_stats": plan.estimator.reads_old,
            "reads_reference": plan.estimator.reference,
            "resample_rounds": cfg.algorithm.max_resample_rounds if plan.group_filter else 0}


def workload_from_config(cfg, *, model_config: str | None = None, prompt_tokens: int | None = None,
                         lengths: str | None = None, reward_latency: tuple[float, float] = (0.0, 0.0),
                         measure_prompts: int = 16) -> Workload:
    """The :class:`Workload` of a GRPO recipe: batch shape from the config, the model's shape from its
    directory (or ``model_config``), prompt tokens and response lengths measured from the task and model when
    they are on this machine."""
    if cfg.workflow != "grpo":
        raise ValueError(f"the planner times GRPO-family steps (workflow grpo: GRPO, DAPO, PPO, online DPO, "
                         f"distillation); this recipe is workflow {cfg.workflow}, whose steps it does not model")
    model_dir = None if model_config else _model_dir(cfg)
    if model_config:
        from transformers import AutoConfig

        data = json.loads(Path(model_config).read_text())
        hf = AutoConfig.for_model(**data)
        shape = ModelShape.from_hf_config(hf, dtype=cfg.model.dtype, lora=cfg.model.lora)
    elif model_dir:
        from transformers import AutoConfig

        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"model directory {model_dir} (trainer.init_from or model.path) has no config.json; "
                             f"give the model's directory, or --model-config CONFIG.json for its shape")
        hf = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        shape = ModelShape.from_hf_config(hf, dtype=cfg.model.dtype, lora=cfg.model.lora)
    elif cfg.model.tiny.shape != "tiny":  # a published shape, not built yet: its config is known
        from transformers import Qwen2Config

        from relayrl.models.tiny import SHAPES

        hf = Qwen2Config(**SHAPES[cfg.model.tiny.shape])
        shape = ModelShape.from_hf_config(hf, dtype=cfg.model.dtype, lora=cfg.model.lora)
    else:
        raise ValueError("the recipe's model is not on this machine: give --model-config CONFIG.json for its shape")
    spec = lengths or ("measure" if model_dir else "max")
    prompts = mean = None
    if model_dir and (prompt_tokens is None or spec == "measure"):
        from relayrl.errors import UserError

        try:
            prompts, mean = sample_prompts(cfg, measure_prompts)
        except (UserError, OSError) as e:
            raise ValueError(f"the plan measures the prompt length (and with --lengths measure the response lengths) "
                             f"on the recipe's prompts, which cannot be loaded here: {e}. Make them readable, or give "
                             f"--prompt-tokens N with --lengths max or mixture:SHORT,P_LONG,LONG_MEAN") from None
    if prompt_tokens is None:
        if mean is None:
            raise ValueError("the prompt length cannot be measured without the recipe's model and its tokenizer on "
                             "this machine: give --prompt-tokens N")
        prompt_tokens = round(mean)
    return Workload(prompts=cfg.data.prompts_per_step, n=cfg.rollout.n, prompt_tokens=prompt_tokens,
                    lengths=_lengths(spec, cfg, model_dir, prompts),
                    reward_latency=LatencyDist(low_s=reward_latency[0], high_s=reward_latency[1]), model=shape,
                    token_budget=cfg.engine.token_budget, stream_groups=cfg.trainer.stream_groups,
                    dp_sync=cfg.engine.dp_sync, sequence_parallel=cfg.engine.sequence_parallel,
                    expert_parallel=cfg.engine.expert_parallel_on and shape.routed > 0,
                    expert_group=0 if cfg.engine.expert_parallel is True else int(cfg.engine.expert_parallel),
                    **plan_passes(cfg), offload=cfg.trainer.offload,
                    checkpointing=cfg.engine.gradient_checkpointing, decode_fused=cfg.rollout.decode_compile,
                    rollout_tp=cfg.rollout.devices_per_rank,
                    expand_kv=cfg.model.attn_implementation == "flex_attention" and flex.EXPAND_KV,
                    head_stored=cfg.engine.head_grad == "stored" and cfg.engine.logprob_chunk > 0,
                    packing=_packing(cfg, hf), pack_length=cfg.engine.pack_length or 0,
                    feed_last=cfg.algorithm.routing_replay != "none" or cfg.engine.router_aux_loss_coef > 0)


def measure_lengths(model_dir: str, prompts: list[list[int]], n: int = 1, max_new_tokens: int = 16, *,
                    temperature: float = 1.0, sampling=None, seed: int = 0, threads: int | None = None) -> list[int]:
    """Response lengths of ``model_dir`` on ``prompts`` (``n`` samples each): the empirical length distribution
    of a workload (:class:`relayrl.planner.workload.LengthDist`). ``sampling`` (a recipe's
    ``cfg.rollout.sampling()``: its temperature, top-p/k, min-p, repetition penalty and stop strings, which all
    move where a response ends) replaces ``n``, ``max_new_tokens`` and ``temperature``."""
    from relayrl.engines.generation.base import SamplingParams
    from relayrl.engines.generation.native import NativeGenerationEngine
    from relayrl.models.load import load_model, load_tokenizer

    if threads:
        torch.set_num_threads(threads)
    eng = NativeGenerationEngine(load_model(model_dir, attn_implementation="auto"), load_tokenizer(model_dir),
                                 device="cpu")
    if sampling is None:
        sampling = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=temperature)
    out = eng.generate(prompts, sampling, generator=torch.Generator().manual_seed(seed))
    return [len(c.token_ids) for c in out]
