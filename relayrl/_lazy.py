"""Package names imported when first asked for (PEP 562), so that a light import of a package (its config, a
storage unit's process) does not import torch."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` comes from ``package.<table[name]>`` on first use and
    stays in the package's namespace."""
    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
