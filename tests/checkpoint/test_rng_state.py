"""capture_rng_state / restore_rng_state over every generator kind."""

import io
import random

import numpy as np
import pytest
import torch

from relayrl.checkpoint import capture_rng_state, restore_rng_state


def _draw(gens):
    return (
        random.random(),
        float(np.random.rand()),
        float(torch.rand(1)),
        float(torch.rand(1, generator=gens["sampler"])),
        float(gens["tasks"].random()),
        gens["np_tasks"].integers(0, 1 << 30),
    )


def test_restore_reproduces_every_generator_after_a_torch_save_round_trip():
    gens = {"sampler": torch.Generator().manual_seed(5), "tasks": random.Random(3), "np_tasks": np.random.default_rng(4)}
    np.random.normal()  # exercise the cached-gaussian field of the legacy state
    state = capture_rng_state(gens)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    first = _draw(gens)
    _draw(gens)
    restore_rng_state(state, gens)
    assert _draw(gens) == first


def test_restore_errors_name_the_generator():
    state = capture_rng_state({"sampler": torch.Generator()})
    with pytest.raises(KeyError, match="no generator named 'tasks'"):
        restore_rng_state(state, {"tasks": random.Random()})
    with pytest.raises(TypeError, match="'sampler' was saved as a torch generator but is now a python one"):
        restore_rng_state(state, {"sampler": random.Random()})
    with pytest.raises(TypeError, match=r"extra_generators\['x'\] is a int"):
        capture_rng_state({"x": 3})
