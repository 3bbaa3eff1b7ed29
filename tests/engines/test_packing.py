"""Packed layouts (relayrl.models.packing) and the engine's packed forwards against per-row forwards."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.models.packing import (PackUnit, additive_mask, build_packed_batch, pack_units, plan_units,
                                    shared_prompt_mask, shared_prompt_mask_mod)
from relayrl.workflows.losses import PolicyLoss

V = 97



def _model(attn="sdpa", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=V, max_position_embeddings=128, **kw)
    cfg._attn_implementation = attn
    return Qwen2ForCausalLM(cfg).float()


def _grouped(spec, seed=1, with_fields=False):
    """spec: (responses in group, prompt length) per group; response lengths 1..8 at random."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, groups = [], [], []
    for gi, (n, lp) in enumerate(spec):
        p = torch.randint(0, V, (lp,), generator=g)
        for _ in range(n):
            lr = int(torch.randint(1, 9, (1,), generator=g))
            prompts.append(p.clone())
            responses.append(torch.randint(0, V, (lr,), generator=g))
            groups.append(gi)
    fields = {}
    if with_fields:
        fields["advantages"] = [torch.randn(len(r), generator=g) for r in responses]
        fields["old_logprobs"] = [-torch.rand(len(r), generator=g) for r in responses]
    return SequenceBatch(prompts, responses, fields, groups)


def _per_row(model, batch, temperature=1.0):
    """Reference: one plain forward per row (no padding, no packing)."""
    lps, ents = [], []
    with torch.no_grad():
        for p, r in zip(batch.prompt_ids, batch.response_ids):
            logits = model(torch.cat([p, r])[None], use_cache=False).logits[0, len(p) - 1:-1].float() / temperature
            logp = torch.log_softmax(logits, -1)
            lps.append(logp.gather(-1, r[:, None]).squeeze(-1))
            ents.append(-(logp.exp() * logp).sum(-1))
    return lps, ents


# ------------------------------------------------------------------ layout
def test_layout_of_one_group_by_hand():
    p, r0, r1 = torch.tensor([11, 12, 13]), torch.tensor([21, 22]), torch.tensor([31])
    unit = PackUnit((0, 1), 3, (2, 1))
    pb = build_packed_batch([p, p], [r0, r1], [[unit]])
    assert pb.input_ids.tolist() == [[11, 12, 13, 21, 22, 31]]
    assert pb.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]  # every response restarts after the prompt
    assert pb.segment_ids.tolist() == [[0, 0, 0, 1, 1, 2]]
    assert pb.rows == (0, 1) and pb.response_lens == (2, 1)
    assert pb.token_src.tolist() == [2, 3, 2]  # first token of each response from the last prompt position
    assert pb.targets.tolist() == [21, 22, 31]
    mask = shared_prompt_mask(pb.doc_ids, pb.segment_ids)
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 1, 0],
                             [1, 1, 1, 0, 0, 1]], dtype=torch.bool)  # response 2 does not see response 1
    assert mask.shape == (1, 1, 6, 6) and torch.equal(mask[0, 0], expected)
    assert torch.equal(pb.to_rows(pb.targets.float()), torch.tensor([[21.0, 22.0], [31.0, 0.0]]))


def test_without_feed_last_the_last_response_token_is_a_target_but_not_an_input():
    """A response's last token predicts nothing inside the pack: a unit with ``feed_last=False`` leaves it out of
    the input, and it is still predicted from the token before it."""
    p, r0, r1, r2 = torch.tensor([11, 12, 13]), torch.tensor([21, 22]), torch.tensor([31]), torch.tensor([41, 42, 43])
    unit = PackUnit((0, 1, 2), 3, (2, 1, 3), feed_last=False)
    assert unit.length == 3 + 1 + 0 + 2
    pb = build_packed_batch([p, p, p], [r0, r1, r2], [[unit]])
    assert pb.input_ids.tolist() == [[11, 12, 13, 21, 41, 42]]
    assert pb.position_ids.tolist() == [[0, 1, 2, 3, 3, 4]] and pb.segment_ids.tolist() == [[0, 0, 0, 1, 3, 3]]
    assert pb.token_src.tolist() == [2, 3, 2, 2, 4, 5] and pb.targets.tolist() == [21, 22, 31, 41, 42, 43]
    assert pb.seq_row.tolist() == [[0, 0, 0, 0, 2, 2]] and pb.seq_pos.tolist() == pb.position_ids.tolist()
    # the planner's budget counts the tokens fed: 3 + 1 + 0 + 2 = 6 fits a max_len of 6 in one unit
    units = plan_units([p, p, p], [r0, r1, r2], [0, 0, 0], max_len=6, feed_last=False)
    assert [u.rows for u in units] == [(0, 1, 2)]
    assert [u.rows for u in plan_units([p, p, p], [r0, r1, r2], [0, 0, 0], max_len=6)] == [(0, 1), (2,)]


def test_dropping_the_last_token_keeps_the_logprobs():
    model = _model()
    batch = _grouped([(3, 5), (1, 2), (4, 3)])
    want, _ = _per_row(model, batch)
    for feed_last in (True, False):
        units = plan_units(batch.prompt_ids, batch.response_ids, batch.groups, feed_last=feed_last)
        pb = build_packed_batch(batch.prompt_ids, batch.response_ids, [units[:2], units[2:]])
        mask = shared_prompt_mask(pb.doc_ids, pb.segment_ids)
        with torch.no_grad():
            logits = model(pb.input_ids, attention_mask=mask, position_ids=pb.position_ids).logits
        lp = torch.log_softmax(logits[pb.token_pack, pb.token_src].float(), -1).gather(-1, pb.targets[:, None])[:, 0]
        rows = pb.to_rows(lp)
        for b, i in enumerate(pb.rows):
            torch.testing.assert_close(rows[b, :pb.response_lens[b]], want[i], atol=1e-5, rtol=1e-5)
    assert sum(u.length for u in units) == 5 + 2 + 3 + sum(len(r) - 1 for r in batch.response_ids)  # (prompts once)


def test_an_engine_feeds_the_last_token_only_where_routes_or_balance_need_it():
    batch = _grouped([(3, 4), (2, 3)])
    eng = TorchTrainingEngine(_model(), TrainEngineConfig(), total_steps=1, trainable=False)
    assert all(not u.feed_last for mb in eng._plan(batch) for row in mb for u in row)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padded_rows_leave_the_last_token_out_and_keep_the_logprobs(attn):
    """engine.packing=none: each row is its prompt and response without the response's last token, padded to the
    longest; the log-probs are the per-row forwards' and the pass counts the tokens it fed."""
    model = _model(attn)
    batch = _grouped([(3, 5), (2, 2)])
    want, _ = _per_row(model, batch)
    eng = TorchTrainingEngine(model, TrainEngineConfig(packing="none"), total_steps=1, trainable=False)
    lps, _ = eng.logprobs(batch)
    for got, w in zip(lps, want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
    rows = list(range(len(batch)))
    fed = max(len(p) + len(r) - 1 for p, r in zip(batch.prompt_ids, batch.response_ids))
    assert eng._padded_len(batch, rows) == len(rows) * fed


def test_packed_rows_are_block_diagonal_and_padding_sees_itself():
    a, b = PackUnit((0,), 2, (1,)), PackUnit((1,), 1, (1,))
    pb = build_packed_batch([torch.tensor([1, 2]), torch.tensor([3])], [torch.tensor([4]), torch.tensor([5])],
                            [[a, b], [PackUnit((0,), 2, (1,))]])
    assert pb.input_ids.shape == (2, 5) and pb.doc_ids[1].tolist() == [0, 0, 0, -1, -1]
    m = shared_prompt_mask(pb.doc_ids, pb.segment_ids)[:, 0]
    assert not m[0, 3:, :3].any() and m[0, 4, 3]  # second sequence sees only itself
    assert m[1, 3:].int().tolist() == [[0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]  # padding: diagonal only
    add = additive_mask(m[:, None], torch.float32)
    assert add[0, 0, 0, 1] == torch.finfo(torch.float32).min and add[0, 0, 1, 0] == 0


def test_mask_mod_is_the_same_predicate():
    batch = _grouped([(3, 4), (2, 2)])
    units = plan_units(batch.prompt_ids, batch.response_ids, batch.groups)
    pb = build_packed_batch(batch.prompt_ids, batch.response_ids, [units[:1], units[1:]])
    L = pb.input_ids.shape[1]
    for window in (None, 3):
        dense = shared_prompt_mask(pb.doc_ids, pb.segment_ids, pb.position_ids, sliding_window=window)
        mod = shared_prompt_mask_mod(pb.doc_ids, pb.segment_ids, pb.position_ids, sliding_window=window)
        for b in range(2):
            grid = mod(torch.tensor(b), torch.tensor(0), torch.arange(L)[:, None], torch.arange(L)[None, :])
            assert torch.equal(grid, dense[b, 0])


def test_plan_units_groups_checks_prompts_and_splits():
    p, q = torch.tensor([1, 2]), torch.tensor([1, 3])
    r = [torch.tensor([5] * n) for n in (3, 2, 4, 1, 2)]
    units = plan_units([p, p, q, p, q], r, [0, 0, 0, 0, 1])
    # Row 2 has group 0 but another prompt: its own unit, never shared with p.
    assert [u.rows for u in units] == [(0, 1, 3), (2,), (4,)]
    assert units[0].length == 2 + 3 + 2 + 1 and units[0].unpacked_length == 3 * 2 + 6
    split = plan_units([p, p, q, p, q], r, [0, 0, 0, 0, 1], max_len=7)
    assert [u.rows for u in split] == [(0, 1), (3,), (2,), (4,)] and all(u.length <= 7 for u in split)
    assert [u.rows for u in plan_units([p, p], r[:2], None)] == [(0,), (1,)]
    assert [u.rows for u in plan_units([p, p], r[:2], [0, 0], mode="sequences")] == [(0,), (1,)]
    with pytest.raises(ValueError, match="row 1: prompt_ids must be a non-empty"):
        plan_units([p, torch.tensor([], dtype=torch.long)], r[:2])
    with pytest.raises(ValueError, match="groups has 1 rows"):
        plan_units([p, p], r[:2], [0])


def test_pack_units_first_fit_decreasing():
    lengths = [5, 9, 3, 7, 2, 12]
    bins = pack_units(lengths, capacity=10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins if len(b) > 1)
    assert bins[0] == [5]  # the unit over capacity gets its own row
    assert bins == [[5], [1], [3, 2], [0, 4]]


# ------------------------------------------------------------------ engine
@pytest.mark.parametrize("packing", ["sequences", "shared_prompt"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_and_entropy_equal_per_row_forwards(packing, attn):
    model = _model(attn)
    batch = _grouped([(3, 5), (1, 2), (5, 7), (2, 1)])
    want_lp, want_ent = _per_row(model, batch, 0.7)
    for budget in (16, 48, 4096):  # many micro-batches (groups split) .. one
        eng = TorchTrainingEngine(model, TrainEngineConfig(packing=packing, token_budget=budget), total_steps=1,
                                  trainable=False)
        assert eng.packing == packing
        lps, ents = eng.logprobs(batch, temperature=0.7, with_entropy=True)
        for i in range(len(batch)):
            torch.testing.assert_close(lps[i], want_lp[i], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ents[i], want_ent[i], atol=1e-5, rtol=1e-5)


def test_a_wrong_mask_would_be_caught():
    """The comparison above is sensitive: attending across responses changes the log-probs."""
    model = _model()
    batch = _grouped([(4, 3)])
    unit = plan_units(batch.prompt_ids, batch.response_ids, batch.groups)
    pb = build_packed_batch(batch.prompt_ids, batch.response_ids, [unit])
    L = pb.input_ids.shape[1]
    causal = torch.ones(1, 1, L, L, dtype=torch.bool).tril()
    with torch.no_grad():
        right = model.model(input_ids=pb.input_ids, position_ids=pb.position_ids, use_cache=False,
                            attention_mask=shared_prompt_mask(pb.doc_ids, pb.segment_ids)).last_hidden_state
        wrong = model.model(input_ids=pb.input_ids, position_ids=pb.position_ids, use_cache=False,
                            attention_mask=causal).last_hidden_state
    assert (right - wrong).abs().max() > 1e-3


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_gradients_equal_between_packed_and_padded(entropy_coef):
    batch = _grouped([(3, 5), (4, 2), (1, 6)], with_fields=True)
    loss = PolicyLoss(agg="seq-mean-token-mean", entropy_coef=entropy_coef)
    grads = {}
    for packing in ("none", "sequences", "shared_prompt"):
        eng = TorchTrainingEngine(_model(), TrainEngineConfig(packing=packing, token_budget=40,
                                  optim=OptimConfig(lr=1e-2, max_grad_norm=None)), total_steps=1)
        got = []
        eng.optimizer.step = lambda: got.extend(p.grad.clone() for p in eng.model.parameters())
        metrics = eng.train_step(batch, loss, temperature=0.9, with_entropy="grad" if entropy_coef else True)
        grads[packing] = (got, metrics)
    for packing in ("sequences", "shared_prompt"):
        for a, b in zip(grads["none"][0], grads[packing][0]):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
        assert grads[packing][1]["actor/grad_norm"] == pytest.approx(grads["none"][1]["actor/grad_norm"], rel=1e-5)
    # Sharing the prompt runs fewer tokens through the model than padded rows.
    assert grads["shared_prompt"][1]["actor/forward_tokens"] < grads["none"][1]["actor/forward_tokens"]


def test_group_with_different_prompts_falls_back_to_per_row_units():
    model = _model()
    batch = _grouped([(3, 4), (2, 4)])
    batch.groups = [0] * len(batch)  # one "group" id, two different prompts
    eng = TorchTrainingEngine(model, TrainEngineConfig(token_budget=4096), total_steps=1, trainable=False)
    lps, _ = eng.logprobs(batch)
    for a, b in zip(lps, _per_row(model, batch)[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    batch.groups = None
    for a, b in zip(eng.logprobs(batch)[0], lps):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_micro_batches_respect_the_token_budget():
    model = _model()
    batch = _grouped([(3, 5), (1, 2), (5, 7), (2, 1), (4, 3)])
    shapes = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                 with_kwargs=True)
    budget = 30
    for packing in ("sequences", "shared_prompt"):
        shapes.clear()
        eng = TorchTrainingEngine(model, TrainEngineConfig(packing=packing, token_budget=budget), total_steps=1,
                                  trainable=False)
        eng.logprobs(batch)
        assert len(shapes) > 1 and all(P * L <= budget for P, L in shapes)
    hook.remove()


def test_sliding_window_layers_get_their_own_mask():
    model = _model(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert "sliding_attention" in model.config.layer_types
    batch = _grouped([(3, 5), (2, 3)])
    eng = TorchTrainingEngine(model, TrainEngineConfig(), total_steps=1, trainable=False)
    assert eng.sliding_window == 4 and eng.packing == "shared_prompt"
    for a, b in zip(eng.logprobs(batch)[0], _per_row(model, batch)[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_attention_without_dense_masks_falls_back_to_padding():
    model = _model()
    model.config._attn_implementation = "flash_attention_2"  # not installed here; the engine only reads the name
    with pytest.warns(UserWarning, match="packing='shared_prompt' disabled.*flash_attention_2"):
        eng = TorchTrainingEngine(model, TrainEngineConfig(), total_steps=1, trainable=False)
    assert eng.packing == "none"
