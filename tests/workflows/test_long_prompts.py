"""``data.max_prompt_tokens`` and ``data.long_prompts`` in a run: the session refuses or leaves out the long rows of
the training and held-out sets before the prompt source is built; a GRPO run trains on the rest and resumes on
the same rows. The tiny model's tokenizer reads each digit as one token and adds no special tokens, so a prompt
of n nines is n tokens long."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import main as cli
from relayrl.cli.boundary import EXIT_CONFIG, EXIT_USER
from relayrl.workflows.session import PromptSource

ROOT = Path(__file__).resolve().parents[2]
LONG = {5: 200, 17: 300, 30: 600}
"""Training rows (1-based) whose prompt is that many nines; the other rows are short sums."""
RUN = [str(ROOT / "recipes" / "arith_grpo.yaml"), "trainer.steps=2", "eval.size=8", "eval.every=0",
       "data.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=6", "telemetry.sinks=[jsonl]",
       "run.threads=1", "run.save_every=0", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256",
       "reward.verifier=exact", "eval.before_training=false"]


@pytest.fixture
def data(tmp_path) -> list[str]:
    """Overrides naming a 40-row training file (rows :data:`LONG` long) and a 5-row held-out file (row 2 long)."""
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps({"prompt": "9" * LONG[i] if i in LONG else f"{i}+{i}=", "answer": str(2 * i)})
                             + "\n" for i in range(1, 41)))
    held.write_text("".join(json.dumps({"prompt": "8" * 250 if i == 2 else f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(1, 6)))
    return ["data.task=null", f"data.path={train}", f"data.eval_path={held}"]


def session(run_dir, recipe: str, *over: str, lines: list[str] | None = None):
    """A :class:`Session` of ``recipe`` with the overrides, logging to ``lines``."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.session import Session

    cfg = load_config(Config, ROOT / "recipes" / recipe, ["reward.verifier=exact", "eval.size=8", "run.threads=1",
                                                          f"run.dir={run_dir}", *over])
    return Session(cfg, log=(lines if lines is not None else []).append)


def test_drop_leaves_out_exactly_the_long_rows_of_both_sets(tmp_path, data, tiny_dir):
    lines: list[str] = []
    s = session(tmp_path / "a", "arith_grpo.yaml", *data, f"model.path={tiny_dir}", "data.max_prompt_tokens=250",
                "data.long_prompts=drop", lines=lines)
    assert [p.meta["row"] for p in s.prompts.problems] == [i for i in range(1, 41) if i not in (17, 30)]
    assert [p.meta["row"] for p in s.eval_problems] == [1, 2, 3, 4, 5]  # 250 tokens: not longer than the cap
    assert "relayrl: data.long_prompts=drop: dropped 2 of 40 training prompts longer than data.max_prompt_tokens=250 " \
           "tokens" in lines, lines
    # without a cap, only the rows the context cannot hold beside the new tokens (512 - 6)
    lines.clear()
    s = session(tmp_path / "b", "arith_grpo.yaml", *data, f"model.path={tiny_dir}", "rollout.max_new_tokens=6",
                "eval.max_new_tokens=300", "data.long_prompts=drop", lines=lines)
    assert [p.meta["row"] for p in s.prompts.problems] == [i for i in range(1, 41) if i != 30]
    assert [p.meta["row"] for p in s.eval_problems] == [1, 3, 4, 5]
    assert "relayrl: data.long_prompts=drop: dropped 1 of 5 held-out prompts too long for the model's " \
           "max_position_embeddings=512 beside eval.max_new_tokens=300 (over 212 tokens)" in lines, lines


def test_an_offline_workflow_caps_its_training_rows_too(tmp_path, data, tiny_dir):
    s = session(tmp_path / "run", "arith_sft.yaml", *data, f"model.path={tiny_dir}", "data.max_prompt_tokens=100",
                "data.long_prompts=drop")
    assert [p.meta["row"] for p in s.prompts.problems] == [i for i in range(1, 41) if i not in LONG]
    assert [p.meta["row"] for p in s.eval_problems] == [1, 3, 4, 5]


def test_fail_refuses_before_training_naming_the_row(capsys, tmp_path, data):
    code = cli.main(["train", *RUN, *data, "data.max_prompt_tokens=100", f"run.dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert code == EXIT_USER, err
    assert "train.jsonl row 5: the prompt is 200 tokens, longer than data.max_prompt_tokens=100; raise " \
           "data.max_prompt_tokens, shorten or drop the row, or set data.long_prompts=drop to leave out every such " \
           "row (2 more too long: rows 17, 30)" in err, err
    assert not (tmp_path / "r").exists()
    code = cli.main(["train", *RUN, *data, "data.max_prompt_tokens=3", "data.long_prompts=drop",
                     f"run.dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG, err
    assert "data.long_prompts=drop would drop all 40 training prompts (longer than data.max_prompt_tokens=3 tokens; " \
           "the shortest is 4 tokens): raise data.max_prompt_tokens to at least 4" in err, err


@pytest.mark.slow  # (two short GRPO runs and a refused resume, a few seconds)
def test_a_grpo_run_trains_on_the_rows_kept_and_resumes_on_the_same_ones(capsys, tmp_path, data, monkeypatch):
    take = PromptSource.take
    taken: list[list[int]] = []
    sources: list[PromptSource] = []

    def recorded(self, n):
        if self not in sources:
            sources.append(self)
        out = take(self, n)
        taken.append([p.meta["row"] for p in out])
        return out

    monkeypatch.setattr(PromptSource, "take", recorded)
    limit = ["data.max_prompt_tokens=100", "data.long_prompts=drop", f"run.dir={tmp_path / 'r'}", "run.save_every=1"]
    assert cli.main(["train", *RUN, *data, *limit]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "dropped 3 of 40 training prompts longer than data.max_prompt_tokens=100 tokens" in out
    assert "dropped 1 of 5 held-out prompts longer than data.max_prompt_tokens=100 tokens" in out
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]
    assert len(taken) == 2 and all(len(rows) == 4 and not set(rows) & set(LONG) for rows in taken), taken
    kept = sources[0].problems
    assert [p.meta["row"] for p in kept] == [i for i in range(1, 41) if i not in LONG]

    # resumed for a third step: the same rows, and the prompts an uninterrupted run would take third
    taken.clear()
    assert cli.main(["train", *RUN, *data, *limit, "trainer.steps=3", "run.resume=auto"]) == 0, capsys.readouterr().err
    assert [p.meta["row"] for p in sources[1].problems] == [p.meta["row"] for p in kept]
    straight = PromptSource(sources[0].seed, problems=kept)
    expected = [[p.meta["row"] for p in take(straight, 4)] for _ in range(3)][2]
    assert taken == [expected], (taken, expected)
    # another cap would train other rows: the checkpoint is refused
    code = cli.main(["train", *RUN, *data, *limit[1:], "data.max_prompt_tokens=250", "trainer.steps=4",
                     "run.resume=auto"])
    err = capsys.readouterr().err
    assert code != 0 and "data.max_prompt_tokens" in err and "another configuration" in err, err


def test_episodes_are_checked_against_the_context_with_their_own_budget(capsys, tmp_path):
    """An episode's response (turns and observations) runs to env.max_tokens, not rollout.max_new_tokens (one
    turn's cap): a budget past the context is refused, in training rows and held-out rows alike."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(20)))
    env = ["env.name=tools", "rollout.stop_strings=['</tool>']", "rollout.max_new_tokens=40", "env.max_tokens=600"]
    toolsum = ["data.task=toolsum", "data.task_options={}", "data.eval_task_options={}"]
    for sets in (["data.task=null", f"data.path={rows}"], toolsum):
        code = cli.main(["train", *RUN, *sets, *env, f"run.dir={tmp_path / 'r'}"])
        err = capsys.readouterr().err
        assert code == EXIT_CONFIG, err
        assert "env.max_tokens=600 new tokens cannot fit in the model's max_position_embeddings=512" in err, err
        assert not (tmp_path / "r").exists()


def test_an_offline_row_whose_answer_outruns_the_context_is_refused_or_dropped(tmp_path, tiny_dir):
    """(SFT trained a short prompt's 2,400-token answer whole, past the tiny model's 512 positions, without a
    word.) The prompt alone fits; prompt + answer + EOS does not."""
    from relayrl.data.errors import DatasetError

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": "7" * 600 if i in (4, 9) else str(2 * i)})
                             + "\n" for i in range(1, 41)))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(1, 9)))
    over = ["data.task=null", f"data.path={train}", f"data.eval_path={held}", f"model.path={tiny_dir}"]
    with pytest.raises(DatasetError, match=r"train.jsonl row 4: the prompt and its answer are 6\d\d tokens with the "
                                           r"EOS, beyond the model's max_position_embeddings=512 .*long_prompts=drop"
                                           r".* \(1 more too long: rows 9\)"):
        session(tmp_path / "a", "arith_sft.yaml", *over)
    lines: list[str] = []
    s = session(tmp_path / "b", "arith_sft.yaml", *over, "data.long_prompts=drop", lines=lines)
    assert not {4, 9} & {p.meta["row"] for p in s.prompts.problems}
    assert any("dropped 2 of" in x and "longer than the model's max_position_embeddings=512" in x for x in lines), lines
