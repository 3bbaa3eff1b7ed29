"""A damaged model directory, LoRA settings the model cannot take and a tiny-model shape that cannot work give
one message naming the file or key and the fix, never a traceback, from ``train`` (the model loads inside a
worker rank), ``eval`` and ``serve`` alike. Run in-process through ``main()``, as tests/cli/test_cli_errors.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from relayrl.cli.boundary import EXIT_CONFIG, EXIT_USER
from test_cli_errors import HINT, run  # (the same in-process runner)

ROOT = Path(__file__).resolve().parents[2]
SFT, GRPO = str(ROOT / "recipes" / "arith_sft.yaml"), str(ROOT / "recipes" / "arith_grpo.yaml")
FAST = ["trainer.steps=2", "eval.every=0", "eval.size=8", "run.threads=1", "telemetry.sinks=[jsonl]"]
TRUNCATED = "model.safetensors is truncated or not a safetensors file"


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch, one_torch_thread):
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)


@pytest.fixture()
def truncated(tiny_dir, tmp_path) -> Path:
    """The tiny model with its weights cut in half (an interrupted copy)."""
    d = Path(shutil.copytree(tiny_dir, tmp_path / "truncated"))
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    return d


@pytest.fixture()
def reshaped(tiny_dir, tmp_path) -> Path:
    """The tiny model's weights beside a config.json of twice its width."""
    d = Path(shutil.copytree(tiny_dir, tmp_path / "reshaped"))
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(hidden_size=2 * cfg["hidden_size"], intermediate_size=2 * cfg["intermediate_size"])
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_train_with_truncated_weights_names_the_file_from_the_rank(capsys, tmp_path, truncated):
    code, err = run(capsys, "train", SFT, f"model.path={truncated}", f"run.dir={tmp_path / 'r'}", *FAST)
    assert code == EXIT_USER and HINT in err
    assert f"error: worker group 'actor' rank 0 failed in '__init__': model directory {truncated}: {TRUNCATED}" in err


def test_eval_and_serve_with_damaged_weights_say_what_is_wrong(capsys, tmp_path, truncated, reshaped):
    code, err = run(capsys, "eval", "--model", str(truncated), "--task", "arith", "--device", "cpu",
                    "--out", str(tmp_path / "e"))
    assert code == EXIT_USER and f"error: model directory {truncated}: {TRUNCATED}" in err
    code, err = run(capsys, "serve", str(reshaped), "--port", "0", "--device", "cpu")
    assert code == EXIT_USER
    assert f"error: model directory {reshaped}: the weights do not match config.json: model.embed_tokens.weight" in err


def test_train_with_a_config_json_that_does_not_parse_names_it(capsys, tmp_path, tiny_dir):
    broken = Path(shutil.copytree(tiny_dir, tmp_path / "badjson"))
    (broken / "config.json").write_text('{"architectures": [')
    code, err = run(capsys, "train", SFT, f"model.path={broken}", f"run.dir={tmp_path / 'r'}", *FAST)
    assert code == EXIT_USER
    assert (f"error: model.path={broken}: model directory {broken}: config.json is not valid JSON (Expecting value "
            f"at line 1 column 20)") in err  # (found by the driver's check of model.path, before any worker starts)


@pytest.mark.parametrize("override,says", [
    ("model.lora.r=100000", "model.lora.r=100000 is larger than model.layers.0.self_attn.q_proj allows"),
    ("model.lora.target_modules=[nosuch]", "model.lora.target_modules names ['nosuch'], which Qwen2ForCausalLM"),
    ("model.lora.target_modules=[lm_head]", "model.lora.target_modules targets lm_head, the output head"),
], ids=["rank", "missing-layer", "lm_head"])
def test_lora_settings_the_model_cannot_take_are_one_message(capsys, tmp_path, tiny_dir, override, says):
    code, err = run(capsys, "train", GRPO, f"model.path={tiny_dir}", "model.lora.enabled=true", override,
                    f"run.dir={tmp_path / 'r'}", *FAST)
    assert code == EXIT_USER and f"error: worker group 'actor' rank 0 failed in '__init__': {says}" in err


def test_a_tiny_shape_that_cannot_work_is_refused_before_anything_is_built(capsys, tmp_path):
    code, err = run(capsys, "train", SFT, "model.tiny.hidden_size=100", "model.tiny.num_heads=3",
                    f"run.dir={tmp_path / 'r'}", *FAST)
    assert code == EXIT_CONFIG and "model.tiny: num_heads=3 does not divide hidden_size=100" in err
    assert not (tmp_path / "r").exists()


def test_serve_on_a_gpu_this_machine_lacks_says_so(capsys, tiny_dir):
    """``--device cuda`` without a GPU was a traceback (torch's "not compiled with CUDA") as the model moved."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, err = run(capsys, "serve", str(tiny_dir), "--device", "cuda", "--port", "0")
    assert code == EXIT_USER and "--device cuda but torch sees no GPU here" in err and "Traceback" not in err, err
