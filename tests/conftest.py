"""Shared fixtures: one tiny default model per test session, cached under .cache/ (git-ignored)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RELAYRL_CACHE", str(ROOT / ".cache" / "test-models"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_sessionstart(session) -> None:
    """Create transformers' log handler now: made lazily inside a test that captures stderr (capsys), it would
    keep writing to that test's closed stream in every later test of the process ("Logging error"). Not in
    pytest-xdist's controller, which runs no test (its import would hold up the workers' start)."""
    config = session.config
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    from transformers.utils import logging

    logging.get_logger("transformers")


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """Directory of a small tiny-model variant and the default tokenizer (built once, then reused)."""
    from relayrl.models.tiny import TinyModelConfig, build_tiny

    return build_tiny(TinyModelConfig(hidden_size=64, intermediate_size=256), verbose=False)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir):
    from relayrl.models.load import load_tokenizer

    return load_tokenizer(tiny_dir)


@pytest.fixture()
def tiny_model(tiny_dir):
    """A fresh copy of the tiny model, perturbed so that its outputs are not uniform."""
    import torch

    from relayrl.models.load import load_model

    torch.manual_seed(0)
    model = load_model(tiny_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture()
def one_torch_thread():
    """torch on one thread for the test (tiny models: more threads on a shared 2-core machine oversubscribe;
    the engine tests took ~65 s instead of ~8 s). Directories that want it for every test use it autouse."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture()
def eos_listed(tmp_path):
    """``eos_listed(model, tokenizer, *ids)``: ``model`` and ``tokenizer`` saved in a directory whose
    generation_config.json lists ``ids`` after the EOS in ``eos_token_id``, as instruct checkpoints list their
    turn ends there (Qwen2.5-Instruct's ``[151645, 151643]``, Llama-3-Instruct's ``<|eot_id|>``)."""
    import json

    def save(model, tokenizer, *ids: int) -> Path:
        out = tmp_path / ("eos-" + "-".join(map(str, ids)))
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        path = out / "generation_config.json"
        cfg = json.loads(path.read_text())
        cfg["eos_token_id"] = [tokenizer.eos_token_id, *ids]
        path.write_text(json.dumps(cfg, indent=2))
        return out

    return save
