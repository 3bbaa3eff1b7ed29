"""The documentation cannot drift from the code: the config reference is the schema's, every metric the code
logs is named on the metrics page, the README's links resolve, and the site builds with ``mkdocs build
--strict`` (a broken link or anchor, or a page missing from the navigation, fails)."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _gen():
    spec = importlib.util.spec_from_file_location("relayrl_docs_gen_reference", DOCS / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_config_reference_is_generated_from_the_schema():
    gen = _gen()
    committed = (DOCS / "reference" / "config.md").read_text()
    assert committed == gen.render_config_reference(), (
        "docs/reference/config.md differs from the schema: run `python docs/gen_reference.py` (or `make docs`) "
        "and commit the page")


def test_every_config_key_is_in_the_config_reference():
    gen = _gen()
    page = (DOCS / "reference" / "config.md").read_text()
    keys = gen.config_keys()
    assert len(keys) > 150  # the walk reaches the nested sections (model.lora.r, reward.judge.path, ...)
    for key in ("run.dir", "model.lora.r", "reward.judge.path", "engine.optim.lr", "env.sandbox.memory_mb",
                "trainer.off_policy_steps", "workflow"):
        assert key in keys
    missing = [k for k in keys if f"`{k}`" not in page]
    assert not missing, f"config keys missing from docs/reference/config.md: {missing}"


def test_every_config_key_has_a_description():
    page = (DOCS / "reference" / "config.md").read_text()
    bare = [line.split("|")[1].strip() for line in page.splitlines()
            if line.startswith("| `") and not line.rstrip().rstrip("|").rsplit("|", 1)[-1].strip()]
    assert not bare, f"config keys without a description (Field(description=...)): {bare}"


def test_config_reference_row_has_type_default_and_allowed_values():
    page = (DOCS / "reference" / "config.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `run.on_nonfinite` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "str" and cells[2] == "`stop`" and cells[3] == "`stop`, `skip`" and "NaN" in cells[4]
    row = next(line for line in page.splitlines() if line.startswith("| `rollout.n` |"))
    assert "`8`" in row and ">= 1" in row


def _documented_patterns(page: str) -> set[str]:
    """Backticked metric names on the page, with ``<name>`` fields and ``*`` as wildcards ``*``."""
    names = set()
    for tok in re.findall(r"`([a-z][a-z0-9_]*/[^`\s]*)`", page):
        names.add(re.sub(r"<[^>]+>|\*", "*", tok))
    return names


@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_every_logged_metric_is_on_the_metrics_page():
    gen = _gen()
    logged = gen.logged_metric_keys()
    # the scan sees the main families and a templated key
    assert {"actor/kl", "reward/mean", "perf/tokens_per_s_per_device", "timing/{}_s"} <= set(logged)
    page = (DOCS / "metrics.md").read_text()
    documented = _documented_patterns(page)
    families = {d.split("/")[0] for d in documented}
    missing = []
    for key, files in sorted(logged.items()):
        family = key.split("/")[0]
        if family not in families:
            missing.append(f"{key} (family {family}/ not on the page; {sorted(files)[0]})")
            continue
        pattern = key.replace("{}", "*")
        if pattern.endswith(("/", "_")):  # a prefix the code matches on (plots) or extends at run time
            if not any(d.startswith(pattern) for d in documented):
                missing.append(f"{key}* ({sorted(files)[0]})")
        elif pattern not in documented and not any(
                "*" in d and d != f"{family}/*" and fnmatch.fnmatchcase(pattern, d) for d in documented):
            missing.append(f"{key} ({sorted(files)[0]})")  # a family wildcard alone does not name a key
    assert not missing, ("metrics logged by the code but not named in docs/metrics.md (add a row: key and "
                         "meaning):\n  " + "\n  ".join(missing))


def test_every_source_file_the_docs_name_exists():
    """Paths in inline code (a code block may show a file the reader is to write)."""
    named = {}
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        for path in re.findall(r"`((?:relayrl|benchmarks|tests|recipes)/[\w/.-]+\.(?:py|yaml|sh))[`:#\s]", text):
            named.setdefault(path, page.name)
    assert len(named) > 50  # the scan sees the docs' paths
    gone = [f"{path} ({page})" for path, page in sorted(named.items()) if not (ROOT / path).exists()]
    assert not gone, "files named in the docs that do not exist:\n  " + "\n  ".join(gone)


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "the README is the way in; move details into docs/"
    for line in ("make demo", "make test", "demo: accuracy BEFORE% -> AFTER% in MINUTES min"):
        assert line in text
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if target.startswith(("http://", "https://")):
            continue
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_no_seed_numbers_in_citations():
    """Papers are cited by short name (docs/references.md), not by the number of a seed document."""
    # (capitalised too, as a sentence opens; "seed" at a line's end and the number on the next too)
    pattern = re.compile(r"\bseeds?\s+0\d\d\b", re.IGNORECASE)
    paths = [path for base in ("relayrl", "tests", "benchmarks", "docs") for path in sorted((ROOT / base).rglob("*"))
             if path.suffix in (".py", ".md") and path.is_file()]
    hits = []
    for path in [*paths, ROOT / "README.md"]:
        text = path.read_text()
        hits += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}" for m in pattern.finditer(text)]
    assert not hits, "cite the paper by its short name from docs/references.md:\n  " + "\n  ".join(hits)


@pytest.mark.slow
def test_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    for page in ("index.html", "quickstart/index.html", "reference/config/index.html", "metrics/index.html",
                 "benchmarks/index.html", "references/index.html", "api/algorithms/index.html"):
        assert (tmp_path / "site" / page).exists(), page
