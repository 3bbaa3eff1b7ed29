"""Generate the pages of the documentation that must not drift from the code.

``docs/reference/config.md`` is written from the pydantic schema (``relayrl.config.schema.Config`` and the
section models it imports): every key with its type, default, allowed values and description. Run it after
changing the schema (``make docs`` does); ``tests/package/test_docs.py`` fails while the committed page
differs from what this script writes.

``logged_metric_keys()`` lists the metric keys the code writes (string literals and f-strings of the form
``family/name`` in ``relayrl/``), for the test that checks ``docs/metrics.md`` names them all.

    python docs/gen_reference.py          # rewrite docs/reference/config.md
    python docs/gen_reference.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import ast
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
CONFIG_PAGE = ROOT / "docs" / "reference" / "config.md"


# ---------------------------------------------------------------- config reference

def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _type_name(tp: Any) -> str:
    """A reader's name for an annotation: ``int``, ``str or null``, ``list[str]``, ``dict[str, int]``."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Annotated:  # (relayrl.config.paths: a str or Path with ~ expanded)
        return "path" if typing.get_args(tp)[0] in (str, Path) else _type_name(typing.get_args(tp)[0])
    if origin is Literal:
        kinds = sorted({type(a).__name__ for a in typing.get_args(tp)})
        return " or ".join("null" if k == "NoneType" else k for k in kinds)
    if origin in (typing.Union, types.UnionType):  # (once each: a Literal of names | str is "str")
        return " or ".join(dict.fromkeys(_type_name(a) for a in typing.get_args(tp)))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is Any:
        return "any"
    if isinstance(tp, type):
        return "path" if issubclass(tp, Path) else tp.__name__
    return str(tp).replace("typing.", "")


def _allowed(tp: Any, metadata: list) -> str:
    """Allowed values: the members of a Literal, and numeric bounds."""
    parts: list[str] = []
    lits: list[Any] = []
    stack = [tp]
    while stack:
        t = stack.pop()
        if typing.get_origin(t) is Literal:
            lits += list(typing.get_args(t))
        elif typing.get_origin(t) in (typing.Union, types.UnionType):
            stack += list(typing.get_args(t))
    if lits:
        parts.append(", ".join(f"`{_value(v)}`" for v in lits))
    symbols = ((annotated_types.Ge, ">=", "ge"), (annotated_types.Gt, ">", "gt"),
               (annotated_types.Le, "<=", "le"), (annotated_types.Lt, "<", "lt"))
    for m in metadata:
        for cls, sym, attr in symbols:
            if isinstance(m, cls):
                parts.append(f"{sym} {getattr(m, attr)}")
    return "; ".join(parts)


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, default=str)
    return str(v)


def _default(field) -> str:
    if field.default_factory is not None:
        return f"`{_value(field.default_factory())}`"
    if field.default is PydanticUndefined:
        return "(required)"
    return f"`{_value(field.default)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every leaf key of the config, dotted (``run.dir``, ``model.lora.r``, ...)."""
    if model is None:
        from relayrl.config.schema import Config
        model = Config
    keys: list[str] = []
    for name, field in model.model_fields.items():
        if _is_model(field.annotation):
            keys += config_keys(field.annotation, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _section(model: type[BaseModel], prefix: str, out: list[str], level: int) -> None:
    leaves = [(n, f) for n, f in model.model_fields.items() if not _is_model(f.annotation)]
    nested = [(n, f) for n, f in model.model_fields.items() if _is_model(f.annotation)]
    title = prefix.rstrip(".") or "top level"
    out.append(f"{'#' * level} `{title}`" if prefix else f"{'#' * level} Top level")
    out.append("")
    doc = (model.__doc__ or "").strip()
    if doc and not doc.startswith(("A base class", "Usage docs")) and model.__module__.startswith("relayrl"):
        out.append(" ".join(doc.split("\n\n")[0].split()))
        out.append("")
    out.append(f"Defined in `{model.__module__}.{model.__name__}`.")
    out.append("")
    if leaves:
        out.append("| key | type | default | allowed | description |")
        out.append("|---|---|---|---|---|")
        for name, field in leaves:
            out.append(f"| `{prefix}{name}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))} | "
                       f"{_cell(_allowed(field.annotation, field.metadata))} | {_cell(field.description or '')} |")
        out.append("")
    for name, field in nested:
        _section(field.annotation, f"{prefix}{name}.", out, min(level + 1, 4) if prefix else 2)


def render_config_reference() -> str:
    from relayrl.config.schema import Config

    out = [
        "# Config reference",
        "",
        "<!-- Generated by docs/gen_reference.py from relayrl/config/schema.py; do not edit by hand. -->",
        "",
        "Every key of a run's config, generated from the pydantic schema. Set a key in a recipe (YAML, one "
        "mapping per section) or on the command line as `section.key=value` ([Recipes and overrides]"
        "(../recipes.md)). The whole config is validated before any work starts; a wrong key or value names the "
        "key and the fix.",
        "",
        f"{len(config_keys())} keys in {len(Config.model_fields)} sections.",
        "",
    ]
    top = [(n, f) for n, f in Config.model_fields.items() if not _is_model(f.annotation)]
    if top:
        out += ["## Top level", "", "| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for name, field in top:
            out.append(f"| `{name}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))} | "
                       f"{_cell(_allowed(field.annotation, field.metadata))} | {_cell(field.description or '')} |")
        out.append("")
    for name, field in Config.model_fields.items():
        if _is_model(field.annotation):
            _section(field.annotation, f"{name}.", out, 2)
    return "\n".join(out).rstrip("\n") + "\n"


# ---------------------------------------------------------------- logged metrics

METRIC_KEY = re.compile(r"^([a-z][a-z0-9_]*)/([A-Za-z0-9_{}<>@.\-]*)$")
# Strings of the same shape that are not metric keys: MIME types, run-directory paths, file names.
NOT_METRIC_FAMILIES = {"application", "text", "runs", "model"}


def _is_prefix(value: ast.AST) -> bool:
    """An f-string field holding the training engine's metric prefix (``{self.prefix}``, ``{prefix}``)."""
    expr = getattr(value, "value", None)
    return (isinstance(expr, ast.Name) and expr.id == "prefix") or (
        isinstance(expr, ast.Attribute) and expr.attr == "prefix")


def logged_metric_keys(package: Path = ROOT / "relayrl") -> dict[str, set[str]]:
    """Metric keys written in the package's code: ``{key: files}``. An f-string's fields read ``{}``
    (``timing/{}_s``); a key whose family is the training engine's metric prefix (``{self.prefix}/grad_norm``;
    ``actor`` by default) is reported as ``actor/grad_norm``."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                s = node.value
            elif isinstance(node, ast.JoinedStr):
                s = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                if s.startswith("{}/") and _is_prefix(node.values[0]):
                    s = "actor" + s[2:]
            else:
                continue
            m = METRIC_KEY.match(s)
            if m and m.group(1) not in NOT_METRIC_FAMILIES:
                found.setdefault(s, set()).add(str(path.relative_to(package.parent)))
    return found


def main(argv: list[str]) -> int:
    text = render_config_reference()
    if "--check" in argv:
        if not CONFIG_PAGE.exists() or CONFIG_PAGE.read_text() != text:
            print(f"{CONFIG_PAGE.relative_to(ROOT)} is out of date: run python docs/gen_reference.py")
            return 1
        return 0
    CONFIG_PAGE.parent.mkdir(parents=True, exist_ok=True)
    if not CONFIG_PAGE.exists() or CONFIG_PAGE.read_text() != text:
        CONFIG_PAGE.write_text(text)
        print(f"wrote {CONFIG_PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
