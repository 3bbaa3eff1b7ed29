"""``relayrl train | eval | plot | demo | serve | dock | plan``."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from relayrl import __version__
from relayrl.cli import argtypes
from relayrl.config.eval_flags import EVAL_FLAGS
from relayrl.config.loader import SHIPPED

__all__ = ["main", "parse_args"]

RECIPES = SHIPPED  # the demo's stages


def builtin_tasks() -> list[str]:
    """The built-in task names, from the registry ``make_task`` reads (its error lists the same ones)."""
    from relayrl.data.tasks import EXTRA_TASKS, TASKS  # (no torch: the parser stays quick)

    return sorted([*TASKS, *EXTRA_TASKS])


def _load(recipe: str | None, overrides: list[str]):
    from relayrl.config.loader import load_run_config

    return load_run_config(recipe, overrides)


def _run(cfg) -> Path:
    """Train ``cfg``'s workflow; a lost worker restarts it from the last checkpoint (``run.max_restarts``)."""
    from relayrl.workflows.registry import run

    return run(cfg)


def cmd_train(args) -> int:
    cfg = _load(args.recipe, args.overrides)  # before torch is imported: a bad key is refused in about a second
    if args.print_config:
        print(resolved_config(cfg), end="")
        return 0
    try:
        out = _run(cfg)
    except Exception as e:
        from relayrl.checkpoint.rundir import RunDirError, rerun_note

        note = None if isinstance(e, RunDirError) or cfg.run.overwrite else rerun_note(cfg.run.dir, cfg.run.resume)
        if note:
            e.add_note(note)  # (the CLI's error boundary prints it after the error)
        raise
    print(f"relayrl: model saved to {out}; metrics in {cfg.run.dir / 'metrics.jsonl'}")
    return 0


def resolved_config(cfg) -> str:
    """``relayrl train --print-config``: the validated config as YAML, every key with its value (the defaults
    too), a recipe that reproduces the run; for workflow grpo comment lines with the step's plan and its notes
    (the run's first lines). Nothing is started or written."""
    import yaml

    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False, width=100)
    if cfg.workflow == "grpo":
        from relayrl.config.plan import step_plan

        plan = step_plan(cfg)
        text = "".join(f"# {line}\n" for line in (plan.describe(), *plan.notes)) + text
    return text


def _final_accuracy(run_dir: Path) -> tuple[float | None, float | None]:
    """(first, last) eval/accuracy in a run's metrics.jsonl."""
    from relayrl.telemetry.sinks import METRICS_FILE

    first = last = None
    for line in (run_dir / METRICS_FILE).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("eval/accuracy") is not None:
            first = rec["eval/accuracy"] if first is None else first
            last = rec["eval/accuracy"]
    return first, last


DEMO_MARK = ".relayrl-demo"
"""A file in each stage directory a demo made: a later demo may replace that directory."""


def cmd_demo(args) -> int:
    """Pretrain on correct sums, SFT on a careless teacher, then GRPO with the verifier alone; ``--tools``:
    SFT on a few calculator-using episodes, then GRPO on multi-turn episodes with the calculator."""
    t0 = time.perf_counter()
    root = Path(args.dir or ("runs/demo-tools" if args.tools else "runs/demo"))
    if args.tools:
        stages = (
            ("sft", "toolsum_sft.yaml", "SFT on a few episodes of a teacher who adds 5-digit numbers with the "
             "calculator in half of them", args.overrides_sft),
            ("grpo", "toolsum_grpo.yaml", "GRPO on multi-turn calculator episodes, the final answer's verifier as "
             "the only reward", args.overrides_grpo),
        )
    else:
        stages = (
            ("base", "arith_base.yaml", "pretrain the tiny model on correct 2-digit sums", args.overrides_base),
            ("sft", "arith_sft.yaml", "SFT on a careless teacher who forgets to carry in 70% of sums", args.overrides_sft),
            ("grpo", "arith_grpo.yaml", "GRPO on fresh 2-digit sums, the verifier as the only reward", args.overrides_grpo),
        )
    for i, (name, recipe, _, overrides) in enumerate(stages):  # every stage's mistakes before the first trains
        init = [f"trainer.init_from={root / stages[i - 1][0] / 'model'}"] if i else []
        cfg = _load(str(RECIPES / recipe), [f"run.dir={root / name}", *init, *overrides])
        if not _demo_owns(args, root / name):  # (another run in a later stage's way: refused now, not minutes on)
            from relayrl.checkpoint.rundir import check_run_dir

            check_run_dir(root / name, cfg.run.resume, cfg.run.overwrite)
    model, rl_min, held_out = None, 0.0, 0
    for i, (name, recipe, what, overrides) in enumerate(stages, 1):
        print(f"relayrl demo: {i}/{len(stages)} {what} (recipes/{recipe})", flush=True)
        init = [f"trainer.init_from={model}"] if model else []
        cfg = _load(str(RECIPES / recipe), [f"run.dir={root / name}", *init, *overrides])
        # A second demo replaces the first one's runs: the stage directories a demo made (marked), and those of
        # the default root. Any other run in the way (`--dir runs` beside the quickstart's runs/sft) is left to
        # the run directory's checks, which refuse it (run.overwrite=true moves it aside).
        if cfg.run.resume == "never" and _demo_owns(args, root / name) and (root / name / "config.json").is_file():
            print(f"relayrl demo: replacing the previous demo run in {root / name}", flush=True)
            shutil.rmtree(root / name)
        t = time.perf_counter()
        model = _run(cfg)
        (root / name / DEMO_MARK).touch()
        rl_min, held_out = (time.perf_counter() - t) / 60, cfg.eval.size
    before, after = _final_accuracy(root / "grpo")
    minutes = (time.perf_counter() - t0) / 60
    if args.tools:
        print(f"relayrl demo: greedy accuracy of multi-turn calculator episodes on held-out 5-digit sums, before "
              f"GRPO (the SFT model) and after {rl_min:.1f} min of GRPO; {minutes:.1f} min in all; run dirs under "
              f"{root}")
        print(f"tools: accuracy {100 * (before or 0):.1f}% -> {100 * (after or 0):.1f}% in {rl_min:.1f} min")
        return 0
    print(f"relayrl demo: GRPO took {rl_min:.1f} min; greedy accuracy on {held_out} held-out 2-digit sums that need "
          f"a carry, before GRPO (the SFT model) and after; run dirs under {root}")
    print(f"demo: accuracy {100 * (before or 0):.1f}% -> {100 * (after or 0):.1f}% in {minutes:.1f} min")
    return 0


def _demo_owns(args, stage_dir: Path) -> bool:
    """Whether a demo may replace the run in ``stage_dir``: one a demo made (marked), or any under the default
    root (``runs/demo``); another run there is left to the run directory's checks."""
    return args.dir is None or (stage_dir / DEMO_MARK).is_file()


def _eval_out(out: Path) -> Path:
    """``relayrl eval --out``, checked before the model loads: a directory, or one that can be made; a report
    already there (eval.json) is replaced, and said so."""
    from relayrl.config.loader import ConfigError

    fix = "give a directory for eval.json and eval_samples.jsonl (e.g. --out runs/eval)"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"relayrl eval: --out {out} is a file, not a directory; {fix}")
    argtypes.check_makeable(out, "relayrl eval: --out", fix)
    if (out / "eval.json").is_file():
        print(f"relayrl eval: {out} holds an eval report; this evaluation replaces its eval.json and "
              f"eval_samples.jsonl", flush=True)
    return out


def _eval_reward(verifier: str, user_fn: list[str] | None, weights: list[float] | None = None):
    """The reward config of ``relayrl eval --data``: a built-in verifier, or the user's functions (errors
    name --user-fn)."""
    from relayrl.config.loader import ConfigError
    from relayrl.engines.reward import RewardConfig

    if user_fn is not None and len(user_fn) == 1:
        user_fn = user_fn[0]
    try:
        return RewardConfig(verifier=verifier, user_fn=user_fn, user_weights=weights)
    except ValueError as e:  # (pydantic's ValidationError: a --user-fn file that is not there)
        errors = getattr(e, "errors", None)
        msg = "; ".join(str(x.get("ctx", {}).get("error", x["msg"])) for x in errors()) if errors else str(e)
        fns = " ".join(user_fn) if isinstance(user_fn, list) else user_fn
        raise ConfigError(f"relayrl eval: --user-fn {fns}: {msg}") from None


def _eval_recipe_config(args):
    """``relayrl eval --recipe``'s run config: the recipe and overrides with ``--model`` as ``model.path``
    (``trainer.init_from`` cleared: a recipe's starting model is not the one evaluated). Refused: the options
    the config holds (naming the key to override instead), an override of the model, a bad override (the
    config's own error)."""
    from relayrl.config.loader import ConfigError

    for dest, (_, key) in EVAL_FLAGS.items():
        if getattr(args, dest) is not None:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"relayrl eval: {flag} does not go with --recipe, whose run config sets {key}; "
                              f"override {key}=... instead, or drop --recipe")
    for item in args.overrides:
        key = item.split("=", 1)[0].strip()
        if key in ("model.path", "trainer.init_from"):
            raise ConfigError(f"relayrl eval: the override {item!r}: --model names the model evaluated (as "
                              f"model.path, with trainer.init_from unset); drop the override")
    return _load(args.recipe, [*args.overrides, f"model.path={args.model}", "trainer.init_from=null"])


def _eval_recipe(args) -> int:
    """``relayrl eval --model DIR --recipe RECIPE [key=value ...]``: the config's held-out set, evaluated as its
    training run evaluates it (``relayrl.workflows.heldout.evaluate_config``)."""
    cfg = _eval_recipe_config(args)  # before torch is imported: a bad key is refused in about a second
    out = _eval_out(Path(args.out))
    from relayrl.models.load import check_model_dir
    from relayrl.workflows.heldout import check_evaluable, evaluate_config

    check_evaluable(cfg)
    check_model_dir(args.model, "--model", f"--model {args.model}")  # (named as given, not as model.path)
    t0 = time.perf_counter()
    d = cfg.data
    extra = {"recipe": str(args.recipe), "overrides": list(args.overrides), "task": d.task,
             "data": d.eval_path or d.path or d.hf_name, "env": cfg.env.name, "k": cfg.eval.k}
    metrics = evaluate_config(cfg, out, extra=extra, log=lambda line: print(line, flush=True))
    _print_metrics(metrics)
    print(f"relayrl eval: report {out / 'eval.json'}, samples {out / 'eval_samples.jsonl'} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


def cmd_eval(args) -> int:
    from relayrl.config.loader import ConfigError

    if args.recipe is not None:
        return _eval_recipe(args)
    if args.overrides:
        raise ConfigError(f"relayrl eval: {args.overrides[0]!r}: dotted overrides set a run config's keys; give "
                          f"the config with --recipe RECIPE (or drop them)")
    for dest, (default, _) in EVAL_FLAGS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    template = _eval_template(args.chat_template)
    import torch

    from relayrl.data.tasks import make_task
    from relayrl.engines.generation.native import NativeGenerationEngine
    from relayrl.engines.reward import RewardConfig, RewardEngine
    from relayrl.evaluation.runner import evaluate, write_report
    from relayrl.models.load import load_model, load_tokenizer

    if (args.task is None) == (args.data is None):
        raise ConfigError("relayrl eval: give exactly one of --task NAME, --data FILE or --recipe RECIPE")
    if args.user_fn is not None and (args.verifier != "user" or args.task is not None):
        raise ConfigError("relayrl eval: --user-fn scores --data with --verifier user; add --verifier user "
                          "(a --task is scored by its own checker)")
    if args.verifier == "user" and args.user_fn is None and args.data is not None:
        raise ConfigError("relayrl eval: --verifier user needs --user-fn, e.g. --user-fn my_rewards.py:score")
    if args.k > 1 and args.temperature == 0:
        raise ConfigError(f"relayrl eval: --k {args.k} samples at --temperature 0 are {args.k} copies of the greedy "
                          f"answer; give --temperature > 0 (e.g. 1.0) or --k 1")
    task_options = _json_object("--task-options", args.task_options, '{"min_digits": 3}')
    template_kwargs = _json_object("--chat-template-kwargs", args.chat_template_kwargs, '{"enable_thinking": false}')
    try:
        from relayrl.data.config import check_template_kwargs

        check_template_kwargs(template_kwargs)
    except ValueError as e:
        raise ConfigError(f"relayrl eval: --chat-template-kwargs: {e}") from None
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"relayrl eval: --device {args.device} but torch sees no GPU here; give --device cpu "
                          f"(or auto)")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.user_weights is not None and args.user_fn is None:
        raise ConfigError("relayrl eval: --user-weights weighs the --user-fn functions; give --user-fn")
    # (before --out is touched)
    reward_cfg = _eval_reward(args.verifier, args.user_fn, args.user_weights) if args.data else None
    out = _eval_out(Path(args.out))
    if args.task:  # the problems first: a bad task or data file is refused before the model loads
        try:
            task = make_task(args.task, **task_options, eval_size=args.size)
        except ValueError as e:
            raise ConfigError(f"relayrl eval: --task {args.task} --task-options {args.task_options or '{}'}: {e}") from None
        problems = task.eval_set()
        reward = RewardEngine(RewardConfig(verifier="task"), task=task)
    else:
        from relayrl.data.datasets import DatasetConfig, load_problems

        problems = _eval_data(args, DatasetConfig, load_problems)
        reward = RewardEngine(reward_cfg, task=None)
        reward.check_fields([problems[0].meta.get("fields")])  # a field the user function needs, before the model
        reward.check_standalone()
    from relayrl.data.prompts import encode_prompt
    from relayrl.data.lengths import PromptRoom, context_limit, fit_prompts

    from relayrl.models.load import check_model_dir

    check_model_dir(args.model, "--model", f"--model {args.model}")
    tok = load_tokenizer(args.model, chat_template=template)
    ids: dict[str, list[int]] = {}

    def encode(p) -> list[int]:
        if p.prompt not in ids:
            ids[p.prompt] = list(encode_prompt(tok, p, None, template_kwargs))
        return ids[p.prompt]

    limit = context_limit(args.model)
    if limit is not None:  # as relayrl train: every prompt and --max-new-tokens fit the context, before the model loads
        room = PromptRoom(budget=args.max_new_tokens, key="--max-new-tokens", limit=limit, model=args.model,
                          drop="--long-prompts drop")
        problems = fit_prompts(problems, encode, room, drop=args.long_prompts == "drop", what="evaluation",
                               log=lambda line: print(line, flush=True))
    budget = _eval_think_budget(tok, args.think_budget, args.max_new_tokens)
    engine = NativeGenerationEngine(load_model(args.model, dtype=args.dtype, device=device, attn_implementation="auto"),
                                    tok, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    if budget is None:
        def generate(p, sp):
            return engine.generate(p, sp, generator=gen)
    else:
        from relayrl.engines.generation.interrupt import generate_interrupted

        def generate(p, sp):
            return generate_interrupted(engine, p, sp, budget, generator=gen)

    def score(prompts, responses, answers, columns, extra):  # (log_extra columns, a verl dict's extras: samples)
        return reward.score_each(prompts, responses, answers, columns=columns, extra=extra)[0]

    result = evaluate(generate, encode, problems, score,
                      max_new_tokens=args.max_new_tokens, k=args.k, temperature=args.temperature,
                      interrupted=budget is not None, decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    data = args.data[0] if args.data and len(args.data) == 1 else args.data  # (one file: its path, as before)
    report, samples = write_report(result, out, extra={"model": args.model, "task": args.task, "data": data,
                                                       "k": args.k, "temperature": args.temperature})
    _print_metrics(result.metrics)
    print(f"relayrl eval: report {report}, samples {samples}")
    return 0


def _eval_think_budget(tokenizer, after: int | None, max_new_tokens: int):
    """``relayrl eval --think-budget``'s interruption (rollout.interrupt's defaults: ScaleRL's phrase, the
    answer in what ``--max-new-tokens`` leaves), refused before the model loads when it does not fit."""
    if after is None:
        return None
    from relayrl.config.interrupt import InterruptConfig
    from relayrl.config.loader import ConfigError
    from relayrl.engines.generation.interrupt import InterruptError, build_interrupt

    it = InterruptConfig(after_tokens=after)
    try:
        return build_interrupt(tokenizer, after_tokens=after, text=it.text, answer_tokens=None, marker=it.marker,
                               max_new_tokens=max_new_tokens, budget_key="--max-new-tokens", after_key="--think-budget")
    except InterruptError as e:
        raise ConfigError(f"relayrl eval: {e}") from None


def _json_object(flag: str, text: str | None, example: str) -> dict:
    """``relayrl eval``'s JSON-object option ``flag`` (``{}`` when not given); a ConfigError otherwise."""
    from relayrl.config.loader import ConfigError

    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"relayrl eval: {flag} is not valid JSON ({e.msg} at column {e.colno}); write e.g. "
                          f"{flag} '{example}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"relayrl eval: {flag} must be a JSON object, got {text!r}; write e.g. {flag} '{example}'")
    return value


def _eval_template(value: str | None) -> str | None:
    """``relayrl eval --chat-template``'s text (as model.chat_template reads it), refused before the model loads."""
    from relayrl.config.loader import ConfigError
    from relayrl.models.chat_template import read_chat_template

    try:
        return None if value is None else read_chat_template(value)
    except ValueError as e:
        raise ConfigError(f"relayrl eval: --chat-template: {e}") from None


def _eval_data(args, DatasetConfig, load_problems) -> list:
    """``relayrl eval --data FILE [FILE ...]``: each file's first ``--size`` rows (several files: every metric
    also per source, as a run's data.eval_path list gives them; an error names the file)."""
    from relayrl.data.errors import DatasetError

    problems = []
    for path in args.data:
        try:
            ds = DatasetConfig(path=path, prompt_key=args.prompt_key, answer_key=args.answer_key, format=args.format,
                               raw_answers=args.user_fn is not None)  # (a --user-fn's ground truths: as stored)
            problems += load_problems(ds)[: args.size]
        except DatasetError as e:
            if len(args.data) == 1:
                raise
            raise DatasetError(f"relayrl eval: --data {path}: {e}") from None
    return problems


def _print_metrics(metrics: dict[str, float]) -> None:
    width = max(20, *map(len, metrics))
    for k, v in metrics.items():
        print(f"{k:>{width}s}  {v:.4f}")


def cmd_plot(args) -> int:
    from relayrl.telemetry.plots import plot_run

    paths = plot_run(Path(args.run_dir), warn=lambda note: print(f"relayrl plot: warning: {note}", file=sys.stderr))
    for p in paths:
        print(p)
    return 0


def cmd_serve(args) -> int:
    """An OpenAI-compatible server over the native engine (``relayrl.serving``)."""
    from relayrl.serving.protocol import ServeLimits
    from relayrl.serving.server import serve

    key = _api_key(args.api_key_file)
    limits = ServeLimits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens, max_n=args.max_n,
                         max_waiting=args.max_waiting, body_timeout_s=args.body_timeout_s,
                         weight_load_timeout_s=args.weight_load_timeout_s)
    serve(args.model_dir, host=args.host, port=args.port, api_key=key, limits=limits, max_batch=args.max_batch,
          dtype=args.dtype, device=args.device, seed=args.seed, threads=args.threads, name=args.name,
          generation_config=args.generation_config)
    return 0


def _api_key(path: str | None) -> str | None:
    """The bearer token: from ``--api-key-file``, else ``RELAYRL_API_KEY``, else none."""
    import os

    from relayrl.serving.server import ServeError

    if path:
        key = Path(path).read_text().strip()
        if not key:
            raise ServeError(f"--api-key-file {path} is empty; write the token into it")
        return key
    return os.environ.get("RELAYRL_API_KEY") or None


def cmd_dock(args) -> int:
    """The dock's service API for external producers and consumers (``relayrl.serving.dockapi``)."""
    from relayrl.serving.dockapi import serve_dock

    serve_dock(host=args.host, port=args.port, api_key=_api_key(args.api_key_file), units=args.units,
               lease_s=args.lease_s, max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relayrl", description="RL post-training of LLMs as a distributed dataflow")
    p.add_argument("--debug", action="store_true", help="show the traceback of every error (also: RELAYRL_DEBUG=1)")
    p.add_argument("--version", action="version", version=f"relayrl {__version__}")
    common = argparse.ArgumentParser(add_help=False)  # --debug after the command too; SUPPRESS keeps the first
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train", parents=[common], help="run a recipe (a file, or a shipped recipe's name): relayrl train arith_grpo trainer.steps=3 "
        "run.dir=/tmp/x")
    t.add_argument("recipe", help="a recipe file, or the name of a shipped one (arith_grpo, arith_sft, ...)")
    t.add_argument("overrides", nargs="*", help="dotted.key=value")
    t.add_argument("--print-config", action="store_true", help="print the validated config as YAML (every key, "
                   "defaults included; a recipe of its own) and the step's plan, and exit without training")
    t.set_defaults(fn=cmd_train)

    d = sub.add_parser(
        "demo", parents=[common], help="pretrain, SFT on a careless teacher, then GRPO on the built-in arithmetic task")
    d.add_argument("--dir", default=None, help="run directories (default runs/demo, or runs/demo-tools with --tools)")
    d.add_argument("--tools", action="store_true", help="the tool demo: SFT on calculator episodes, then GRPO on "
                   "multi-turn episodes (recipes/toolsum_*.yaml)")
    d.add_argument("--base", dest="overrides_base", action="append", default=[], help="override for the pretraining stage")
    d.add_argument("--sft", dest="overrides_sft", action="append", default=[], help="override for the SFT stage")
    d.add_argument("--grpo", dest="overrides_grpo", action="append", default=[], help="override for the GRPO stage")
    d.set_defaults(fn=cmd_demo)

    e = sub.add_parser(
        "eval", parents=[common], help="greedy accuracy, pass@k, avg@k of a model on a task or dataset, or on a run "
        "config's held-out set as its training run evaluates it (--recipe: multi-turn episodes too)")
    e.add_argument("--model", required=True, help="local Hugging Face model directory")
    e.add_argument("--recipe", help="a run's recipe (a file, or a shipped recipe's name) and dotted overrides after "
                   "it: its held-out set, environment (env.*), reward, prompts and lengths (eval.*, rollout.*), "
                   "evaluated as its training run does, with --model as model.path; the options below are then "
                   "the config's keys")
    e.add_argument("overrides", nargs="*", help="with --recipe: dotted.key=value (e.g. eval.size=50 eval.k=4)")
    e.add_argument("--task", help=f"built-in task: {', '.join(builtin_tasks())}")
    e.add_argument("--task-options", help='JSON options of the task, e.g. \'{"min_digits": 3, "max_digits": 3}\'')
    e.add_argument("--data", nargs="+", help="JSONL or Parquet file with prompt and answer fields; several: each "
                   "file's first --size rows, every metric also per file as eval/<metric>/<source>")
    e.add_argument("--format", choices=["jsonl", "parquet"], help="format of --data (default: from its suffix)")
    e.add_argument("--prompt-key", help="(default prompt)")
    e.add_argument("--answer-key", help="(default answer)")
    e.add_argument("--verifier", choices=["math", "exact", "user"],
                   help="verifier for --data (default math; user: the function --user-fn, as reward.user_fn)")
    e.add_argument("--user-fn", nargs="+", help="with --verifier user: my_rewards.py:score or "
                   "my_pkg.rewards:score, score(prompts, responses, answers, **fields) -> list[float] or a TRL "
                   "reward function (as reward.user_fn); several: their weighted sum (--user-weights)")
    e.add_argument("--user-weights", nargs="+", type=float, help="a weight per --user-fn function (default 1 each)")
    e.add_argument("--size", type=argtypes.int_at_least(1),
                   help="prompts to evaluate (default 200; with several --data files, of each)")
    e.add_argument("--k", type=argtypes.int_at_least(1),
                   help="samples per prompt for pass@k / avg@k (default 1: greedy only)")
    e.add_argument("--temperature", type=argtypes.non_negative_float,
                   help="sampling temperature of the k samples (default 1.0)")
    e.add_argument("--max-new-tokens", type=argtypes.int_at_least(1), help="(default 16)")
    e.add_argument("--long-prompts", choices=["fail", "drop"],
                   help="a prompt that the model's context cannot hold beside --max-new-tokens: fail (default) "
                   "names the first such row; drop leaves those rows out (a line says how many)")
    e.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="(default float32)")
    e.add_argument("--device", type=argtypes.device, help="(default auto)")
    e.add_argument("--seed", type=int, help="(default 0)")
    e.add_argument("--chat-template", help="render chat prompts with this template instead of the model's, as "
                   "model.chat_template does: a Jinja file, a tokenizer directory or the template itself")
    e.add_argument("--chat-template-kwargs", help="JSON variables for the chat template, as data.chat_template_kwargs: "
                   "e.g. '{\"enable_thinking\": false}'")
    e.add_argument("--think-budget", type=argtypes.int_at_least(1),
                   help="a thinking budget (as rollout.interrupt.after_tokens): an answer still thinking after this "
                   "many tokens (no </think> yet) gets ScaleRL's end-of-thinking phrase and answers in what "
                   "--max-new-tokens leaves; eval/interrupted_frac says how often")
    e.add_argument("--out", default="runs/eval", help="directory for eval.json and eval_samples.jsonl")
    e.set_defaults(fn=cmd_eval)

    sv = sub.add_parser(
        "serve", parents=[common], help="OpenAI-compatible HTTP server over the native engine: relayrl serve MODEL_DIR")
    sv.add_argument("model_dir", help="local Hugging Face model directory")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (not loopback: needs a bearer token)")
    sv.add_argument("--port", type=argtypes.port, default=8000, help="0: any free port (printed at start)")
    sv.add_argument("--api-key-file", help="file holding the bearer token clients must send (or set RELAYRL_API_KEY)")
    sv.add_argument("--name", help="model name clients ask for (default: the directory's name)")
    sv.add_argument("--max-batch", type=argtypes.int_at_least(1), default=64, help="sequences decoded together")
    sv.add_argument("--max-tokens", type=argtypes.int_at_least(1), default=1024, help="largest max_tokens of a request")
    sv.add_argument("--max-n", type=argtypes.int_at_least(1), default=16, help="largest n of a request")
    sv.add_argument("--max-body-bytes", type=argtypes.int_at_least(1024), default=1 << 20, help="largest request body")
    sv.add_argument("--body-timeout-s", type=argtypes.positive_float, default=60.0,
                    help="seconds to receive a request body before 408 (weights payloads: 600)")
    sv.add_argument("--weight-load-timeout-s", type=argtypes.positive_float, default=600.0,
                    help="seconds a weight load may take to apply (the running batch drains first) before 503")
    sv.add_argument("--max-waiting", type=argtypes.int_at_least(1), default=1024, help="queued requests before 503")
    sv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    sv.add_argument("--generation-config", choices=["auto", "none"], default="auto", help="auto: a request that "
                    "leaves temperature, top_p, top_k, min_p or repetition_penalty out takes the model's "
                    "generation_config.json value, as vllm serve does; none: OpenAI's defaults")
    sv.add_argument("--device", type=argtypes.device, default="auto")
    sv.add_argument("--seed", type=int, default=0, help="seed of unseeded requests' sampling")
    sv.add_argument("--threads", type=argtypes.int_at_least(0), default=0, help="torch CPU threads (0: all cores)")
    sv.set_defaults(fn=cmd_serve)

    dk = sub.add_parser(
        "dock", parents=[common], help="the dock's service API (put prompts/experience, lease, ack, weight notices)")
    dk.add_argument("--host", default="127.0.0.1", help="address to bind (not loopback: needs a bearer token)")
    dk.add_argument("--port", type=argtypes.port, default=8100, help="0: any free port (printed at start)")
    dk.add_argument("--api-key-file", help="file holding the bearer token clients must send (or set RELAYRL_API_KEY)")
    dk.add_argument("--units", type=argtypes.int_at_least(1), default=1, help="storage units")
    dk.add_argument("--lease-s", type=argtypes.non_negative_float, default=60.0, help="seconds before a lease is re-delivered")
    dk.add_argument("--max-body-bytes", type=argtypes.int_at_least(1024), default=256 << 20, help="largest put")
    dk.add_argument("--body-timeout-s", type=argtypes.positive_float, default=300.0,
                    help="seconds to receive a request body before 408")
    dk.set_defaults(fn=cmd_dock)

    pl = sub.add_parser(
        "plot", parents=[common], help="PNG figures, stage timeline and trace.json of a run directory")
    pl.add_argument("run_dir")
    pl.set_defaults(fn=cmd_plot)

    from relayrl.planner.cli import add_parser as add_plan

    add_plan(sub, common)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the command inside the CLI's error boundary (``relayrl.cli.boundary``)."""
    args = parse_args(argv)
    from relayrl.cli.boundary import debug_requested, run_guarded

    return run_guarded(args.fn, args, debug=debug_requested(getattr(args, "debug", False)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's namespace: its flags, and the dotted overrides wherever they stand (after an option
    too). Unknown arguments exit with argparse's usage error (2), with the relayrl key of a peer's flag where
    one is known."""
    from relayrl.cli.hints import refuse, unknown_flags

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    command, overrides, unknown, values = unknown_flags(parser, argv)
    if unknown:  # (named before argparse's "the following arguments are required", which it reports first)
        refuse(parser, command, overrides, unknown, values, with_values=True)
    args, extra = parser.parse_known_args(argv)
    if extra:  # dotted overrides after an option (argparse takes a positional list in one piece)
        if not hasattr(args, "overrides") or any("=" not in x or x.startswith("-") for x in extra):
            # (the next argument is the flag's value unless it is a flag or an override itself)
            values = [v if not v.startswith("-") and "=" not in v else None for v in extra[1:]] + [None]
            refuse(parser, getattr(args, "command", None), hasattr(args, "overrides"), extra, values)
        args.overrides = [*args.overrides, *extra]
    return args


if __name__ == "__main__":
    sys.exit(main())
