"""Stage timeline: spans of generate / reward / log-prob / update / weight relay per worker group.

This records what AsyncFlow (Figure 11) draws as its per-step stage
timeline. Each span is (name, group, step, start, end, pid, tid, attrs); it is
appended as one JSON line to RUN_DIR/spans.jsonl the moment it closes, so a
crash keeps every finished span. `export_chrome_trace` turns the file into
Chrome trace-event JSON (complete "X" events; one process track per worker
group, one thread track per recording process/thread) that Perfetto and
chrome://tracing open.

Clocks: spans timed here use `time.perf_counter` relative to the timeline's
start, and also carry a wall-clock start (`time.time`) so that spans from
other processes (`add_span(..., clock="wall")`) and from a resumed run line up
on one axis. Wall clocks of different machines are only as aligned as NTP
keeps them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

SPANS_FILE = "spans.jsonl"
TRACE_FILE = "trace.json"


@dataclass(frozen=True)
class Span:
    """One timed stage of one step on one worker group."""

    name: str
    """Stage name, e.g. "generate", "reward", "logprob", "update", "weight_relay"."""
    group: str
    """Worker group (track), e.g. "rollout", "actor", "reference", "driver"."""
    step: int
    start: float
    """Seconds since the recording timeline started."""
    end: float
    wall_start: float
    """Wall-clock start, seconds since the epoch (the common axis across processes)."""
    pid: int
    tid: int
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


def read_spans(run_dir: Path) -> list[Span]:
    """All spans in RUN_DIR/spans.jsonl (a torn last line is skipped)."""
    path = Path(run_dir) / SPANS_FILE
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    spans: list[Span] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            spans.append(Span(**json.loads(line)))
        except (json.JSONDecodeError, TypeError) as exc:
            if lineno == len(lines):
                break  # the writer died mid-line
            raise ValueError(f"{path}:{lineno}: not a span record ({exc})") from exc
    return spans


class Timeline:
    """Records spans to RUN_DIR/spans.jsonl and sums their durations per step (until `forget`).

    Thread-safe. With `start_step > 0` (resume) spans of later steps left by
    the crashed run are dropped; with `start_step == 0` the file starts empty.
    """

    def __init__(self, run_dir: Path, *, start_step: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / SPANS_FILE
        self._perf0 = time.perf_counter()
        self._wall0 = time.time()
        self._lock = threading.Lock()
        self._sums: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        if start_step > 0 and self.path.exists():
            kept = [s for s in read_spans(self.run_dir) if s.step <= start_step]
            tmp = self.path.with_name(SPANS_FILE + ".tmp")
            tmp.write_text("".join(json.dumps(asdict(s)) + "\n" for s in kept), encoding="utf-8")
            os.replace(tmp, self.path)
            self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")
        else:
            self._file = open(self.path, "w", encoding="utf-8")

    @contextmanager
    def span(self, name: str, group: str, step: int, **attrs: Any) -> Iterator[None]:
        """Time the body as one span; recorded (with attrs["error"]) even if the body raises."""
        t0 = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            attrs = {**attrs, "error": type(exc).__name__}
            raise
        finally:
            t1 = time.perf_counter()
            self.add_span(name, group, step, t0, t1, clock="perf", **attrs)

    def add_span(
        self,
        name: str,
        group: str,
        step: int,
        start: float,
        end: float,
        *,
        clock: Literal["wall", "perf"] = "wall",
        pid: int | None = None,
        tid: int | None = None,
        **attrs: Any,
    ) -> Span:
        """Record a span measured elsewhere.

        Args:
            start, end: `time.time()` values (clock="wall", e.g. returned by a
                remote worker) or `time.perf_counter()` values of this process
                (clock="perf").
            pid, tid: the recording process/thread (defaults: this one); each
                distinct (group, pid, tid) becomes one track in the trace.
            attrs: extra JSON-able fields (e.g. tokens=4096), shown in the trace.
        """
        if end < start:
            raise ValueError(f"span '{name}' (group '{group}', step {step}): end {end} is before start {start}")
        if clock == "perf":
            rel = start - self._perf0
        elif clock == "wall":
            rel = start - self._wall0
        else:
            raise ValueError(f"clock must be 'wall' or 'perf', got {clock!r}")
        try:
            json.dumps(attrs)
        except TypeError as exc:
            raise TypeError(f"span '{name}' attrs must be JSON-serialisable: {exc}") from exc
        span = Span(
            name=name,
            group=group,
            step=int(step),
            start=rel,
            end=rel + (end - start),
            wall_start=self._wall0 + rel,
            pid=os.getpid() if pid is None else int(pid),
            tid=threading.get_ident() if tid is None else int(tid),
            attrs=dict(attrs),
        )
        line = json.dumps(asdict(span)) + "\n"
        with self._lock:
            if self._file is None:
                raise RuntimeError(f"{self.path}: timeline is closed")
            self._file.write(line)
            self._file.flush()
            self._sums[span.step][name] += span.duration
        return span

    def durations(self, step: int) -> dict[str, float]:
        """Seconds per span name recorded for `step` (summed over groups and repeats)."""
        with self._lock:
            return dict(self._sums.get(step, {}))

    def timing_metrics(self, step: int) -> dict[str, float]:
        """`durations(step)` keyed as metrics: {"timing/<name>_s": seconds}."""
        return {f"timing/{name}_s": secs for name, secs in self.durations(step).items()}

    def forget(self, step: int) -> None:
        """Drop the in-memory sums of `step` and of every earlier step (the file keeps their spans): call it once
        a step's figures are read, or the sums grow by a dict a step for the whole run. Earlier steps go too: a
        span recorded after its step was read (the checkpoint's) would otherwise stay for good."""
        with self._lock:
            for old in [s for s in self._sums if s <= step]:
                del self._sums[old]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> "Timeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chrome_trace_events(spans: list[Span]) -> list[dict[str, Any]]:
    """Chrome trace events: one process per group, one thread per (pid, tid) in it.

    Times are microseconds from the earliest span's wall-clock start.
    """
    if not spans:
        return []
    origin = min(s.wall_start for s in spans)
    groups: dict[str, int] = {}
    tracks: dict[tuple[str, int, int], int] = {}
    events: list[dict[str, Any]] = []
    for s in sorted(spans, key=lambda s: s.wall_start):
        if s.group not in groups:
            gid = groups[s.group] = len(groups) + 1
            events.append({"name": "process_name", "ph": "M", "pid": gid, "tid": 0, "args": {"name": s.group}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": gid, "tid": 0, "args": {"sort_index": gid}})
        gid = groups[s.group]
        key = (s.group, s.pid, s.tid)
        if key not in tracks:
            tracks[key] = sum(1 for k in tracks if k[0] == s.group) + 1
            events.append(
                {"name": "thread_name", "ph": "M", "pid": gid, "tid": tracks[key],
                 "args": {"name": f"pid {s.pid} thread {s.tid}"}}
            )
        events.append(
            {
                "name": s.name,
                "cat": s.group,
                "ph": "X",
                "ts": (s.wall_start - origin) * 1e6,
                "dur": s.duration * 1e6,
                "pid": gid,
                "tid": tracks[key],
                "args": {"step": s.step, **s.attrs},
            }
        )
    return events


def export_chrome_trace(run_dir: Path, out_path: Path | None = None) -> Path:
    """Write RUN_DIR/trace.json (Chrome trace-event format) from RUN_DIR/spans.jsonl."""
    run_dir = Path(run_dir)
    if not (run_dir / SPANS_FILE).exists():
        raise FileNotFoundError(f"{run_dir / SPANS_FILE}: no span file; was a Timeline recording this run?")
    out = Path(out_path) if out_path is not None else run_dir / TRACE_FILE
    trace = {"traceEvents": chrome_trace_events(read_spans(run_dir)), "displayTimeUnit": "ms"}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(trace), encoding="utf-8")
    os.replace(tmp, out)
    return out
