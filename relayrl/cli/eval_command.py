"""``relayrl eval``: a model's greedy accuracy, pass@k and avg@k on a built-in task or dataset files
(:func:`cmd_eval`), or on a run config's held-out set as its training run evaluates it (``--recipe``). Every option
is checked (the output directory, the reward functions, the JSON options, the chat template, the thinking budget,
prompts that do not fit the context) before the model loads."""

from __future__ import annotations

import json
import time
from pathlib import Path

from relayrl.cli import argtypes
from relayrl.config.eval_flags import EVAL_FLAGS

__all__ = ["cmd_eval"]


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
    from relayrl.config.loader import ConfigError, load_run_config

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
    return load_run_config(args.recipe, [*args.overrides, f"model.path={args.model}", "trainer.init_from=null"])


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

    from relayrl.data.tasks import make_task, task_option_error
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
    for dest in ("top_p", "top_k", "min_p"):  # (as eval.top_p and the others with eval.k=1)
        flag, off = "--" + dest.replace("_", "-"), EVAL_FLAGS[dest][0]
        if args.k == 1 and getattr(args, dest) != off:
            raise ConfigError(f"relayrl eval: {flag} {getattr(args, dest)} filters the --k samples, and --k 1 "
                              f"evaluates the greedy answer only: give --k > 1 (e.g. 8) or drop {flag}")
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
        if (why := task_option_error(task_options, "--task-options", flag=True)) is not None:
            raise ConfigError(f"relayrl eval: {why}")
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
                      top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                      interrupted=budget is not None, decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    data = args.data[0] if args.data and len(args.data) == 1 else args.data  # (one file: its path, as before)
    report, samples = write_report(result, out, extra={"model": args.model, "task": args.task, "data": data,
                                                       "k": args.k, "temperature": args.temperature,
                                                       "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p})
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
