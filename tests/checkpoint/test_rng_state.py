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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rng_and_cuda_tensors_round_trip(tmp_path):
    from relayrl.checkpoint import CheckpointManager

    gen = torch.Generator(device="cuda").manual_seed(1)
    state = capture_rng_state({"sampler": gen})
    first = (torch.rand(3, device="cuda"), torch.rand(3, device="cuda", generator=gen))
    restore_rng_state(state, {"sampler": gen})
    again = (torch.rand(3, device="cuda"), torch.rand(3, device="cuda", generator=gen))
    assert all(torch.equal(a, b) for a, b in zip(first, again))

    w = torch.randn(4, 4, device="cuda")
    cm = CheckpointManager(tmp_path)
    path = cm.save(1, model_state={"w": w, "tied": w}, optimizer_state=None, scheduler_state=None, trainer_state={})
    ck = cm.load(path, map_location="cuda")
    assert ck.model_state["w"].is_cuda and torch.equal(ck.model_state["tied"], w)
