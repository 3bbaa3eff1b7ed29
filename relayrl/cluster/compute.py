"""One thread of the driver process runs the torch work of the workers that live in it.

Why: PyTorch's CPU kernels run on OpenMP, and OpenMP keeps a team of threads for every thread that starts
a parallel region. Measured on a 2-core machine, a model's forward on a second Python thread of a process
whose main thread already used torch ran 2.6x slower than on the main thread (its team and the main
thread's idle one exceed the cores, and the OpenMP runtime then stops spinning between regions). The
dataflow's stages are threads, so an in-process trainer or rollout called from a stage thread paid that on
every pass.

How: while the main thread waits for a step's stage threads (:func:`serve_until`), it runs the calls they
route here (:func:`run`) one at a time, in arrival order; a call from the main thread itself, or made while
nobody serves, runs at once on the caller's thread (so nothing can wait for a server that is not there).
:func:`submit` starts long work (a rollout's generation) without waiting for it: served by the main thread
when it serves, at once when the main thread runs a step's stages one after another (:func:`inline`), on a
thread of its own otherwise (a worker process, whose main thread takes the driver's calls). A device is
time-shared anyway: colocated roles never needed to compute at the same time.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["run", "submit", "serve_until", "serving", "wake", "inline"]

_calls: "queue.SimpleQueue[tuple[Callable, tuple, dict, Future] | None]" = queue.SimpleQueue()
_state = threading.Lock()
_serving = False
_inline = False


def serving() -> bool:
    """Whether the main thread is serving routed calls now."""
    return _serving


def _on_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def _enqueue(fn: Callable, args: tuple, kwargs: dict) -> Future | None:
    """Queue the call for the serving main thread; None when nobody serves (the caller runs it)."""
    fut: Future = Future()
    with _state:
        if not _serving:
            return None
        _calls.put((fn, args, kwargs, fut))
    return fut


def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on the main thread when it serves, else here; returns or raises what it did."""
    if not _on_main():
        fut = _enqueue(fn, args, kwargs)
        if fut is not None:
            return fut.result()
    return fn(*args, **kwargs)


def submit(fn: Callable[..., Any], *args: Any, name: str = "relayrl-compute", **kwargs: Any) -> Future:
    """Start ``fn(*args, **kwargs)`` without waiting: queued for the serving main thread, or on a new daemon
    thread when it does not serve. The future holds its result or error."""
    fut = _enqueue(fn, args, kwargs)
    if fut is not None:
        return fut
    fut = Future()
    if _inline and _on_main():
        _execute(fn, args, kwargs, fut)
        return fut

    def body() -> None:
        _execute(fn, args, kwargs, fut)

    threading.Thread(target=body, name=name, daemon=True).start()
    return fut


def _execute(fn: Callable, args: tuple, kwargs: dict, fut: Future) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - the caller's result() raises it
        fut.set_exception(e)
        if isinstance(e, (KeyboardInterrupt, SystemExit)) and _on_main():
            raise  # Ctrl-C on the main thread stops the run here too, not only whoever reads the future


@contextlib.contextmanager
def inline():
    """On the main thread: while inside, :func:`submit` runs its work at once, here (a step whose stages run
    one after another on this thread: the work it starts is the next thing to do anyway)."""
    global _inline
    if not _on_main():
        yield
        return
    _inline = True
    try:
        yield
    finally:
        _inline = False


def wake() -> None:
    """Make a serving main thread check its ``done()`` now (call it when what it waits for has changed)."""
    _calls.put(None)


def serve_until(start: Callable[[], None], done: Callable[[], bool], poll_s: float = 0.2) -> None:
    """On the main thread: ``start()`` the work (threads that route calls here), then run routed calls until
    ``done()`` is true, then run what is still queued. Anywhere else (or when a serve is already running):
    ``start()``, then wait for ``done()`` without serving."""
    global _serving
    if not _on_main() or _serving:
        start()
        while not done():
            threading.Event().wait(poll_s)
        return
    with _state:
        _serving = True
    try:
        start()
        while not done():
            try:
                item = _calls.get(timeout=poll_s)
            except queue.Empty:
                continue
            if item is not None:
                _execute(*item)
    finally:
        with _state:
            _serving = False
        while True:  # calls queued before serving stopped still run (their callers wait for them)
            try:
                item = _calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                _execute(*item)
