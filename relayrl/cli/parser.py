"""The ``relayrl`` command line: the parser of every subcommand (:func:`build_parser`; ``relayrl plan``'s is
:mod:`relayrl.planner.cli`'s) and :func:`parse_args`, which takes dotted overrides wherever they stand and refuses
an unknown flag naming the relayrl key of a peer's. Each subcommand's handler is set as its ``fn``."""

from __future__ import annotations

import argparse
import sys

from relayrl import __version__
from relayrl.cli import argtypes
from relayrl.cli.commands import cmd_demo, cmd_dock, cmd_plot, cmd_serve, cmd_train
from relayrl.cli.eval_command import cmd_eval

__all__ = ["build_parser", "builtin_tasks", "parse_args"]


def builtin_tasks() -> list[str]:
    """The built-in task names, from the registry ``make_task`` reads (its error lists the same ones)."""
    from relayrl.data.tasks import EXTRA_TASKS, TASKS  # (no torch: the parser stays quick)

    return sorted([*TASKS, *EXTRA_TASKS])


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
    e.add_argument("--top-p", type=argtypes.fraction(zero=False),
                   help="nucleus sampling of the k samples, as eval.top_p (default 1.0: off)")
    e.add_argument("--top-k", type=argtypes.top_k, help="sample the k samples among the top-k tokens, as eval.top_k "
                   "(default 0: off)")
    e.add_argument("--min-p", type=argtypes.fraction(zero=True),
                   help="min-p sampling of the k samples, as eval.min_p (default 0.0: off)")
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
