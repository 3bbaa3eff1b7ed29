"""The CLI's one error boundary: what a user sees when a command fails.

* An error that is the user's to fix (:func:`relayrl.errors.is_user_error`:
  config, data, checkpoint, model path, reward function, run directory,
  missing GPU, a file-system error naming its file) prints ``relayrl: error:``
  and its message (which names the key, file or row and the fix) and exits 2
  for config and argument errors, 1 otherwise, with no traceback.
* The same error raised inside a worker rank arrives as one
  :class:`~relayrl.cluster.errors.WorkerError` carrying the message; it is
  printed as one line naming the group and the ranks that failed.
* A worker that is lost (its process or host died) is printed the same way,
  with the keys that resume the run.
* Ctrl-C prints where the run stopped ("interrupted at step N; resume with
  run.resume=auto ...", or with no checkpoint yet how to start over) and
  exits 130; the ranks of a call still running in the background are stopped, not waited for
  (:mod:`relayrl.cluster.interrupt`, one line says which).
* Anything else is a bug: its traceback is shown as Python shows it.

``--debug`` or ``RELAYRL_DEBUG=1`` prints the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable

from relayrl.errors import ProcessLost, is_user_error, user_message

__all__ = ["DEBUG_ENV", "debug_requested", "run_guarded", "EXIT_INTERRUPTED", "EXIT_TERMINATED", "EXIT_CONFIG",
           "EXIT_USER", "Terminated"]

DEBUG_ENV = "RELAYRL_DEBUG"
EXIT_USER = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM (kill, a scheduler's preemption)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: the run stops as for Ctrl-C (workers shut down, the message names
    the checkpoint to resume from)."""


def debug_requested(flag: bool) -> bool:
    """``--debug`` given, or ``RELAYRL_DEBUG`` set to anything but "", "0", "false", "no"."""
    return flag or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


_LOST_HINT = ("({what} is gone: run.max_restarts=N recreates the worker groups and the dock and resumes from the "
              "last checkpoint by itself; run.resume=auto resumes by hand, or, with no checkpoint yet, "
              "run.overwrite=true starts over)")


def _say(text: str) -> None:
    print(f"relayrl: {text}", file=sys.stderr, flush=True)


def _say_notes(exc: BaseException) -> None:
    """The notes a command added to the error on its way out (``BaseException.add_note``): what to do next."""
    for note in getattr(exc, "__notes__", ()):
        _say(note)


def run_guarded(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace, *, debug: bool) -> int:
    """Run one command; turn user errors, Ctrl-C and SIGTERM into a message and an exit code."""
    import signal
    import threading

    from relayrl.cluster.errors import WorkerError
    from relayrl.config.loader import ConfigError

    term = {"got": False}

    def on_term(signum, frame) -> None:
        term["got"] = True
        raise Terminated("terminated (SIGTERM)")

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return fn(args)
    except KeyboardInterrupt as exc:
        from relayrl.cluster.interrupt import say_stopped, stop_calls_in_flight

        say_stopped(stop_calls_in_flight())  # (a run's loop did it already; a command outside one, here)
        if debug:
            traceback.print_exc()
        _say(str(exc) or "interrupted")  # a RunInterrupted says the step and the checkpoint
        return EXIT_TERMINATED if term["got"] else EXIT_INTERRUPTED
    except WorkerError as exc:
        if exc.lost and exc.user_message is None:  # a process or host went away: not a bug, no traceback
            if debug:
                traceback.print_exc()
            _say(f"error: {exc.brief()}")
            _say_notes(exc)
            _say(_LOST_HINT.format(what="the worker's process or host"))
            return EXIT_USER
        if exc.user_message is None:
            raise
        if debug:
            traceback.print_exc()
        _say(f"error: {exc.brief()}")
        _say_notes(exc)
        if not debug:
            _say(f"(--debug or {DEBUG_ENV}=1 shows the traceback)")
        return EXIT_USER
    except ProcessLost as exc:  # a dock storage unit (its process, actor or host) is gone: not a bug either
        if debug:
            traceback.print_exc()
        _say(f"error: {exc}")
        _say(_LOST_HINT.format(what="a dock storage unit's process or host"))
        return EXIT_USER
    except Exception as exc:
        if not is_user_error(exc):
            raise
        if debug:
            traceback.print_exc()
        _say(f"error: {user_message(exc)}")
        _say_notes(exc)
        if isinstance(exc, ConfigError):
            return EXIT_CONFIG
        if not debug:
            _say(f"(--debug or {DEBUG_ENV}=1 shows the traceback)")
        return EXIT_USER
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
