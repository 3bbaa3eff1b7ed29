"""Checkpoint of a partition's unfinished rows (``Dock.state_dict`` / ``Dock.load_state_dict``).

A simple version for asynchronous workflows that stop mid-step: the state
holds the partition's declaration, every registered stage's spec and
acknowledged rows, and the data of every row some stage has not acknowledged
yet. Rows every stage acknowledged are dropped (they are restored as
acknowledged, without data). Leases are not saved: rows leased at save time
are handed out again after a restore (at-least-once). The state holds plain
Python values and CPU/GPU tensors, so ``torch.save`` can write it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

STATE_VERSION = 1


def partition_state(name: str, part: Any, stages: Mapping[str, Any],
                    read: Callable[[str, np.ndarray], list]) -> dict[str, Any]:
    """Snapshot of partition ``name`` (see module docstring): ``part`` is its record, ``stages`` the dock's
    stage controllers, ``read(column, rows)`` the values of ``rows`` of a column from the storage units."""
    with part.lock:
        allocated = part.allocated
        present = {c: p.copy() for c, p in part.present.items()}
    acked = {s: ctl.acked_rows(part.gen) for s, ctl in stages.items()}
    done = np.logical_and.reduce(list(acked.values())) if acked else np.zeros(part.rows, dtype=bool)
    keep = np.flatnonzero(~done[:allocated])
    data = {}
    for c, p in present.items():
        rows = keep[p[keep]]
        if len(rows):
            data[c] = {"indexes": rows.tolist(), "values": read(c, rows)}
    return {
        "version": STATE_VERSION,
        "name": name,
        "rows": part.rows,
        "group_size": part.group_size,
        "columns": None if part.declared is None else sorted(part.declared),
        "allocated": allocated,
        "data": data,
        "stages": {
            s: {
                "columns": list(ctl.spec.columns),
                "whole_groups": ctl.spec.whole_groups,
                "token_columns": list(ctl.spec.token_columns),
                "acked": np.flatnonzero(acked[s]).tolist(),
            }
            for s, ctl in stages.items()
        },
    }


def check_state(state: Mapping[str, Any]) -> None:
    """Refuse a state that :func:`partition_state` did not make (a missing key, another version)."""
    for key in ("version", "name", "rows", "group_size", "allocated", "data", "stages"):
        if key not in state:
            raise KeyError(f"load_state_dict: state has no {key!r}; it was not made by Dock.state_dict")
    if state["version"] != STATE_VERSION:
        raise ValueError(f"load_state_dict: state version {state['version']} is not {STATE_VERSION}")
