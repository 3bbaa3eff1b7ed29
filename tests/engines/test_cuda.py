"""The engines' CUDA paths (fp32 exactness, bf16 training, shared-prompt masks on GPU kernels).

Skipped without a GPU (CI has none); run them on a GPU machine with
``python -m pytest tests/engines/test_cuda.py``.
"""

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.workflows.losses import PolicyLoss
from weight_swap import swap_at

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["1+2=", "123+456=", "sort 5 12 9 =", "77+1=", "9+9="]


def _ids(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


def _grouped(tok, n=4):
    """Two prompts with n sampled-looking responses each (shared-prompt groups)."""
    g = torch.Generator().manual_seed(0)
    prompts, responses, groups = [], [], []
    for gi, text in enumerate(["12+34=", "sort 3 1 2 ="]):
        p = torch.tensor(tok(text)["input_ids"])
        for _ in range(n):
            prompts.append(p.clone())
            responses.append(torch.randint(10, 200, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g))
            groups.append(gi)
    fields = {"advantages": [torch.randn(len(r), generator=g) for r in responses]}
    return SequenceBatch(prompts, responses, fields, groups)


def test_greedy_generation_on_cuda_matches_hf_generate(tiny_model, tiny_tokenizer):
    model = tiny_model.cuda()
    eng = NativeGenerationEngine(model, tiny_tokenizer, max_batch=2, device="cuda")
    prompts = _ids(tiny_tokenizer, PROMPTS)
    outs = eng.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    for p, o in zip(prompts, outs):
        ref = model.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"),
                             max_new_tokens=8, do_sample=False, eos_token_id=tiny_tokenizer.eos_token_id,
                             pad_token_id=tiny_tokenizer.pad_token_id)[0, len(p):].tolist()
        assert o.token_ids.tolist() == ref[: len(o.token_ids)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_sampled_logprobs_on_cuda_match_a_forward(tiny_model, tiny_tokenizer, dtype, tol):
    model = tiny_model.to("cuda", dtype)
    eng = NativeGenerationEngine(model, tiny_tokenizer, max_batch=4, device="cuda")
    prompts = _ids(tiny_tokenizer, PROMPTS)
    outs = eng.generate(prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=6),
                        generator=torch.Generator(device="cuda").manual_seed(1))
    for o in outs:
        p = prompts[o.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([p + o.token_ids.tolist()], device="cuda")).logits[0, len(p) - 1:-1].float() / 0.8
        ref = torch.log_softmax(logits, -1).gather(-1, o.token_ids.to("cuda")[:, None]).squeeze(-1)
        torch.testing.assert_close(o.logprobs.float().cpu(), ref.cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("packing", ["none", "shared_prompt"])
def test_training_logprobs_on_cuda_match_cpu(tiny_model, tiny_tokenizer, packing):
    batch = _grouped(tiny_tokenizer)
    cpu = TorchTrainingEngine(tiny_model, TrainEngineConfig(packing="none"), total_steps=1, trainable=False)
    want, _ = cpu.logprobs(batch, temperature=1.0)
    gpu = TorchTrainingEngine(tiny_model, TrainEngineConfig(packing=packing, token_budget=24), total_steps=1,
                              trainable=False, device="cuda")
    got, _ = gpu.logprobs(batch, temperature=1.0)
    for a, b in zip(want, got):
        torch.testing.assert_close(b.float().cpu(), a, atol=1e-4, rtol=1e-4)


def test_bf16_policy_update_on_cuda_is_finite_and_moves_the_weights(tiny_model, tiny_tokenizer):
    model = tiny_model.to("cuda", torch.bfloat16)
    eng = TorchTrainingEngine(model, TrainEngineConfig(packing="shared_prompt", optim=OptimConfig(lr=1e-3)),
                              total_steps=2, device="cuda")
    before = [p.detach().clone() for p in eng.model.parameters()]
    m = eng.train_step(_grouped(tiny_tokenizer), PolicyLoss(), temperature=1.0, with_entropy=True)
    assert torch.isfinite(torch.tensor(m["actor/grad_norm"])) and m["actor/grad_norm"] > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, eng.model.parameters()))


@pytest.mark.parametrize("swap", [False, True])
def test_graphed_static_decode_matches_the_dynamic_path_on_cuda(tiny_model, tiny_dir, tiny_tokenizer, swap):
    """Graph replays give the dynamic path's tokens, with rows ending at scattered steps (continuous
    batching); ``swap``: new weights land after the 3rd decode step (partial rollout), loaded in place under
    the recorded graphs, and both paths prefill the in-flight rows again."""
    from relayrl.models.load import load_model

    other = load_model(tiny_dir)
    other.load_state_dict(tiny_model.state_dict())
    new = [(k, v.detach() + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9)))
           for k, v in tiny_model.named_parameters()]
    dyn = NativeGenerationEngine(tiny_model.cuda(), tiny_tokenizer, max_batch=3, device="cuda", decode="dynamic")
    sta = NativeGenerationEngine(other.cuda(), tiny_tokenizer, max_batch=3, device="cuda", decode="auto")
    assert sta.static is not None and sta.static.graphs
    prompts = _ids(tiny_tokenizer, PROMPTS)
    stop_ids = tuple(range(5, tiny_model.config.vocab_size, 3))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12, stop_token_ids=stop_ids)

    a = dyn.generate(prompts, params, between=swap_at(dyn, new, 4 if swap else None))
    b = sta.generate(prompts, params, between=swap_at(sta, new, 4 if swap else None))
    assert len({len(c.token_ids) for c in a}) > 1  # rows ended at different steps
    for x, y in zip(a, b):
        assert x.token_ids.tolist() == y.token_ids.tolist() and x.finish_reason == y.finish_reason
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-3, rtol=1e-3)
        assert x.token_versions.tolist() == y.token_versions.tolist()
    if swap:
        assert any(1 in c.token_versions.tolist() and 0 in c.token_versions.tolist() for c in b)
    assert sta.static._graphs  # the steps ran as graph replays


@pytest.mark.parametrize("compile_step", [False, True, "flex", "triton", "splitk"])
@pytest.mark.parametrize("narrow", [dict(top_k=50), {}, dict(min_p=0.05, repetition_penalty=1.3)],
                         ids=["top_k", "plain", "min_p+penalty"])  # plain: the blockwise sampler (block_mass)
def test_sampled_graphed_decode_in_chunks_matches_the_dynamic_path_on_cuda(tiny_model, tiny_dir, tiny_tokenizer,
                                                                          compile_step, narrow):
    """Sampling inside the graph (counter-based uniforms) over chunks of steps between host reads gives the
    dynamic path's tokens and log-probs, with the step compiled (its projections fused) or not, or compiled
    with its attention as one FlexAttention call (``flex``) or one Triton kernel (``triton``), or its q/k/v, o
    and down products as split-K partial products (``splitk``); rows end at scattered steps inside chunks and
    freed slots take waiting prompts. ``narrow``: top-k, nothing (the blockwise sampler, compiled with the step),
    or min-p with a repetition penalty (the seen-token mask written inside the graph)."""
    from relayrl.engines.generation.static import StaticDecoder
    from relayrl.models.load import load_model

    other = load_model(tiny_dir)
    other.load_state_dict(tiny_model.state_dict())
    dyn = NativeGenerationEngine(tiny_model.cuda(), tiny_tokenizer, max_batch=8, device="cuda", decode="dynamic")
    sta = NativeGenerationEngine(other.cuda(), tiny_tokenizer, max_batch=8, device="cuda", decode="auto",
                                 decode_compile=bool(compile_step))
    assert sta.static is not None and sta.static.graphs and sta.decode_chunk > 1
    assert sta.static.fuse == bool(compile_step)
    if compile_step in ("flex", "triton"):
        sta.static = StaticDecoder(other, 8, graphs=True, compile=True, fuse=True, attention=compile_step)
    if compile_step == "splitk":
        sta.static = StaticDecoder(other, 8, graphs=True, compile=True, fuse=True, split_k=4)
    prompts = _ids(tiny_tokenizer, PROMPTS) * 3
    params = SamplingParams(n=2, temperature=0.9, **narrow, max_new_tokens=40,
                            stop_token_ids=tuple(range(5, tiny_model.config.vocab_size, 11)))
    a = dyn.generate(prompts, params, torch.Generator(device="cuda").manual_seed(5))
    b = sta.generate(prompts, params, torch.Generator(device="cuda").manual_seed(5))
    assert len({len(c.token_ids) for c in a}) > 3
    for x, y in zip(a, b):
        assert x.token_ids.tolist() == y.token_ids.tolist() and x.finish_reason == y.finish_reason
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-3, rtol=1e-3)


def test_split_k_products_in_bf16_round_once_on_cuda():
    """The decode step's split-K products (relayrl.engines.generation.split_k) in bf16 on CUDA (partials in
    float32 through bmm's out_dtype): the float32 product's values up to bf16 rounding, as the single product."""
    from relayrl.engines.generation.split_k import split_k_linear, split_k_reason

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 1, 4864, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(896, 4864, device="cuda", generator=g, dtype=torch.bfloat16) / 70
    assert split_k_reason(w, 8) is None
    want = (x.float() @ w.float().T)  # float32 reference
    for splits in (1, 8):
        got = split_k_linear(x, w, None, splits)
        assert got.dtype == torch.bfloat16 and got.shape == (256, 1, 896)
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=2 ** -8)  # bf16 rounding


def test_mixed_precision_keeps_small_updates_on_cuda(tiny_dir, tiny_tokenizer):
    from relayrl.models.load import load_model

    eng = TorchTrainingEngine(load_model(tiny_dir, device="cuda"), TrainEngineConfig(
        optim=OptimConfig(lr=1e-6, weight_decay=0.0, max_grad_norm=None)), total_steps=1, device="cuda",
        compute_dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    eng.train_step(_grouped(tiny_tokenizer), PolicyLoss(agg="token-mean"))
    changed = sum(int((p.detach() != before[n]).sum()) for n, p in eng.model.named_parameters())
    assert changed > 0.5 * sum(t.numel() for t in before.values())


def test_offload_frees_device_memory_and_keeps_training_exact(tiny_dir, tiny_tokenizer):
    from relayrl.models.load import load_model

    def engine():
        torch.manual_seed(0)
        return TorchTrainingEngine(load_model(tiny_dir, device="cuda"), TrainEngineConfig(), total_steps=3,
                                   device="cuda", compute_dtype=torch.bfloat16)

    batch, loss = _grouped(tiny_tokenizer), PolicyLoss(agg="token-mean")
    a, b = engine(), engine()
    for eng in (a, b):
        eng.train_step(batch, loss)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    b.offload()
    assert torch.cuda.memory_allocated() < held - 3 * sum(p.numel() * 4 for p in b.model.parameters()) * 0.9
    b.reload()
    for eng in (a, b):
        eng.train_step(batch, loss)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n


def test_compiled_layers_match_eager_on_cuda(tiny_dir, tiny_tokenizer):
    from relayrl.models.load import load_model

    batch, out = _grouped(tiny_tokenizer), []
    for compiled in (False, True):
        torch.manual_seed(0)
        eng = TorchTrainingEngine(load_model(tiny_dir, device="cuda"), TrainEngineConfig(compile=compiled),
                                  total_steps=2, device="cuda", compute_dtype=torch.bfloat16)
        lp = eng.logprobs(batch)[0]
        m = eng.train_step(batch, PolicyLoss(agg="token-mean"))
        out.append((lp, m["actor/grad_norm"]))
    for x, y in zip(out[0][0], out[1][0]):
        torch.testing.assert_close(x, y, atol=0.05, rtol=0.05)  # bf16 compute, fused differently
    assert out[1][1] == pytest.approx(out[0][1], rel=0.05)


@pytest.mark.parametrize("copy", [False, True])
def test_cuda_graph_layers_match_compiled_ones_over_micro_batches_on_cuda(tiny_dir, tiny_tokenizer, copy):
    """engine.cuda_graphs: each micro-batch starts a graph step, and the first micro-batch's gradients survive
    the second's replays (with or without a compute copy): two updates of several micro-batches each give the
    compiled layers' log-probs and gradient norms."""
    from relayrl.models.load import load_model

    batch, out = _grouped(tiny_tokenizer), []
    for graphs in (False, True):
        torch.manual_seed(0)
        cfg = TrainEngineConfig(compile=True, cuda_graphs=graphs, compute_copy=copy, token_budget=32)
        eng = TorchTrainingEngine(load_model(tiny_dir, device="cuda"), cfg, total_steps=2, device="cuda",
                                  compute_dtype=torch.bfloat16)
        assert len(eng._plan(batch)) > 1  # several micro-batches per update
        norms = [eng.train_step(batch, PolicyLoss(agg="token-mean"))["actor/grad_norm"] for _ in range(2)]
        out.append((eng.logprobs(batch)[0], norms))
    for x, y in zip(out[0][0], out[1][0]):
        torch.testing.assert_close(x, y, atol=0.02, rtol=0.02)
    assert out[1][1] == pytest.approx(out[0][1], rel=0.02)



@pytest.mark.parametrize("fused", [False, True])
def test_sum_of_squared_probabilities_in_bf16_on_cuda(fused):
    """OTB's ``sum_v p_v^2`` from the chunked head in bf16 on CUDA (compiled with the other statistics when
    ``fused``): the full logits' value up to bf16 rounding of the products; the log-probs unchanged by asking."""
    from relayrl.engines.training.head import chunked_token_logprobs

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(300, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(5000, 256, device="cuda", generator=g, dtype=torch.bfloat16) / 16
    t = torch.randint(0, 5000, (300,), device="cuda", generator=g)
    with torch.no_grad():
        lp, _, sq = chunked_token_logprobs(h, w, t, temperature=0.7, chunk=128, with_sum_sq=True, fused=fused)
        lp2, _ = chunked_token_logprobs(h, w, t, temperature=0.7, chunk=128, fused=fused)
    z = (h @ w.T).float() / 0.7
    torch.testing.assert_close(sq, torch.exp(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)),
                               atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(lp, lp2)


@pytest.mark.parametrize("compile_step", [False, True])
def test_fp32_head_in_graphed_static_decode_and_the_bf16_trainer_on_cuda(tiny_model, tiny_dir, tiny_tokenizer,
                                                                          compile_step):
    """model.head_fp32 on CUDA: the static decoder's graphs capture the float32 head (bf16 operands, float32
    output: torch.mm's out_dtype) and give the dynamic path's greedy tokens; the trainer's bf16 chunked head
    with head_dtype=float32 (fused with Triton and compiled) matches a float64 product of the same operands."""
    from relayrl.engines.training import head as head_mod
    from relayrl.models.load import load_model

    other = load_model(tiny_dir)
    other.load_state_dict(tiny_model.state_dict())
    dyn = NativeGenerationEngine(tiny_model.to("cuda", torch.bfloat16), tiny_tokenizer, max_batch=3, device="cuda",
                                 decode="dynamic", head_fp32=True)
    sta = NativeGenerationEngine(other.to("cuda", torch.bfloat16), tiny_tokenizer, max_batch=3, device="cuda",
                                 decode="auto", decode_compile=compile_step, head_fp32=True)
    assert sta.static is not None and sta.static.graphs
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=10, ignore_eos=True)
    prompts = _ids(tiny_tokenizer, PROMPTS)
    for x, y in zip(dyn.generate(prompts, params), sta.generate(prompts, params)):
        assert x.token_ids.tolist() == y.token_ids.tolist()
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=0.05, rtol=0)
    assert sta.static._graphs
    with torch.no_grad():
        logits = other.get_output_embeddings()(torch.randn(4, 1, other.config.hidden_size, device="cuda",
                                                           dtype=torch.bfloat16))
    assert logits.dtype == torch.float32

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(300, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(5000, 256, device="cuda", generator=g, dtype=torch.bfloat16) * (5 / 16)
    t = torch.randint(0, 5000, (300,), device="cuda", generator=g)
    want = torch.log_softmax(h.double() @ w.double().T, -1).gather(-1, t[:, None]).squeeze(-1)
    for fused in ("compile", "triton"):
        head_mod.FUSED = fused
        try:
            for grad_by in ("positions", "vocab", "stored"):
                hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                lp, _ = head_mod.chunked_token_logprobs(hh, ww, t, chunk=128, fused=True, grad_by=grad_by,
                                                        head_dtype=torch.float32)
                lp.sum().backward()
                assert float((lp.double() - want).abs().max()) < 1e-4
                assert torch.isfinite(hh.grad).all() and torch.isfinite(ww.grad).all()
        finally:
            head_mod.FUSED = "compile"
