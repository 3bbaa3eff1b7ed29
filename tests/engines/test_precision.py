"""Mixed precision: float32 master weights with bf16 compute (issue 15, item 1), and the static decoder."""

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.engines.generation.static import StaticDecoder
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.models.load import load_model
from relayrl.workflows.losses import PolicyLoss
from weight_swap import swap_at


def _batch(tok):
    prompts = ["1+2=", "123+456=", "sort 5 12 9 =", "77+1="]
    answers = ["3", "579", "5 9 12", "78"]
    eos = torch.tensor([tok.eos_token_id])
    resp = [torch.cat([torch.tensor(tok(a, add_special_tokens=False)["input_ids"]), eos]) for a in answers]
    g = torch.Generator().manual_seed(0)
    return SequenceBatch([torch.tensor(tok(p)["input_ids"]) for p in prompts], resp,
                         {"advantages": [torch.randn(len(r), generator=g) for r in resp]})


def _engine(tiny_dir, weights: torch.dtype, compute: torch.dtype, lr: float = 1e-6):
    torch.manual_seed(0)
    model = load_model(tiny_dir, dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[weights])
    return TorchTrainingEngine(model, TrainEngineConfig(optim=OptimConfig(lr=lr, weight_decay=0.0, max_grad_norm=None)),
                               total_steps=1, compute_dtype=compute)


def _changed(eng, before):
    after = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    return sum(int((after[n] != before[n]).sum()) for n in before), sum(t.numel() for t in before.values())


def test_a_1e6_update_changes_a_bf16_computed_model(tiny_dir, tiny_tokenizer):
    """fp32 master weights + bf16 compute keep a 1e-6 Adam step; pure bf16 weights lose nearly all of it."""
    batch = _batch(tiny_tokenizer)
    mixed = _engine(tiny_dir, torch.float32, torch.bfloat16)
    assert mixed._autocast and next(mixed.model.parameters()).dtype == torch.float32
    before = {n: p.detach().clone() for n, p in mixed.model.named_parameters()}
    mixed.train_step(batch, PolicyLoss(agg="token-mean"))
    changed, total = _changed(mixed, before)
    assert changed > 0.5 * total  # Adam moves every weight with a gradient by about lr

    pure = _engine(tiny_dir, torch.bfloat16, torch.bfloat16)
    before = {n: p.detach().clone() for n, p in pure.model.named_parameters()}
    pure.train_step(batch, PolicyLoss(agg="token-mean"))
    lost, _ = _changed(pure, before)
    assert lost < 0.05 * total  # what pure bf16 training silently drops


def test_mixed_precision_computes_in_bf16(tiny_dir, tiny_tokenizer):
    """Log-probs of the mixed engine are bf16-computed: close to, but not equal to, the fp32 ones."""
    batch = _batch(tiny_tokenizer)
    fp32 = _engine(tiny_dir, torch.float32, torch.float32)
    mixed = _engine(tiny_dir, torch.float32, torch.bfloat16)
    a, _ = fp32.logprobs(batch)
    b, _ = mixed.logprobs(batch)
    diff = max(float((x - y).abs().max()) for x, y in zip(a, b))
    assert 1e-5 < diff < 0.2
    assert all(t.dtype == torch.float32 for t in b)


@pytest.mark.slow  # (about 1 s: make test runs it, the fast set does not)
def test_compute_copy_runs_the_passes_of_a_bf16_model_and_steps_float32_masters(tiny_dir, tiny_tokenizer,
                                                                                 monkeypatch):
    """engine.compute_copy: the passes (and so the gradients) are those of the model cast to bf16, summed over
    micro-batches in float32; Adam steps the float32 masters (a 1e-6 step survives) and the copy follows them."""
    batch = _batch(tiny_tokenizer)
    cfg = TrainEngineConfig(token_budget=16, compute_copy=True,  # several micro-batches
                            optim=OptimConfig(lr=1e-6, weight_decay=0.0, max_grad_norm=None))
    torch.manual_seed(0)
    eng = TorchTrainingEngine(load_model(tiny_dir), cfg, total_steps=1, compute_dtype=torch.bfloat16)
    assert not eng._autocast and next(eng.runner.parameters()).dtype == torch.bfloat16
    ref = TorchTrainingEngine(load_model(tiny_dir, dtype="bfloat16"), cfg, total_steps=1, trainable=False)
    want = ref.logprobs(batch)[0]  # the same model cast to bf16, no autocast
    for a, b in zip(eng.logprobs(batch)[0], want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    bf16 = TorchTrainingEngine(load_model(tiny_dir, dtype="bfloat16"), cfg, total_steps=1)
    per_mb = []  # the bf16 model's gradients of each micro-batch, summed in float32
    bf16.optimizer.step = lambda: None
    real_backward = torch.Tensor.backward

    def backward(loss, *a, **k):
        real_backward(loss, *a, **k)
        per_mb.append([p.grad.float().clone() for p in bf16.model.parameters()])
        bf16.optimizer.zero_grad(set_to_none=True)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "backward", backward)
        m_ref = bf16.train_step(batch, PolicyLoss(agg="token-mean"))
    assert len(per_mb) > 1
    got = []
    step = eng.optimizer.step
    eng.optimizer.step = lambda: (got.extend(p.grad.clone() for p in eng.model.parameters()), step())
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    m = eng.train_step(batch, PolicyLoss(agg="token-mean"))
    assert m["actor/loss"] == pytest.approx(m_ref["actor/loss"], rel=1e-6)
    for g, parts in zip(got, zip(*per_mb)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, torch.stack(parts).sum(0), atol=1e-6, rtol=1e-5)
    changed, total = _changed(eng, before)
    assert changed > 0.5 * total
    for master, comp in zip(eng.model.parameters(), eng.runner.parameters()):
        assert torch.equal(comp, master.detach().to(torch.bfloat16))
    after = eng.logprobs(batch)[0]
    eng.offload()
    eng.reload()  # the copy comes back from the master weights
    for a, b in zip(eng.logprobs(batch)[0], after):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_config_refuses_fp16_training_and_pointless_pure_precision():
    from relayrl.config.schema import Config

    with pytest.raises(ValueError, match="loss scaling"):
        Config.model_validate({"model": {"dtype": "float16"}})
    with pytest.raises(ValueError, match="pure_low_precision"):
        Config.model_validate({"model": {"pure_low_precision": True}})
    cfg = Config.model_validate({"model": {"dtype": "bfloat16"}, "rollout": {"dtype": "float16"}})
    from relayrl.workflows.precision import role_precision

    prec = role_precision(cfg.model, cfg.rollout)
    assert prec["trained"] == {"dtype": "float32", "compute_dtype": "bfloat16", "head_fp32": False}
    assert prec["frozen"] == {"dtype": "bfloat16", "head_fp32": False}
    assert prec["rollout"] == {"dtype": "float16", "head_fp32": False}
    # LoRA: the trained roles' base is frozen too, so it loads in the compute dtype (the adapters are float32)
    lora = Config.model_validate({"model": {"dtype": "bfloat16", "lora": {"enabled": True}}})
    assert role_precision(lora.model)["trained"] == {"dtype": "bfloat16", "compute_dtype": "bfloat16",
                                                          "head_fp32": False}


def test_lora_on_a_bf16_base_trains_float32_adapters(tiny_dir, tiny_tokenizer):
    """The adapters peft adds to a bf16 base are float32 and the only weights with a gradient; a step moves
    them and leaves the base as it was."""
    from relayrl.models.lora import LoraConfig, apply_lora

    model = load_model(tiny_dir, dtype="bfloat16")
    apply_lora(model, LoraConfig(enabled=True))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and all(p.dtype == torch.float32 and p.requires_grad for p in adapters.values())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for n, p in model.named_parameters()
               if n in base)
    eng = TorchTrainingEngine(model, TrainEngineConfig(optim=OptimConfig(lr=1e-2)), total_steps=2,
                              compute_dtype=torch.bfloat16)
    lora_b = {n: p.detach().clone() for n, p in adapters.items() if "lora_B" in n}
    eng.train_step(_batch(tiny_tokenizer), PolicyLoss())
    assert any(not torch.equal(lora_b[n], adapters[n]) for n in lora_b)
    assert all(torch.equal(base[n], p) for n, p in model.named_parameters() if n in base)


_SLOW = pytest.mark.slow  # (the fast set keeps one case per feature: stops, swap, fuse, chunk sizes; `make test` runs all)


@pytest.mark.parametrize("n,max_batch,stops,swap,fuse,chunk", [
    (1, 2, 0, False, False, 16), pytest.param(3, 4, 0, False, False, 16, marks=_SLOW),
    pytest.param(2, 16, 0, False, False, 16, marks=_SLOW), pytest.param(2, 16, 3, False, False, 16, marks=_SLOW),
    pytest.param(2, 16, 3, True, False, 16, marks=_SLOW), pytest.param(3, 4, 0, False, True, 16, marks=_SLOW),
    (2, 16, 3, True, True, 16), pytest.param(2, 4, 3, False, False, 3, marks=_SLOW), (2, 3, 3, False, False, 1),
    pytest.param(3, 4, 0, False, False, 4, marks=_SLOW), pytest.param(2, 4, 13, False, False, 3, marks=_SLOW),
    (2, 4, 13, False, False, (3, 16)), pytest.param(2, 16, 3, True, 4, 16, marks=_SLOW)])
def test_static_decoder_matches_the_dynamic_path(tiny_model, tiny_dir, tiny_tokenizer, n, max_batch, stops, swap,
                                                 fuse, chunk):
    """The static-cache decode step (eager on CPU, graphed on CUDA) gives the same tokens and log-probs as the
    Hugging Face forward with a dynamic cache, including slots freed and refilled (continuous batching).
    ``stops``: every ``stops``-th token id ends a row (3: a third of the vocabulary), so rows finish at
    scattered steps (a slot above every running one finishing used to index past the decode batch; with 13,
    rows that reach the budget run beside rows that started later); ``swap``: new weights after the 3rd step
    (partial rollout: both paths prefill the in-flight rows again); ``fuse``: q/k/v and gate/up as one product
    each (what ``rollout.decode_compile`` runs), whose weight copies must follow the swap (a number: also the
    q/k/v, o and down products as that many split-K partial products); ``chunk``: decode
    steps between two reads (below ``max_new_tokens``: a chunk is queued before the last is read, so a row
    that stopped decodes on through it, and its slot is refilled a chunk later; a pair: the chunk and the
    attended span's bucket, 16 positions where the default is 128)."""
    texts = ["1+2=", "123+456=", "sort 5 12 9 =", "77+1=", "9+9=", "3+4+5=", "countdown 3 7 5 -> 9 :"]
    prompts = [tiny_tokenizer(t)["input_ids"] for t in texts]
    other = load_model(tiny_dir)
    other.load_state_dict(tiny_model.state_dict())
    dyn = NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=max_batch, decode="dynamic")
    chunk, bucket = chunk if isinstance(chunk, tuple) else (chunk, 128)
    sta = NativeGenerationEngine(other, tiny_tokenizer, max_batch=max_batch, decode="static", decode_chunk=chunk)
    if bucket != 128:
        sta.static = StaticDecoder(other, max_batch, graphs=False, bucket=bucket)
    assert dyn.static is None and sta.static is not None
    if fuse:
        sta.static = StaticDecoder(other, max_batch, graphs=False, fuse=True, split_k=1 if fuse is True else fuse)
    stop_ids = tuple(range(5, tiny_model.config.vocab_size, stops)) if stops else ()
    params = SamplingParams(n=n, temperature=0.0 if n == 1 else 1.0, max_new_tokens=10, stop_token_ids=stop_ids)
    new = [(k, v.detach() + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9)))
           for k, v in tiny_model.named_parameters()]

    # without a swap no ``between`` hook either: the static path then decodes in chunks
    a = dyn.generate(prompts, params, torch.Generator().manual_seed(3), between=swap_at(dyn, new, 4) if swap else None)
    b = sta.generate(prompts, params, torch.Generator().manual_seed(3), between=swap_at(sta, new, 4) if swap else None)
    if stops:
        assert len({len(c.token_ids) for c in a}) > 2  # rows did finish at scattered steps
    assert [(c.prompt_index, c.sample_index) for c in a] == [(c.prompt_index, c.sample_index) for c in b]
    for x, y in zip(a, b):
        assert x.token_ids.tolist() == y.token_ids.tolist() and x.finish_reason == y.finish_reason
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-4, rtol=1e-4)
        assert x.token_versions.tolist() == y.token_versions.tolist()
    if swap:
        assert any(1 in c.token_versions.tolist() and 0 in c.token_versions.tolist() for c in b)
    if fuse:  # the copies hold the swapped weights
        layer, fused = other.model.layers[0], sta.static._fused[0]
        assert torch.equal(fused.w_qkv[: layer.self_attn.q_proj.out_features], layer.self_attn.q_proj.weight)
        assert torch.equal(fused.w_gu[-layer.mlp.up_proj.out_features:], layer.mlp.up_proj.weight)


def test_finished_rows_takes_the_first_stop_token_or_the_last_of_the_budget():
    from relayrl.engines.generation.native import finished_rows

    # slots 0-3; read from token 4 on (lo=4), 4 columns: tokens 4..7
    tokens = torch.tensor([[5, 9, 9, 9],    # slot 0: a stop token (9) at token 5, read already (done=6)
                           [1, 2, 9, 3],    # slot 1: stop at token 6
                           [1, 2, 3, 4],    # slot 2: no stop; the budget's last token is token max_new - 1
                           [1, 9, 3, 4]])   # slot 3: not in the read
    ends = finished_rows(tokens, [0, 1, 2], done=[6, 4, 4], seen=[8, 8, 8], lo=4, max_new=8, stop_ids={9})
    assert ends == {0: (7, "stop"), 1: (7, "stop"), 2: (8, "length")}
    ends = finished_rows(tokens, [0, 1, 2], done=[6, 4, 4], seen=[8, 8, 8], lo=4, max_new=9, stop_ids={9})
    assert ends == {0: (7, "stop"), 1: (7, "stop")}  # slot 2 goes on
    ends = finished_rows(tokens, [0, 1, 2], done=[6, 4, 4], seen=[8, 6, 8], lo=4, max_new=7, stop_ids={9})
    assert ends == {0: (7, "stop"), 2: (7, "length")}  # slot 1's stop is past what the device sampled
    assert finished_rows(tokens, [1], done=[4], seen=[8], lo=4, max_new=20, stop_ids=set()) == {}
    assert finished_rows(tokens, [1], done=[4], seen=[8], lo=4, max_new=7, stop_ids={2}) == {1: (6, "stop")}


@pytest.mark.slow  # (about 1 s: make test runs it, the fast set does not)
def test_static_decoder_stop_strings_match_the_dynamic_path(tiny_model, tiny_dir, tiny_tokenizer):
    """With stop strings the static path finishes rows token by token on their text, as the dynamic path."""
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ["1+2=", "123+456=", "sort 5 12 9 =", "9+9="]]
    other = load_model(tiny_dir)
    other.load_state_dict(tiny_model.state_dict())
    dyn = NativeGenerationEngine(tiny_model, tiny_tokenizer, max_batch=4, decode="dynamic")
    sta = NativeGenerationEngine(other, tiny_tokenizer, max_batch=4, decode="static", decode_chunk=3)
    free = dyn.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12),
                        torch.Generator().manual_seed(1))
    stops = tuple({c.text[3:5] for c in free[:3] if len(c.text) >= 5})
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, stop_strings=stops)
    a = dyn.generate(prompts, params, torch.Generator().manual_seed(1))
    b = sta.generate(prompts, params, torch.Generator().manual_seed(1))
    assert {c.finish_reason for c in a} == {"stop", "length"}
    assert [(c.token_ids.tolist(), c.finish_reason) for c in a] == [(c.token_ids.tolist(), c.finish_reason) for c in b]


def test_fusing_refuses_layers_it_cannot_fuse(tiny_model):
    from torch import nn

    from relayrl.engines.generation.static_fit import fuse_reason

    layer = tiny_model.model.layers[0]
    assert fuse_reason(layer) is None
    layer.self_attn.k_proj.bias = None  # q and v keep theirs
    assert "bias on some" in fuse_reason(layer)
    layer.mlp.up_proj = nn.Sequential(layer.mlp.up_proj)  # a wrapper (LoRA, quantization) is not nn.Linear
    assert "not plain nn.Linear" in fuse_reason(layer)
    with pytest.raises(ValueError, match="fused projections: .*not plain nn.Linear"):
        StaticDecoder(tiny_model, 4, graphs=False, fuse=True)


@pytest.mark.slow  # (4 s: the eager FlexAttention reference on CPU; the full `make test` runs it)
def test_flex_attention_decode_step_samples_the_matmul_steps_tokens(tiny_model):
    """The step's attention as one FlexAttention call (the score masked past each row's position) samples what
    the two matrix products do, with rows at different positions. Run eagerly here (FlexAttention's reference
    path): Inductor's CPU kernel for it fails to build with a dynamic batch in torch 2.13, and the compiled
    step it is meant for runs on CUDA (``tests/engines/test_cuda.py``)."""
    import warnings

    out = []
    for flex in (False, True):
        dec = StaticDecoder(tiny_model, 8, graphs=False)
        dec.attention = "flex" if flex else "matmul"  # what attention="flex" sets (it also asks for compile)
        dec.ensure(300, 20)
        dec.tokens.copy_(torch.arange(8) * 5 + 11)
        dec.positions.copy_(torch.tensor([5, 5, 40, 127, 3, 60, 5, 9]))
        dec.row_keys.copy_(torch.arange(8) * 7 + 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "flex_attention called without torch.compile()"
            for B, L in ((8, 256), (3, 256), (6, 384)):
                dec.run(B, L, 3, SamplingParams(temperature=1.0))
        out.append((dec.hist_tokens.clone(), dec.hist_logprobs.clone()))
    assert torch.equal(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-5, rtol=1e-5)


def test_flex_attention_decode_needs_compile_and_a_known_name(tiny_model):
    with pytest.raises(ValueError, match="'flex' needs compile"):
        StaticDecoder(tiny_model, 4, graphs=False, attention="flex")
    with pytest.raises(ValueError, match="bucket 48: .* multiple of 16, 32, 64 or 128"):
        StaticDecoder(tiny_model, 4, graphs=False, bucket=48)
    dec = StaticDecoder(tiny_model, 4, graphs=False, bucket=32)
    dec.ensure(300)  # 384 positions
    assert [dec.span(last) for last in (0, 31, 32, 200, 383, 500)] == [32, 32, 64, 224, 384, 384]
    with pytest.raises(ValueError, match="attention 'sdpa': one of matmul: .*; flex: "):
        StaticDecoder(tiny_model, 4, graphs=False, attention="sdpa")


def test_static_decoding_refuses_a_model_whose_forward_keeps_every_logit(tiny_dir):
    from relayrl.engines.generation.static_fit import unsupported_reason

    model = load_model(tiny_dir)
    assert unsupported_reason(model) is None

    class AllLogits(type(model)):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    model.__class__ = AllLogits
    assert "takes no logits_to_keep" in unsupported_reason(model)


def test_share_weights_is_zero_copy(tiny_model, tiny_dir, tiny_tokenizer):
    """A colocated rollout engine can run on the actor's own parameters: an in-place update shows at once."""
    actor = TorchTrainingEngine(tiny_model, TrainEngineConfig(), total_steps=1)
    eng = NativeGenerationEngine(load_model(tiny_dir), tiny_tokenizer, max_batch=4)
    eng.share_weights(actor.named_weights(), version=3)
    assert eng.weight_version == 3
    shared = {n: p.data_ptr() for n, p in eng.model.named_parameters()}
    assert all(shared[n] == p.data_ptr() for n, p in actor.model.named_parameters())
    with torch.no_grad():
        actor.model.get_input_embeddings().weight.mul_(0.5)
    torch.testing.assert_close(eng.model.get_input_embeddings().weight, actor.model.get_input_embeddings().weight)
    with pytest.raises(ValueError, match="float32"):
        eng.share_weights([(n, p.to(torch.bfloat16)) for n, p in actor.named_weights()], version=4)


def test_static_decoder_runs_a_bf16_model(tiny_dir, tiny_tokenizer):
    """bf16 weights: float32 logits and log-probs come out, every row reaches its length."""
    eng = NativeGenerationEngine(load_model(tiny_dir, dtype="bfloat16"), tiny_tokenizer, max_batch=4, decode="static")
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ["1+2=", "123+456=", "sort 5 12 9 ="]]
    outs = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, ignore_eos=True),
                        torch.Generator().manual_seed(0))
    assert len(outs) == 6 and all(len(c.token_ids) == 6 and torch.isfinite(c.logprobs).all() for c in outs)
    assert all(c.logprobs.dtype == torch.float32 for c in outs)


def test_static_decoder_refuses_more_samples_than_slots(tiny_dir, tiny_tokenizer):
    from relayrl.config.schema import Config

    eng = NativeGenerationEngine(load_model(tiny_dir), tiny_tokenizer, max_batch=2, decode="static")
    with pytest.raises(ValueError, match="max_batch"):
        eng.generate([tiny_tokenizer("1+2=")["input_ids"]], SamplingParams(n=3, temperature=1.0, max_new_tokens=2))
    with pytest.raises(ValueError, match="rollout.max_batch"):
        Config.model_validate({"rollout": {"n": 8, "max_batch": 4}})


@pytest.mark.slow
@pytest.mark.parametrize("split_k", [1, 4])
def test_compiled_decode_step_gives_the_eager_tokens_and_compiles_once_for_every_shape(tiny_model, split_k):
    """``rollout.decode_compile``: the layer step (its projections fused, and with ``split_k`` as split-K partial
    products), the head and the sampler's block masses compiled by Inductor (here for the CPU) sample the eager
    step's tokens, and one compilation of each serves every batch bucket and cache length (slot 3 a row further
    on than the others)."""
    from torch._dynamo.utils import counters

    from relayrl.engines.generation.static import StaticDecoder

    torch._dynamo.reset()
    counters.clear()
    out = []
    for compiled in (False, True):
        dec = StaticDecoder(tiny_model, 8, graphs=False, compile=compiled, fuse=compiled,  # fused as on CUDA
                            split_k=split_k if compiled else 1)
        dec.ensure(300, 40)
        dec.tokens.copy_(torch.arange(8) * 5 + 11)
        dec.positions.fill_(5)
        dec.positions[3] = 60
        dec.row_keys.copy_(torch.arange(8) * 7 + 1)
        for B, L in ((8, 128), (3, 128), (8, 256), (2, 256), (6, 128)):
            dec.run(B, L, 4, SamplingParams(temperature=1.0))
        out.append((dec.hist_tokens.clone(), dec.hist_logprobs.clone()))
    assert torch.equal(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 3  # the layer step, the head and the block masses, once each


@pytest.mark.slow
def test_decode_step_compiled_with_a_mode_gives_the_eager_tokens(tiny_model):
    """``StaticDecoder(compile_mode=...)``: the layer step and the head compiled with another torch.compile mode
    (here max-autotune without CUDA graphs, on the CPU) sample the eager step's tokens."""
    from relayrl.engines.generation.static import StaticDecoder

    out = []
    for kw in ({"compile": False}, {"compile": True, "compile_mode": "max-autotune-no-cudagraphs"}):
        torch._dynamo.reset()
        dec = StaticDecoder(tiny_model, 8, graphs=False, fuse=kw["compile"], **kw)
        dec.ensure(300, 40)
        dec.tokens.copy_(torch.arange(8) * 5 + 11)
        dec.positions.fill_(5)
        dec.row_keys.copy_(torch.arange(8) * 7 + 1)
        for B, L in ((8, 128), (3, 128)):
            dec.run(B, L, 4, SamplingParams(temperature=1.0))
        out.append((dec.hist_tokens.clone(), dec.hist_logprobs.clone()))
    assert torch.equal(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-5, rtol=1e-5)


def test_split_k_products_equal_the_single_product_and_bad_splits_are_refused(tiny_model):
    from relayrl.engines.generation.split_k import split_k_linear

    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((5, 1, 24), (7, 24), (7,)))
    for splits in (1, 2, 3, 8):
        for bias in (None, b):
            got = split_k_linear(x, w, bias, splits)
            assert got.shape == (5, 1, 7)
            torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias))
    with pytest.raises(ValueError, match="split_k=4 needs fuse"):
        StaticDecoder(tiny_model, 4, graphs=False, split_k=4)
    with pytest.raises(ValueError, match=r"input width 64 of a \[64, 64\] weight is not a multiple of split_k=3"):
        StaticDecoder(tiny_model, 4, graphs=False, fuse=True, split_k=3)
    with pytest.raises(ValueError, match="split_k=0 must be >= 1"):
        StaticDecoder(tiny_model, 4, graphs=False, fuse=True, split_k=0)
