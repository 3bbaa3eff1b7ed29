"""LoRA through peft (relayrl.models.lora): merged weights, what trains, what the rollout receives, what a
checkpoint holds, the adapters-off reference, and config errors that name their key."""

import copy

import pytest
import torch
from pydantic import ValidationError

from relayrl.config.schema import Config
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TrainEngineConfig
from relayrl.models.load import load_model
from relayrl.models.lora import DEFAULT_TARGETS, LoraConfig, adapters_disabled, apply_lora, merged_weights
from relayrl.weights import WeightRelay
from relayrl.workflows.losses import PolicyLoss, ValueLoss
from relayrl.workflows.rollout_worker import RolloutWorker
from relayrl.workflows.trainer_workers import CriticWorker, PolicyWorker, ReferenceWorker

LORA = LoraConfig(enabled=True, r=4, alpha=8.0)
LOSS = PolicyLoss(agg="seq-mean-token-mean")


def _batch(tok, prompts=3, group=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = prompts * group
    ids = [torch.tensor(tok(f"{i}+{i + 5}=")["input_ids"]) for i in range(prompts) for _ in range(group)]
    resp = [torch.randint(5, 200, (int(n),), generator=g) for n in torch.randint(2, 8, (rows,), generator=g)]
    adv = [torch.randn(len(r), generator=g) for r in resp]
    return SequenceBatch(ids, resp, {"advantages": adv, "values": [torch.zeros(len(r)) for r in resp],
                                     "returns": adv}, groups=[i // group for i in range(rows)])


def _kw(tiny_dir, **over):
    return dict(model_path=str(tiny_dir), engine=TrainEngineConfig(token_budget=64, optim=OptimConfig(lr=1e-2)),
                total_steps=4, threads=1, seed=0, **over)


def _perturb_adapters(model, seed=0):
    """B starts at zero (the adapted model is the base); give every adapter a random B so merging shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_merged_weights_equal_base_plus_scaled_b_a_by_hand(tiny_dir):
    base = {n: p.detach().clone() for n, p in load_model(tiny_dir).named_parameters()}
    model = load_model(tiny_dir)
    apply_lora(model, LORA)
    _perturb_adapters(model)
    merged = dict(merged_weights(model))
    assert list(merged) == list(base)  # the base model's names, in its order; no adapter tensors
    layer = model.model.layers[1].self_attn.q_proj
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # [r, in], [out, r]
    name = "model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(merged[name], base[name] + B @ A * (8.0 / 4))
    adapted = [n for n in base if n.rsplit(".", 2)[-2] in DEFAULT_TARGETS and n.endswith(".weight")]  # (null: these)
    assert len(adapted) == 7 * len(model.model.layers)
    for n in base:  # the adapted linears moved, nothing else did
        assert torch.equal(merged[n], base[n]) != (n in adapted), n
    # the merged model computes what the adapted one does
    plain = load_model(tiny_dir)
    plain.load_state_dict(merged, strict=False)
    ids = torch.tensor([[3, 17, 42, 9, 5]])
    model.eval(), plain.eval()
    torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    with adapters_disabled(model):  # adapters off: the base model
        torch.testing.assert_close(model(ids).logits, load_model(tiny_dir).eval()(ids).logits)
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)  # back on after the block


@pytest.mark.slow  # (about 1 s: make test runs it, the fast set does not)
def test_lora_trains_only_the_adapters_and_the_rollout_receives_merged_weights(tiny_dir, tiny_tokenizer):
    actor = PolicyWorker(**_kw(tiny_dir), lora=LORA)
    trainable = [n for n, p in actor.engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    opt = [p for g in actor.engine.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in opt) == sum(p.numel() for p in actor.engine.model.parameters() if p.requires_grad)
    before = {n: p.detach().clone() for n, p in actor.engine.model.named_parameters()}
    for seed in range(2):  # B is zero at first, so A only moves from the second step on
        actor.update(_batch(tiny_tokenizer, seed=seed), LOSS)
    for n, p in actor.engine.model.named_parameters():
        assert torch.equal(p, before[n]) != (n in trainable), n  # base frozen, every adapter moved

    merged = dict(actor.named_weights())
    rollout = RolloutWorker(str(tiny_dir), threads=1)
    assert set(merged) == {n for n, _ in rollout.engine.model.named_parameters()}
    WeightRelay(pin_memory=False).push(list(merged.items()), [rollout.engine], version=1)  # packed buckets
    for n, p in rollout.engine.model.named_parameters():
        assert torch.equal(p, merged[n]), n
    assert any(not torch.equal(merged[n], before[n.replace("q_proj.", "q_proj.base_layer.")])
               for n in merged if "q_proj.weight" in n)

    # the relayed model generates what the adapted actor computes: same log-probs of the same tokens
    batch = _batch(tiny_tokenizer, seed=5)
    plain = ReferenceWorker(str(tiny_dir), _kw(tiny_dir)["engine"], threads=1)
    plain.engine.model.load_state_dict({n: t for n, t in merged.items()}, strict=False)
    for a, b in zip(actor.logprobs(batch), plain.logprobs(batch), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # (about 1 s; the full `make test` runs it)
def test_lora_checkpoint_holds_the_adapters_and_resumes_exactly(tiny_dir, tiny_tokenizer):
    a = PolicyWorker(**_kw(tiny_dir), lora=LORA)
    a.update(_batch(tiny_tokenizer, seed=0), LOSS)
    state = a.state()
    assert set(state["model"]) == set(a.param_shapes()) == {
        n for n, p in a.engine.model.named_parameters() if p.requires_grad}
    assert len(state["optimizer"]["state"]) == len(state["model"])  # Adam moments of the adapters only
    b = PolicyWorker(**_kw(tiny_dir), lora=LORA)
    b.load_state(copy.deepcopy(state))  # as from disk: on a CPU the state holds the live tensors
    batch = _batch(tiny_tokenizer, seed=1)
    ma, mb = a.update(batch, LOSS), b.update(batch, LOSS)
    assert ma == mb
    for (n, x), (_, y) in zip(a.engine.model.named_parameters(), b.engine.model.named_parameters()):
        assert torch.equal(x, y), n
    full = PolicyWorker(**_kw(tiny_dir))  # a full fine-tuning checkpoint does not fit a LoRA actor
    with pytest.raises(ValueError, match="unexpected"):
        b.load_state(full.state())


def test_critic_lora_keeps_the_value_head_trainable(tiny_dir, tiny_tokenizer):
    critic = CriticWorker(**_kw(tiny_dir), lora=LORA)
    trainable = [n for n, p in critic.engine.model.named_parameters() if p.requires_grad]
    assert {"lm_head.weight", "lm_head.bias"} <= set(trainable)
    assert all(".lora_" in n or n.startswith("lm_head.") for n in trainable)
    head = critic.engine.model.get_output_embeddings().weight.detach().clone()
    critic.update(_batch(tiny_tokenizer), ValueLoss(clip=None))
    assert not torch.equal(head, critic.engine.model.get_output_embeddings().weight)
    assert {"lm_head.weight", "lm_head.bias"} <= set(critic.state()["model"])


def test_tri_model_reference_is_the_base_with_adapters_off(tiny_dir, tiny_tokenizer):
    tri = PolicyWorker(**_kw(tiny_dir), lora=LORA, tri_model=True)
    assert tri.engine.reference_model is None  # no second copy of the weights
    _perturb_adapters(tri.engine.model)
    batch = _batch(tiny_tokenizer, seed=2)
    policy, reference = tri.logprobs(batch, with_reference=True)
    base = ReferenceWorker(str(tiny_dir), _kw(tiny_dir)["engine"], threads=1).logprobs(batch)
    for r, b in zip(reference, base, strict=True):
        torch.testing.assert_close(r, b, atol=1e-5, rtol=1e-5)
    assert max(float((p - r).abs().max()) for p, r in zip(policy, reference)) > 1e-3
    loss = PolicyLoss(agg="seq-mean-token-mean", kl_coef=0.1, kl_kind="k3")
    m = tri.update(batch, loss)
    assert m["actor/ref_forward_passes"] >= 1 and m["actor/ref_kl_k1"] != 0.0


def _refused(over: dict, *words: str):
    with pytest.raises((ValidationError, ValueError)) as e:
        Config.model_validate(over)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_config_errors_name_the_key(tiny_dir):
    _refused({"model": {"lora": {"enabled": True, "r": 0}}}, "model", "lora", "r")
    _refused({"model": {"lora": {"rank": 8}}}, "lora", "rank")
    _refused({"model": {"lora": {"enabled": True, "target_modules": []}}}, "model.lora.target_modules")
    Config.model_validate({"model": {"lora": {"enabled": True}}, "cluster": {"devices": 2}})  # FSDP2 shards it
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules names \['c_attn'\]") as e:
        PolicyWorker(**_kw(tiny_dir), lora=LoraConfig(enabled=True, target_modules=["q_proj", "c_attn"]))
    assert "q_proj" in str(e.value) and "lm_head" not in str(e.value)  # the layers offered are the ones accepted


def test_all_linear_is_the_default_and_other_strings_are_refused_naming_the_list(tiny_dir):
    """peft and TRL users write target_modules="all-linear": every linear layer but the output head, which is what
    null (the default) resolves to, so it is taken as null. Another string (peft's regular expression) is refused
    naming the list form, not with pydantic's 'Input should be a valid list'."""
    import peft

    from relayrl.models.lora import resolve_targets

    lora = Config.model_validate({"model": {"lora": {"enabled": True, "target_modules": "all-linear"}}}).model.lora
    assert lora.target_modules is None
    peft_own = peft.get_peft_model(load_model(tiny_dir), peft.LoraConfig(r=4, target_modules="all-linear"))
    assert set(resolve_targets(load_model(tiny_dir), lora)) == peft_own.peft_config["default"].target_modules
    for text in (".*q_proj", "q_proj", "all_linear"):
        _refused({"model": {"lora": {"enabled": True, "target_modules": text}}}, "model.lora.target_modules",
                 f"{text!r}", "a list of layer names", "all-linear")
    _refused({"model": {"lora": {"target_modules": ["q_proj", "all-linear"]}}}, "model.lora.target_modules=all-linear")


def test_lora_keys_without_enabled_are_refused_not_ignored():
    """verl's lora_rank > 0 turns LoRA on; here model.lora.r alone did nothing and every weight trained. A recipe's
    LoRA keys go with model.lora={} (a full fine-tune of that recipe)."""
    from relayrl.config.loader import load_run_config

    for over in ({"r": 8}, {"alpha": 16}, {"enabled": False, "target_modules": ["q_proj"]}):
        _refused({"model": {"lora": over}}, f"model.lora.{sorted(set(over) - {'enabled'})[0]} is read only with "
                 "model.lora.enabled=true", "model.lora={}")
    with pytest.raises(ValueError, match="model.lora.alpha is read only with model.lora.enabled=true"):
        load_run_config("recipes/arith_grpo_lora.yaml", ["model.lora.enabled=false"])
    assert not load_run_config("recipes/arith_grpo_lora.yaml", ["model.lora={}"]).model.lora.enabled
    assert Config.model_validate({"model": {"lora": {"enabled": False}}}).model.lora.r == 16


def test_resuming_with_lora_switched_is_refused_naming_the_key():
    from pathlib import Path

    from relayrl.checkpoint import CheckpointError
    from relayrl.checkpoint.rundir import check_fingerprint

    lora = Config.model_validate({"model": {"lora": {"enabled": True}}}).model_dump(mode="json")
    full = Config().model_dump(mode="json")
    with pytest.raises(CheckpointError, match="model.lora.enabled: checkpoint True, now False"):
        check_fingerprint(Path("ck"), lora, full)
    del lora["model"]["lora"]  # a checkpoint written before model.lora existed: nothing to compare
    check_fingerprint(Path("ck"), lora, full)


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_adapters_on_fused_expert_tensors_merge_into_the_base_models_tensors(arch):
    """model.lora.target_parameters (peft's ParamWrapper, one adapter per expert): the merged weights carry the
    base model's names, and a base model loaded with them computes what the adapted model computes."""
    from tests.models.architectures import build

    model, base = build(arch), build(arch)
    apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8.0, target_parameters=EXPERTS))
    adapted = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("experts" in n and "lora_A" in n for n in adapted)
    for m in model.modules():  # B = 0 at the start: move it so the merge shows
        if hasattr(m, "lora_B"):
            torch.nn.init.normal_(m.lora_B["default"].weight, std=0.1)
    ids = torch.arange(3, 23)[None]
    with torch.no_grad():
        want = model(ids).logits
        merged = dict(merged_weights(model))
        assert set(merged) == set(dict(base.named_parameters()))
        before = base(ids).logits
        base.load_state_dict(merged, strict=True)
        got = base(ids).logits
    assert (want - before).abs().max() > 1.0  # (the experts' adapters moved the model)
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)


def test_expert_tensor_targets_are_checked():
    from tests.models.architectures import build

    with pytest.raises(ValueError, match="names \\['mlp.experts.up_proj'\\], which Qwen3MoeForCausalLM has no "
                                         "parameter called; its fused \\(3-D\\) parameters are "
                                         "\\['mlp.experts.down_proj', 'mlp.experts.gate_up_proj'\\]"):
        apply_lora(build("qwen3_moe"), LoraConfig(enabled=True, r=4, target_parameters=["mlp.experts.up_proj"]))
    with pytest.raises(ValidationError, match="set model.lora.dropout=0"):
        LoraConfig(enabled=True, target_parameters=EXPERTS, dropout=0.1)


def test_adapter_delta_is_peft_s_for_expert_tensors_and_2d_weights_whole_and_by_rows():
    """adapter_delta (what a sharded merge adds to a rank's experts) is peft's own update of each wrapped
    parameter: the fused experts and a 2-D router weight, whole and a slice of experts (rows) at a time."""
    from peft.tuners.lora import ParamWrapper

    from relayrl.models.lora import adapter_delta
    from tests.models.architectures import build

    model = build("qwen3_moe")
    apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8.0, target_parameters=[*EXPERTS, "mlp.gate.weight"]))
    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    assert {m.get_param().dim() for m in wrappers} == {2, 3}
    for m in wrappers:
        torch.nn.init.normal_(m.lora_B["default"].weight, std=0.1)
        want = m.get_delta_weight("default")
        a, b, p = m.lora_A["default"].weight, m.lora_B["default"].weight, m.get_param()
        for rows in (slice(None), slice(0, 1), slice(1, 3), slice(3, 4)):
            got = adapter_delta(a, b, m.scaling["default"], p.dim(), m.num_experts, rows,
                                m._did_swap_in_out_features)
            torch.testing.assert_close(got, want[rows], atol=1e-6, rtol=1e-6)
        assert want.shape == p.shape and want.abs().max() > 1e-3
