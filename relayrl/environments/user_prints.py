"""What user code run in-process (an environment's methods, a tool) prints stays off the console.

A user environment's ``reset``/``step`` and a user tool (a function or a tool object of ``env.tools``) run in
the environment's worker threads, many calls at once, thousands a step: a ``print`` in them, left alone,
streams into the trainer's console and log. What they give the model is what they *return* (capped to the
observation's size); what they print is kept off the console, and said once per run for each tool and each
environment class: one log line naming it, how much it printed and the start of the first line, so a user
debugging it knows where the prints went (log them, or return them).

The capture is per thread: while a call runs, ``sys.stdout`` and ``sys.stderr`` are a router that sends
what the calling thread writes to a buffer (``max_chars`` kept) and what any other thread writes to the
stream it replaced; the last call to end puts the streams back (a call that never ends, a hung step, keeps
only its own router: streams replaced since, by pytest's capture say, get a router of their own). A capture
inside another (a tool called in an environment's ``step``) has a buffer of its own for the block, so each
print is said of the code that made it. Output written to the file descriptors themselves (a subprocess, C code) is not Python's
``sys.stdout`` and is not caught. The python tool's sandbox is apart: its output is read from pipes, capped
by ``sandbox.output_bytes``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Iterator

__all__ = ["captured_prints", "note_tool_prints", "note_env_prints"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_local = threading.local()
_noted: set[tuple[str, str]] = set()  # (kind, name) said this run


class _Capture:
    """What one call printed: the first ``max_chars`` characters and the total count."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars, self.chars, self.parts = max_chars, 0, []

    def write(self, text: str) -> None:
        room = self.max_chars - self.chars  # (what is kept is the first max_chars of all that was written)
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
        self.base, self.active = base, 0  # (active: the captures that use this router now)

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
    outer = getattr(_local, "capture", None)
    if outer is not None:  # (a tool in an environment's step: its prints are its own, the streams stay routed)
        _local.capture = cap = _Capture(max_chars)
        try:
            yield cap
        finally:
            _local.capture = outer
        return
    with _lock:  # (a router over the streams now in place: one installed over streams replaced since is not)
        routers = (_routed("stdout"), _routed("stderr"))
    _local.capture = cap = _Capture(max_chars)
    try:
        yield cap
    finally:
        _local.capture = None
        with _lock:
            for name, r in zip(("stdout", "stderr"), routers):
                r.active -= 1
                # (the last call through it puts the stream back, if it is still ours: one replaced during
                # the call, pytest's capture say, is theirs; a call that hung keeps only its own router)
                if r.active == 0 and getattr(sys, name) is r:
                    setattr(sys, name, r.base)


def _routed(name: str) -> "_Router":
    """``sys.<name>``'s router (installed if the stream is not one), counting one more call (held: ``_lock``)."""
    r = getattr(sys, name)
    if not isinstance(r, _Router):
        r = _Router(r)
        setattr(sys, name, r)
    r.active += 1
    return r


def note_tool_prints(tool: str, cap: _Capture) -> None:
    """Say once per tool per process (a run) that ``tool`` printed, and where its prints went."""
    if _first(("tool", tool), cap):
        log.warning("tool %r printed %d characters in a call (first line: %r); a tool's prints are kept off the "
                    "console (said once per tool): its result for the model is what it returns; log with "
                    "logging to see them", tool, cap.chars, _first_line(cap))


def note_env_prints(env_class: str, method: str, cap: _Capture) -> None:
    """Say once per environment class per process (a run) that its ``method`` printed, and where that went."""
    if _first(("environment", env_class), cap):
        log.warning("environment %r printed %d characters in %s (first line: %r); an environment's prints are "
                    "kept off the console (said once per environment class): what the model sees is what reset "
                    "and step return; log with logging to see them", env_class, cap.chars, method, _first_line(cap))


def _first(key: tuple[str, str], cap: _Capture) -> bool:
    """``cap`` holds output and ``key`` has not been said yet this process (now it has)."""
    if not cap.chars:
        return False
    with _lock:
        if key in _noted:
            return False
        _noted.add(key)
    return True


def _first_line(cap: _Capture) -> str:
    return cap.text.strip().splitlines()[0][:120] if cap.text.strip() else ""
