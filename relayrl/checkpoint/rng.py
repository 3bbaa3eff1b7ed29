"""Capture and restore every random-number generator a run draws from.

Global generators: Python `random`, NumPy's legacy global state, torch CPU,
and torch CUDA (all devices, when CUDA is initialised). Named extra generators
cover the ones a component owns (the generation sampler's `torch.Generator`,
a task generator's `random.Random` or `numpy.random.Generator`).

The captured state holds only tensors, ints, strings, tuples, lists and dicts,
so `torch.load(..., weights_only=True)` can read it back.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any, Union

import numpy as np
import torch

ExtraGenerator = Union[torch.Generator, np.random.Generator, random.Random]


def _capture_one(name: str, gen: ExtraGenerator) -> dict[str, Any]:
    if isinstance(gen, torch.Generator):
        return {"kind": "torch", "device": str(gen.device), "state": gen.get_state()}
    if isinstance(gen, np.random.Generator):
        return {"kind": "numpy", "state": gen.bit_generator.state}
    if isinstance(gen, random.Random):
        return {"kind": "python", "state": gen.getstate()}
    raise TypeError(
        f"extra_generators['{name}'] is a {type(gen).__name__}; expected torch.Generator, "
        "numpy.random.Generator or random.Random"
    )


def capture_rng_state(extra_generators: Mapping[str, ExtraGenerator] | None = None) -> dict[str, Any]:
    """Snapshot of all global RNGs plus the named `extra_generators`."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "algorithm": str(np_state[0]),
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "extra": {name: _capture_one(name, gen) for name, gen in (extra_generators or {}).items()},
    }
    return state


def restore_rng_state(state: Mapping[str, Any], extra_generators: Mapping[str, ExtraGenerator] | None = None) -> None:
    """Put every generator back to `state` (from `capture_rng_state`).

    Raises KeyError naming a generator in `extra_generators` that the state
    does not hold, and TypeError when its kind differs from the saved one.
    CUDA states are restored when this process has as many CUDA devices;
    otherwise a warning says they were skipped.
    """
    for key in ("python", "numpy", "torch"):
        if key not in state:
            raise KeyError(f"RNG state has no '{key}' entry; it was not made by capture_rng_state")
    random.setstate(_as_tuple(state["python"]))
    npst = state["numpy"]
    np.random.set_state(
        (npst["algorithm"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda", [])
    if cuda_states:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            warnings.warn(
                f"checkpoint holds CUDA RNG states for {len(cuda_states)} device(s) but this process has {have}; "
                "CUDA RNG not restored",
                stacklevel=2,
            )
    saved_extra = state.get("extra", {})
    for name, gen in (extra_generators or {}).items():
        if name not in saved_extra:
            raise KeyError(
                f"RNG state has no generator named '{name}' (saved: {sorted(saved_extra)}); "
                "pass the same extra_generators names to capture and restore"
            )
        saved = saved_extra[name]
        kind = _capture_one(name, gen)["kind"]
        if saved["kind"] != kind:
            raise TypeError(f"generator '{name}' was saved as a {saved['kind']} generator but is now a {kind} one")
        if kind == "torch":
            gen.set_state(saved["state"])
        elif kind == "numpy":
            gen.bit_generator.state = saved["state"]
        else:
            gen.setstate(_as_tuple(saved["state"]))


def _as_tuple(value: Any) -> Any:
    """random.setstate needs tuples; a round trip through some serialisers yields lists."""
    if isinstance(value, list):
        return tuple(_as_tuple(v) for v in value)
    return value
