"""MkDocs hook: regenerate the config reference from the schema before every build, so the built site
cannot drift from the code (``docs/gen_reference.py``; ``tests/package/test_docs.py`` checks the committed
page too)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def on_pre_build(config, **kwargs) -> None:
    root = str(_HERE.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location("relayrl_docs_gen_reference", _HERE / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.main([])
