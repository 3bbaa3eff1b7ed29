"""The handlers of ``relayrl train | demo | plot | serve | dock``: each takes the parsed namespace and returns the
exit status (the parser is :mod:`relayrl.cli.parser`'s, ``relayrl eval`` is :mod:`relayrl.cli.eval_command`'s). Torch
is imported inside a handler, never here, so the parser stays quick."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from relayrl.config.loader import SHIPPED

__all__ = ["DEMO_MARK", "RECIPES", "cmd_demo", "cmd_dock", "cmd_plot", "cmd_serve", "cmd_train", "resolved_config"]

RECIPES = SHIPPED  # the demo's stages


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
    from relayrl.checkpoint.rundir import check_run_dir, release_run_dir

    for i, (name, recipe, _, overrides) in enumerate(stages):  # every stage's mistakes before the first trains
        init = [f"trainer.init_from={root / stages[i - 1][0] / 'model'}"] if i else []
        cfg = _load(str(RECIPES / recipe), [f"run.dir={root / name}", *init, *overrides])
        # another run in a later stage's way: refused now, not minutes on; one the demo replaces is checked as one
        # moved aside is (run.overwrite), so that a live run there (another demo's) is refused, not deleted
        check_run_dir(root / name, cfg.run.resume, cfg.run.overwrite or _demo_owns(args, root / name))
    _hold_demo_root(root)
    try:
        return _run_stages(args, root, stages, t0)
    finally:
        release_run_dir(root)


def _hold_demo_root(root: Path) -> None:
    """One demo at a time in ``root``: two started together both pass the stage checks, then each would replace
    the stage the other trains in. The second to take ``root``'s lock is refused, naming the first."""
    from relayrl.checkpoint.rundir import RunDirError, hold_run_dir, lock_holder

    try:
        hold_run_dir(root)
    except RunDirError:
        raise RunDirError(f"relayrl demo: {root} is in use by another demo or run ({lock_holder(root) or 'gone'}); "
                          f"wait for it to finish, or give this demo another --dir") from None


def _run_stages(args, root: Path, stages, t0: float) -> int:
    from relayrl.checkpoint.rundir import check_run_dir

    model, rl_min, held_out = None, 0.0, 0
    for i, (name, recipe, what, overrides) in enumerate(stages, 1):
        print(f"relayrl demo: {i}/{len(stages)} {what} (recipes/{recipe})", flush=True)
        init = [f"trainer.init_from={model}"] if model else []
        cfg = _load(str(RECIPES / recipe), [f"run.dir={root / name}", *init, *overrides])
        # A second demo replaces the first one's runs: the stage directories a demo made (marked), and those of
        # the default root. Any other run in the way (`--dir runs` beside the quickstart's runs/sft) is left to
        # the run directory's checks, which refuse it (run.overwrite=true moves it aside).
        if cfg.run.resume == "never" and _demo_owns(args, root / name) and (root / name / "config.json").is_file():
            check_run_dir(root / name, "never", True)  # (a run started there since the demo's checks: refused)
            print(f"relayrl demo: replacing the previous demo run in {root / name}", flush=True)
            shutil.rmtree(root / name)
        (root / name).mkdir(parents=True, exist_ok=True)  # (marked before it trains: a demo stopped in this stage
        (root / name / DEMO_MARK).touch()  # is replaced by the next one, not refused as another run)
        t = time.perf_counter()
        try:
            model = _run(cfg)
        except KeyboardInterrupt as e:
            raise _demo_interrupted(e, root / name, f"{i}/{len(stages)}") from None
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


def _demo_interrupted(e: KeyboardInterrupt, stage_dir: Path, stage: str) -> KeyboardInterrupt:
    """A demo stopped in a stage that wrote no checkpoint: the run's own message says to run "the same
    command" with run.overwrite=true, which a demo does not take; the next demo replaces the partial run."""
    from relayrl.checkpoint.manager import CheckpointManager
    from relayrl.workflows.session import RunInterrupted

    if not isinstance(e, RunInterrupted) or CheckpointManager(stage_dir / "checkpoints").latest() is not None:
        return e
    return RunInterrupted(f"relayrl demo: interrupted in stage {stage} ({stage_dir}) before it wrote a checkpoint; "
                          f"run the same relayrl demo command again to start the demo over (it replaces the "
                          f"partial run there)")


def _demo_owns(args, stage_dir: Path) -> bool:
    """Whether a demo may replace the run in ``stage_dir``: one a demo made (marked), or any under the default
    root (``runs/demo``); another run there is left to the run directory's checks."""
    return args.dir is None or (stage_dir / DEMO_MARK).is_file()


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
