"""Helpers of the end-to-end tests: run the CLI on the tiny model and read a run's metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
FAST = ["eval.size=16", "run.threads=1", "telemetry.sinks=[jsonl]", "model.tiny.hidden_size=64",
        "model.tiny.intermediate_size=256"]


SUBPROCESS_ENV = "RELAYRL_TEST_CLI_SUBPROCESS"
"""Set to 1: every run is ``python -m relayrl.cli.main`` in a fresh interpreter, as a user starts it."""


def relayrl(*args: str, timeout: float = 600, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """``relayrl ARGS`` as a process of its own, from the repository root; its exit code, stdout and stderr.

    The process is forked from a server that imported torch and transformers once for the whole test session
    (the imports take ~10 s of the ~14 s of a one-step run here), and then runs the CLI's ``main`` as
    ``python -m relayrl.cli.main`` does, in this process's environment of now. The tests that are about the
    interpreter's start (signals, process groups) start it with ``subprocess``. ``env``: variables set for
    this run on top of this process's environment (None: unset)."""
    env = {k: v for k, v in {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}.items() if v is not None}
    if os.environ.get(SUBPROCESS_ENV) == "1":
        return subprocess.run([sys.executable, "-m", "relayrl.cli.main", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, env=env)
    import multiprocessing
    import tempfile

    from relayrl.cluster.local import PRELOAD

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, "relayrl.cli.main"])  # (the first caller's list is the server's)
    with tempfile.TemporaryDirectory(prefix="relayrl-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = ctx.Process(target=_cli_main, args=(list(args), str(ROOT), env, str(out), str(err)), daemon=False)
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["relayrl", *args], timeout, out.read_text(), err.read_text())
        # (-N: killed by signal N, as subprocess says it)
        return subprocess.CompletedProcess(["relayrl", *args], proc.exitcode, out.read_text(), err.read_text())


def _cli_main(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """The forked process: this directory and environment, stdout and stderr to files, then the CLI, and the
    exit an interpreter makes (its ``atexit`` functions: Ray's shutdown, for one)."""
    import atexit
    import traceback

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["relayrl", *args]
    try:
        from relayrl.cli.main import main

        code = main(args)
    except SystemExit as e:  # argparse's errors, as the interpreter turns them into an exit code
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def once_per_session(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """``tmp/NAME``, made by ``build(path)`` once for the whole test session: pytest-xdist's workers share
    their session's temporary root, and a lock there lets the first one build while the others wait for it
    (the pytest-xdist docs' recipe for a session fixture run once; filelock comes with torch). After a build
    that raised, the next caller clears what it left and builds again."""
    import shutil

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            done.touch()
    return path
