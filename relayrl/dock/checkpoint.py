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

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

if TYPE_CHECKING:
    from .dock import Dock

STATE_VERSION = 1


def partition_state(dock: "Dock", name: str) -> dict[str, Any]:
    """Snapshot of partition ``name`` (see module docstring)."""
    part = dock._part(name)
    with dock._lock:
        stages = dict(dock._stages)
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
            data[c] = {"indexes": rows.tolist(), "values": dock._plane.read(part.gen, [c], rows, part.owner[rows], part.schemas)[c]}
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


def restore_partition(dock: "Dock", state: Mapping[str, Any]) -> None:
    """Re-open the partition described by ``state`` in ``dock`` (which must not have it open)."""
    for key in ("version", "name", "rows", "group_size", "allocated", "data", "stages"):
        if key not in state:
            raise KeyError(f"load_state_dict: state has no {key!r}; it was not made by Dock.state_dict")
    if state["version"] != STATE_VERSION:
        raise ValueError(f"load_state_dict: state version {state['version']} is not {STATE_VERSION}")
    name = state["name"]
    dock.open_partition(name, state["rows"], group_size=state["group_size"], columns=state["columns"])
    for stage, spec in state["stages"].items():
        dock.register_stage(stage, spec["columns"], whole_groups=spec["whole_groups"], token_columns=spec["token_columns"])
    part = dock._part(name)
    with part.lock:
        part.allocated = int(state["allocated"])
    for stage, spec in state["stages"].items():
        dock._stages[stage].set_acked(part.gen, np.asarray(spec["acked"], dtype=np.int64))
    for column, cell in state["data"].items():
        dock.put(name, {column: cell["values"]}, indexes=cell["indexes"])
