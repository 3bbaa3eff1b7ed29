"""A base model (its tokenizer has no chat template) trained on chat-message prompts with ``model.chat_template``:
refused without it, trained with it, and the run's exported model renders as the run did."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from relayrl.cli import main as cli
from relayrl.cli.boundary import EXIT_USER
from relayrl.data.datasets import encode_prompt
from relayrl.data.tasks import Problem
from relayrl.models.load import load_tokenizer

pytestmark = pytest.mark.slow  # (tiny GRPO and SFT runs, relayrl eval: seconds each)

ROOT = Path(__file__).resolve().parents[2]
MARKERS = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
           "{% if add_generation_prompt %}<<assistant>>{% endif %}")
RUN = [str(ROOT / "recipes" / "arith_grpo.yaml"), "trainer.steps=1", "eval.size=4", "eval.every=0",
       "eval.before_training=false", "data.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4",
       "telemetry.sinks=[jsonl]", "run.threads=1", "reward.verifier=exact",
       "model.device=cpu"]


@pytest.fixture
def bare(tiny_dir, tmp_path) -> Path:
    """The tiny model with its chat template removed, as a base model's directory is."""
    d = Path(shutil.copytree(tiny_dir, tmp_path / "base"))
    (d / "chat_template.jinja").unlink()
    assert load_tokenizer(d).chat_template is None
    return d


@pytest.fixture
def chats(tmp_path) -> list[str]:
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}="}], "answer": str(2 * i)})
                            + "\n" for i in range(1, 13)))
    return ["data.task=null", f"data.path={rows}"]


def test_a_base_model_trains_on_chat_prompts_with_the_runs_template(capsys, monkeypatch, tmp_path, bare, chats):
    import relayrl.data.prompts as prompts

    encode, rendered = prompts.encode_prompt, []

    def recorded(tokenizer, problem, chat_template=None, template_kwargs=None):  # the prompts generated from
        ids = encode(tokenizer, problem, chat_template, template_kwargs)
        rendered.append(tokenizer.decode(ids))
        return ids

    monkeypatch.setattr(prompts, "encode_prompt", recorded)
    run = tmp_path / "run"
    code = cli.main(["train", *RUN, *chats, f"model.path={bare}", f"run.dir={run}"])
    err = capsys.readouterr().err
    assert code == EXIT_USER and ("the prompt is chat messages (the row's, or its text with data.system_prompt's "
                                  "message) but tokenizer") in err, err
    assert "has no chat template; give the run one with model.chat_template" in err, err
    (tmp_path / "markers.jinja").write_text(MARKERS)
    code = cli.main(["train", *RUN, *chats, f"model.path={bare}", f"model.chat_template={tmp_path / 'markers.jinja'}",
                     f"run.dir={run}", "run.overwrite=true", "telemetry.samples_per_step=2"])
    assert code == 0, capsys.readouterr().err
    assert rendered and all(t.startswith("<<user>>") and t.endswith("=\n<<assistant>>") for t in rendered), rendered
    # samples.jsonl: the chat prompt readable, and as the model read it (old behaviour: the readable lines only)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["prompt"].startswith("user: ") for s in samples), samples
    assert all(s["prompt_text"] == f"<<user>>{s['prompt'][len('user: '):]}\n<<assistant>>" for s in samples), samples
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in steps if "reward/mean" in r] == [1]
    # RUN_DIR/model carries the template: relayrl eval --model and relayrl serve render as the run did
    saved = load_tokenizer(run / "model")
    assert saved.chat_template == MARKERS
    chat = Problem("3+3=", "6", meta={"messages": [{"role": "user", "content": "3+3="}]})
    assert saved.decode(encode_prompt(saved, chat)) == "<<user>>3+3=\n<<assistant>>"


def test_sft_masks_conversations_with_the_runs_template_and_exports_it(capsys, tmp_path, bare):
    from relayrl.config.loader import load_run_config
    from relayrl.data.chat import conversation_ids
    from relayrl.workflows.session import Session

    talk = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}]
    path = tmp_path / "talks.jsonl"
    path.write_text("".join(json.dumps({"messages": talk}) + "\n" for _ in range(8)))
    over = ["data.task=null", f"data.path={path}", "data.messages_key=messages", "reward.verifier=exact",
            "trainer.steps=1", "trainer.batch_size=2", "eval.size=2", "eval.every=0", "eval.before_training=false",
            "run.threads=1", "model.device=cpu", "telemetry.sinks=[jsonl]", f"model.path={bare}",
            f"model.chat_template={MARKERS}", f"run.dir={tmp_path / 'run'}"]
    s = Session(load_run_config(ROOT / "recipes" / "arith_sft.yaml", over), log=lambda m: None)
    prompt, (response, mask) = conversation_ids(s.tokenizer, s.prompts.take(1)[0].meta["conversation"])
    assert s.tokenizer.decode(prompt) == "<<user>>12+30=\n<<assistant>>"
    assert s.tokenizer.decode([t for t, m in zip(response, mask) if m]) == "42\n"
    # the offline workflows' actor exports the template with the model too
    assert cli.main(["train", str(ROOT / "recipes" / "arith_sft.yaml"), *over]) == 0, capsys.readouterr().err
    assert load_tokenizer(tmp_path / "run" / "model").chat_template == MARKERS


def test_relayrl_eval_takes_the_template_too(capsys, tmp_path, bare, chats):
    from relayrl.cli.boundary import EXIT_CONFIG

    rows = chats[1].split("=", 1)[1]
    (tmp_path / "markers.jinja").write_text(MARKERS)
    args = ["eval", "--model", str(bare), "--data", rows, "--verifier", "exact", "--size", "2", "--max-new-tokens", "2",
            "--device", "cpu", "--out", str(tmp_path / "eval")]
    assert cli.main(args) == EXIT_USER and "has no chat template" in capsys.readouterr().err
    assert cli.main([*args, "--chat-template", str(tmp_path / "markers.jinja")]) == 0, capsys.readouterr().err
    assert (tmp_path / "eval" / "eval.json").is_file()
    # each sample's chat prompt as the model read it (old behaviour: its role: content lines only)
    samples = [json.loads(x) for x in (tmp_path / "eval" / "eval_samples.jsonl").read_text().splitlines()]
    assert [s["prompt_text"] for s in samples] == ["<<user>>1+1=\n<<assistant>>", "<<user>>2+2=\n<<assistant>>"]
    assert [s["prompt"] for s in samples] == ["user: 1+1=", "user: 2+2="]
    assert cli.main([*args, "--chat-template", str(tmp_path / "nope.jinja")]) == EXIT_CONFIG
    assert f"relayrl eval: --chat-template: '{tmp_path / 'nope.jinja'}' is no file or directory here" \
        in capsys.readouterr().err
    recipe = ["eval", "--model", str(bare), "--recipe", "arith_grpo", "--chat-template", MARKERS]
    assert cli.main(recipe) == EXIT_CONFIG
    assert "--chat-template does not go with --recipe, whose run config sets model.chat_template; override " \
           "model.chat_template=... instead" in capsys.readouterr().err


THINK = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<<assistant>>{% if enable_thinking is defined and not enable_thinking %}"
         "<nothink>{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_prompts_the_run_generates_from(capsys, monkeypatch, tmp_path, bare, chats):
    """data.chat_template_kwargs (TRL's chat_template_kwargs; Qwen3's enable_thinking): the template reads them
    when it renders the training and held-out prompts; the run's eval report uses the same prompts."""
    import relayrl.data.prompts as prompts

    encode, rendered = prompts.encode_prompt, []

    def recorded(tokenizer, problem, chat_template=None, template_kwargs=None):
        ids = encode(tokenizer, problem, chat_template, template_kwargs)
        rendered.append(tokenizer.decode(ids))
        return ids

    monkeypatch.setattr(prompts, "encode_prompt", recorded)
    (tmp_path / "think.jinja").write_text(THINK)
    run = tmp_path / "run"
    code = cli.main(["train", *RUN, *chats, f"model.path={bare}", f"model.chat_template={tmp_path / 'think.jinja'}",
                     "data.chat_template_kwargs={enable_thinking: false}", f"run.dir={run}"])
    assert code == 0, capsys.readouterr().err
    assert rendered and all(t.endswith("=\n<<assistant>><nothink>") for t in rendered), rendered
    saved = json.loads((run / "config.json").read_text())["data"]["chat_template_kwargs"]
    assert saved == {"enable_thinking": False}


def test_relayrl_eval_takes_the_template_kwargs(capsys, tmp_path, bare, chats):
    """relayrl eval --chat-template-kwargs: the eval samples' prompts render with them; bad JSON, a reserved
    name, and the option beside --recipe are refused before the model loads."""
    from relayrl.cli.boundary import EXIT_CONFIG

    rows = chats[1].split("=", 1)[1]
    (tmp_path / "think.jinja").write_text(THINK)
    args = ["eval", "--model", str(bare), "--data", rows, "--verifier", "exact", "--size", "2", "--max-new-tokens", "2",
            "--device", "cpu", "--out", str(tmp_path / "eval"), "--chat-template", str(tmp_path / "think.jinja")]
    import relayrl.data.prompts as prompts

    seen = []
    encode = prompts.encode_prompt
    prompts.encode_prompt = lambda tok, p, ct=None, kw=None: seen.append(kw) or encode(tok, p, ct, kw)
    try:
        assert cli.main([*args, "--chat-template-kwargs", '{"enable_thinking": false}']) == 0, capsys.readouterr().err
    finally:
        prompts.encode_prompt = encode
    assert seen and all(kw == {"enable_thinking": False} for kw in seen)
    for bad, msg in (("{enable", "--chat-template-kwargs is not valid JSON"), ("[1]", "must be a JSON object"),
                     ('{"tokenize": true}', "apply_chat_template's own argument")):
        assert cli.main([*args, "--chat-template-kwargs", bad]) == EXIT_CONFIG
        assert msg in capsys.readouterr().err
    recipe = ["eval", "--model", str(bare), "--recipe", "arith_grpo", "--chat-template-kwargs", "{}"]
    assert cli.main(recipe) == EXIT_CONFIG
    assert "does not go with --recipe" in capsys.readouterr().err
