"""Ctrl-C during work the main thread runs inline (the colocated step's rollout stream) stops the run: it is
raised on the main thread, not only stored in the work's future (a run once hung at Ctrl-C, its driver waiting
for a stream that had swallowed the interrupt)."""

from __future__ import annotations

import pytest

from relayrl.cluster import compute


def _interrupted():
    raise KeyboardInterrupt


def test_a_keyboard_interrupt_in_inline_work_reaches_the_main_thread():
    with compute.inline():
        with pytest.raises(KeyboardInterrupt):
            compute.submit(_interrupted)


def test_other_errors_of_inline_work_stay_in_its_future():
    def fails():
        raise ValueError("boom")

    with compute.inline():
        fut = compute.submit(fails)
    with pytest.raises(ValueError, match="boom"):
        fut.result()
