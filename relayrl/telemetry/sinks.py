"""Metric sinks: console (a tqdm bar on a terminal, plain lines in a log file; a periodic table),
metrics.jsonl, TensorBoard, W&B.

Each sink receives `(step, metrics)` once per `Tracker.log` call. On resume
(start_step > 0) the file sinks drop what the crashed run wrote after the
checkpoint, so a resumed run leaves the same files as an uninterrupted one:
JSONL keeps lines with step <= start_step, TensorBoard uses the event
writer's `purge_step`, W&B resumes the same run id with `resume="allow"`.

Non-finite values are written to JSONL as `null` (strict JSON has no NaN);
TensorBoard and W&B receive them as floats.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from tqdm.auto import tqdm

from relayrl.errors import UserError

Number = float | int

METRICS_FILE = "metrics.jsonl"  # a run's metrics, one JSON record a line (RUN_DIR/metrics.jsonl)


class Sink(Protocol):
    """Anything that accepts one step of metrics and can be closed."""

    def log(self, step: int, metrics: Mapping[str, Number]) -> None: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- jsonl


class MetricsFileError(UserError, ValueError):
    """A metrics.jsonl that cannot be read, naming the file and the line."""


def read_jsonl_records(path: Path, skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse a metrics.jsonl (or samples.jsonl) file; a torn last line (killed mid-write, even inside a
    character) is skipped.

    A malformed line elsewhere raises MetricsFileError naming the file and line.
    ``skipped``, when given, receives a sentence per line skipped.
    """
    data = _drop_cut_character(Path(path), Path(path).read_bytes(), skipped)
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise MetricsFileError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); the file is damaged or "
                               f"is not a {Path(path).name}") from None
    records: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines):
                if skipped is not None:
                    skipped.append(f"{path}:{lineno}: skipped the last line, which is not valid JSON ({exc.msg}); "
                                   f"the run was probably killed while writing it")
                break  # the writer died mid-line; everything before is intact
            raise MetricsFileError(f"{path}:{lineno}: not valid JSON ({exc.msg}); the file is damaged: fix or "
                                   f"delete that line") from exc
        if not isinstance(record, dict) or "step" not in record:
            raise MetricsFileError(f"{path}:{lineno}: expected an object with a 'step' key; the file is damaged: "
                                   f"fix or delete that line")
        if not isinstance(record["step"], int) or isinstance(record["step"], bool):
            raise MetricsFileError(f"{path}:{lineno}: 'step' is {record['step']!r}, not an integer; the file is "
                                   f"damaged: fix or delete that line")
        records.append(record)
    return records


def _drop_cut_character(path: Path, data: bytes, skipped: list[str] | None) -> bytes:
    """``data`` without a last line that has no newline and is cut inside a UTF-8 character (a writer killed
    between two chunks of a write: samples.jsonl keeps responses as UTF-8), said in ``skipped``."""
    cut = data.rfind(b"\n") + 1
    try:
        data[cut:].decode("utf-8")
    except UnicodeDecodeError:
        if skipped is not None:
            lineno = data.count(b"\n", 0, cut) + 1
            skipped.append(f"{path}:{lineno}: skipped the last line, which is cut inside a character; the run was "
                           f"probably killed while writing it")
        return data[:cut]
    return data


class JsonlSink:
    """Appends `{"step": s, **metrics}` per call to RUN_DIR/metrics.jsonl, flushed per line."""

    def __init__(self, path: Path, *, start_step: int = 0) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = _open_records(self.path, start_step)

    def log(self, step: int, metrics: Mapping[str, Number]) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path}: JSONL sink is closed")
        record: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            record[key] = value if math.isfinite(value) else None
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _open_records(path: Path, start_step: int) -> IO[str]:
    """A JSONL file of ``{"step": s, ...}`` records opened for appending: a fresh run's (truncated), or a resumed
    run's with the records after ``start_step`` dropped (what the crashed run wrote after its checkpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if start_step > 0 and path.exists():
        kept = [r for r in read_jsonl_records(path) if r["step"] <= start_step]
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in kept:
                f.write(json.dumps(r, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return open(path, "a", encoding="utf-8")
    return open(path, "w", encoding="utf-8")  # a fresh run owns the file


class SampleSink:
    """Appends a step's sampled responses to RUN_DIR/samples.jsonl, one ``{"step": s, **sample}`` line each
    (``telemetry.samples_per_step``)."""

    def __init__(self, path: Path, *, start_step: int = 0) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = _open_records(self.path, start_step)

    def write(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path}: sample sink is closed")
        for sample in samples:
            clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in sample.items()}
            self._file.write(json.dumps({"step": step, **clean}, ensure_ascii=False, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ----------------------------------------------------------------------------- console


def _fmt(value: Number) -> str:
    if isinstance(value, int):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


def format_table(step: int, total_steps: int, metrics: Mapping[str, Number], width: int = 100) -> str:
    """A compact aligned table: one block per metric group (the key prefix before '/').

    Example:
        ── step 20/100 ──
        actor   entropy=1.23  kl=0.0012
        reward  mean=0.45  std=0.21
    """
    groups: dict[str, list[tuple[str, Number]]] = {}
    for key in sorted(metrics):
        group, _, name = key.partition("/")
        if not name:
            group, name = "-", key
        groups.setdefault(group, []).append((name, metrics[key]))
    label = max((len(g) for g in groups), default=1)
    lines = [f"── step {step}/{total_steps} " + "─" * max(0, 24 - len(str(step)) - len(str(total_steps)))]
    for group, items in groups.items():
        cells = [f"{name}={_fmt(value)}" for name, value in items]
        prefix = group.ljust(label)
        line, line_has_cell = prefix, False
        for cell in cells:
            if line_has_cell and len(line) + 2 + len(cell) > width:
                lines.append(line)
                line, line_has_cell = " " * label, False
            line += "  " + cell
            line_has_cell = True
        lines.append(line)
    return "\n".join(lines)


class ConsoleSink:
    """Key metrics as a tqdm progress bar on a terminal, or as plain lines where the stream is not one (a log
    file, a pipe, a batch job: a bar's carriage returns would pile up there); plus a table every
    `table_every` steps.

    A plain line (``step 3/100  reward/mean=0.5  ...  (1.2 s/step)``) comes at the first trained step and
    otherwise at most every ``line_every_s`` seconds; a step with a table (step 0, every ``table_every``-th,
    the last) prints a table instead. ``live``: force the bar (True) or the lines (False); None: by the
    stream."""

    def __init__(
        self,
        total_steps: int,
        *,
        key_metrics: Sequence[str],
        table_every: int,
        start_step: int = 0,
        stream: IO[str] | None = None,
        live: bool | None = None,
        line_every_s: float = 10.0,
    ) -> None:
        self.total_steps = total_steps
        self.key_metrics = tuple(key_metrics)
        self.table_every = table_every
        self.stream = stream
        self.line_every_s = line_every_s
        self._latest: dict[str, Number] = {}
        self._step = self._start = start_step
        if live is None:
            isatty = getattr(stream if stream is not None else sys.stderr, "isatty", None)
            live = bool(isatty and isatty())
        self._bar = tqdm(total=total_steps, initial=start_step, file=stream, dynamic_ncols=True, unit="step",
                         desc="train", leave=True) if live else None
        self._t0 = time.monotonic()
        self._line_at: float | None = None  # when the last plain line was written

    def log(self, step: int, metrics: Mapping[str, Number]) -> None:
        self._latest.update(metrics)
        postfix = {k: _fmt(self._latest[k]) for k in self.key_metrics if k in self._latest}
        table = bool(self.table_every) and (step % self.table_every == 0 or step == self.total_steps)
        if self._bar is not None:
            self._bar.update(max(0, step - self._step))
            self._bar.set_postfix(postfix, refresh=True)
        elif step > self._step:
            now = time.monotonic()
            due = (self._line_at is None or step == self.total_steps
                   or now - self._line_at >= self.line_every_s)
            if due and not table:
                per = (now - self._t0) / (step - self._start)
                cells = "  ".join(f"{k}={v}" for k, v in postfix.items())
                self.write(f"step {step}/{self.total_steps}  {cells}  ({per:.3g} s/step)")
            if due or table:
                self._line_at = now
        self._step = max(self._step, step)
        if table:
            self.write(format_table(step, self.total_steps, metrics))

    def write(self, msg: str) -> None:
        tqdm.write(msg, file=self.stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ----------------------------------------------------------------------------- tensorboard


class TensorBoardSink:
    """Scalars to RUN_DIR/tensorboard via torch.utils.tensorboard (tensorboard event files)."""

    def __init__(self, log_dir: Path, *, start_step: int = 0, run_config: Mapping[str, Any] | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events at or after it that a crashed run left behind.
        self._writer = SummaryWriter(
            log_dir=str(log_dir), purge_step=start_step + 1 if start_step > 0 else None
        )
        if run_config is not None and start_step == 0:
            text = json.dumps(run_config, indent=2, default=str)
            self._writer.add_text("config", "```\n" + text + "\n```", global_step=0)

    def log(self, step: int, metrics: Mapping[str, Number]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# ----------------------------------------------------------------------------- wandb


class WandbSink:
    """Weights & Biases run; the run id is kept in RUN_DIR/wandb_run_id so a resume continues it."""

    def __init__(
        self,
        run_dir: Path,
        *,
        project: str | None,
        mode: str,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        import wandb

        id_file = Path(run_dir) / "wandb_run_id"
        if id_file.exists():
            run_id = id_file.read_text(encoding="utf-8").strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n", encoding="utf-8")
        self._run = wandb.init(
            project=project or "relayrl",
            mode=mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            name=Path(run_dir).name,
            config=dict(run_config) if run_config is not None else None,
        )

    def log(self, step: int, metrics: Mapping[str, Number]) -> None:
        self._run.log(dict(metrics), step=step)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """A step's sampled responses as a W&B table under ``samples`` (TRL logs its completions the same way);
        the columns are every key of the samples (``None`` in a row that lacks one)."""
        import wandb

        columns = list(dict.fromkeys(k for s in samples for k in s))
        self._run.log({"samples": wandb.Table(columns=["step", *columns],
                                              data=[[step, *(s.get(c) for c in columns)] for s in samples])},
                      step=step)

    def close(self) -> None:
        self._run.finish()
