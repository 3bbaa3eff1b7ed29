"""A resume that changed config keys rewrites RUN_DIR/config.json with the resumed run's config and appends what
changed, with the previous config, to RUN_DIR/resumes.jsonl."""

from __future__ import annotations

import json

import pytest

from relayrl.workflows.session import RESUMES_FILE, config_changes, record_resume


def test_config_changes_names_each_changed_leaf_by_its_dotted_key():
    old = {"trainer": {"steps": 2, "optim": {"lr": 1e-3}}, "eval": {"size": 8}, "gone": 1}
    new = {"trainer": {"steps": 4, "optim": {"lr": 1e-3}}, "eval": {"size": 8}, "added": {"x": 1}}
    assert config_changes(old, new) == {"trainer.steps": [2, 4], "gone": [1, "<unset>"],
                                        "added": ["<unset>", {"x": 1}]}
    assert config_changes(old, old) == {}


def test_record_resume_keeps_the_previous_config_and_skips_an_unchanged_one(tmp_path):
    old = {"trainer": {"steps": 2}, "run": {"resume": "never"}}
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert record_resume(tmp_path, 2, {"trainer": {"steps": 2}, "run": {"resume": "auto"}}) == {}
    assert not (tmp_path / RESUMES_FILE).exists()  # run.resume alone is how the session started
    assert record_resume(tmp_path, 2, {"trainer": {"steps": 4}, "run": {"resume": "auto"}}) == {
        "trainer.steps": [2, 4]}
    rec = json.loads((tmp_path / RESUMES_FILE).read_text())
    assert rec["resumed_at_step"] == 2 and rec["changed"] == {"trainer.steps": [2, 4]}
    assert rec["previous_config"] == old


def test_a_damaged_config_json_is_kept_and_the_resume_recorded_against_the_checkpoints_config(tmp_path):
    """A truncated RUN_DIR/config.json (a disk that filled, an editor's crash) was skipped without a word: the
    resume recorded nothing and config.json was overwritten, its text and the changes lost."""
    ck = tmp_path / "checkpoints" / "step-000002"
    ck.mkdir(parents=True)
    saved = {"trainer": {"steps": 2}, "run": {"resume": "never"}}
    (ck / "config.json").write_text(json.dumps(saved))
    (tmp_path / "config.json").write_text('{"trainer": {"ste')
    said: list[str] = []
    changes = record_resume(tmp_path, 2, {"trainer": {"steps": 4}, "run": {"resume": "auto"}}, checkpoint=ck,
                            log=said.append)
    assert changes == {"trainer.steps": [2, 4]}
    assert (tmp_path / "config.json.damaged").read_text() == '{"trainer": {"ste'  # nothing lost
    rec = json.loads((tmp_path / RESUMES_FILE).read_text())
    assert rec["previous_config"] == saved and rec["previous_config_from"] == str(ck / "config.json")
    assert len(said) == 1 and "config.json.damaged" in said[0] and "not valid JSON" in said[0]
    # a missing config.json (deleted): the checkpoint's config is the one compared with too
    (tmp_path / RESUMES_FILE).unlink()
    assert record_resume(tmp_path, 2, {"trainer": {"steps": 4}}, checkpoint=ck, log=said.append) == {
        "trainer.steps": [2, 4], "run": [{"resume": "never"}, "<unset>"]}


def test_a_record_after_a_truncated_resumes_jsonl_starts_a_line_of_its_own(tmp_path):
    """A resumes.jsonl cut mid-record (a crash while it was appended) took the next record onto its broken
    line: neither parsed."""
    (tmp_path / "config.json").write_text(json.dumps({"trainer": {"steps": 2}}))
    (tmp_path / RESUMES_FILE).write_text('{"resumed_at_step": 1, "chan')
    record_resume(tmp_path, 2, {"trainer": {"steps": 4}})
    lines = (tmp_path / RESUMES_FILE).read_text().splitlines()
    assert lines[0] == '{"resumed_at_step": 1, "chan' and json.loads(lines[1])["changed"] == {"trainer.steps": [2, 4]}


@pytest.mark.slow
def test_a_resumed_run_rewrites_config_json_and_records_the_old_one(tmp_path, tiny_dir):
    from grpo_runs import run_grpo

    run = tmp_path / "run"
    run_grpo(run, tiny_dir, "trainer.steps=1", "run.save_every=1")
    first = json.loads((run / "config.json").read_text())
    run_grpo(run, tiny_dir, "trainer.steps=2", "run.save_every=1", "run.resume=auto", "eval.size=6")
    now = json.loads((run / "config.json").read_text())
    assert now["trainer"]["steps"] == 2 and now["eval"]["size"] == 6
    (rec,) = [json.loads(x) for x in (run / RESUMES_FILE).read_text().splitlines()]
    assert rec["resumed_at_step"] == 1 and rec["previous_config"] == first
    assert rec["changed"] == {"trainer.steps": [1, 2], "eval.size": [8, 6]}
