"""PPO's critic: values at the right positions in every layout, and a value loss that fits the returns."""

import pytest
import torch

from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.models.load import load_value_model
from relayrl.workflows.losses import ValueLoss


def _batch(tok):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.tensor(tok(f"{i}{i}+{i}8=")["input_ids"]) for i in range(3)]
    return SequenceBatch([p for p in prompts for _ in range(2)],
                         [torch.randint(5, 200, (int(n),), generator=g) for n in torch.randint(2, 7, (6,), generator=g)],
                         groups=[i // 2 for i in range(6)])


@pytest.mark.slow  # (about 1 s: make test runs it, the fast set does not)
@pytest.mark.parametrize("packing", ["none", "sequences", "shared_prompt"])
def test_critic_values_are_the_head_on_the_state_before_each_response_token(tiny_dir, tiny_tokenizer, packing):
    model = load_value_model(tiny_dir)
    assert model.get_output_embeddings().out_features == 1
    assert float(model.get_output_embeddings().weight.detach().abs().sum()) == 0.0  # every value starts at 0
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.5)
        model.get_output_embeddings().bias.fill_(0.3)
    eng = TorchTrainingEngine(model, TrainEngineConfig(token_budget=24, packing=packing), total_steps=1,
                              trainable=False, output="values")
    batch = _batch(tiny_tokenizer)
    values, _ = eng.logprobs(batch)
    for p, r, v in zip(batch.prompt_ids, batch.response_ids, values):
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=torch.cat([p, r])[None]).last_hidden_state[0]
            want = model.get_output_embeddings()(hidden[len(p) - 1:len(p) - 1 + len(r)])[:, 0]
        torch.testing.assert_close(v, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # (about 1 s; the full `make test` runs it)
def test_the_value_loss_fits_the_returns(tiny_dir, tiny_tokenizer):
    batch = _batch(tiny_tokenizer)
    returns = [torch.full((len(r),), 1.0 if i % 2 else -0.5) for i, r in enumerate(batch.response_ids)]
    batch.fields.update({"values": [torch.zeros(len(r)) for r in batch.response_ids], "returns": returns})
    eng = TorchTrainingEngine(load_value_model(tiny_dir), TrainEngineConfig(optim=OptimConfig(lr=3e-3)),
                              total_steps=30, output="values", metric_prefix="critic")
    losses = [eng.train_step(batch, ValueLoss(clip=None))["critic/vf_loss"] for _ in range(30)]
    assert losses[0] == pytest.approx(0.5 * (1.0 + 0.25) / 2, rel=0.05)  # values start at 0
    assert losses[-1] < 0.2 * losses[0]
    clipped = eng.train_step(batch, ValueLoss(clip=0.01))  # values far from the old ones (0): clipped
    assert clipped["critic/vf_clip_frac"] > 0.5


def test_a_critic_state_without_a_tensor_is_refused(tiny_dir):
    """The engine reported no missing name ever (torch's full-state load fills them in with the model's own
    values) and the worker let any lm_head.weight go (for the critic: its value head); fails before."""
    from relayrl.engines.training.torch_engine import TrainEngineConfig
    from relayrl.workflows.trainer_workers import CriticWorker

    critic = CriticWorker(str(tiny_dir), TrainEngineConfig(), total_steps=1)
    state = critic.state()
    critic.load_state(state)  # whole: fine
    for name in ("lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
        with pytest.raises(ValueError, match=rf"checkpoint does not match the model: missing {name}$"):
            critic.load_state({"model": {k: v for k, v in state["model"].items() if k != name}})


@pytest.mark.slow  # (over a second; the full `make test` runs it)
def test_resuming_a_checkpoint_whose_critic_lacks_a_tensor_names_the_file_and_tensor(tmp_path, monkeypatch):
    from relayrl.checkpoint import CheckpointError
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.registry import train
    from relayrl.workflows.trainer_workers import CriticWorker

    over = [f"run.dir={tmp_path}", "eval.size=8", "eval.every=0", "telemetry.sinks=[jsonl]", "run.threads=1",
            "model.tiny.hidden_size=64", "model.tiny.intermediate_size=256", "data.prompts_per_step=4",
            "rollout.n=4", "rollout.max_new_tokens=6"]
    real = CriticWorker.state
    with monkeypatch.context() as patch:  # a checkpoint whose critic state lacks its value head's bias
        patch.setattr(CriticWorker, "state",
                      lambda self: {**(s := real(self)), "model": {k: v for k, v in s["model"].items()
                                                                   if k != "lm_head.bias"}})
        train(load_config(Config, "recipes/arith_ppo.yaml", [*over, "trainer.steps=1"]))
    with pytest.raises(CheckpointError) as info:
        train(load_config(Config, "recipes/arith_ppo.yaml", [*over, "trainer.steps=2", "run.resume=auto"]))
    assert str(info.value) == (f"{tmp_path}/checkpoints/step-000001/extra.pt: does not fit the model: missing keys "
                               f"['lm_head.bias']")


@pytest.mark.parametrize("budget,mini_batches", [(10_000, 1), (16, 1), (16, 2)])
def test_explained_variance_is_the_batch_figure(tiny_dir, tiny_tokenizer, budget, mini_batches):
    """``critic/explained_variance`` is 1 - Var(R - V) / Var(R) over the batch's tokens however the critic's
    update cuts it; it was the token mean of the micro-batches' figures, NaN as soon as one micro-batch held
    returns that are all equal (a prompt group whose responses all got the same reward), fails before."""
    import numpy as np

    batch = _batch(tiny_tokenizer)
    # rows 0-1 (one prompt group) share their return: a micro-batch of them alone has no variance to explain
    returns = [torch.full((len(r),), 1.0 if i < 2 else float(i) / 3) for i, r in enumerate(batch.response_ids)]
    batch.fields.update({"values": [torch.zeros(len(r)) for r in batch.response_ids], "returns": returns})
    model = load_value_model(tiny_dir)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    eng = TorchTrainingEngine(model, TrainEngineConfig(token_budget=budget, packing="none",
                                                       optim=OptimConfig(lr=1e-12)),
                              total_steps=4, output="values", metric_prefix="critic")
    values = np.concatenate([v.numpy() for v in eng.logprobs(batch)[0]]).astype(np.float64)
    r = np.concatenate([x.numpy() for x in returns]).astype(np.float64)
    want = 1.0 - np.var(r - values) / np.var(r)
    m = eng.train_step(batch, ValueLoss(clip=None), mini_batches=mini_batches,
                       generator=torch.Generator().manual_seed(0))
    assert m["critic/explained_variance"] == pytest.approx(want, rel=1e-5)
    assert not any(k.startswith("_ev/") for k in m)
