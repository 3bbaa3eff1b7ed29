"""``relayrl plan``: calibrate a profile, or search placements for a recipe on N devices.

    relayrl plan --profile [--out relayrl-profile.json]              # calibrate this machine (about 5 minutes)
    relayrl plan RECIPE [overrides] --devices N [--hardware PROFILE]  # the plan table and the best overrides
    relayrl plan --from-run RUN_DIR [--devices N]                     # fitted to a run's spans and lengths

The recipe's dotted overrides may come before, between or after the options (as for ``relayrl train``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from relayrl.cli.argtypes import check_makeable
from relayrl.planner.profile import Profile, load_profile, save_profile

if TYPE_CHECKING:
    from relayrl.config.schema import Config

__all__ = ["add_parser", "cmd_plan"]

DEFAULT_PROFILE = "relayrl-profile.json"
PROFILES = Path(__file__).resolve().parent / "profiles"


def add_parser(sub, common) -> None:
    from relayrl.cli.argtypes import finite_float, int_at_least, positive_float

    p = sub.add_parser("plan", parents=[common], help="calibrate a hardware profile (--profile), or rank placements "
                       "and step modes of a recipe on N devices by predicted throughput")
    p.add_argument("recipe", nargs="?", help="the recipe to plan (omit with --profile)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, as for relayrl train")
    p.add_argument("--profile", action="store_true", help="calibrate this machine and write the profile (--out)")
    p.add_argument("--out", default=DEFAULT_PROFILE, help="where --profile writes (.json or .yaml)")
    p.add_argument("--model", help="--profile: model directory the costs are measured with (default: the tiny one)")
    p.add_argument("--reward-fn", default="task", help="--profile: reward function to time (module:function)")
    p.add_argument("--no-overhead", action="store_true", help="--profile: skip the short runs of each driver "
                   "path that measure what the path adds (faster; predictions then leave it out)")
    p.add_argument("--devices", type=int_at_least(1), help="devices to plan for (GPUs, or on a CPU profile shares of the cores); --from-run: "
                   "default the run's, on a CPU profile at least the profile's cores")
    p.add_argument("--hardware", default=None, help=f"profile file to plan with (default: {DEFAULT_PROFILE}; a "
                   f"name in relayrl/planner/profiles, e.g. h100_7b)")
    p.add_argument("--model-config", help="a Hugging Face config.json for the model's shape, when the recipe's "
                   "model is not on this machine (e.g. relayrl/planner/profiles/qwen2_7b_config.json)")
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=None, help="prompt length in tokens "
                   "(default: the mean over the recipe's prompts, a task's or a dataset's rows, as its model's "
                   "tokenizer encodes them)")
    p.add_argument("--lengths", default=None, help="response lengths: 'measure' (sample the recipe's model), "
                   "'max' (every response hits rollout.max_new_tokens), or 'mixture:SHORT,P_LONG,LONG_MEAN' "
                   "(default: measure for a model on this machine, max otherwise)")
    p.add_argument("--length-growth", type=finite_float, default=0.0, help="response tokens gained per step as "
                   "training goes on (GRPO responses usually lengthen): the plan uses the mean length over the run's "
                   "trainer.steps, the lengths given or measured growing from step 0")
    p.add_argument("--reward-latency", default="0,0", help="outside latency per scored response, uniform "
                   "LOW,HIGH seconds")
    p.add_argument("--from-run", metavar="RUN_DIR", help="fit the profile to a run's own spans and lengths "
                   "(RUN_DIR: its run.dir) and rank the placements for that workload (no recipe)")
    p.add_argument("--lengths-at", choices=("rest", "now"), default="rest", help="--from-run: plan with the "
                   "response lengths the run's trend predicts over its remaining steps (rest) or its last steps' (now)")
    p.add_argument("--keep-frac", type=positive_float, default=None, help="dynamic sampling "
                   "(algorithm.dynamic_sampling=true): the share of groups a round keeps, their rewards not all "
                   "equal (default 1: no round resamples); a run logs it as 1 - dapo/dropped_groups / "
                   "dapo/sampled_groups, and --from-run reads it there")
    p.add_argument("--no-offpolicy", action="store_true", help="leave the off-policy modes out of the search")
    p.add_argument("--top", type=int_at_least(1), default=12, help="rows of the table")
    p.set_defaults(fn=cmd_plan)


def _hardware(arg: str | None) -> Profile:
    if arg is None:
        return load_profile(DEFAULT_PROFILE)
    for cand in (Path(arg), PROFILES / arg, PROFILES / f"{arg}.yaml", PROFILES / f"{arg}.json"):
        if cand.is_file():
            return load_profile(cand)
    return load_profile(arg)  # raises, naming how to make one


def _check_profile_inputs(reward_fn: str, out: Path, model: str | None) -> None:
    """``--profile``'s model directory, reward function (imported and its signature checked) and ``--out`` (a
    file that can be written), before the calibration."""
    import os

    from relayrl.config.loader import ConfigError

    if model is not None:
        from relayrl.models.load import check_model_dir

        check_model_dir(model, "--model", f"relayrl plan --profile --model {model}")

    if reward_fn != "task":
        from relayrl.engines.reward.config import RewardError
        from relayrl.engines.reward.user import load_reward_fn

        try:
            load_reward_fn(reward_fn)
        except RewardError as e:
            raise ConfigError(f"relayrl plan --profile --reward-fn {reward_fn}: {e}") from None
    fix = "give a file path, e.g. --out relayrl-profile.json"
    if out.is_dir():
        raise ConfigError(f"relayrl plan --profile: --out {out} is a directory; {fix}")
    if out.exists():
        if not os.access(out, os.W_OK):
            raise ConfigError(f"relayrl plan --profile: --out {out} is not writable; {fix}")
        return
    check_makeable(out, "relayrl plan --profile: --out", fix)


def _run_steps(cfg: Config) -> Config:
    """``cfg`` with the steps its run takes, for ``--length-growth``: a ``trainer.total_epochs`` recipe's are
    counted from its training rows loaded as the run loads them (:func:`relayrl.workflows.problems.resolve_steps`,
    the code the run resolves them with); the lines about the rows and the steps are printed."""
    from relayrl.config.loader import ConfigError
    from relayrl.errors import UserError
    from relayrl.workflows.problems import resolve_steps

    epochs = cfg.trainer.total_epochs
    if epochs is None:
        return cfg
    source = f"data.path={cfg.data.path}" if cfg.data.path is not None else f"data.hf_name={cfg.data.hf_name}"
    try:
        cfg, line = resolve_steps(cfg, log=print)
    except (UserError, OSError) as e:
        raise ConfigError(f"relayrl plan --length-growth grows the lengths over the run's trainer.steps, which "
                          f"trainer.total_epochs={epochs:g} counts from the training rows of {source} as the run "
                          f"loads them (with the model's tokenizer), and they cannot be loaded here: {e}. Make them "
                          f"readable here, or give trainer.steps=N with trainer.total_epochs=null, or drop "
                          f"--length-growth") from None
    print(f"relayrl plan: {line}")
    return cfg


def cmd_plan(args) -> int:
    from pydantic import ValidationError

    from relayrl.config.loader import ConfigError, field_errors

    if args.profile:
        if args.recipe:
            raise ConfigError("relayrl plan --profile calibrates this machine and takes no recipe; run "
                              "`relayrl plan RECIPE --devices N` afterwards")
        _check_profile_inputs(args.reward_fn, Path(args.out), args.model)  # before minutes of calibration
        from relayrl.planner.calibrate import calibrate

        prof = calibrate(args.model, reward_fn=args.reward_fn, overhead=not args.no_overhead)
        print(f"relayrl plan: profile written to {save_profile(prof, args.out)}")
        return 0
    if args.from_run:
        if args.recipe:
            raise ConfigError("relayrl plan --from-run RUN_DIR reads the run's own config; give no recipe")
        if args.keep_frac is not None:
            raise ConfigError("relayrl plan --from-run reads the share of groups dynamic sampling kept from the "
                              "run's dapo/ metrics; drop --keep-frac")
        from relayrl.planner.from_run import plan_from_run

        try:
            print(plan_from_run(args.from_run, _hardware(args.hardware), devices=args.devices,
                                lengths_at=args.lengths_at, top=args.top, offpolicy=not args.no_offpolicy,
                                prompt_tokens=args.prompt_tokens, model_config=args.model_config))
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"relayrl plan: {e}") from None
        return 0
    if not args.recipe or args.devices is None:
        raise ConfigError("relayrl plan: give a recipe and --devices N (e.g. relayrl plan recipes/arith_grpo.yaml "
                          "--devices 2), or --profile to calibrate this machine")
    try:
        low, high = (float(x) for x in args.reward_latency.split(","))
    except ValueError:
        raise ConfigError(f"relayrl plan: --reward-latency {args.reward_latency!r}: write LOW,HIGH seconds, e.g. "
                          f"0.02,0.2") from None
    from relayrl.config.loader import load_run_config
    from relayrl.planner.from_config import workload_from_config
    from relayrl.planner.search import candidates, format_plan, rank

    cfg = load_run_config(args.recipe, args.overrides)
    if args.length_growth:
        cfg = _run_steps(cfg)
    try:
        prof = _hardware(args.hardware)
        w = workload_from_config(cfg, model_config=args.model_config, prompt_tokens=args.prompt_tokens,
                                 lengths=args.lengths, reward_latency=(low, high))
        if args.keep_frac is not None:
            if not w.group_filter:
                raise ValueError(f"--keep-frac {args.keep_frac:g} is the share of groups dynamic sampling keeps; "
                                 f"this recipe does not filter groups (set algorithm.dynamic_sampling=true or drop "
                                 f"--keep-frac)")
            from relayrl.planner.workload import Workload

            w = Workload.model_validate({**w.model_dump(), "keep_frac": args.keep_frac})
        if args.length_growth:
            start = w.lengths.mean()
            over_run = max(1.0, start + args.length_growth * cfg.trainer.steps / 2)
            w = w.model_copy(update={"lengths": w.lengths.scaled(over_run / start)})
    except ValidationError as e:  # (a workload built from bad flags)
        raise ConfigError(f"relayrl plan: {'; '.join(field_errors(e))} (check --prompt-tokens, --reward-latency, "
                          f"--lengths, --keep-frac)") from None
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"relayrl plan: {e}") from None
    preds = rank(prof, w, candidates(args.devices, offpolicy=not args.no_offpolicy,
                                         cpu=prof.cores > 0, rollout_tp=w.rollout_tp))
    title = (f"relayrl plan: PREDICTED for {args.recipe} on {args.devices} device(s) of profile '{prof.name}'\n"
             f"  ({w.prompts} prompts x {w.n}, {w.prompt_tokens} prompt tokens, responses {w.lengths.kind} up to "
             f"{w.lengths.max_new_tokens}" + (f", mean {w.lengths.mean():.0f} over the run with "
                                              f"{args.length_growth:+g} tokens/step" if args.length_growth else "")
             + (f", dynamic sampling keeping {w.keep_frac:.0%} of groups a round, up to {w.resample_rounds} more "
                f"round(s)" if w.group_filter else "")
             + f", model {w.model.params / 1e6:.1f}M params; source: {prof.source})")
    from relayrl.planner.from_config import unmodelled

    title += "".join(f"\nrelayrl plan: not simulated: {line}" for line in unmodelled(cfg))
    print(format_plan(preds, title=title, top=args.top))
    return 0
