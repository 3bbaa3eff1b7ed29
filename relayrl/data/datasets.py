"""User prompt datasets: JSONL (or JSON) and Parquet files, and Hugging Face ``datasets`` (a ``save_to_disk``
directory, an Arrow file, a dataset name: :mod:`relayrl.data.hf`) -> :class:`Problem` records.

This module owns reading a source's rows and :func:`load_problems`, which turns each into a :class:`Problem`
(:func:`~relayrl.data.rows.row_problem`) and refuses the source with every bad row counted. Each row holds a prompt
(plain text, or chat messages ``[{"role", "content"}, ...]``) and a ground-truth answer under configurable keys
(:class:`~relayrl.data.dataset_config.DatasetConfig`); what a row may hold and how it is checked is
:mod:`relayrl.data.rows`'s. Every malformed row is reported with its file, its 1-based row number (for JSONL, the
line number) and what is wrong, so a bad dataset fails before any training starts.

Chat prompts keep their messages in ``Problem.meta["messages"]``; the tokenizer's chat template is applied when a
prompt is encoded (:func:`encode_prompt`, in :mod:`relayrl.data.prompts`), so one dataset serves models with
different templates. The names users import from here (the config, the prompt rendering) are re-exported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from relayrl.data.dataset_config import DatasetConfig, key_options
from relayrl.data.errors import DatasetError, duplicate_column, missing_column
from relayrl.data.prompts import encode_prompt, prompt_identity, render_plain, render_prompt  # re-exported
from relayrl.data.rows import CHAT_ROLES, BadRow, row_problem  # (CHAT_ROLES re-exported)
from relayrl.data.tasks import Problem

__all__ = ["DatasetConfig", "DatasetError", "load_problems", "encode_prompt", "prompt_identity", "render_prompt",
           "render_plain"]

MAX_ROW_ERRORS = 20
"""How many bad rows one error lists (all of them are counted)."""
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet",
             ".arrow": "arrow"}


class _DuplicateKey(ValueError):
    """A JSON object with one key twice (``json`` would keep the last value and drop the first, unsaid)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json``'s ``object_pairs_hook``: the object as a dict, or :class:`_DuplicateKey` naming a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _loads(text: str) -> Any:
    """``json.loads`` refusing an object with a key twice (:class:`_DuplicateKey`)."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def _duplicate_message(key: str) -> str:
    return (f"key {key!r} appears twice in one object (JSON would keep the second value and drop the first "
            f"unsaid); keep one")


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(row number, parsed value) per non-blank line; a file starting with ``[`` is one JSON array.

    A line that is not valid UTF-8 or JSON, or has an object with a key twice, is yielded as a :class:`BadRow`,
    so that every bad row is reported. A file of one JSON object spread over several lines (pretty-printed) is
    refused once, with the fix, not as a bad row per line."""
    name = path.name
    with path.open("rb") as f:
        head = f.read(64)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DatasetError(f"{name}: the file is UTF-16 text (it starts with a UTF-16 byte-order mark); save it as "
                           f"UTF-8 (e.g. iconv -f UTF-16 -t UTF-8 {name} > {path.stem}.utf8{path.suffix})")
    head = head.removeprefix(b"\xef\xbb\xbf").lstrip()  # (a UTF-8 byte-order mark, as editors write)
    if head.startswith(b"["):
        try:
            rows = _loads(path.read_text(encoding="utf-8-sig"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DatasetError(f"{name}: invalid JSON array ({e})") from None
        except _DuplicateKey as e:  # (the array is parsed whole, so its row is not known)
            raise DatasetError(f"{name}: {_duplicate_message(str(e))}") from None
        yield from enumerate(rows, start=1)
        return
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield lineno, BadRow(f"{name} row {lineno}: not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                value = _loads(line.rstrip("\r\n"))  # (an error at the row's end is then on its line, not the next)
            except json.JSONDecodeError as e:
                if lineno == 1 and head.startswith(b"{"):
                    _refuse_spread_object(path)
                yield lineno, BadRow(f"{name} row {lineno}: invalid JSON ({e.msg} at column {e.colno})")
                continue
            except _DuplicateKey as e:
                yield lineno, BadRow(f"{name} row {lineno}: {_duplicate_message(str(e))}")
                continue
            yield lineno, value


def _refuse_spread_object(path: Path) -> None:
    """Raise the :class:`DatasetError` of a file whose first line is not JSON but whose whole text is: JSON
    objects written over several lines (pretty-printed), where JSON lines needs one object per line; else
    return (the line is reported as a bad row)."""
    text = path.read_text(encoding="utf-8-sig", errors="replace")
    decoder, objects, at = json.JSONDecoder(), 0, 0
    try:
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            if at == len(text):
                break
            _, at = decoder.raw_decode(text, at)
            objects += 1
    except json.JSONDecodeError:
        return
    what = "one JSON object" if objects == 1 else f"{objects} JSON objects"
    raise DatasetError(f"{path.name}: the file is {what} written over several lines (pretty-printed), not JSON lines "
                       f"(one object per line) nor a JSON array of objects; rewrite it, e.g. jq -c "
                       f"'.' {path.name} > {path.stem}.lines.jsonl (a file of one object that holds the rows in a "
                       f"list under a key: jq -c '.KEY[]')")


def _iter_parquet(path: Path, keys: tuple[str, ...], options: dict[str, str],
                  implicit: tuple[str, str] | None = None) -> Iterator[tuple[int, Any]]:
    """(row number, row dict) per row; a key no column holds fails before any row is read
    (:func:`~relayrl.data.errors.missing_column`, ``implicit`` as there)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DatasetError(f"{path.name}: not a readable Parquet file ({e})") from None
    twice = duplicate_column(pf.schema_arrow.names)
    if twice is not None:
        raise DatasetError(f"{path.name}: {twice}")
    missing = missing_column(pf.schema_arrow, keys, options, implicit)
    if missing is not None:
        raise DatasetError(f"{path.name}: {missing.replace('field', 'column', 1)}")
    rowno = 0
    # every column, as a JSONL row has them: a reward function's fields (verl's extra_info), data_source
    for batch in pf.iter_batches():
        for row in batch.to_pylist():
            rowno += 1
            yield rowno, row


_SHOWN_ROWS = 5
"""How many row numbers a line of rows that fail alike lists."""


@dataclass
class _RowErrors:
    """A source's bad rows: every one counted, the first :data:`MAX_ROW_ERRORS` lines listed. ``grouped`` (a
    columnar source: a column has one type, so a wrongly typed one fails every row alike): rows that fail for
    the same reason share one line, with their count and first row numbers; else each row has its line."""

    label: str
    grouped: bool
    count: int = 0
    lines: dict[str, list] = field(default_factory=dict)
    """reason -> [the first row's message, rows counted, the first row numbers]"""

    def add(self, rowno: int, message: str) -> None:
        self.count += 1
        prefix = f"{self.label} row {rowno}: "
        reason = message.removeprefix(prefix) if self.grouped and message.startswith(prefix) else message
        line = self.lines.get(reason)
        if line is None:
            if len(self.lines) < MAX_ROW_ERRORS:
                self.lines[reason] = [message, 1, [rowno]]
            return
        line[1] += 1
        if len(line[2]) < _SHOWN_ROWS:
            line[2].append(rowno)

    def _line(self, reason: str, message: str, n: int, rows: list[int]) -> str:
        if n == 1:
            return message
        shown = ", ".join(map(str, rows[:_SHOWN_ROWS])) + (", ..." if n > _SHOWN_ROWS else "")
        return f"{self.label} rows {shown} ({n} rows): {reason}"

    def error(self, source: str) -> DatasetError:
        """The error that refuses the source: its one bad row's, or the count and the lines."""
        if self.count == 1:
            return DatasetError(next(iter(self.lines.values()))[0])
        listed = [self._line(reason, *line) for reason, line in self.lines.items()]
        shown = "" if sum(n for _, n, _ in self.lines.values()) == self.count else f" (the first {len(listed)} listed)"
        return DatasetError(f"{source}: {self.count} bad rows{shown}; fix or remove them:\n  " + "\n  ".join(listed))


def load_problems(cfg: DatasetConfig, tokenizer=None) -> list[Problem]:
    """Read every row of ``cfg.path`` (or of the dataset ``cfg.hf_name``) into a :class:`Problem`.

    A chat prompt's messages go to ``meta["messages"]``; its ``prompt`` text is the
    tokenizer's rendering (chat template, generation prompt added) when a tokenizer
    with a template is given, else :func:`render_plain`. ``meta["row"]`` is the
    row number, ``meta["extra"]`` the row's other fields and ``meta["fields"]`` every field as it was, the prompt
    under ``"prompt"`` (its messages, system prompt added, or its text): what a user reward function gets. Raises
    :class:`DatasetError` for a missing, empty or unreadable file, and for
    malformed rows: all of them are counted and the first
    :data:`MAX_ROW_ERRORS` listed, each with its number (rows of a columnar source that fail for the same reason,
    as every row does under a wrongly typed column, on one line with their count: :class:`_RowErrors`).
    """
    rows, label, columnar = _rows(cfg)
    problems: list[Problem] = []
    bad = _RowErrors(label, grouped=columnar)
    for rowno, row in rows:
        try:
            problems.append(row_problem(row, rowno, cfg, tokenizer, label))
        except DatasetError as e:
            bad.add(rowno, str(e))
        if cfg.limit is not None and len(problems) >= cfg.limit:
            break
    source = cfg.path or cfg.hf_name
    if bad.count:
        raise bad.error(str(source))
    if not problems:
        raise DatasetError(f"dataset {label if cfg.path is None else f'file {source}'} has no rows")
    return problems


def _required_keys(cfg: DatasetConfig) -> tuple[tuple[str, ...], tuple[str, str] | None]:
    """``(keys, implicit)``: the fields every row of ``cfg`` needs, which a columnar source checks against its
    columns before reading a row, and ``(prompt_key, answer_key)`` when the prompt may be implicit (a row without
    it takes it from an answer of whole conversations, :func:`~relayrl.data.rows._implicit_prompt`); a conversation row needs its
    messages field alone."""
    if cfg.messages_key is not None:
        return (cfg.messages_key,), None
    keys = tuple(k for k in (cfg.prompt_key, cfg.answer_key, cfg.rejected_key, cfg.label_key) if k)
    return keys, (cfg.prompt_key, cfg.answer_key)


def _rows(cfg: DatasetConfig) -> tuple[Iterator[tuple[int, Any]], str, bool]:
    """``(rows, label, columnar)``: the source's ``(row number, row)`` pairs, its name in row errors, and whether
    it is columnar (Parquet, Arrow, ``datasets``: one type per column)."""
    keys, implicit = _required_keys(cfg)
    if cfg.hf_name is not None or (cfg.path is not None and Path(cfg.path).is_dir()):
        from relayrl.data.hf import iter_rows, open_dataset

        ds, label = open_dataset(None if cfg.path is None else Path(cfg.path), cfg.hf_name, cfg.hf_config, cfg.split)
        return iter_rows(ds, label, keys, key_options(cfg), implicit), label, True
    path = Path(cfg.path)
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist")
    if not path.is_file():
        raise DatasetError(f"dataset path {path} is not a file")
    fmt = cfg.format or _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        hint = (" relayrl does not read CSV; convert it to JSON lines, e.g. python -c \"import pandas as pd; "
                f"pd.read_csv('{path}').to_json('{path.with_suffix('.jsonl')}', orient='records', lines=True)\""
                if path.suffix.lower() in (".csv", ".tsv") else "")
        raise DatasetError(
            f"cannot tell the format of {path.name} from its suffix {path.suffix!r}: use one of "
            f"{', '.join(sorted(_SUFFIXES))}, or, if the file is one of those, set its format (data.format=jsonl, "
            f"parquet or arrow in a recipe, --format for relayrl eval).{hint}"
        )
    if path.stat().st_size == 0:
        raise DatasetError(f"dataset file {path} is empty")
    if fmt == "arrow":
        from relayrl.data.hf import iter_rows, open_dataset

        ds, label = open_dataset(path, None, None, cfg.split)
        return iter_rows(ds, label, keys, key_options(cfg), implicit), label, True
    if fmt == "jsonl":
        return _iter_jsonl(path), path.name, False
    return _iter_parquet(path, keys, key_options(cfg), implicit), path.name, True
