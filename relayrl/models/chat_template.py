"""A run's own chat template (``model.chat_template``): the Jinja template that renders chat-message prompts
in place of the one in the model directory's tokenizer files (a base model has none).

The key names the template three ways, as TRL's ``chat_template_path`` and verl's
``actor_rollout_ref.model.custom_chat_template`` do between them: the template itself (a string holding
``{%`` or ``{{``), a Jinja file, or a tokenizer directory whose template is taken. :func:`read_chat_template`
turns any of them into the template's text, refusing a missing file, a directory without a template or a
template that does not compile, with the reason; it reads no torch or transformers, so a recipe is checked
before the engines load. :func:`relayrl.models.load.load_tokenizer` puts the text on the tokenizer.

Unlike TRL, a tokenizer directory given here lends only its template: its special tokens are not added to
the policy's vocabulary (a template that writes a token the vocabulary lacks writes it as plain text).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["TEMPLATE_FILE", "is_inline", "read_chat_template", "check_jinja"]

TEMPLATE_FILE = "chat_template.jinja"
"""Where a tokenizer directory saved by transformers 4.43+ keeps its template (older ones keep it in
``tokenizer_config.json``'s ``chat_template``)."""

_FORMS = ("a Jinja file (.jinja, .j2, .txt), a tokenizer directory, or the template itself (text holding {% or "
          "{{); null keeps the tokenizer's own")


def is_inline(value: str) -> bool:
    """True when ``value`` is a template rather than a path: it holds a Jinja tag or expression."""
    return "{%" in value or "{{" in value


def read_chat_template(value: str) -> str:
    """The template text ``value`` names: ``value`` itself when inline, a file's text (a ``.json`` file: its
    ``chat_template`` field, as in ``tokenizer_config.json``), or a tokenizer directory's template. Raises
    ``ValueError`` with the reason (the caller names the key)."""
    if not value.strip():
        raise ValueError(f"is empty; give {_FORMS}")
    if is_inline(value):
        check_jinja(value, "the template")
        return value
    path = Path(value).expanduser()
    if path.is_dir():
        text, where = _directory_template(path)
    elif path.is_file():
        text, where = (_json_template(path) if path.suffix == ".json" else _file_text(path)), str(path)
        if text is None:
            raise ValueError(f"{path} has no chat_template field; give {_FORMS}")
    else:
        raise ValueError(f"{value!r} is no file or directory here, nor a template (it holds no {{% or {{{{); "
                         f"give {_FORMS}")
    if not text.strip():
        raise ValueError(f"the template in {where} is empty")
    check_jinja(text, where)
    return text


def check_jinja(text: str, where: str) -> None:
    """Compile ``text`` as transformers does (a sandboxed Jinja environment with trimmed blocks, loop controls
    and the ``{% generation %}`` tag that marks assistant tokens); a syntax error or an unknown filter or tag
    raises ``ValueError`` naming ``where`` and the line."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # parsed only: the body is kept, the marking is transformers' business
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    try:
        env.from_string(text)
    except jinja2.TemplateSyntaxError as e:  # (an unknown filter or test too: TemplateAssertionError)
        raise ValueError(f"{where} does not compile as a Jinja template: {e.message} (line {e.lineno})") from None


def _file_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); give a Jinja template "
                         f"file") from None


def _json_template(path: Path) -> str | None:
    """``path``'s ``chat_template`` field: a string, or transformers' list of named templates (the one named
    ``default``)."""
    try:
        data = json.loads(_file_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    found = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{path} has named chat templates ({', '.join(map(str, named))}) but none named "
                             f"default; give the one you want as a Jinja file")
        found = named["default"]
    if found is not None and not isinstance(found, str):
        raise ValueError(f"{path}: chat_template is a {type(found).__name__}, not a template string")
    return found


def _directory_template(path: Path) -> tuple[str, str]:
    """(template, the file it came from) of a tokenizer directory: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s field, else ``chat_template.json``'s (a processor's)."""
    if (path / TEMPLATE_FILE).is_file():
        return _file_text(path / TEMPLATE_FILE), str(path / TEMPLATE_FILE)
    for name in ("tokenizer_config.json", "chat_template.json"):
        if (path / name).is_file():
            found = _json_template(path / name)
            if found is not None:
                return found, str(path / name)
    raise ValueError(f"directory {path} holds no chat template (no {TEMPLATE_FILE}, and no chat_template in "
                     f"tokenizer_config.json or chat_template.json); give a Jinja file or a tokenizer directory "
                     f"that has one")
