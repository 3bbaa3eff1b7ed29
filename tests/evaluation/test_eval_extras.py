"""``relayrl eval`` keeps what the reward functions say about each row, as training's ``samples.jsonl`` does: a
verl ``compute_score`` dict's keys beside ``"score"`` (``"pred"``, the answer it extracted) and a TRL function's
``log_extra`` columns are fields of each record of ``eval_samples.jsonl``, greedy and sampled; a column named
like one of the record's own fields is written ``extra_NAME``. (They were dropped.)"""

from __future__ import annotations

import json

import pytest

from relayrl.cli import main as cli

FNS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    ok = solution_str.strip() == ground_truth
    return {"score": float(ok), "acc": ok, "pred": solution_str.strip()[::-1], "answer": "mine"}


def lengths(prompts, completions, log_extra, **kwargs):
    log_extra("chars", [len(c) for c in completions])
    return [0.0 for _ in completions]
'''


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch):
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)


@pytest.mark.slow
def test_eval_samples_hold_a_verl_dicts_extras_and_log_extra_columns(capsys, tiny_dir, tmp_path):
    (tmp_path / "fns.py").write_text(FNS)
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(3)))
    out = tmp_path / "eval"
    code = cli.main(["eval", "--model", str(tiny_dir), "--data", str(data), "--verifier", "user", "--user-fn",
                     f"{tmp_path / 'fns.py'}:compute_score", f"{tmp_path / 'fns.py'}:lengths", "--k", "2",
                     "--temperature", "1.0", "--max-new-tokens", "4", "--size", "3", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    samples = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert [s["mode"] for s in samples] == ["greedy"] * 3 + ["sample@2"] * 6
    for s in samples:
        assert s["pred"] == s["response"].strip()[::-1], s  # (each value with its own response)
        assert s["acc"] is (s["response"].strip() == s["answer"]), s
        assert s["chars"] == len(s["response"]), s
        assert s["extra_answer"] == "mine" and s["answer"] != "mine", s  # (the record's own answer kept)
