"""workflow dpo with the losses beside DPO: SimPO, ORPO and CPO train without a reference model (none is built, no
reference pass), APO with one."""

from __future__ import annotations

import json

import pytest


def _run(run_dir, tiny_dir, *over: str) -> list[dict]:
    """Six steps on the tiny model over the same 8 pairs (a set it can learn within them)."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows import dpo

    data = run_dir / "pairs.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b), "rejected": str(a + b - 10)})
                            + "\n" for a, b in [(17, 25), (38, 46), (59, 13), (24, 68), (45, 27), (66, 19),
                                                (29, 34), (57, 36), (18, 18), (49, 49), (77, 15), (28, 55)]))
    cfg = load_config(Config, "recipes/arith_dpo.yaml", [
        f"run.dir={run_dir / 'run'}", "data.task=null", f"data.path={data}", "reward.verifier=exact",
        "trainer.steps=6", "trainer.batch_size=8", "eval.size=4", "eval.every=0",
        "telemetry.sinks=[jsonl]", "run.save_every=0", f"trainer.init_from={tiny_dir}", "engine.optim.lr=1e-2",
        "engine.optim.warmup_steps=0", "dpo.nll_weight=0", *over])
    dpo.train_dpo(cfg)
    return [json.loads(x) for x in (run_dir / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("over", [("dpo.kind=simpo", "dpo.beta=2.0", "dpo.gamma=0.5"), ("dpo.kind=orpo",),
                                  ("dpo.kind=cpo", "dpo.nll_weight=1.0"), ("dpo.kind=apo_zero",)],
                         ids=["simpo", "orpo", "cpo", "apo_zero"])
def test_preference_kind_trains(tmp_path, tiny_dir, monkeypatch, over):
    from relayrl.workflows import dpo

    built, orig = [], dpo.OfflineRun.group  # the worker groups the run builds, by name
    monkeypatch.setattr(dpo.OfflineRun, "group", lambda self, cls, name, **kw: built.append(name) or
                        orig(self, cls, name, **kw))
    recs = [r for r in _run(tmp_path, tiny_dir, *over) if "dpo/loss" in r]
    assert len(recs) == 6
    free = over[0] in ("dpo.kind=simpo", "dpo.kind=orpo", "dpo.kind=cpo")
    assert ("reference" in built) is not free and {"actor", "rollout"} <= set(built)
    assert all(("timing/ref_logprob_s" in r) is not free for r in recs)  # the step log: no reference pass
    if over[0] == "dpo.kind=orpo":
        assert all("dpo/log_odds_ratio" in r for r in recs)
    if over[0] == "dpo.kind=cpo":  # the paper's L_prefer + L_NLL: the chosen answers' NLL is in the loss
        assert all(0.0 < r["dpo/loss"] - r["dpo/nll_chosen"] < 1.0 for r in recs)  # ~log 2 per pair at the start
    first, last = recs[0], recs[-1]
    assert last["dpo/loss"] < first["dpo/loss"] and last["dpo/reward_margin"] > first["dpo/reward_margin"], (
        [(r["dpo/loss"], r["dpo/reward_margin"]) for r in recs])
