"""The ``python benchmarks/X.py ...`` commands the docs show name scripts that exist and flags their parsers know.
Each command, in a fenced block or an inline code span (a span may run over a line break), is handed to its
script's own ``argparse`` parser: the script runs as ``__main__`` until it has parsed its arguments and is stopped
there, so a renamed or removed flag fails here, not on the first try of a reader repeating a record. ``DIR``-like
placeholders stay as written (they are values, not flags); ``...`` is dropped and a ``# comment`` cut."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `python benchmarks/x.py ...` in a code span, or a code block's line starting with it (a `\` continuation joined)
_PYTHON = r"(?:[\w./-]*/)?python3?"  # (python, python3, .venv/bin/python)
# (a span without the interpreter counts when it has arguments: `benchmarks/gpu.py --only big`)
_SPAN = re.compile(rf"`{_PYTHON} (benchmarks/\w+\.py)([^`]*)`|`(benchmarks/\w+\.py)(\s-[^`]*)`")
_LINE = re.compile(rf"^\s*{_PYTHON} (benchmarks/\w+\.py)((?:[^\n]*\\\n)*[^\n]*)$", re.M)


def shown_commands(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number, script path, arguments) of each ``python benchmarks/...`` command on a page (``python3``
    or a venv's python too)."""
    out = []
    for pattern in (_SPAN, _LINE):
        for m in pattern.finditer(text):
            script, rest = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            rest = rest.replace("\\\n", " ").replace("\n", " ")
            args = [a for a in shlex.split(rest, comments=True) if a != "..."]
            out.append((text.count("\n", 0, m.start()) + 1, script, args))
    return sorted(out)


CASES = [pytest.param(script, args, id=f"{page.name}:{line}")
         for page in PAGES for line, script, args in shown_commands(page.read_text())]


def test_the_pages_show_benchmark_commands():
    # (the extraction itself: a change of the pages' format that finds nothing would pass every case below)
    assert len(CASES) >= 25
    scripts = {c.values[0] for c in CASES}
    assert scripts >= {"benchmarks/async_flow.py", "benchmarks/gpu.py", "benchmarks/planner_validation.py",
                       "benchmarks/pref_losses.py", "benchmarks/serve_load.py"}
    spanning = [c for c in CASES if c.values[0] == "benchmarks/planner_validation.py"]
    assert ["--repeats", "1"] in [c.values[1] for c in spanning]  # (a span broken over two lines of the page)


class _Parsed(Exception):
    pass


def parses(script: str, args: list[str], monkeypatch) -> argparse.Namespace:
    """The namespace ``script``'s parser makes of ``args`` (SystemExit: it refuses them)."""
    path = ROOT / script
    assert path.is_file(), f"{script}: no such script"
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, argv=None, namespace=None):
        raise _Parsed(original(self, argv, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])  # (as `python benchmarks/x.py` starts)
    try:
        runpy.run_path(str(path), run_name="__main__")
    except _Parsed as parsed:
        return parsed.args[0]
    except ModuleNotFoundError as e:  # a benchmark-only peer this environment lacks (ray, trl, ...): not a doc fault
        if e.name is None or e.name.split(".")[0] == "relayrl" or (path.parent / f"{e.name}.py").exists():
            raise
        pytest.skip(f"{script} imports {e.name}, which is not installed here")
    raise AssertionError(f"{script} ran to its end without parsing its arguments")


@pytest.mark.parametrize(("script", "args"), CASES)
def test_a_documented_benchmark_command_parses(script, args, monkeypatch, capsys):
    try:
        parses(script, args, monkeypatch)
    except SystemExit:
        pytest.fail(f"python {script} {' '.join(args)}: the script refuses its arguments\n{capsys.readouterr().err}")


def test_a_stale_flag_in_a_shown_benchmark_command_fails(monkeypatch):
    page = ("Run `python benchmarks/retire.py --steps 3 --stepz 4` or\n```\npython benchmarks/retire.py \\\n"
            "  --steps 5   # a comment\n```\n`.venv/bin/python benchmarks/retire.py\n--seed 2`, as\n"
            "`benchmarks/retire.py --rows 8` does; `benchmarks/retire.py` is a name, not a command\n")
    assert shown_commands(page) == [(1, "benchmarks/retire.py", ["--steps", "3", "--stepz", "4"]),
                                    (3, "benchmarks/retire.py", ["--steps", "5"]),
                                    (6, "benchmarks/retire.py", ["--seed", "2"]),
                                    (8, "benchmarks/retire.py", ["--rows", "8"])]
    assert parses("benchmarks/retire.py", ["--steps", "5"], monkeypatch).steps == 5
    with pytest.raises(SystemExit):
        parses("benchmarks/retire.py", ["--steps", "3", "--stepz", "4"], monkeypatch)
    with pytest.raises(AssertionError, match="no such script"):
        parses("benchmarks/nope.py", [], monkeypatch)


def session_commands(tmp_path, **env) -> list[list[str]]:
    """The commands ``benchmarks/gpu_session.sh`` runs for ``env`` (its ``DRY=1`` mode prints them), each from its
    ``python3`` on."""
    import os
    import subprocess

    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "DRY": "1", "OUT": str(tmp_path), **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [shlex.split(ln) for ln in proc.stdout.splitlines() if not ln.startswith("==")]
    return [argv[argv.index("python3"):] for argv in lines if "python3" in argv]


def test_the_gpu_session_script_calls_its_benchmarks_with_flags_they_know(tmp_path, monkeypatch, capsys):
    commands = session_commands(tmp_path, PARTS="flex train decode profile moe", OLD=".", AUTOTUNE="1",
                                TRACE="1", HF="1")
    scripts = [c for c in commands if c[1].endswith(".py")]
    assert len(scripts) == 7 and {Path(c[1]).name for c in scripts} == {"gpu.py", "routing_replay.py"}
    for _, script, *args in scripts:
        try:
            parses(str(Path(script)), args, monkeypatch)  # (./benchmarks/gpu.py: OLD=. is this tree)
        except SystemExit:
            pytest.fail(f"gpu_session.sh: python3 {script} {' '.join(args)}: refused\n{capsys.readouterr().err}")


def test_the_gpu_page_and_the_session_script_run_the_same_cuda_test_files(tmp_path):
    (pytest_call,) = [c for c in session_commands(tmp_path, PARTS="tests") if c[1:3] == ["-m", "pytest"]]
    session = {a for a in pytest_call if a.endswith(".py")}
    page = (ROOT / "docs" / "gpu.md").read_text()
    shown = re.search(r"```bash\n(python -m pytest [^`]*)```", page).group(1).replace("\\\n", " ")
    assert {a for a in shlex.split(shown) if a.endswith(".py")} == session
    # every test file with a test that skips without CUDA is among them
    marker = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")
    cuda = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if marker.search(p.read_text())}
    assert cuda and cuda <= session, f"CUDA tests outside the session's files: {sorted(cuda - session)}"
