"""User prompt datasets: JSONL (or JSON) and Parquet files, and Hugging Face ``datasets`` (a ``save_to_disk``
directory, an Arrow file, a dataset name: :mod:`relayrl.data.hf`) -> :class:`Problem` records.

Each row holds a prompt (plain text, or chat messages ``[{"role", "content"}, ...]``)
and a ground-truth answer (a string; numbers are converted to strings) under
configurable keys; dotted keys (``"extra.answer"``) reach into nested objects. Rows read for a user reward
function (``raw_answers``) keep a non-text answer's value beside its text (:class:`~relayrl.data.truth.GroundTruth`:
an int stays an int, and a list or dict, verl's countdown ``{"target": 24, ...}``, is read too).
Every malformed row is reported with its file, its 1-based row number (for
JSONL, the line number) and what is wrong, so a bad dataset fails before any
training starts.

Chat prompts keep their messages in ``Problem.meta["messages"]``; the tokenizer's
chat template is applied when a prompt is encoded (:func:`encode_prompt`), as
the HybridFlow/verl data path does, so one dataset serves models with different
templates. A ``system_prompt`` makes every prompt chat messages (the system
message, then the row's prompt as the user's); an ``answer_regex`` cuts the
ground truth out of a worked solution (GSM8K's ``... #### 42``), and a preference row's rejected answer alike.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relayrl.data.errors import DatasetError, missing_column, missing_field
from relayrl.data.tasks import Problem
from relayrl.data.truth import GroundTruth, plain

__all__ = ["DatasetConfig", "DatasetError", "load_problems", "encode_prompt", "prompt_identity", "render_prompt",
           "render_plain"]

_MISSING = object()
MAX_ROW_ERRORS = 20
"""How many bad rows one error lists (all of them are counted)."""
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet",
             ".arrow": "arrow"}


class DatasetConfig(BaseModel):
    """Where a user dataset is and which fields hold the prompt and the answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path | None = Field(None, description="a .jsonl/.json/.ndjson (JSON lines, or one JSON array), .parquet or "
                              ".arrow file, or a directory datasets' save_to_disk wrote; None: hf_name")
    hf_name: str | None = Field(None, min_length=1, description="a dataset name for datasets.load_dataset (a hub "
                                "name, read from the cache first, or a local directory of data files)")
    hf_config: str | None = Field(None, min_length=1, description="the dataset's configuration (e.g. 'main')")
    split: str = Field("train", min_length=1, description="split of hf_name, or of a DatasetDict directory")
    system_prompt: str | None = Field(None, description="a system message put before every prompt (the prompt "
                                      "becomes chat messages); a chat prompt that has one keeps its own")
    answer_regex: str | None = Field(None, min_length=1, description="the answer is this regex's first group (or "
                                     "whole match) searched in the answer field, and the rejected answer the same "
                                     "in the rejected field; a row without a match is an error")
    prompt_key: str = Field("prompt", min_length=1, description='field with the prompt; dots reach nested fields ("x.prompt")')
    answer_key: str = Field("answer", min_length=1, description="field with the ground truth (string or number)")
    raw_answers: bool = Field(False, description="the rows are scored by a user reward function: a number, list, "
                              "dict or boolean answer is a GroundTruth, its text beside the value the file holds; "
                              "False: a number becomes its text, and the others are refused naming the row")
    rejected_key: str | None = Field(None, min_length=1, description="field with a rejected answer (preference "
                                     "pairs: the answer field is the chosen one); None: not read")
    label_key: str | None = Field(None, min_length=1, description="field labelling the answer desirable (true) or "
                                  "undesirable (false): unpaired preference rows (KTO), kept in meta['label']; "
                                  "None: not read")
    format: Literal["jsonl", "parquet", "arrow"] | None = Field(None, description="None: inferred from the file suffix")
    messages_key: str | None = Field(None, min_length=1, description="multi-turn SFT: field with a whole "
                                     "conversation (chat messages); prompt_key and answer_key are then not read")
    limit: int | None = Field(None, ge=1, description="keep only the first N rows")

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetConfig":
        if (self.path is None) == (self.hf_name is None):
            raise ValueError("give exactly one of path (a file or a save_to_disk directory) and hf_name")
        if self.answer_regex is not None:
            try:
                re.compile(self.answer_regex)
            except re.error as e:
                raise ValueError(f"answer_regex={self.answer_regex!r} is not a regular expression ({e})") from None
        return self

    @property
    def label(self) -> str:
        """How row errors name the source: the file's name, or the dataset name and split."""
        return Path(self.path).name if self.path is not None else f"{self.hf_name}[{self.split}]"


def _get(row: dict, key: str) -> Any:
    """``row[key]``; a dotted key walks nested dicts when no field has that literal name."""
    if key in row:
        return row[key]
    if "." not in key:
        return _MISSING
    cur: Any = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


class _BadRow(str):
    """A row that could not even be parsed; the string says why (yielded in place of the row)."""


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(row number, parsed value) per non-blank line; a file starting with ``[`` is one JSON array.

    A line that is not valid UTF-8 or JSON is yielded as a :class:`_BadRow`, so that every bad row is reported."""
    name = path.name
    with path.open("rb") as f:
        head = f.read(64)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DatasetError(f"{name}: the file is UTF-16 text (it starts with a UTF-16 byte-order mark); save it as "
                           f"UTF-8 (e.g. iconv -f UTF-16 -t UTF-8 {name} > {path.stem}.utf8{path.suffix})")
    head = head.removeprefix(b"\xef\xbb\xbf").lstrip()  # (a UTF-8 byte-order mark, as editors write)
    if head.startswith(b"["):
        try:
            rows = json.loads(path.read_text(encoding="utf-8-sig"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DatasetError(f"{name}: invalid JSON array ({e})") from None
        yield from enumerate(rows, start=1)
        return
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield lineno, _BadRow(f"{name} row {lineno}: not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip("\r\n"))  # (an error at the row's end is then on its line, not the next)
            except json.JSONDecodeError as e:
                yield lineno, _BadRow(f"{name} row {lineno}: invalid JSON ({e.msg} at column {e.colno})")
                continue
            yield lineno, value


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
    missing = missing_column(pf.schema_arrow, keys, options, implicit)
    if missing is not None:
        raise DatasetError(f"{path.name}: {missing.replace('field', 'column', 1)}")
    rowno = 0
    # every column, as a JSONL row has them: a reward function's fields (verl's extra_info), data_source
    for batch in pf.iter_batches():
        for row in batch.to_pylist():
            rowno += 1
            yield rowno, row


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""Chat roles a message may have."""


def _check_messages(msgs: list, where: str, key: str) -> list[dict[str, str]]:
    if not msgs:
        raise DatasetError(f"{where}: field {key!r} is an empty list of messages")
    out = []
    for j, m in enumerate(msgs, start=1):
        if not isinstance(m, dict):
            raise DatasetError(f"{where}: field {key!r} message {j} is {type(m).__name__}; expected {{'role', 'content'}}")
        for part in ("role", "content"):
            if part not in m:
                raise DatasetError(f"{where}: field {key!r} message {j} has no {part!r} (keys: {', '.join(map(str, m)) or 'none'})")
            if not isinstance(m[part], str):
                raise DatasetError(
                    f"{where}: field {key!r} message {j} {part!r} is {type(m[part]).__name__}; expected a string"
                )
        dropped = next((k for k, v in m.items() if k not in ("role", "content") and v is not None), None)
        if dropped is not None:
            raise DatasetError(f"{where}: field {key!r} message {j} has key {dropped!r}, which relayrl does not render "
                               f"(a message is its role and content), so the model would not see it; drop the key "
                               f"or write it into the content")
        if m["role"] not in CHAT_ROLES:
            raise DatasetError(f"{where}: field {key!r} message {j} has role {m['role']!r}; expected one of "
                               f"{', '.join(CHAT_ROLES)}")
        if m["role"] == "assistant" and not m["content"].strip():
            raise DatasetError(f"{where}: field {key!r} message {j} is an empty assistant turn (nothing to learn "
                               f"or compare against)")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def render_plain(messages: list[dict[str, str]]) -> str:
    """Chat messages as readable text (``role: content`` lines), for logs and templateless tokenizers."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def _row_problem(row: Any, rowno: int, cfg: DatasetConfig, tokenizer, label: str | None = None) -> Problem:
    if isinstance(row, _BadRow):
        raise DatasetError(str(row))
    where = f"{label or cfg.label} row {rowno}"
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object with fields, got {type(row).__name__}")
    if cfg.messages_key is not None:
        return _conversation_problem(row, rowno, where, cfg)
    prompt = _get(row, cfg.prompt_key)
    answer = _get(row, cfg.answer_key)
    if prompt is _MISSING and _is_messages(answer):  # TRL's implicit prompt: whole conversations
        prompt = _implicit_prompt(row, answer, where, cfg)
    for key, value in ((cfg.prompt_key, prompt), (cfg.answer_key, answer)):
        if value is _MISSING:
            raise DatasetError(f"{where}: {missing_field(key, row, key_options(cfg).get(key))}")
        if value is None:
            raise DatasetError(f"{where}: field {key!r} is null")
    meta: dict[str, Any] = {"row": rowno, "source": str(cfg.path or cfg.hf_name)}
    if isinstance(prompt, str) and not prompt.strip():
        raise DatasetError(f"{where}: field {cfg.prompt_key!r} is an empty string")
    if isinstance(prompt, str) and cfg.system_prompt is None:
        text = prompt
    elif isinstance(prompt, (list, str)):
        messages = (_check_messages(prompt, where, cfg.prompt_key) if isinstance(prompt, list)
                    else [{"role": "user", "content": prompt}])
        if cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        meta["messages"] = messages
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            text = _render(tokenizer, Problem("", "", {"messages": messages}), None)[0]
        else:
            text = render_plain(messages)
    else:
        raise DatasetError(
            f"{where}: field {cfg.prompt_key!r} is {type(prompt).__name__}; expected a string or a list of "
            "{'role', 'content'} messages"
        )
    asked = [m for m in (prompt, meta.get("messages")) if isinstance(m, list)]  # (as given, and with the system prompt)
    answer = _ground_truth(_reply(answer, asked, where, cfg.answer_key), where, cfg)
    if cfg.answer_regex is not None:
        answer = _cut_answer(answer, cfg.answer_regex, where, cfg.answer_key)
    if cfg.rejected_key is not None:
        rejected = _rejected_answer(row, asked, where, cfg)
        if rejected.strip() == answer.strip():  # (both as trained: cut by answer_regex alike)
            raise DatasetError(f"{where}: the rejected answer equals the chosen one ({rejected!r}"
                               f"{'' if rejected == answer else f' against {answer!r}, apart from spaces'})")
        meta["rejected"] = rejected
    if cfg.label_key is not None:
        meta["label"] = _label(row, where, cfg.label_key, key_options(cfg).get(cfg.label_key))
    extra = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.answer_key, cfg.rejected_key,
                                                       cfg.label_key)}
    if extra:
        meta["extra"] = extra
    # what a user reward function gets: the row as it was, its prompt under "prompt" (messages, or the text)
    meta["fields"] = {**{k: v for k, v in row.items() if k != cfg.prompt_key}, "prompt": meta.get("messages", prompt)}
    return Problem(text, answer, meta)


def _rejected_answer(row: dict, asked: list[list], where: str, cfg: DatasetConfig) -> str:
    """A preference row's rejected answer as it is trained: its text (a reply after one of the prompt's
    message lists ``asked``, as the chosen one), cut by ``answer_regex`` as the chosen answer is, so the two
    sides of a pair are compared and trained alike (a rejected answer without a match is refused, as a chosen
    one is)."""
    key = cfg.rejected_key
    value = _get(row, key)
    if value is _MISSING:  # (named as a missing chosen answer is, with the option that names the field)
        missing = missing_field(key, row, key_options(cfg).get(key))
        raise DatasetError(f"{where}: {missing.replace(f'field {key!r}', f'field {key!r} (the rejected answer)', 1)}")
    text = _answer_text(_reply(value, asked, where, key), where, key)
    return text if cfg.answer_regex is None else _cut_answer(text, cfg.answer_regex, where, key)


_LABELS = {"true": True, "false": False, "1": True, "0": False}


def _label(row: dict, where: str, key: str, option: str | None = None) -> bool:
    """A row's desirable / undesirable label: a bool, 1 / 0, or the strings 'true' / 'false' / '1' / '0'.
    ``option``: the config key that names the field, named when the row lacks it."""
    value = _get(row, key)
    if value is _MISSING:
        raise DatasetError(f"{where}: {missing_field(key, row, option)} (the label: true for a desirable "
                           f"completion, false for an undesirable one)")
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _LABELS:
        return _LABELS[value.strip().lower()]
    raise DatasetError(f"{where}: field {key!r} is {value!r}; expected a boolean label (true for a desirable "
                       f"completion, false for an undesirable one; 1/0 and 'true'/'false' are read too)")


def _is_messages(value: Any) -> bool:
    """Whether a field holds chat messages: a list of dicts, one at least with a ``role`` (a list of other
    records -- a verl ground truth of test cases ``[{"input": ..., "output": ...}]`` -- is a value)."""
    return (isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)
            and any("role" in m for m in value))


def _implicit_prompt(row: dict, chosen: list, where: str, cfg: DatasetConfig) -> list:
    """The prompt of a row with no prompt field whose answer is a whole conversation (TRL's "implicit prompt"
    preference rows: ``chosen`` and ``rejected`` each a conversation ending in the assistant's reply): the
    messages before that reply, which the rejected conversation must share."""
    msgs = _check_messages(chosen, where, cfg.answer_key)
    if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
        raise DatasetError(f"{where}: field {cfg.prompt_key!r} is missing and field {cfg.answer_key!r} is not a "
                           f"conversation ending in an assistant reply, from which to take the prompt")
    rejected = _get(row, cfg.rejected_key) if cfg.rejected_key is not None else _MISSING
    if isinstance(rejected, list):
        other = _check_messages(rejected, where, cfg.rejected_key)
        if other[:-1] != msgs[:-1]:
            raise DatasetError(f"{where}: fields {cfg.answer_key!r} and {cfg.rejected_key!r} are conversations "
                               f"that differ before their last reply; with no {cfg.prompt_key!r} field the prompt "
                               f"is what they share")
    return msgs[:-1]


def _reply(value: Any, prompts: list[list], where: str, key: str) -> Any:
    """An answer given as chat messages (TRL's conversational rows: ``[{"role": "assistant", ...}]``, or the
    whole conversation, one of the prompt's message lists ``prompts`` first) as the text of its one assistant
    reply; anything else as it is."""
    if not _is_messages(value):
        return value
    msgs = _check_messages(value, where, key)
    for p in prompts:
        if msgs[:len(p)] == [{"role": m["role"], "content": m["content"]} for m in p]:
            msgs = msgs[len(p):]
            break
    if len(msgs) != 1 or msgs[0]["role"] != "assistant":
        got = ", ".join(m["role"] for m in msgs) or "nothing"
        raise DatasetError(f"{where}: field {key!r} holds messages; relayrl takes one assistant reply after the "
                           f"prompt (got {got} after it)")
    return msgs[0]["content"]


def _answer_text(value: Any, where: str, key: str) -> str:
    """An answer field as text: a non-empty string, or a finite number."""
    if value is None:
        raise DatasetError(f"{where}: field {key!r} is null")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: field {key!r} is {type(value).__name__}; expected a string or a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise DatasetError(f"{where}: field {key!r} is {value}, not an answer")
    if isinstance(value, str) and not value.strip():
        raise DatasetError(f"{where}: field {key!r} must be a non-empty string, got {value!r} (there is no answer "
                           f"to train on or verify against)")
    return value if isinstance(value, str) else str(value)


def _ground_truth(value: Any, where: str, cfg: DatasetConfig) -> str:
    """A row's answer: its text (:func:`_answer_text`), or with ``cfg.raw_answers`` a number, list, dict or
    boolean as a :class:`GroundTruth` (a number as its text); a list, dict or boolean read for anything else,
    or cut by ``answer_regex``, is refused with the fix."""
    value, key = plain(value), cfg.answer_key
    if not isinstance(value, (bool, list, dict)):
        text = _answer_text(value, where, key)
        return GroundTruth.of(value) if cfg.raw_answers and not isinstance(value, str) else text
    if cfg.raw_answers and cfg.answer_regex is None:
        return GroundTruth.of(value)
    if cfg.raw_answers:
        raise DatasetError(f"{where}: field {key!r} is {type(value).__name__}; answer_regex "
                           f"{cfg.answer_regex!r} cuts the answer out of text: set data.answer_regex=null to "
                           f"score the value as the file has it")
    inner = next((k for k, v in value.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)),
                 None) if isinstance(value, dict) else None
    point = "" if inner is None else f", or set data.answer_key={key}.{inner} (a text or number inside it)"
    kind = type(value).__name__
    raise DatasetError(f"{where}: field {key!r} is {kind}; expected a string or a number (relayrl's built-in "
                       f"verifiers compare text, and workflows sft, dpo, kto and rm train on it): score a {kind} "
                       f"ground truth with a reward function of yours, which gets it as the file has it (a verl "
                       f"compute_score's ground_truth), reward.verifier=user reward.user_fn=FILE.py:compute_score "
                       f"with workflow grpo{point}")


def _cut_answer(text: str, pattern: str, where: str, key: str) -> str:
    """The answer inside a worked solution: ``pattern``'s first group (or whole match), stripped."""
    m = re.search(pattern, text)
    if m is None:
        tail = text if len(text) <= 80 else "..." + text[-77:]
        raise DatasetError(f"{where}: field {key!r} ({tail!r}) has no match for answer_regex {pattern!r}")
    cut = (m.group(1) if m.re.groups else m.group(0)).strip()
    if not cut:
        raise DatasetError(f"{where}: answer_regex {pattern!r} matched an empty answer in field {key!r}")
    return cut


def _conversation_problem(row: dict, rowno: int, where: str, cfg: DatasetConfig) -> Problem:
    """A whole conversation (multi-turn SFT): ``meta["conversation"]`` holds every message; the prompt is the
    conversation up to its first assistant turn and the answer that turn (what evaluation compares)."""
    msgs = _get(row, cfg.messages_key)
    if not isinstance(msgs, list):
        raise DatasetError(f"{where}: field {cfg.messages_key!r} must be a list of {{'role', 'content'}} messages, got "
                           f"{'nothing' if msgs is _MISSING else type(msgs).__name__}")
    messages = _check_messages(msgs, where, cfg.messages_key)
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise DatasetError(f"{where}: field {cfg.messages_key!r} needs a user turn followed by an assistant turn to "
                           f"train on")
    return Problem(render_plain(messages[:first]), messages[first]["content"],
                   {"row": rowno, "source": str(cfg.path or cfg.hf_name), "messages": messages[:first], "conversation": messages})


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
            problems.append(_row_problem(row, rowno, cfg, tokenizer, label))
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


def key_options(cfg: DatasetConfig) -> dict[str, str]:
    """Each field name ``cfg`` reads, mapped to the option that sets it (``answer`` -> ``data.answer_key``): a
    missing field's error names the option to change."""
    options = {"prompt_key": cfg.prompt_key, "answer_key": cfg.answer_key, "rejected_key": cfg.rejected_key,
               "label_key": cfg.label_key, "messages_key": cfg.messages_key}
    return {key: f"data.{name}" for name, key in reversed(options.items()) if key}


def _required_keys(cfg: DatasetConfig) -> tuple[tuple[str, ...], tuple[str, str] | None]:
    """``(keys, implicit)``: the fields every row of ``cfg`` needs, which a columnar source checks against its
    columns before reading a row, and ``(prompt_key, answer_key)`` when the prompt may be implicit (a row without
    it takes it from an answer of whole conversations, :func:`_implicit_prompt`); a conversation row needs its
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


def _tokenizer_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def render_prompt(tokenizer, problem: Problem, chat_template: bool | None = None,
                  template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The text the model sees for ``problem`` (before tokenization).

    ``chat_template``: None (auto) applies the tokenizer's chat template iff the
    problem has chat messages; True applies it always (a text prompt becomes one
    user message); False never (the ``prompt`` text as is). The generation prompt
    (e.g. ``<|im_start|>assistant``) is appended when the template is applied, unless the messages end with
    an assistant message: that one is continued (TRL's ``continue_final_message``). ``template_kwargs``
    (``data.chat_template_kwargs``): more variables for the template, e.g. ``{"enable_thinking": False}``.
    """
    return _render(tokenizer, problem, chat_template, template_kwargs)[0]


def _render(tokenizer, problem: Problem, chat_template: bool | None,
            template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, bool]:
    """(text, whether the chat template was applied)."""
    messages = problem.meta.get("messages")
    use = (messages is not None) if chat_template is None else bool(chat_template)
    if not use:
        return problem.prompt, False
    if not getattr(tokenizer, "chat_template", None):
        why = ("the prompt is chat messages (the row's, or its text with data.system_prompt's message)"
               if chat_template is None else "chat_template=True")
        raise DatasetError(
            f"{why} but tokenizer {_tokenizer_name(tokenizer)!r} has no chat template; give the run one with "
            "model.chat_template (a Jinja file, a tokenizer directory or the template itself; relayrl eval: "
            "--chat-template), or set data.chat_template=false to encode the prompt as plain text"
        )
    msgs = messages if messages is not None else [{"role": "user", "content": problem.prompt}]
    tools = problem.meta.get("tools")  # the run's tools, in the template's tools list (env.tools_in_prompt)
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    # a prompt that ends with the assistant's own words (a prefill: "The answer is") is continued, as TRL renders
    # it (continue_final_message): no end of turn and no new assistant turn after it
    prefill = msgs[-1].get("role") == "assistant"
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=not prefill,
                                         continue_final_message=prefill, **extra), True


def prompt_identity(problem: Problem) -> str:
    """What decides ``problem``'s prompt ids besides a run's template options: its text, and its chat messages and
    tools where it has them (a chat row and a text row whose plain text agrees, e.g. ``user: hi``, encode apart;
    so do two rows that offer other tools). A cache of encoded prompts is keyed on it."""
    messages, tools = problem.meta.get("messages"), problem.meta.get("tools")
    if messages is None and tools is None:
        return problem.prompt
    return json.dumps([problem.prompt, messages, tools], sort_keys=True, default=str)


def encode_prompt(tokenizer, problem: Problem, chat_template: bool | None = None,
                  template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids ``[L]`` of ``problem``'s prompt (see :func:`render_prompt` for ``chat_template``).

    Templated text already carries its special tokens, so the tokenizer adds none
    then; plain text gets the tokenizer's usual special tokens (e.g. a BOS).
    """
    text, templated = _render(tokenizer, problem, chat_template, template_kwargs)
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
