"""What an in-process tool prints stays off the console.

A user tool (a function or a tool object of ``env.tools``) runs in the environment's worker threads, many
calls at once, thousands a step: a ``print`` in it, left alone, streams into the trainer's console and log.
Its output to the model is what it *returns* (capped to the observation's size); what it prints is kept off
the console, and said once per tool per run: one log line naming the tool, how much it printed and the
start of the first line, so a user debugging a tool knows where its prints went (log them, or return them).

The capture is per thread: while a call runs, ``sys.stdout`` and ``sys.stderr`` are a router that sends
what the calling thread writes to a buffer (``max_chars`` kept) and what any other thread writes to the
stream it replaced; the last call to end puts the streams back. Output written to the file descriptors
themselves (a subprocess the tool starts, C code) is not Python's ``sys.stdout`` and is not caught. The
python tool's sandbox is apart: its output is read from pipes, capped by ``sandbox.output_bytes``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Iterator

__all__ = ["captured_prints", "note_prints"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_local = threading.local()
_active = 0
_saved: tuple[object, object] | None = None
_noted: set[str] = set()


class _Capture:
    """What one call printed: the first ``max_chars`` characters and the total count."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars, self.chars, self.parts = max_chars, 0, []

    def write(self, text: str) -> None:
        room = self.max_chars - sum(len(p) for p in self.parts)
        if room > 0:
            self.parts.append(text[:room])
        self.chars += len(text)

    @property
    def text(self) -> str:
        return "".join(self.parts)


class _Router:
    """``sys.stdout`` (or ``sys.stderr``) while a tool call runs: the capturing thread's writes go to its
    capture, every other thread's to ``base``; the rest (``fileno``, ``isatty``, ``encoding``, ...) is the
    stream's. (Not an ``io.TextIOBase``: its own ``fileno`` raises, and faulthandler or a progress bar in
    another thread would have read that of a stream that has none.)"""

    def __init__(self, base) -> None:
        self.base = base

    def write(self, text: str) -> int:
        cap = getattr(_local, "capture", None)
        if cap is None:
            return self.base.write(text)
        cap.write(str(text))
        return len(text)

    def flush(self) -> None:
        if getattr(_local, "capture", None) is None:
            self.base.flush()

    def __getattr__(self, name: str):  # (encoding, isatty, fileno ... of the stream it stands for)
        return getattr(self.base, name)


@contextlib.contextmanager
def captured_prints(max_chars: int = 4096) -> Iterator[_Capture]:
    """Within the block, what this thread writes to ``sys.stdout``/``sys.stderr`` goes to the yielded
    capture, not the console; other threads' output passes through."""
    global _active, _saved
    if getattr(_local, "capture", None) is not None:  # (a tool calling a tool: the outer capture holds)
        yield _local.capture
        return
    with _lock:
        if _active == 0:
            _saved = (sys.stdout, sys.stderr)
            sys.stdout, sys.stderr = _Router(sys.stdout), _Router(sys.stderr)
        _active += 1
    cap = _Capture(max_chars)
    _local.capture = cap
    try:
        yield cap
    finally:
        _local.capture = None
        with _lock:
            _active -= 1
            if _active == 0 and _saved is not None:
                # (only ours: a stream someone replaced during the call, pytest's capture say, is theirs)
                if isinstance(sys.stdout, _Router):
                    sys.stdout = _saved[0]
                if isinstance(sys.stderr, _Router):
                    sys.stderr = _saved[1]
                _saved = None


def note_prints(tool: str, cap: _Capture) -> None:
    """Say once per tool per process (a run) that ``tool`` printed, and where its prints went."""
    if not cap.chars:
        return
    with _lock:
        if tool in _noted:
            return
        _noted.add(tool)
    first = cap.text.strip().splitlines()[0][:120] if cap.text.strip() else ""
    log.warning("tool %r printed %d characters in a call (first line: %r); a tool's prints are kept off the "
                "console (said once per tool): its result for the model is what it returns; log with "
                "logging to see them", tool, cap.chars, first)
