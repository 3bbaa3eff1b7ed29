"""Placement per role and the step modes: what the config accepts and what it refuses, naming the key."""

from __future__ import annotations

import pytest

from relayrl.config.schema import Config
from relayrl.config.plan import step_plan

SPLIT = {"placement": {"pools": {"gen": 1}, "rollout": "gen"}}


def validate(data: dict) -> Config:
    """The config on CPU cores (``model.device=auto`` would count GPUs on a GPU machine, where a single GPU
    cannot hold a split placement), unless the test names a device."""
    model = {"device": "cpu", **data.get("model", {})}
    return Config.model_validate({**data, "model": model})


def refused(data: dict, *words: str) -> None:
    with pytest.raises(ValueError) as info:
        validate(data)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_the_plan_reads_mode_and_placement():
    default = step_plan(validate({}))
    assert default.colocated and default.update == "batch" and default.ahead == 0 and default.mode == "sync"
    assert default.roles == ("actor", "rollout") and default.pools == {"actor": "main", "rollout": "main"}
    split = step_plan(validate(SPLIT))
    assert not split.colocated and split.update == "batch" and split.pools["rollout"] == "gen"
    periodic = step_plan(validate({**SPLIT, "trainer": {"mode": "periodic"}}))
    assert periodic.update == "accumulate" and periodic.mode == "periodic" and not periodic.notes
    ref = step_plan(validate({"algorithm": {"kl_coef": 0.1}, "placement": {"pools": {"r": 1}, "reference": "r"}}))
    assert ref.roles == ("actor", "rollout", "reference") and ref.pools["reference"] == "r"


@pytest.mark.parametrize("over,why", [
    ({"algorithm": {"advantage": "gae"}}, "critic"), ({"algorithm": {"advantage": "reinforce++"}}, "reads the whole batch"),
    ({"trainer": {"mini_batches": 2}}, "mini_batches=2"), ({"trainer": {"epochs": 2}}, "epochs=2")])
def test_a_periodic_step_that_cannot_accumulate_says_so(over, why):
    """Issue 31 item 10: periodic with a critic, a batch-whitened estimator or several optimizer steps per
    batch updated on the whole batch without a word; the plan now says so (printed at start-up)."""
    data = {**SPLIT, **over, "trainer": {"mode": "periodic", **over.get("trainer", {})}}
    plan = step_plan(validate(data))
    assert plan.update == "batch" and plan.mode == "periodic"
    assert len(plan.notes) == 1 and why in plan.notes[0] and "whole batch" in plan.notes[0]


def test_refusals_name_the_key_and_the_fix():
    refused({"trainer": {"mode": "periodic"}}, "trainer.mode=periodic", "placement.rollout=gen")
    refused({"placement": {"pools": {"gen": 64}, "rollout": "gen"}}, "gen=64", "CPU core")
    refused({"placement": {"rollout": "nowhere"}}, "placement.rollout='nowhere'", "placement.pools")
    refused({"placement": {"pools": {"main": 1}}}, "'main' is the actor's pool")
    refused({"trainer": {"tri_model": True}}, "trainer.tri_model", "kl_coef")
    refused({"trainer": {"tri_model": True}, "algorithm": {"kl_coef": 0.1, "kl_in_reward": True}}, "kl_in_reward")
    refused({**SPLIT, "trainer": {"offload": True}}, "trainer.offload")
    refused({**SPLIT, "trainer": {"off_policy_steps": 1, "mode": "periodic"}}, "choose one")
    # old behaviour: without a pool this asked for placement.pools.gen=1 placement.rollout=gen, and adding it
    # gave the "choose one" refusal second; the conflict comes first
    refused({"trainer": {"off_policy_steps": 1, "mode": "periodic"}}, "choose one")
    refused({"rollout": {"partial": True}}, "rollout.partial", "off_policy_steps")
    refused({"trainer": {"off_policy_steps": 1}, "cluster": {"devices": 64}}, "rollout=1", "CPU core")
    refused({"workflow": "sft", **SPLIT}, "workflow grpo")
    refused({**SPLIT, "placement": {**SPLIT["placement"], "nodes": {"gen": "10.0.0.2"}}}, "placement.nodes",
            "cluster.backend=ray")
    refused({"cluster": {"backend": "ray"}, "placement": {"nodes": {"gpu": "10.0.0.2"}}}, "placement.nodes.gpu",
            "no pool 'gpu'")
    refused({"dock": {"nodes": ["10.0.0.2"]}}, "dock.nodes", "dock.backend=ray")
    # old behaviour: "nodes=2: ... set backend='ray'" named neither key as a recipe or the command line spells it
    refused({"cluster": {"nodes": 2}}, "cluster.nodes=2", "set cluster.backend=ray (with cluster.ray_address")
    refused({"workflow": "sft", "reward": {"stream": "sample"}}, "reward.stream=sample", "no rollout")
    # old behaviour: a pool no role names was accepted and ignored (the rollout stayed on main), and with
    # trainer.off_policy_steps its devices were counted on top of the rollout's own pool
    refused({"placement": {"pools": {"gen": 1}}}, "placement.pools.gen=1 holds no role", "placement.rollout=gen")
    refused({"placement": {"pools": {"gen": 1, "rm": 1}, "rollout": "gen"}}, "placement.pools.rm=1 holds no role")
    assert validate({"placement": {"pools": {"rm": 1}, "reward": "rm"}}).placement.pools == {"rm": 1}


def test_off_policy_takes_the_dataflow_with_the_rollout_on_its_own_pool():
    from relayrl.config.schema import offpolicy_placement

    cfg = validate({"trainer": {"off_policy_steps": 1}, "rollout": {"partial": True}})
    plan = step_plan(cfg)
    assert plan.ahead == 1 and plan.partial and plan.update == "accumulate" and plan.pools["rollout"] == "rollout"
    placed = offpolicy_placement(cfg)
    assert placed.placement.split and placed.placement.pools == {"rollout": 1}
    named = validate({**SPLIT, "trainer": {"off_policy_steps": 2}})
    assert offpolicy_placement(named) is named  # a placement that names the rollout's pool is kept


def test_dynamic_sampling_and_remax_are_plan_parts_in_every_mode():
    for extra in ({}, {"trainer": {"mode": "periodic"}}, {"trainer": {"off_policy_steps": 1}}):
        for algo, part in (({"dynamic_sampling": True}, "group_filter"), ({"advantage": "remax"}, "baseline")):
            cfg = validate({**(SPLIT if extra else {}), **extra, "algorithm": algo})
            assert getattr(step_plan(cfg), part)


def test_per_sample_scoring_is_accepted_in_every_placement():
    for extra in ({}, SPLIT, {"trainer": {"off_policy_steps": 1}}):
        assert validate({**extra, "reward": {"stream": "sample"}}).reward.stream == "sample"


def test_tri_model_with_kl_is_accepted_and_has_no_reference_group():
    plan = step_plan(validate({"trainer": {"tri_model": True}, "algorithm": {"kl_coef": 0.05}}))
    assert plan.tri_model and "reference" not in plan.roles


def test_cpu_ranks_share_the_cores_even_where_a_gpu_exists(monkeypatch):
    """A CPU run on a GPU machine got no thread share (the check asked whether CUDA exists, not which device
    the run uses): 8 ranks x 4 threads on 16 cores. Now every rank gets cores / devices."""
    import os

    import torch

    from relayrl.workflows.roles import placed_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    cpu = validate({"model": {"device": "cpu"}, "cluster": {"devices": 4},
                                 "placement": {"pools": {"gen": 4}, "rollout": "gen"}})
    assert placed_config(cpu).run.threads == 2
    assert placed_config(cpu.model_copy(update={"run": cpu.run.model_copy(update={"threads": 3})})).run.threads == 3
    gpu = validate({"model": {"device": "auto"}})  # one pool, GPUs: unchanged
    assert placed_config(gpu).run.threads == 0


def test_the_device_count_asks_torch_only_where_a_gpu_driver_is(monkeypatch):
    """Validation stays torch-free on a machine with no GPU driver (a recipe with extra pools on
    model.device=auto imported torch, 5 s, to learn there was no GPU)."""
    import os
    import sys

    import torch

    from relayrl.config import schema

    def asked():
        raise AssertionError("torch was asked")

    cfg = validate({"model": {"device": "auto"}})
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(os.path, "exists", lambda p: False if p in schema.GPU_NODES else True)
    monkeypatch.setattr(torch.cuda, "is_available", asked)
    assert schema.available_devices(cfg)[0] == "CPU core"
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidiactl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert schema.available_devices(cfg) == ("GPU", 3)


@pytest.mark.parametrize("gpus, fits", [(0, True), (1, False), (2, True)])
def test_a_gpu_placement_is_counted_where_there_are_gpus(monkeypatch, gpus, fits):
    """A split GPU placement (2 GPUs) is refused on a machine with 1 GPU, naming the pools; on a machine with
    none it is a recipe read elsewhere (a laptop planning a GPU run, the recipe tests): accepted, and a run
    there stops at start (model.device=cuda with no GPU)."""
    from relayrl.config import schema

    monkeypatch.setattr(schema, "available_devices", lambda cfg: ("GPU", gpus))
    data = {**SPLIT, "model": {"device": "cuda"}}
    if fits:
        assert validate(data).placement.pools == {"gen": 1}
    else:
        refused(data, "placement needs 2 GPUs (main=1 (cluster.devices), gen=1) but this machine has 1")


def test_the_role_names_are_the_role_table_in_build_order():
    """``ROLES`` named three things (these role names, the workflows' table of Role records, and chat roles);
    the names said "in the order they are built" in an order the table does not build them in."""
    from relayrl.config.plan import ROLE_NAMES
    from relayrl.data.datasets import CHAT_ROLES
    from relayrl.workflows.roles import ROLES

    assert tuple(r.name for r in ROLES) == ROLE_NAMES
    assert "assistant" in CHAT_ROLES and not set(CHAT_ROLES) & set(ROLE_NAMES)


def test_a_role_the_run_does_not_build_cannot_be_placed():
    """Old behaviour: placement.critic on GRPO, placement.reference with kl_coef=0 and placement.teacher without a
    teacher loaded and placed nothing, leaving their pool idle (and taking the placed dataflow)."""
    pools = {"pools": {"p": 1}}
    refused({"placement": {**pools, "critic": "p"}}, "placement.critic=p places the critic",
            "advantage=grpo has none; gae has one", "drop placement.critic")
    refused({"placement": {**pools, "reference": "p"}}, "algorithm.kl_coef=0 and advantage=grpo reads no reference")
    refused({"placement": {**pools, "teacher": "p"}}, "algorithm.distill.teacher is not set")
    assert step_plan(validate({"algorithm": {"advantage": "gae"}, "placement": {**pools, "critic": "p"}})).pools[
        "critic"] == "p"
    assert validate({"algorithm": {"advantage": "online-dpo", "policy_loss": "gpg", "loss_agg": "seq-mean-token-sum"},
                     "placement": {**pools, "reference": "p"}}).placement.reference == "p"
