"""engine.dropout: the trained model's dropout off for RL (a noisy ratio otherwise), as loaded for SFT."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.models.load import disable_dropout, load_model


@pytest.fixture()
def dropout_dir(tiny_dir, tmp_path):
    """The tiny model with attention dropout 0.3 in its config."""
    d = tmp_path / "dropout_model"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["attention_dropout"] = 0.3
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _two_passes(model) -> tuple[torch.Tensor, torch.Tensor]:
    model.train()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        return model(ids).logits, model(ids).logits


def test_disable_dropout_zeroes_the_rates_but_not_the_config(dropout_dir):
    model = load_model(dropout_dir, attn_implementation="eager")
    a, b = _two_passes(model)
    assert not torch.equal(a, b)  # dropout on in train mode: two passes differ
    layers = model.config.num_hidden_layers
    assert disable_dropout(model) == layers and disable_dropout(model) == 0
    a, b = _two_passes(model)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert model.config.attention_dropout == 0.3  # an export keeps the model's own rate


def test_the_engine_applies_it_and_the_config_resolves_auto(dropout_dir):
    from relayrl.config.schema import Config

    eng = TorchTrainingEngine(load_model(dropout_dir), TrainEngineConfig(dropout="none"), total_steps=1)
    assert all(m.self_attn.attention_dropout == 0.0 for m in eng.model.model.layers)
    eng = TorchTrainingEngine(load_model(dropout_dir), TrainEngineConfig(), total_steps=1)  # auto: as loaded
    assert all(m.self_attn.attention_dropout == 0.3 for m in eng.model.model.layers)
    assert Config().train_engine().dropout == "none"
    assert Config(workflow="sft").train_engine().dropout == "model"
    assert Config.model_validate({"engine": {"dropout": "model"}}).train_engine().dropout == "model"
    critic = Config.model_validate({"algorithm": {"advantage": "gae"}, "critic": {"optim": {"lr": 0.5}}})
    assert critic.train_engine(optim=critic.critic.optim).optim.lr == 0.5


@pytest.mark.slow
def test_grpo_on_a_dropout_model_recomputes_the_generators_logprobs(dropout_dir, tmp_path):
    """The first update is on-policy: with dropout off (the default for grpo) the trainer's log-probs equal the
    generator's; with dropout on, the update pass's dropout makes them differ (rollout/logprob_error > 1)."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.pipeline import GRPOPipeline

    errors = {}
    for dropout in ("auto", "model"):
        run = tmp_path / dropout
        cfg = load_config(Config, "recipes/arith_grpo.yaml",
                          [f"run.dir={run}", "trainer.steps=1", "eval.size=4", "eval.every=0", "data.prompts_per_step=2",
                           "rollout.n=4", "rollout.max_new_tokens=8", "telemetry.sinks=[jsonl]", "run.save_every=0",
                           f"trainer.init_from={dropout_dir}", f"engine.dropout={dropout}"])
        GRPOPipeline(cfg).run()
        rec = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()][1]
        errors[dropout] = rec["rollout/logprob_error"]
    assert errors["auto"] == pytest.approx(1.0, abs=1e-3)
    assert errors["model"] > 1.01
