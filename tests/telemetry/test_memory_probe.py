"""The CPU peak-memory probe says when the kernel refuses to reset the peak (it was swallowed)."""

from __future__ import annotations

import warnings

import pytest

from relayrl.telemetry import memory


def test_a_refused_peak_reset_warns_once(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "_CLEAR_REFS", tmp_path / "no-such-dir" / "clear_refs")
    monkeypatch.setattr(memory, "_warned", False)
    with pytest.warns(RuntimeWarning, match=r"peak resident set of this process could not be reset .*clear_refs: "
                                            r"No such file or directory\); its memory/<phase>_peak_gb figures"):
        assert memory.reset_peak("cpu") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert memory.reset_peak("cpu") is False  # once per process
    assert memory.peak_gb("cpu") > 0

