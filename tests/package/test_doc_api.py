"""The API pages (``docs/api/*.md``, rendered by mkdocstrings) name objects that exist, are public and say what
they are: each ``::: relayrl.x.y`` target imports (a module, or an attribute of one), no part of its dotted name
is private, and it has a docstring (mkdocstrings renders nothing useful without one). The algorithms page lists
every public module of ``relayrl.algorithms``, so a new estimator or loss shows up in the API reference; the
strict site build (``test_docs.py``, slow) checks the rendering itself."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[2] / "docs" / "api"
TARGETS = [pytest.param(t, id=f"{page.name}:{t}") for page in sorted(API.glob("*.md"))
           for t in re.findall(r"^::: (\S+)", page.read_text(), re.M)]
# public modules of relayrl.algorithms left off its page, and why
NOT_ON_PAGE = {"names": "the config's accepted names (algorithm.loss_agg, ...), read by the config checks"}


def resolve(dotted: str):
    """The object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_api_pages_have_targets():
    assert len(TARGETS) >= 40


@pytest.mark.parametrize("target", TARGETS)
def test_an_api_target_exists_is_public_and_documented(target):
    assert not any(p.startswith("_") for p in target.split(".")), f"{target}: a private name on an API page"
    obj = resolve(target)
    assert (inspect.getdoc(obj) or "").strip(), f"{target}: no docstring"


def test_the_algorithms_page_lists_every_public_algorithms_module():
    import relayrl.algorithms

    page = set(re.findall(r"^::: relayrl\.algorithms\.(\w+)$", (API / "algorithms.md").read_text(), re.M))
    public = {m.name for m in pkgutil.iter_modules(relayrl.algorithms.__path__) if not m.name.startswith("_")}
    missing = public - page - set(NOT_ON_PAGE)
    assert not missing, f"not on docs/api/algorithms.md: {sorted(missing)}"
    assert set(NOT_ON_PAGE) <= public - page
    assert page <= public


def test_a_missing_or_private_target_fails():
    with pytest.raises((ModuleNotFoundError, AttributeError)):
        resolve("relayrl.algorithms.no_such_module")
    with pytest.raises(AttributeError):
        resolve("relayrl.config.loader.no_such_function")
    assert resolve("relayrl.config.loader.load_run_config").__name__ == "load_run_config"
