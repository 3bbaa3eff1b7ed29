"""Colocated memory (issue 15, item 2): a GRPO step's peak is below the sum of its roles' footprints.

Runs in a fresh process, because the measure is the process's resident set (on a CPU, memory is the
process's): a warm-up run with a small model imports everything first, the large model is built (written
to disk), freed memory goes back to the OS, then the baseline is read, then
a colocated GRPO run with a model large enough (0.75 GB of float32 weights) that its tensors, not the
interpreter, make up the growth. The roles' footprints are the actor's weights, gradients and two Adam
moments (4P), the rollout's weights (P) and the reference's (P). The rollout runs on the actor's
parameters (zero-copy colocation), so the step's peak stays near 5P; without that it would exceed 6P.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from e2e_cli import FAST, records, relayrl

from tests.workflows.test_e2e import _stable

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent('''
    import gc, json, sys, torch
    torch.set_num_threads(1)
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.telemetry import memory
    from relayrl.workflows.pipeline import GRPOPipeline

    def run(overrides, steps):
        wf = GRPOPipeline(load_config(Config, "recipes/arith_grpo.yaml", overrides))
        peaks = {}
        for step in wf.begin():
            m = wf.step(step)
            peaks = {k: max(v, peaks.get(k, 0.0)) for k, v in m.items() if k.startswith("memory/")}
            if step >= steps:
                break
        P = sum(t.numel() * t.element_size() for _, t in wf.actor.one("named_weights")) / 2**30
        shared = wf.shared
        wf.shutdown()
        return peaks, P, shared

    run_dir, common = sys.argv[1], sys.argv[2:]
    run([f"run.dir={run_dir}/warm", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256", *common], 1)
    from relayrl.models.tiny import TinyModelConfig, build_tiny
    build_tiny(TinyModelConfig(hidden_size=2048, intermediate_size=8192, num_layers=3), verbose=False)
    from relayrl.workflows.rollout_worker import _trim_heap
    _trim_heap()  # what the warm-up and the model build freed goes back to the OS
    base = memory.current_gb("cpu")
    peaks, P, shared = run([f"run.dir={run_dir}/big", "model.tiny.hidden_size=2048", "model.tiny.intermediate_size=8192",
                            "model.tiny.num_layers=3", *common], 2)
    print(json.dumps({"base_gb": base, "param_gb": P, "shared": shared, "peaks": peaks}))
''')


@pytest.mark.slow
def test_colocated_step_peak_is_below_the_roles_footprints(tmp_path):
    common = ["run.threads=1", "telemetry.sinks=[jsonl]", "eval.size=4", "data.prompts_per_step=4", "rollout.n=4",
              "algorithm.kl_coef=0.01", "rollout.max_new_tokens=8"]
    r = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), *common], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    P, peaks = out["param_gb"], out["peaks"]
    assert out["shared"] and P > 0.7
    assert {"memory/generate_peak_gb", "memory/ref_logprob_peak_gb", "memory/update_peak_gb"} <= set(peaks)
    growth = max(peaks.values()) - out["base_gb"]
    footprints = 4 * P + P + P  # actor (weights, gradients, Adam moments) + rollout + reference
    assert growth < footprints, f"peak grew {growth:.2f} GB over the baseline, roles' footprints {footprints:.2f} GB"
    assert growth > 4 * P  # the measure sees the actor's state at all (a probe that reads nothing would pass)


@pytest.mark.slow
@pytest.mark.parametrize("rollout_dtype", ["float32", "bfloat16"])
def test_offload_does_not_change_the_run(sft_model, tmp_path, rollout_dtype):
    """trainer.offload moves the idle roles to host and back between phases; the run's numbers are the same.
    float32: the rollout runs on the actor's parameters (zero-copy), so only the actor's Adam state and the
    reference move; bfloat16: the rollout has its own weights, which leave and come back without their values
    (the relay overwrites them; their buffers must survive)."""
    runs = {}
    for offload in ("false", "true"):
        run = tmp_path / offload
        r = relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={run}", f"trainer.init_from={sft_model}",
                    "trainer.steps=3", "algorithm.kl_coef=0.01", f"rollout.dtype={rollout_dtype}",
                    f"trainer.offload={offload}", *FAST)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[offload] = records(run)
    assert all(x.get("timing/offload_s", 0) > 0 for x in runs["true"][1:])
    assert all("timing/offload_s" not in x for x in runs["false"][1:])
    for a, b in zip(runs["false"], runs["true"]):
        assert _stable(a) == _stable(b), f"step {a['step']} differs"
