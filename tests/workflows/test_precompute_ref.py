"""trainer.precompute_ref: the reference scores every row of the steps left in one pass before the first step and
leaves memory; dpo and kto then train as they do with the reference beside them (the same figures at every step,
over several epochs of a shuffled dataset, after a resume)."""

from __future__ import annotations

import gc
import json
import re
import weakref

import pytest

from relayrl.data.tasks import Problem
from relayrl.workflows.dpo import pair_rows, take_pairs
from relayrl.workflows.kto import reference_rows, unpaired
from relayrl.workflows.ref_logps import ReferenceLogps, planned_rows, row_key
from relayrl.workflows.session import PromptSource

SUMS = [(17, 25), (38, 46), (59, 13), (24, 68), (45, 27), (66, 19), (29, 34), (57, 36), (18, 18), (49, 49),
        (77, 15), (28, 55)]


def _pairs(n: int) -> list[Problem]:
    return [Problem(f"{a}+{b}=", str(a + b), {"rejected": str(a + b - 10)}) for a, b in SUMS[:n]]


def test_the_plan_holds_every_row_the_steps_draw_once_keyed_by_text_and_leaves_the_source_where_it_was():
    """Three pairs, two a step, four steps: eight draws over three epochs of per-epoch permutations. The plan is the
    three pairs' six rows, a prompt's rows side by side; the steps then draw only planned rows, in other orders."""
    source = PromptSource(3, problems=_pairs(3))
    draw = lambda take: pair_rows(take_pairs(take, 2))  # noqa: E731 (as train_dpo's)
    plan = planned_rows(source, 4, draw)
    assert source.state()["consumed"] == 0  # the plan drew from a fork
    keys = [row_key(r) for r in plan]
    assert sorted(keys) == sorted(row_key(r) for r in pair_rows(_pairs(3)))
    assert [k[0] for k in keys[0::2]] == [k[0] for k in keys[1::2]]  # a prompt's two rows side by side
    drawn = [row_key(r) for _ in range(4) for r in draw(source.take)]
    assert set(drawn) == set(keys) and len(drawn) == 16
    epochs = [[k[0] for k in drawn[i:i + 6:2]] for i in (0, 6)]  # each epoch: the three prompts, in its order
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1] and source.epoch == 2
    assert planned_rows(source, 0, draw) == []


def test_the_plan_of_a_resumed_run_starts_at_its_data_position():
    source = PromptSource(0, problems=_pairs(12))
    draw = lambda take: pair_rows(take_pairs(take, 2))  # noqa: E731
    whole = planned_rows(source, 4, draw)
    source.take(4)  # two steps done
    left = planned_rows(source, 2, draw)
    assert len(whole) == 16 and len(left) == 8
    assert [row_key(r) for r in left] == [row_key(r) for r in whole[8:]]


def test_kto_plans_each_example_and_the_kl_row_of_its_step():
    """The KL rows pair prompt i with example i - 1's completion of the same step's batch, so the plan holds the
    rows of the batch the step will draw (of a built-in task's fresh draws too)."""
    rows = [Problem("a", "x", {"label": True}), Problem("b", "y", {"label": False}), Problem("c", "z", {"label": True})]
    assert [row_key(r) for r in reference_rows(unpaired(rows))] == [
        ("a", "x"), ("a", "z"), ("b", "y"), ("b", "x"), ("c", "z"), ("c", "y")]
    from relayrl.data.tasks import make_task

    task = make_task("arith", min_digits=2, max_digits=2, carries="inner")
    source = PromptSource(3, task=task)
    draw = lambda take: reference_rows(unpaired(take_pairs(take, 4)))  # noqa: E731 (as train_kto's on arith)
    plan = {row_key(r) for r in planned_rows(source, 3, draw)}
    assert {row_key(r) for _ in range(3) for r in draw(source.take)} == plan


def test_stored_values_are_looked_up_by_row_and_an_unplanned_row_is_named():
    ref = ReferenceLogps(None, None, None)
    ref.stored = {("1+1=", "2"): -1.5, ("1+1=", "3"): -4.0}
    rows = [(Problem("1+1=", "2"), "3"), (Problem("1+1=", "2", {"rejected": "3"}), "2")]
    assert ref(rows, None, 1) == [-4.0, -1.5]
    with pytest.raises(RuntimeError, match=r"step 5 drew the row \(prompt '2\+2=', completion '4'\).*"
                                           r"trainer.precompute_ref=false"):
        ref([(Problem("2+2=", "4"), "4")], None, 5)


def test_config_refusals_name_the_keys():
    from pydantic import ValidationError

    from relayrl.config.schema import Config

    on = {"precompute_ref": True}
    for over, match in ((dict(trainer=on), "workflow grpo's reference scores the responses the policy samples"),
                        (dict(workflow="sft", trainer=on), "workflow sft has no reference model"),
                        (dict(workflow="rm", trainer=on), "workflow rm has no reference model"),
                        (dict(workflow="dpo", dpo={"kind": "simpo"}, trainer=on), "dpo.kind=simpo is reference-free"),
                        (dict(workflow="dpo", dpo={"kind": "orpo"}, trainer=on), "dpo.kind=orpo is reference-free"),
                        (dict(workflow="kto", trainer={**on, "ref_sync_every": 2}),
                         "trainer.ref_sync_every=2 moves the reference")):
        with pytest.raises(ValidationError, match=match):
            Config.model_validate(over)
    for workflow in ("dpo", "kto"):
        assert Config.model_validate(dict(workflow=workflow, trainer=on)).trainer.precompute_ref
    assert not Config().trainer.precompute_ref


# ------------------------------------------------------------------------------------------------ runs

def _run(tmp_path, tiny_dir, capsys, name: str, workflow: str, *over: str) -> tuple[list[dict], dict]:
    """A short run of ``workflow`` on the tiny model; its step records and what the probe saw: ``built`` (the
    worker groups by name), ``ref_alive`` (whether the reference's model was still alive at each update) and
    ``out`` (what the run printed)."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows import dpo, kto, ref_logps
    from relayrl.workflows.offline import OfflineRun
    from relayrl.workflows.trainer_workers import _TrainerWorker

    seen: dict = {"built": [], "ref_alive": []}
    group, update = OfflineRun.group, _TrainerWorker.update

    def recorded_group(self, cls, gname, **kw):
        g = group(self, cls, gname, **kw)
        seen["built"].append(gname)
        if gname == "reference":
            seen["ref_model"] = weakref.ref(g._ranks.worker.engine.model)  # (in-process: the driver's objects)
        return g

    def probed_update(self, *a, **kw):
        gc.collect()
        seen["ref_alive"].append(seen["ref_model"]() is not None)
        return update(self, *a, **kw)

    run_dir = tmp_path / name
    cfg = load_config(Config, f"recipes/arith_{workflow}.yaml", [
        f"run.dir={run_dir}", "eval.size=4", "eval.every=0", "eval.before_training=false", "telemetry.sinks=[jsonl]",
        "run.save_every=0", f"trainer.init_from={tiny_dir}", "engine.optim.lr=1e-2", "engine.optim.warmup_steps=0",
        *(["dpo.nll_weight=0"] if workflow == "dpo" else []), *over])
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(OfflineRun, "group", recorded_group)
        mp.setattr(_TrainerWorker, "update", probed_update)
        mp.setattr(ref_logps, "PROGRESS_EVERY_S", 0.0)  # a progress line after every call but the last
        (dpo.train_dpo if workflow == "dpo" else kto.train_kto)(cfg)
    seen["out"] = capsys.readouterr().out
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in recs if f"{workflow}/loss" in r], seen


def _dataset(tmp_path, workflow: str, n: int) -> list[str]:
    data = tmp_path / f"{workflow}.jsonl"
    if workflow == "dpo":
        rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "rejected": str(a + b - 10)} for a, b in SUMS[:n]]
        keys = []
    else:
        rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b - 10 * (i % 2)), "label": i % 2 == 0}
                for i, (a, b) in enumerate(SUMS[:n])]
        keys = ["data.answer_key=completion"]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["data.task=null", f"data.path={data}", "reward.verifier=exact", *keys]


def _scored(seen: dict) -> list[int]:
    """The row counts the precompute pass logged."""
    return [int(n) for n in re.findall(r"(\d+) reference log-probs in", seen["out"])]


KEYS = {"dpo": ("dpo/loss", "dpo/reward_margin", "dpo/rewards_chosen", "dpo/rewards_rejected", "actor/grad_norm"),
        "kto": ("kto/loss", "kto/kl", "kto/rewards_desirable", "kto/rewards_undesirable", "actor/grad_norm")}


@pytest.mark.slow
@pytest.mark.parametrize("workflow,data", [("dpo", "dataset"), ("kto", "dataset"), ("kto", "arith")])
def test_a_precomputed_reference_trains_as_the_live_one_and_leaves_memory(tmp_path, tiny_dir, capsys,
                                                                         workflow, data):
    """Four steps of four over six rows of a dataset (three epochs, each a new permutation; 4 fresh arith sums a
    step for kto's arith), with the reference beside the policy and precomputed: the same losses, rewards, KL
    estimates and gradient norms at every step (the reference's values of a row computed in another batch agree
    to float rounding). Precomputed, the step log has no reference pass and the reference's model is gone before
    the first update."""
    over = ["trainer.steps=4", "trainer.batch_size=4", *(_dataset(tmp_path, workflow, 6) if data == "dataset" else [])]
    live, seen_live = _run(tmp_path, tiny_dir, capsys, "live", workflow, *over)
    pre, seen = _run(tmp_path, tiny_dir, capsys, "pre", workflow, *over, "trainer.precompute_ref=true")
    assert len(live) == len(pre) == 4
    for a, b in zip(live, pre):
        for k in KEYS[workflow]:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["step"], k)
    assert live[-1][f"{workflow}/loss"] != pytest.approx(live[0][f"{workflow}/loss"], rel=1e-3)  # it trained
    if workflow == "kto":
        # the policy has left its reference, so z0 > 0 used the stored values of the KL rows
        assert max(r["kto/kl"] for r in pre) > 0, [r["kto/kl"] for r in pre]
    assert all("timing/ref_logprob_s" in r for r in live) and not any("timing/ref_logprob_s" in r for r in pre)
    assert seen_live["ref_alive"] == [True] * 4 and seen["ref_alive"] == [False] * 4
    assert "reference" in seen["built"] and _scored(seen_live) == []
    # dpo: six pairs, two rows each; kto on a dataset: six examples and the KL rows of its 16 draws; arith: 16 of each
    n = _scored(seen)
    if workflow == "dpo":  # calls of a step's 8 rows
        assert re.findall(r"precompute_ref: (\d+/\d+) rows \((\d+)%\)", seen["out"]) == [("8/12", "66")]
    fits = {"dpo": n[0] == 12, "kto": 6 < n[0] <= 22 if data == "dataset" else 16 < n[0] <= 32}[workflow]
    assert len(n) == 1 and fits, n


@pytest.mark.slow
def test_a_resumed_run_scores_its_steps_left_and_trains_as_the_whole_run(tmp_path, tiny_dir, capsys):
    """dpo over 12 pairs, two a step: a run cut after step 2 (its checkpoint) and resumed computes the reference
    values again for steps 3 and 4 only, and its steps 3 and 4 are the whole run's."""
    over = ["trainer.batch_size=2", "trainer.precompute_ref=true", "run.save_every=2", *_dataset(tmp_path, "dpo", 12)]
    whole, seen_whole = _run(tmp_path, tiny_dir, capsys, "whole", "dpo", "trainer.steps=4", *over)
    _, seen_cut = _run(tmp_path, tiny_dir, capsys, "cut", "dpo", "trainer.steps=2", *over)
    resumed, seen = _run(tmp_path, tiny_dir, capsys, "cut", "dpo", "trainer.steps=4", "run.resume=auto", *over)
    assert _scored(seen_whole) == [16] and _scored(seen_cut) == [8] and _scored(seen) == [8]
    resumed = [r for r in resumed if r["step"] > 2]
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(whole[2:], resumed):
        for k in KEYS["dpo"]:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["step"], k)


@pytest.mark.slow
def test_a_resumed_run_with_nothing_left_to_train_runs_no_pass(tmp_path, tiny_dir, capsys):
    """A finished run resumed with the same trainer.steps, and one that stopped early at eval.stop_at resumed with
    the target still met: nothing left to train, so the reference scores nothing before saying so."""
    over = ["trainer.batch_size=2", "trainer.precompute_ref=true", "run.save_every=1", *_dataset(tmp_path, "dpo", 6)]
    _, first = _run(tmp_path, tiny_dir, capsys, "done", "dpo", "trainer.steps=2", *over)
    assert _scored(first) == [8]  # (2 steps x 2 pairs x 2 answers)
    _, again = _run(tmp_path, tiny_dir, capsys, "done", "dpo", "trainer.steps=2", "run.resume=auto", *over)
    assert _scored(again) == [] and "precompute_ref" not in again["out"]
    stop = ["eval.every=1", "eval.stop_at=0.0", "trainer.steps=3", *over]
    _, early = _run(tmp_path, tiny_dir, capsys, "early", "dpo", *stop)
    assert "stopping early" in early["out"] or "eval.stop_at" in early["out"], early["out"]
    _, resumed = _run(tmp_path, tiny_dir, capsys, "early", "dpo", *stop, "run.resume=auto")
    assert "nothing left to train" in resumed["out"] and _scored(resumed) == [], resumed["out"]
