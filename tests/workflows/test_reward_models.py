"""workflow rm end to end (runs, resumes exactly, exports a sequence classifier) and GRPO scored by the
reward model it saved (sync and on the streaming dataflow, the verifier logged beside). Slow: CLI runs."""

from __future__ import annotations

import json

import pytest

from e2e_cli import FAST, records, relayrl

VOLATILE = ("timing/", "memory/", "perf/", "params/", "optimizer/state_bytes")  # (sizes: each process's first step)


def _stable(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if not k.startswith(VOLATILE)}


@pytest.fixture(scope="module")
def rm_run(sft_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("rm")
    common = ["trainer.steps=4", "trainer.batch_size=8", "eval.every=2", "run.save_every=1",
              f"trainer.init_from={sft_model}", *FAST]
    r = relayrl("train", "recipes/arith_rm.yaml", f"run.dir={run / 'ref'}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    return run, common


@pytest.mark.slow
def test_rm_workflow_runs_resumes_exactly_and_saves_a_sequence_classifier(rm_run):
    from transformers import AutoModelForSequenceClassification

    run, common = rm_run
    recs = records(run / "ref")
    assert [x["step"] for x in recs] == [0, 1, 2, 3, 4]
    assert recs[0]["eval/pair_accuracy"] == 0.0 and recs[0]["eval/loss"] == pytest.approx(0.6931, abs=1e-3)
    for key in ("rm/loss", "rm/accuracy", "rm/reward_margin", "rm/grad_norm", "eval/pair_accuracy",
                "eval/reward_margin", "eval/accuracy"):
        assert key in recs[-1], key
    model = AutoModelForSequenceClassification.from_pretrained(run / "ref" / "model")
    assert model.config.num_labels == 1 and model.config.architectures == ["Qwen2ForSequenceClassification"]
    cut = run / "cut"  # stopped after step 2, resumed: the same run
    assert relayrl("train", "recipes/arith_rm.yaml", f"run.dir={cut}", *common, "trainer.steps=2").returncode == 0
    r = relayrl("train", "recipes/arith_rm.yaml", f"run.dir={cut}", "run.resume=auto", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout + r.stderr
    b = records(cut)
    assert [x["step"] for x in b] == [0, 1, 2, 3, 4]
    for x, y in zip(recs, b):
        assert _stable(x) == _stable(y), f"step {x['step']} differs"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "dataflow"])
def test_grpo_with_the_reward_model_as_the_only_reward_logs_the_verifier(rm_run, sft_model, tmp_path, mode):
    run, _ = rm_run
    extra = ["placement.pools.rm=1", "placement.reward=rm"] if mode == "dataflow" else []
    r = relayrl("train", "recipes/arith_grpo_rm.yaml", f"run.dir={tmp_path}", "trainer.steps=2",
                f"trainer.init_from={sft_model}", f"reward.model={run / 'ref' / 'model'}", "eval.every=2",
                "reward.normalize=running", "reward.clip=3", *extra, *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    last = records(tmp_path)[-1]
    for key in ("reward/model_mean", "reward/model_std", "reward/verifier_mean", "reward/norm_mean",
                "reward/norm_std", "reward/clip_frac", "reward/raw_mean", "eval/accuracy"):
        assert key in last, key
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["reward"]["verifier_weight"] == 0.0


@pytest.mark.slow
def test_grpo_with_an_llm_judge_counts_its_malformed_verdicts(sft_model, tmp_path):
    # the SFT model as the judge: it answers sums, not "Score: N" verdicts, so many are malformed (scored 0)
    r = relayrl("train", "recipes/arith_grpo.yaml", f"run.dir={tmp_path}", "trainer.steps=1",
                f"trainer.init_from={sft_model}", "reward.verifier_weight=0", f"reward.judge.path={sft_model}",
                "reward.judge.max_new_tokens=4", "reward.judge.malformed_score=0", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    last = records(tmp_path)[-1]
    assert 0 <= last["reward/judge_malformed"] <= 64 and 0 <= last["reward/judge_mean"] <= 1
    assert "reward/verifier_mean" in last and "eval/accuracy" in last


@pytest.mark.slow
def test_rm_on_two_held_out_sets_reports_each(sft_model, tmp_path):
    """data.eval_path lists two files: pair accuracy and margin also per file (eval/pair_accuracy/<stem>), the
    overall figure the pairs' mean of the two."""
    def write(name, sums):
        rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "rejected": str(a + b - 10)} for a, b in sums]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("train.jsonl", [(a, b) for a in range(15, 60, 3) for b in range(17, 40, 7)])
    write("easy.jsonl", [(19, 23), (28, 35), (47, 16)])
    write("hard.jsonl", [(58, 67), (79, 85), (66, 77), (95, 96), (88, 49)])
    r = relayrl("train", "recipes/arith_rm.yaml", f"run.dir={tmp_path / 'run'}", f"trainer.init_from={sft_model}",
                "data.task=null", "data.eval_task_options=null", f"data.path={tmp_path / 'train.jsonl'}",
                f"data.eval_path=[{tmp_path / 'easy.jsonl'},{tmp_path / 'hard.jsonl'}]", "data.rejected_key=rejected",
                "trainer.steps=2", "trainer.batch_size=8", "eval.every=2", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    last = records(tmp_path / "run")[-1]
    easy, hard = last["eval/pair_accuracy/easy"], last["eval/pair_accuracy/hard"]
    assert last["eval/pair_accuracy"] == pytest.approx((3 * easy + 5 * hard) / 8)
    assert "eval/reward_margin/easy" in last and "eval/loss/easy" not in last
