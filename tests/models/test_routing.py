"""MoE routing record and replay (relayrl.models.routing) on transformers' own MoE architectures."""

from __future__ import annotations

import pytest
import torch

from relayrl.models.routing import RouterShape, Routing, RoutingError, laid_out, router_shape
from tests.models.architectures import build

MOE = ["qwen3_moe", "mixtral", "gpt_oss", "qwen3_next"]


def _share(routing: Routing) -> float:
    """The share of the replayed picks since the last call that the routers would have made themselves."""
    matched, picks = routing.take_counts()
    return float(matched) / float(picks)
IDS = (torch.arange(3, 23) * 7 % 97)[None]


@pytest.mark.parametrize("arch", MOE)
def test_recorded_routes_replayed_give_the_same_logits_and_others_change_them(arch):
    model = build(arch)
    routing = Routing(model)
    layers = model.config.num_hidden_layers
    assert routing.shape == RouterShape(layers, 2, 4)
    with routing.record() as rec:
        free = model(IDS).logits
    routes = rec.routes()
    assert routes.shape == (IDS.numel(), layers, 2)
    assert int(routes.min()) >= 0 and int(routes.max()) < 4
    routing.replay(routes)
    assert torch.equal(model(IDS).logits, free)
    assert _share(routing) == 1.0
    routing.replay((routes + 1) % 4)  # every token to other experts
    moved = model(IDS).logits
    assert (moved - free).abs().max() > 1e-2
    assert _share(routing) < 1.0
    routing.replay(None)
    assert torch.equal(model(IDS).logits, free)
    assert routing.take_counts() is None  # (nothing replayed since)


def test_a_replayed_choice_is_the_blocks_own_arithmetic_at_those_experts():
    """Qwen3-MoE's block at replayed experts: the router's softmax at the chosen experts (renormalised with
    norm_topk_prob) weighting those experts' outputs."""
    model = build("qwen3_moe")
    block = model.model.layers[0].mlp
    routing = Routing(block)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0))
    chosen = torch.tensor([[0, 1], [2, 3], [3, 0], [1, 2], [0, 3]])
    routing.replay(chosen[:, None, :])
    out = block(x)[0]
    probs = torch.softmax(x[0] @ block.gate.weight.T, -1)
    want = torch.zeros_like(out)
    for t in range(5):
        w = probs[t, chosen[t]]
        w = w / w.sum() if block.gate.norm_topk_prob else w
        for j, e in enumerate(chosen[t].tolist()):
            gate, up = (x[0, t] @ block.experts.gate_up_proj[e].T).chunk(2)
            want[t] += w[j] * ((torch.nn.functional.silu(gate) * up) @ block.experts.down_proj[e].T)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    block.gate.norm_topk_prob = True  # (the tiny config's default is False)
    renormalised = block(x)[0]
    assert (renormalised - out).abs().max() > 1e-4


def test_replayed_routing_keeps_the_gate_weights_gradient():
    model = build("mixtral").train()
    routing = Routing(model)
    with routing.record() as rec, torch.no_grad():
        model(IDS)
    routing.replay((rec.routes() + 1) % 4)
    model(IDS).logits.square().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if n.endswith("gate.weight")]
    assert len(grads) == 2 and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_rows_of_minus_one_keep_the_routers_own_choice():
    model = build("qwen3_moe")
    routing = Routing(model)
    with routing.record() as rec:
        free = model(IDS).logits
    other = (rec.routes() + 1) % 4
    other[10:] = -1  # the last ten tokens route themselves
    routing.replay(other)
    mixed = model(IDS).logits
    assert _share(routing) < 1.0
    assert (mixed[0, :10] - free[0, :10]).abs().max() > 1e-3
    routing.replay(rec.routes().masked_fill(torch.ones_like(rec.routes(), dtype=torch.bool), -1))
    assert torch.equal(model(IDS).logits, free)


def test_routes_for_another_token_count_or_shape_are_refused():
    model = build("qwen3_moe")
    routing = Routing(model)
    with pytest.raises(ValueError, match="expected \\[tokens, 2 MoE layers, top_k=2\\]"):
        routing.replay(torch.zeros(20, 3, 2, dtype=torch.long))
    routing.replay(torch.zeros(7, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="scored 20 tokens but 7 recorded routes"):
        model(IDS)


def test_a_dense_model_has_no_routing_to_replay():
    dense = build("qwen2")
    assert router_shape(dense) is None
    with pytest.raises(RoutingError, match="needs a mixture-of-experts model; Qwen2ForCausalLM has no router"):
        Routing(dense)


def test_routes_are_laid_out_where_the_pack_puts_each_token():
    shape = RouterShape(layers=2, top_k=1, experts=8)
    # row 0: 4 tokens (3 routed: the last was never run); row 1: 3 tokens, all routed
    r0 = torch.tensor([1, 2, 3]).repeat_interleave(2).reshape(3, 2, 1)
    r1 = torch.tensor([4, 5, 6]).repeat_interleave(2).reshape(3, 2, 1)
    seq_row = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    seq_pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    out = laid_out([r0, r1], seq_row, seq_pos, shape)
    assert out.shape == (1, 8, 2, 1)
    assert out[0, :, 0, 0].tolist() == [1, 2, 3, -1, 4, 5, 6, -1]
    with pytest.raises(ValueError, match="row 1: routes name experts outside 0..7"):
        laid_out([r0, r1 + 5], seq_row, seq_pos, shape)
    with pytest.raises(ValueError, match="row 0: routes of shape \\(3, 2\\)"):
        laid_out([r0[..., 0], r1], seq_row, seq_pos, shape)


MORE = {  # transformers' other MoE routers: grouped top-k with a bias (DeepSeek-V3), shared experts, a gating
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),  # module of its own (GraniteMoE)
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=0, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "qwen3_5_moe_text": dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
}


@pytest.mark.parametrize("arch", sorted(MORE))
def test_other_moe_routers_record_and_replay(arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.models.architectures import COMMON

    cfg = AutoConfig.for_model(arch, **{**COMMON, **MORE[arch]})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    routing = Routing(model)
    assert routing.shape.layers == cfg.num_hidden_layers
    with routing.record() as rec:
        free = model(IDS).logits
    routing.replay(rec.routes())
    assert torch.equal(model(IDS).logits, free)
    routing.replay((rec.routes() + 1) % routing.shape.experts)
    assert (model(IDS).logits - free).abs().max() > 1e-3


def test_a_pass_reads_only_its_own_rows_routes():
    """A micro-batch lays out the rows it holds; another row's routes (even malformed ones) are not read, and a
    row with no recorded routes (a padding pass's one token) routes itself."""
    shape = RouterShape(layers=1, top_k=1, experts=4)
    routes = [torch.tensor([[[1]], [[2]]]), torch.zeros(5, 7), torch.zeros(0, 1, 1, dtype=torch.int16)]
    out = laid_out(routes, torch.tensor([[0, 0, 0, -1]]), torch.tensor([[0, 1, 2, 0]]), shape)
    assert out[0, :, 0, 0].tolist() == [1, 2, -1, -1]
    assert laid_out(routes, torch.tensor([[2, 2]]), torch.tensor([[0, 1]]), shape).eq(-1).all()
