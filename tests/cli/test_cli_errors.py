"""The CLI's error boundary, run in-process through ``main()``: each user mistake gives a message, the fix
and a non-zero exit code, never a traceback; ``--debug`` / ``RELAYRL_DEBUG=1`` show it; bugs keep theirs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from relayrl.cli import main as cli
from relayrl.cli.boundary import EXIT_CONFIG, EXIT_USER

ROOT = Path(__file__).resolve().parents[2]
SFT, GRPO = str(ROOT / "recipes" / "arith_sft.yaml"), str(ROOT / "recipes" / "arith_grpo.yaml")
FAST = ["eval.size=8", "run.threads=1", "telemetry.sinks=[jsonl]", "model.tiny.hidden_size=64",
        "model.tiny.intermediate_size=256"]
HINT = "(--debug or RELAYRL_DEBUG=1 shows the traceback)"


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch):
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)


def run(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``relayrl ARGV``; asserts that no traceback was printed."""
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def argparse_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_an_unknown_flag_is_named_with_the_close_flag_or_the_override_it_may_mean(capsys):
    """``--steps 3``, ``--stepz 3`` and ``--debugg`` said only "unrecognized arguments" (a peer framework's flag
    got its relayrl key; these did not)."""
    err = argparse_error(capsys, "train", GRPO, "--steps", "3")
    assert "--steps: relayrl takes dotted overrides (section.key=value), not flags; did you mean trainer.steps=3?" in err
    err = argparse_error(capsys, "train", GRPO, "--stepz", "3", "--debugg")
    assert "did you mean trainer.steps=3?" in err and "--debugg: did you mean --debug?" in err
    err = argparse_error(capsys, "serve", "some/dir", "--max-tokenz", "5")
    assert "--max-tokenz: did you mean --max-tokens?" in err and "dotted" not in err  # (serve takes no overrides)
    assert "did you mean" not in argparse_error(capsys, "train", GRPO, "--qwertyuiop")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_plan_length_growth_must_be_a_finite_number(capsys, value):
    """--length-growth nan planned "with +nan tokens/step" (the lengths' mean fell to the floor of 1)."""
    err = argparse_error(capsys, "plan", GRPO, "--devices", "2", "--hardware", "h100_7b", f"--length-growth={value}")
    assert f"argument --length-growth: {value} is not a finite number" in err


# ------------------------------------------------------------------------ eval arguments
@pytest.mark.parametrize("k", ["0", "-3"])
def test_eval_refuses_k_below_one(capsys, k):
    err = argparse_error(capsys, "eval", "--model", "m", "--task", "arith", "--k", k)
    assert f"argument --k: {k} is not >= 1" in err


@pytest.mark.parametrize("flag,value,says", [("--size", "0", "argument --size: 0 is not >= 1"),
                                             ("--max-new-tokens", "x", "argument --max-new-tokens: 'x' is not an integer"),
                                             ("--temperature", "-1", "argument --temperature: -1.0 is not >= 0")])
def test_eval_refuses_other_bad_numbers(capsys, flag, value, says):
    assert says in argparse_error(capsys, "eval", "--model", "m", "--task", "arith", flag, value)


def test_eval_argument_combinations_are_refused_before_loading_the_model(capsys, tmp_path):
    missing = str(tmp_path / "no-model")  # never loaded: the arguments are checked first
    code, err = run(capsys, "eval", "--model", missing)
    assert code == EXIT_CONFIG and "give exactly one of --task NAME, --data FILE or --recipe RECIPE" in err
    code, err = run(capsys, "eval", "--model", missing, "--task", "arith", "--k", "4", "--temperature", "0")
    assert code == EXIT_CONFIG and "--k 4 samples at --temperature 0 are 4 copies of the greedy answer" in err
    code, err = run(capsys, "eval", "--model", missing, "--task", "arith", "--task-options", "{min_digits: 3}")
    assert code == EXIT_CONFIG and "--task-options is not valid JSON" in err
    code, err = run(capsys, "eval", "--model", missing, "--task", "arith", "--task-options", "[1]")
    assert code == EXIT_CONFIG and "--task-options must be a JSON object, got '[1]'" in err
    code, err = run(capsys, "eval", "--model", missing, "--task", "nosuch", "--device", "cpu")
    assert code == EXIT_CONFIG and "unknown task 'nosuch'" in err
    code, err = run(capsys, "eval", "--model", missing, "--task", "arith", "--task-options", '{"foo": 1}',
                    "--device", "cpu")
    assert code == EXIT_CONFIG and "task 'arith' has no option 'foo'" in err
    code, err = run(capsys, "eval", "--model", missing, "--task", "arith", "--task-options", '{"eval_size": 5}',
                    "--device", "cpu")  # (it was a TypeError's traceback: eval_size given twice)
    assert code == EXIT_CONFIG and "--task-options: 'eval_size' is set by --size" in err and "Traceback" not in err


@pytest.mark.parametrize("flag,value,key", [
    ("--task", "arith", "data.task"), ("--data", "rows.jsonl", "data.eval_path"), ("--verifier", "exact", "reward.verifier"),
    ("--user-fn", "r.py:score", "reward.user_fn"), ("--k", "4", "eval.k"), ("--size", "200", "eval.size"),
    ("--max-new-tokens", "8", "eval.max_new_tokens"), ("--device", "cpu", "model.device"),
    ("--think-budget", "8", "rollout.interrupt.after_tokens")])
def test_eval_refuses_options_a_recipe_sets(capsys, tmp_path, monkeypatch, flag, value, key):
    """With --recipe the run config decides: an option it holds is refused (even at its default value), naming
    the key to override instead."""
    _no_model_load_or_evaluation(monkeypatch)
    code, err = run(capsys, "eval", "--model", str(tmp_path / "no-model"), "--recipe", "arith_grpo", flag, value)
    assert code == EXIT_CONFIG
    assert f"relayrl eval: {flag} does not go with --recipe, whose run config sets {key}; override {key}=... " \
        f"instead" in err


def test_eval_recipe_refuses_bad_overrides_before_loading_anything(capsys, tmp_path, monkeypatch):
    _no_model_load_or_evaluation(monkeypatch)
    missing = str(tmp_path / "no-model")
    code, err = run(capsys, "eval", "--model", missing, "--recipe", "arith_grpo", "eval.sise=8")
    assert code == EXIT_CONFIG and "eval.sise: unknown key; did you mean eval.size?" in err  # the config's own
    code, err = run(capsys, "eval", "--model", missing, "--recipe", "arith_grpo", "eval.k=0")
    assert code == EXIT_CONFIG and "eval.k" in err
    code, err = run(capsys, "eval", "--model", missing, "--recipe", "arith_grpo", f"model.path={tmp_path}")
    assert code == EXIT_CONFIG and f"the override 'model.path={tmp_path}': --model names the model evaluated" in err
    code, err = run(capsys, "eval", "--model", missing, "--recipe", "nosuch_recipe")
    assert code == EXIT_CONFIG and "recipe nosuch_recipe is neither a file here" in err
    code, err = run(capsys, "eval", "--model", missing, "--task", "arith", "eval.size=8")
    assert code == EXIT_CONFIG and "'eval.size=8': dotted overrides set a run config's keys; give the config with " \
        "--recipe RECIPE" in err
    code, err = run(capsys, "eval", "--model", missing, "--recipe", "arith_grpo", "--device", "cpu")
    assert code == EXIT_CONFIG and "--device does not go with --recipe" in err
    code, err = run(capsys, "eval", "--model", missing, "--recipe", "arith_grpo", "model.device=cpu")
    assert code == EXIT_USER and f"--model {missing}: no such directory" in err  # named as given
    code, err = run(capsys, "eval", "--model", missing, "--recipe", "arith_rm", "model.device=cpu")
    assert code == EXIT_CONFIG and "workflow rm trains a reward model, which generates nothing" in err


@pytest.mark.parametrize("argv,says", [
    (["eval", "--model", "m", "--task", "arith", "--device", "gpu"], "'gpu' is not a device: give auto, cpu, cuda"),
    (["eval", "--model", "m", "--task", "arith", "--dtype", "float64"], "argument --dtype: invalid choice"),
    (["serve", "m", "--port", "99999"], "argument --port: 99999 is not a port (0-65535)"),
    (["serve", "m", "--device", "tpu"], "'tpu' is not a device"),
    (["plan", "r.yaml", "--devices", "0"], "argument --devices: 0 is not >= 1"),
    (["plan", "r.yaml", "--devices", "2", "--prompt-tokens", "-5"], "argument --prompt-tokens: -5 is not >= 1"),
    (["plan", "r.yaml", "--devices", "2", "--top", "0"], "argument --top: 0 is not >= 1")])
def test_bad_flags_are_refused_before_anything_loads(capsys, argv, says):
    assert says in argparse_error(capsys, *argv)


def test_plan_names_a_missing_model_and_a_damaged_profile(capsys, tmp_path):
    code, err = run(capsys, "plan", GRPO, f"model.path={tmp_path / 'nope'}", "--devices", "2", "--hardware", "h100_7b")
    assert code == EXIT_CONFIG and f"model directory {tmp_path / 'nope'} (trainer.init_from or model.path) has no" in err
    (tmp_path / "p.json").write_text('{"name": ')
    code, err = run(capsys, "plan", GRPO, "--devices", "2", "--hardware", str(tmp_path / "p.json"))
    assert code == EXIT_CONFIG and f"profile {tmp_path / 'p.json'} is not valid JSON" in err
    (tmp_path / "p.json").write_text('{"name": 3}')
    code, err = run(capsys, "plan", GRPO, "--devices", "2", "--hardware", str(tmp_path / "p.json"))
    assert code == EXIT_CONFIG and "name: Input should be a valid string (got 3); source: Field required" in err


def test_plan_profile_checks_the_reward_fn_and_out_before_calibrating(capsys, tmp_path, monkeypatch):
    def reached(*a, **k):
        raise AssertionError("the calibration ran before --reward-fn and --out were checked")

    monkeypatch.setattr("relayrl.planner.calibrate.calibrate", reached)
    out = str(tmp_path / "p.json")
    code, err = run(capsys, "plan", "--profile", "--reward-fn", "nosuch_mod:score", "--out", out)
    assert code == EXIT_CONFIG and "--reward-fn nosuch_mod:score: reward function 'nosuch_mod:score': no module " \
        "named 'nosuch_mod'" in err
    code, err = run(capsys, "plan", "--profile", "--out", str(tmp_path))
    assert code == EXIT_CONFIG and f"--out {tmp_path} is a directory; give a file path" in err
    (tmp_path / "f").write_text("")
    code, err = run(capsys, "plan", "--profile", "--out", str(tmp_path / "f" / "p.json"))
    assert code == EXIT_CONFIG and f"cannot be made: {tmp_path / 'f'} is a file" in err
    assert not (tmp_path / "p.json").exists()
    run_dir = tmp_path / "run"  # a run's directory given for its model/
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "tokenizer_config.json").write_text("{}")
    code, err = run(capsys, "plan", "--profile", "--model", str(run_dir), "--out", out)
    assert code == EXIT_USER and f"--model {run_dir}: {run_dir} is a run directory, not a model directory; did " \
        f"you mean --model={run_dir / 'model'}?" in err
    code, err = run(capsys, "plan", "--profile", "--model", str(tmp_path / "nope"), "--out", out)
    assert code == EXIT_USER and "no such directory; give a local Hugging Face model directory" in err
    code, err = run(capsys, "plan", "--profile", "--model", str(tmp_path / "f"), "--out", out)
    assert code == EXIT_USER and "a file, not a directory; give a local Hugging Face model directory" in err
    (tmp_path / "empty").mkdir()
    code, err = run(capsys, "plan", "--profile", "--model", str(tmp_path / "empty"), "--out", out)
    assert code == EXIT_USER and "the directory is empty; give a local Hugging Face model directory" in err


def test_overrides_may_follow_the_options_of_plan_and_train(capsys, tmp_path):
    code, err = run(capsys, "plan", GRPO, "--devices", "2", "--hardware", "h100_7b", f"model.path={tmp_path / 'nope'}")
    assert code == EXIT_CONFIG and f"model directory {tmp_path / 'nope'} (trainer.init_from or model.path)" in err
    code, err = run(capsys, "plan", GRPO, "run.seed=1", "--devices", "2", "--hardware", "h100_7b", "trainer.steps=true")
    assert code == EXIT_CONFIG and "trainer.steps=true: an integer is expected" in err
    assert cli.main(["train", GRPO, "--debug", "trainer.steps=true"]) == EXIT_CONFIG  # (--debug: a traceback)
    assert "trainer.steps=true: an integer is expected" in capsys.readouterr().err
    assert "unrecognized arguments: --bogus" in argparse_error(capsys, "plan", GRPO, "--devices", "2", "--bogus")
    assert "unrecognized arguments: nokey" in argparse_error(capsys, "plan", GRPO, "--devices", "2", "nokey")


def test_eval_of_a_missing_model_names_it(capsys, tmp_path):
    code, err = run(capsys, "eval", "--model", str(tmp_path / "nope"), "--task", "arith", "--device", "cpu")
    assert code == EXIT_USER and f"--model {tmp_path / 'nope'}: no such directory" in err and HINT in err


def _no_model_load_or_evaluation(monkeypatch):
    """Reaching the model or the evaluation fails the test: what is checked must be checked first."""
    def reached(*a, **k):
        raise AssertionError("the model loaded or the evaluation ran before the arguments were checked")

    # (the modules that bind load_model at their import are imported first: imported under the patch, they would
    # keep it after this test)
    import relayrl.workflows.heldout  # noqa: F401

    monkeypatch.setattr("relayrl.models.load.load_model", reached)
    monkeypatch.setattr("relayrl.evaluation.runner.evaluate", reached)


def test_eval_refuses_an_out_that_is_a_file_before_loading_anything(capsys, tmp_path, monkeypatch):
    _no_model_load_or_evaluation(monkeypatch)
    (tmp_path / "good.jsonl").write_text("{}\n")
    missing = str(tmp_path / "no-model")  # the --out check comes before the problems, the tokenizer, the model
    code, err = run(capsys, "eval", "--model", missing, "--task", "arith", "--device", "cpu",
                    "--out", str(tmp_path / "good.jsonl"))
    assert code == EXIT_CONFIG and f"--out {tmp_path / 'good.jsonl'} is a file, not a directory; give a dir" in err
    code, err = run(capsys, "eval", "--model", missing, "--task", "arith", "--device", "cpu",
                    "--out", str(tmp_path / "good.jsonl" / "sub"))
    assert code == EXIT_CONFIG and f"cannot be made: {tmp_path / 'good.jsonl'} is a file" in err


@pytest.mark.slow  # (over half a second; the full make test runs it)
def test_eval_says_it_replaces_the_report_in_out(capsys, tmp_path, monkeypatch, tiny_dir):
    from relayrl.evaluation.runner import EvalResult

    out = tmp_path / "ev"
    out.mkdir()
    (out / "eval.json").write_text("{}\n")
    monkeypatch.setattr("relayrl.evaluation.runner.evaluate", lambda *a, **k: EvalResult({"eval/accuracy": 0.5}, []))
    assert cli.main(["eval", "--model", str(tiny_dir), "--task", "arith", "--size", "2", "--device", "cpu",
                     "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"relayrl eval: {out} holds an eval report; this evaluation replaces its eval.json" in said
    assert json.loads((out / "eval.json").read_text())["metrics"] == {"eval/accuracy": 0.5}
    monkeypatch.setattr("relayrl.evaluation.runner.evaluate", lambda *a, **k: EvalResult({"eval/accuracy": 1.0}, []))
    assert cli.main(["eval", "--model", str(tiny_dir), "--task", "arith", "--size", "2", "--device", "cpu",
                     "--out", str(tmp_path / "fresh")]) == 0
    assert "holds an eval report" not in capsys.readouterr().out


def test_eval_checks_the_context_as_train_does_before_loading_the_model(capsys, tmp_path, monkeypatch, tiny_dir):
    _no_model_load_or_evaluation(monkeypatch)  # the tiny model's max_position_embeddings is 512
    code, err = run(capsys, "eval", "--model", str(tiny_dir), "--task", "arith", "--size", "4", "--device", "cpu",
                    "--max-new-tokens", "100000", "--out", str(tmp_path / "ev"))
    assert code == EXIT_CONFIG and "--max-new-tokens=100000 new tokens cannot fit in the model's " \
        "max_position_embeddings=512" in err and "; give at most 5" in err
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "9" * 2000, "answer": "9"}, {"prompt": "2+2=", "answer": "4"},
            {"prompt": "8" * 2000, "answer": "8"}]
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = run(capsys, "eval", "--model", str(tiny_dir), "--data", str(data), "--verifier", "exact",
                    "--device", "cpu", "--out", str(tmp_path / "ev"))
    assert code == EXIT_USER and f"{data} row 2: the prompt is " in err and " tokens and --max-new-tokens=16 " in err
    assert "beyond the model's max_position_embeddings=512" in err and "shorten or drop the row, or set " \
        "--long-prompts drop to leave out every such row (1 more too long: rows 4)" in err
    assert not (tmp_path / "ev").exists()
    # with --long-prompts drop the two long rows are left out and the model loads (the stand-in stops the test there)
    with pytest.raises(AssertionError, match="the model loaded"):
        run(capsys, "eval", "--model", str(tiny_dir), "--data", str(data), "--verifier", "exact", "--device", "cpu",
            "--long-prompts", "drop", "--out", str(tmp_path / "ev"))
    assert "relayrl: --long-prompts drop: dropped 2 of 4 evaluation prompts" in capsys.readouterr().out


def test_eval_refuses_a_thinking_budget_that_leaves_no_room_to_answer(capsys, tmp_path, monkeypatch, tiny_dir):
    _no_model_load_or_evaluation(monkeypatch)
    code, err = run(capsys, "eval", "--model", str(tiny_dir), "--task", "arith", "--size", "4", "--device", "cpu",
                    "--think-budget", "10", "--max-new-tokens", "12", "--out", str(tmp_path / "ev"))
    assert code == EXIT_CONFIG and "relayrl eval: --think-budget=10 + the phrase's " in err
    assert "do not fit in --max-new-tokens=12" in err and "or lower --think-budget" in err
    assert not (tmp_path / "ev").exists()


@pytest.mark.slow  # (a few seconds: it generates)
def test_eval_with_a_thinking_budget_interrupts_and_says_how_often(capsys, tmp_path, tiny_dir):
    """The tiny model never writes </think>: every answer that runs past 2 tokens is interrupted, gets the
    phrase, and the report counts them (eval/interrupted_frac) and marks each sample."""
    out = tmp_path / "ev"
    assert cli.main(["eval", "--model", str(tiny_dir), "--task", "arith", "--size", "3", "--device", "cpu",
                     "--think-budget", "2", "--max-new-tokens", "120", "--out", str(out)]) == 0
    report = json.loads((out / "eval.json").read_text())
    samples = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert 0 < report["metrics"]["eval/interrupted_frac"] <= 1 and len(samples) == 3
    assert report["metrics"]["eval/interrupted_frac"] == sum(s["interrupted"] for s in samples) / 3
    assert all("time is up" in s["response"] for s in samples if s["interrupted"])


# ------------------------------------------------------------------------------- plot
@pytest.mark.slow  # (about 1 s; the full `make test` runs it)
def test_plot_of_a_missing_or_empty_metrics_file_says_so(capsys, tmp_path):
    code, err = run(capsys, "plot", str(tmp_path / "nope"))
    assert code == EXIT_USER and "no such directory; give a run directory" in err
    code, err = run(capsys, "plot", str(tmp_path))
    assert code == EXIT_USER and "metrics.jsonl: no metrics file" in err
    (tmp_path / "metrics.jsonl").write_text("")
    code, err = run(capsys, "plot", str(tmp_path))
    assert code == EXIT_USER and "holds no metrics records; the run logged nothing yet" in err
    assert not (tmp_path / "plots").exists()


@pytest.mark.slow  # (draws figures: about 2 s; the fast set keeps the rest of this file, `make test` runs it)
def test_plot_names_a_damaged_line_and_warns_about_a_torn_last_line(capsys, tmp_path):
    good = [json.dumps({"step": s, "reward/mean": 0.1 * s}) for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join([good[0], "{not json", *good[1:]]) + "\n")
    code, err = run(capsys, "plot", str(tmp_path))
    assert code == EXIT_USER and "metrics.jsonl:2: not valid JSON" in err and "fix or delete that line" in err
    (tmp_path / "metrics.jsonl").write_text("\n".join([*good, '{"step": 3, "rew']) + "\n")
    code, err = run(capsys, "plot", str(tmp_path))
    assert code == 0
    assert "relayrl plot: warning:" in err and "metrics.jsonl:4: skipped the last line" in err
    assert (tmp_path / "plots" / "reward_accuracy.png").exists()


# ------------------------------------------------------------------------------ train
def test_temperature_zero_with_several_responses_is_refused_at_config_time(capsys, tmp_path):
    code, err = run(capsys, "train", GRPO, "rollout.temperature=0", f"run.dir={tmp_path}")
    assert code == EXIT_CONFIG
    assert "rollout.temperature=0 samples greedily, so the rollout.n=8 responses" in err
    assert "set rollout.temperature > 0" in err and "Value error" not in err
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu_names_model_device(capsys, tmp_path):
    code, err = run(capsys, "train", SFT, "model.device=cuda", f"run.dir={tmp_path / 'r'}", *FAST)
    assert code == EXIT_CONFIG and "model.device=cuda but torch sees no GPU here" in err
    assert "set model.device=cpu" in err and not (tmp_path / "r").exists()
    code, err = run(capsys, "eval", "--model", "m", "--task", "arith", "--device", "cuda")
    assert code == EXIT_CONFIG and "--device cuda but torch sees no GPU" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_reward_model_on_cuda_without_a_gpu_names_reward_model_device(capsys, tmp_path):
    """It was refused nowhere: the run started, evaluated, generated its first step and then stopped with torch's
    AssertionError ("Torch not compiled with CUDA enabled") when the reward model loaded to score it."""
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text("{}")
    code, err = run(capsys, "train", GRPO, f"reward.model={rm}", "reward.model_device=cuda",
                    f"run.dir={tmp_path / 'r'}", *FAST)
    assert code == EXIT_CONFIG and "reward.model_device=cuda but torch sees no GPU here" in err
    assert "for the reward model; set reward.model_device=cpu" in err and not (tmp_path / "r").exists()


def test_csv_data_gets_advice_that_exists(capsys, tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("prompt,answer\n1+1=,2\n")
    code, err = run(capsys, "train", SFT, "data.task=null", f"data.path={data}",
                    "reward.verifier=exact", f"run.dir={tmp_path / 'r'}", *FAST)
    assert code == EXIT_USER and "relayrl does not read CSV; convert it to JSON lines" in err
    assert "data.format=jsonl" in err
    from relayrl.config.schema import DataConfig

    assert "format" in DataConfig.model_fields  # the key the message names exists


def test_every_bad_dataset_row_is_reported(capsys, tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}, "{oops", {"prompt": "", "answer": "3"},
            {"prompt": "3+3=", "answer": "6"}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    code, err = run(capsys, "train", SFT, "data.task=null", f"data.path={data}",
                    "reward.verifier=exact", f"run.dir={tmp_path / 'r'}", *FAST)
    assert code == EXIT_USER and f"{data}: 3 bad rows; fix or remove them" in err
    for line in ("train.jsonl row 2: field 'answer' is missing", "train.jsonl row 3: invalid JSON",
                 "train.jsonl row 4: field 'prompt' is an empty string"):
        assert line in err


def test_a_prompt_that_leaves_no_room_for_the_response_is_refused_naming_the_row(capsys, tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}] * 20 + [{"prompt": "9" * 2000, "answer": "9"}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, err = run(capsys, "train", GRPO, "data.task=null", f"data.path={data}", "reward.verifier=exact",
                    "eval.size=4", f"run.dir={tmp_path / 'r'}", *FAST[1:])
    assert code == EXIT_USER, err
    assert f"{data} row 21: the prompt is " in err and " tokens and rollout.max_new_tokens=" in err
    assert "beyond the model's max_position_embeddings=512" in err and "shorten or drop the row" in err
    assert not (tmp_path / "r").exists()


def test_missing_model_path_names_the_key(capsys, tmp_path):
    code, err = run(capsys, "train", SFT, f"model.path={tmp_path / 'nope'}",
                    f"run.dir={tmp_path / 'r'}", *FAST)
    assert code == EXIT_USER and f"model.path={tmp_path / 'nope'}: no such directory" in err
    code, err = run(capsys, "train", GRPO, f"trainer.init_from={tmp_path / 'nope'}",
                    f"run.dir={tmp_path / 'r'}", *FAST)
    assert code == EXIT_USER and f"trainer.init_from={tmp_path / 'nope'}: no such directory" in err


def test_a_model_error_inside_a_rank_arrives_as_one_message(capsys, tmp_path, tiny_dir):
    import shutil

    broken = tmp_path / "damaged-weights"
    shutil.copytree(tiny_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x10")  # (found when the actor loads it, in its rank)
    code, err = run(capsys, "train", SFT, f"model.path={broken}", f"run.dir={tmp_path / 'r'}",
                    *FAST)
    assert code == EXIT_USER
    assert (f"error: worker group 'actor' rank 0 failed in '__init__': model directory {broken}: "
            f"model.safetensors is truncated or not a safetensors file") in err


def test_a_model_directory_without_weights_is_refused_before_any_work(capsys, tmp_path, tiny_dir):
    """(It was found only when the actor loaded the model, after the data had loaded.)"""
    import shutil

    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_dir, broken)
    for f in broken.glob("*.safetensors"):
        f.unlink()
    code, err = run(capsys, "train", SFT, f"model.path={broken}", f"run.dir={tmp_path / 'r'}", *FAST)
    assert code == EXIT_USER
    assert f"error: model.path={broken}: model directory {broken} has config.json but no *.safetensors" in err
    assert "worker group" not in err and not (tmp_path / "r").exists()


def test_a_run_dir_under_a_file_names_the_file(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, err = run(capsys, "train", SFT, f"run.dir={blocker / 'run'}", *FAST)
    assert code == EXIT_USER and f"error: run.dir={blocker / 'run'}: {blocker} is a file, not a directory" in err


# ----------------------------------------------------------------------- debug, bugs
@pytest.mark.slow  # (about 1 s: make test runs it, the fast set does not)
def test_debug_flag_and_env_show_the_traceback(capsys, tmp_path, monkeypatch):
    for argv in (["--debug", "plot", str(tmp_path)], ["plot", str(tmp_path), "--debug"]):
        assert cli.main(argv) == EXIT_USER
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "MetricsFileError" in err
        assert "error: " in err and HINT not in err
    monkeypatch.setenv("RELAYRL_DEBUG", "1")
    assert cli.main(["plot", str(tmp_path)]) == EXIT_USER
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    monkeypatch.setenv("RELAYRL_DEBUG", "0")
    run(capsys, "plot", str(tmp_path))


@pytest.mark.slow  # (over half a second; the full make test runs it)
def test_a_lost_worker_says_how_to_go_on_with_or_without_a_checkpoint(capsys, monkeypatch, tmp_path):
    import relayrl.telemetry.plots as plots
    from relayrl.cluster.errors import WorkerError

    def lost(*args, **kwargs):
        raise WorkerError("actor", 0, "update", "rank process died", lost=True)

    monkeypatch.setattr(plots, "plot_run", lost)
    code, err = run(capsys, "plot", str(tmp_path))
    assert code == EXIT_USER and "rank process died" in err
    assert "run.resume=auto resumes by hand, or, with no checkpoint yet, run.overwrite=true starts over" in err


def test_a_lost_dock_unit_says_how_to_go_on_without_a_traceback(capsys, monkeypatch, tmp_path):
    """A storage unit (or its host) gone is not a bug: one line and the way on, as for a lost worker (fails
    before: the UnitLostError's traceback, and no word of run.max_restarts)."""
    import relayrl.telemetry.plots as plots
    from relayrl.dock import UnitLostError

    def lost(*args, **kwargs):
        raise UnitLostError("Ray storage unit 0 (host 10.0.0.2) died; its rows are lost [drop: ActorDiedError]")

    monkeypatch.setattr(plots, "plot_run", lost)
    code, err = run(capsys, "plot", str(tmp_path))
    assert code == EXIT_USER and "error: Ray storage unit 0 (host 10.0.0.2) died" in err
    assert "run.max_restarts=N" in err and "Traceback" not in err and "UnitLostError" not in err


def test_internal_errors_keep_their_traceback(monkeypatch, tmp_path):
    import relayrl.telemetry.plots as plots

    def buggy(*args, **kwargs):
        raise RuntimeError("a bug in relayrl")

    monkeypatch.setattr(plots, "plot_run", buggy)
    with pytest.raises(RuntimeError, match="a bug in relayrl"):  # propagates: Python prints the traceback
        cli.main(["plot", str(tmp_path)])
    monkeypatch.setattr(plots, "plot_run", lambda *a, **k: (_ for _ in ()).throw(KeyError("x")))
    with pytest.raises(KeyError):
        cli.main(["plot", str(tmp_path)])


def test_a_keyboard_interrupt_before_training_exits_130(capsys, monkeypatch, tmp_path):
    import relayrl.telemetry.plots as plots

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "plot_run", interrupted)
    code, err = run(capsys, "plot", str(tmp_path))
    assert code == 130 and "relayrl: interrupted" in err


# ------------------------------------------------------------------ classification
def test_which_errors_are_the_users():
    import errno
    import pickle

    from relayrl.cluster import WorkerError
    from relayrl.errors import RunStopped, is_user_error, user_message

    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x.jsonl")
    assert is_user_error(missing) and user_message(missing) == "/data/x.jsonl: No such file or directory; check the path"
    full = OSError(errno.ENOSPC, "No space left on device", "/runs/a/model")
    assert user_message(full) == "/runs/a/model: No space left on device; free disk space or choose another run.dir"
    assert not is_user_error(FileNotFoundError("no file name: could be anything"))  # a bug until shown otherwise
    assert not is_user_error(OSError(errno.EIO, "I/O error", "/dev/x"))
    assert is_user_error(RunStopped("step 3: actor/loss is nan")) and not is_user_error(KeyError("k"))
    err = WorkerError("actor", 1, "update", "Traceback ...\nDatasetError: bad row", "bad row")
    back = pickle.loads(pickle.dumps(err))
    assert (back.group, back.rank, back.method, back.user_message) == ("actor", 1, "update", "bad row")
    assert back.brief() == "worker group 'actor' rank 1 failed in 'update': bad row"


@pytest.mark.slow
def test_help_and_a_mistyped_command_answer_without_importing_torch():
    """``relayrl --help``, ``relayrl plan --help`` and ``relayrl trian`` answer in well under a second: the
    parser imports no torch (importing it takes ~4 s here)."""
    import subprocess
    import sys

    probe = ("import sys\nfrom relayrl.cli.main import main\nfor argv in (['--help'], ['plan', '--help'], ['trian']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print('torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "invalid choice: 'trian'" in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "False False", r.stderr[-2000:]


def test_eval_given_a_run_directory_asks_whether_its_model_was_meant(capsys, tmp_path, tiny_dir):
    import shutil

    shutil.copytree(tiny_dir, tmp_path / "run" / "model")
    code, err = run(capsys, "eval", "--model", str(tmp_path / "run"), "--task", "arith", "--size", "2")
    assert code == EXIT_USER and f"is a run directory, not a model directory; did you mean " \
                                  f"--model={tmp_path / 'run' / 'model'}?" in err, err


def test_serve_names_a_run_directory_given_for_its_model(capsys, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")
    code, err = run(capsys, "serve", str(tmp_path), "--port", "0")
    assert code == EXIT_USER and f"relayrl serve {tmp_path}: {tmp_path} is a run directory, not a model " \
        f"directory; did you mean {tmp_path / 'model'}?" in err


def test_version_is_the_installed_packages(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"relayrl {version('relayrl')}"  # pyproject reads relayrl.__version__


def test_eval_scores_data_with_the_users_reward_function(capsys, tmp_path, tiny_dir):
    """``relayrl eval --verifier user --user-fn FILE.py:fn`` scores --data as reward.user_fn scores a run (the
    verifier choices were math and exact only: a run trained on its own reward could not be evaluated on it),
    with each row's other fields by keyword."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "weight": i / 4}) + "\n"
                            for i in range(3)))
    (tmp_path / "my_rewards.py").write_text("def score(prompts, responses, answers, weight=None):\n"
                                            "    return weight\n")
    out = tmp_path / "ev"
    assert cli.main(["eval", "--model", str(tiny_dir), "--data", str(data), "--verifier", "user", "--user-fn",
                     f"{tmp_path}/my_rewards.py:score", "--max-new-tokens", "2", "--device", "cpu",
                     "--out", str(out)]) == 0
    assert json.loads((out / "eval.json").read_text())["metrics"]["eval/reward_mean"] == 0.25
    (tmp_path / "more_rewards.py").write_text("def one(completions, **kwargs):\n"  # TRL's shape beside relayrl's
                                              "    return [1.0] * len(completions)\n")
    assert cli.main(["eval", "--model", str(tiny_dir), "--data", str(data), "--verifier", "user", "--user-fn",
                     f"{tmp_path}/my_rewards.py:score", f"{tmp_path}/more_rewards.py:one", "--user-weights", "2",
                     "0.5", "--max-new-tokens", "2", "--device", "cpu", "--out", str(out)]) == 0
    assert json.loads((out / "eval.json").read_text())["metrics"]["eval/reward_mean"] == 2 * 0.25 + 0.5
    missing = str(tmp_path / "no-model")  # the function and the flags are checked before the model loads
    code, err = run(capsys, "eval", "--model", missing, "--data", str(data), "--verifier", "user")
    assert code == EXIT_CONFIG and "--verifier user needs --user-fn" in err
    code, err = run(capsys, "eval", "--model", missing, "--data", str(data), "--user-fn", "my_rewards.py:score")
    assert code == EXIT_CONFIG and "add --verifier user" in err
    code, err = run(capsys, "eval", "--model", missing, "--data", str(data), "--verifier", "user", "--user-fn",
                    f"{tmp_path}/my_rewards.py:score", "--user-weights", "1", "2")
    assert code == EXIT_CONFIG and "reward.user_weights has 2 weight(s) for 1 function(s)" in err
    code, err = run(capsys, "eval", "--model", missing, "--data", str(data), "--verifier", "user", "--user-fn",
                    f"{tmp_path}/nothere.py:score", "--out", str(tmp_path / "ev2"))
    assert code == EXIT_CONFIG and "no file" in err and not (tmp_path / "ev2").exists()


@pytest.mark.slow  # (a fresh interpreter: ~1.5 s)
def test_python_dash_m_relayrl_is_the_relayrl_command():
    """``python -m relayrl`` (a virtualenv whose scripts are not on PATH) runs the CLI: its config errors and exit
    codes, under the name ``relayrl``."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "relayrl", "train", GRPO, "trainer.stepz=3"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == EXIT_CONFIG, out.stderr
    assert "trainer.stepz: unknown key; did you mean trainer.steps?" in out.stderr and "Traceback" not in out.stderr
    assert subprocess.run([sys.executable, "-m", "relayrl", "--help"], capture_output=True, text=True,
                          timeout=120).stdout.startswith("usage: relayrl ")


def test_eval_help_lists_the_tasks_the_registry_has(capsys):
    """Old behaviour: --help said 'arith, sort, countdown' (a string of its own) while the unknown-task error,
    from the registry, listed toolsum too."""
    from relayrl.data.tasks import EXTRA_TASKS, TASKS, make_task

    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # (argparse wraps the help text)
    names = sorted([*TASKS, *EXTRA_TASKS])
    assert f"built-in task: {', '.join(names)}" in out and "toolsum" in out
    with pytest.raises(ValueError, match=re.escape(f"built-in tasks are {names}")):
        make_task("nosuch")
    from relayrl.data.config import DataConfig  # the key's description (the config reference) lists them too

    assert f"({', '.join(names)})" in DataConfig.model_fields["task"].description


@pytest.mark.parametrize("argv, typo, close", [
    (["train"], "--print-confg", "--print-config"),  # (its recipe missing)
    (["eval"], "--modle", "--model"),  # (--model missing: argparse said so first)
    (["plan"], "--devicez", "--devices"),
    (["serve"], "--prot", "--port"),  # (its model_dir missing)
    (["dock"], "--unitz", "--units"),
    (["plot"], "--debugg", "--debug"),  # (its run_dir missing)
    (["demo"], "--toolz", "--tools"),
])
def test_an_unknown_flag_is_named_before_a_missing_required_argument(capsys, argv, typo, close):
    """``relayrl eval --bogus`` said "the following arguments are required: --model": argparse checks the
    required arguments before it returns the unknown ones."""
    err = argparse_error(capsys, *argv, "--bogus")
    assert "unrecognized arguments: --bogus" in err and "required" not in err, err
    err = argparse_error(capsys, *argv, typo, "3")
    assert f"unrecognized arguments: {typo} 3" in err and f"{typo}: did you mean {close}?" in err, err
    assert "required" not in err
