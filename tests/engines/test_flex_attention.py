"""The FlexAttention route (relayrl.engines.training.flex) against the dense shared-prompt mask through SDPA.

On CPU the engine runs torch's unfused FlexAttention reference implementation (the mask predicate on every
pair), which torch refuses to differentiate on CPU: the gradient tests lift that guard. The tiles of the
BlockMask are checked against torch's own builder and run once through a compiled (block-sparse) CPU kernel.
The CUDA tests at the end run the engine on the fused kernels in both directions. Sequences here are hundreds
of tokens, so packs span several 128-token tiles (empty, full and partial ones).
"""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from relayrl.engines.training import flex
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.models.packing import build_packed_batch, plan_units, shared_prompt_mask, shared_prompt_mask_mod
from relayrl.workflows.losses import PolicyLoss

V = 97
# (responses, prompt length, shortest and longest response) per group: packed units of ~90 to ~650 tokens
SPEC = [(4, 130, 60, 200), (3, 40, 100, 300), (2, 300, 10, 50), (1, 70, 5, 20)]
# (token_budget, pack_length): one micro-batch of one unit per pack; several units per pack and micro-batches
LAYOUTS = [(8192, None), (2048, 1024)]
SLIDING = dict(use_sliding_window=True, sliding_window=96, max_window_layers=1)


def _model(attn: str, seed: int = 0, device: str = "cpu", **kw):
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=V, max_position_embeddings=1024, **kw)  # head_dim 16
    cfg._attn_implementation = attn
    return Qwen2ForCausalLM(cfg).float().to(device)


def _batch(spec=SPEC, seed: int = 1) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    prompts, responses, groups = [], [], []
    for gi, (n, lp, lo, hi) in enumerate(spec):
        p = torch.randint(0, V, (lp,), generator=g)
        for _ in range(n):
            prompts.append(p.clone())
            responses.append(torch.randint(0, V, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g))
            groups.append(gi)
    fields = {"advantages": [torch.randn(len(r), generator=g) for r in responses],
              "old_logprobs": [-torch.rand(len(r), generator=g) for r in responses]}
    return SequenceBatch(prompts, responses, fields, groups)


def _engine(model, budget: int, pack_length: int | None, trainable: bool = False, device: str = "cpu"):
    cfg = TrainEngineConfig(token_budget=budget, pack_length=pack_length,
                            optim=OptimConfig(lr=1e-2, max_grad_norm=None))
    return TorchTrainingEngine(model, cfg, total_steps=1, trainable=trainable, device=device)


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    """Lift torch's "no FlexAttention backward on CPU" guard: the unfused reference implementation (dense
    scores, torch's own autograd formulas) then runs backward on CPU. Keeps the guard's other checks."""
    import torch.nn.attention.flex_attention as fa

    guard = getattr(fa, "_validate_device", None)
    if guard is None:
        pytest.skip("this torch build has no CPU guard to lift (torch.nn.attention.flex_attention._validate_device)")
    monkeypatch.setattr(fa, "_validate_device", lambda q, k, v: guard(q.detach(), k.detach(), v.detach()))
    if not flex.backward_supported(torch.device("cpu")):
        pytest.skip("FlexAttention cannot run a backward pass on this CPU build")


# ------------------------------------------------------------------ the BlockMask
@pytest.mark.parametrize("window", [None, 24])
def test_block_mask_tiles_match_torch_and_the_dense_mask(window):
    from torch.nn.attention.flex_attention import create_block_mask

    batch = _batch()
    units = plan_units(batch.prompt_ids, batch.response_ids, batch.groups)
    pb = build_packed_batch(batch.prompt_ids, batch.response_ids, [units[:2], units[2:]]).pad_to(16)
    P, L = pb.input_ids.shape
    got = flex.block_mask(pb.doc_ids, pb.segment_ids, pb.position_ids, sliding_window=window, block=16)
    mod = shared_prompt_mask_mod(pb.doc_ids, pb.segment_ids, pb.position_ids, sliding_window=window)
    want = create_block_mask(mod, P, None, L, L, device="cpu", BLOCK_SIZE=16)
    assert torch.equal(got.kv_num_blocks, want.kv_num_blocks)  # partial tiles
    assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)
    assert torch.equal(got.to_dense(), want.to_dense())
    for b in range(P):  # partial tiles evaluate the same predicate as the dense mask
        grid = got.mask_mod(torch.tensor(b), torch.tensor(0), torch.arange(L)[:, None], torch.arange(L)[None, :])
        dense = shared_prompt_mask(pb.doc_ids, pb.segment_ids, pb.position_ids, sliding_window=window)
        assert torch.equal(grid, dense[b, 0])
    assert got.to_dense().float().mean() < 0.5  # most tiles are skipped
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        flex.block_mask(pb.doc_ids[:, :-1], pb.segment_ids[:, :-1])


def test_pad_to_adds_self_attending_columns():
    batch = _batch([(2, 5, 3, 4)])
    pb = build_packed_batch(batch.prompt_ids, batch.response_ids,
                            [plan_units(batch.prompt_ids, batch.response_ids, batch.groups)])
    padded = pb.pad_to(16)
    L = pb.input_ids.shape[1]
    assert padded.input_ids.shape == (1, 16) and torch.equal(padded.input_ids[:, :L], pb.input_ids)
    assert padded.doc_ids[0, L:].eq(-1).all() and padded.segment_ids[0, L:].eq(-1).all()
    assert torch.equal(padded.token_src, pb.token_src) and padded.pad_to(16) is padded
    assert pb.pad_to(16, at_least=32).input_ids.shape == (1, 32)
    assert padded.pad_to(8, at_least=20).input_ids.shape == (1, 24)
    m = shared_prompt_mask(padded.doc_ids, padded.segment_ids)[0, 0]
    assert torch.equal(m[L:], torch.eye(16, dtype=torch.bool)[L:])  # padding sees itself only
    assert not m[:L, L:].any()  # and nothing real sees padding


@pytest.mark.slow  # a C++ compilation: ~8 s on 2 shared cores
def test_compiled_block_sparse_kernel_equals_dense_sdpa():
    """The tiles drive a real block-sparse kernel (compiled for CPU, static shapes): skipped tiles must be empty
    and full tiles unmasked, or the output differs from dense attention."""
    from torch.nn.attention.flex_attention import flex_attention

    batch = _batch()
    units = plan_units(batch.prompt_ids, batch.response_ids, batch.groups)
    pb = build_packed_batch(batch.prompt_ids, batch.response_ids, [units[:2], units[2:]]).pad_to(flex.BLOCK)
    P, L = pb.input_ids.shape
    mask = flex.block_mask(pb.doc_ids, pb.segment_ids, dynamic=False)  # torch 2.13 miscompiles dynamic CPU shapes
    assert mask.to_dense().float().mean() < 0.6 and mask.full_kv_num_blocks.sum() > 0
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(P, h, L, 16, generator=g) for h in (4, 2, 2))
    with torch.no_grad():
        got = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=mask, enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=shared_prompt_mask(pb.doc_ids, pb.segment_ids), enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ engine, CPU
@pytest.mark.parametrize("budget,pack_length", [pytest.param(*LAYOUTS[0], marks=pytest.mark.slow), LAYOUTS[1]])
@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_flex_logprobs_equal_sdpa(budget, pack_length, sliding):
    kw = SLIDING if sliding else {}
    batch = _batch()
    dense = _engine(_model("sdpa", **kw), budget, pack_length)
    sparse = _engine(_model("flex_attention", **kw), budget, pack_length)
    assert sparse.attn_impl == flex.ATTN and sparse.packing == "shared_prompt"
    assert (sparse.sliding_window is not None) == sliding
    shapes = {}
    for name, eng in (("sdpa", dense), ("flex", sparse)):
        shapes[name] = []
        eng.model.model.register_forward_pre_hook(
            lambda m, a, kw, out=shapes[name]: out.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    want_lp, want_ent = dense.logprobs(batch, temperature=0.7, with_entropy=True)
    got_lp, got_ent = sparse.logprobs(batch, temperature=0.7, with_entropy=True)
    # flex: a micro-batch's packed rows as one row of whole tiles
    assert len(shapes["flex"]) == len(shapes["sdpa"])
    assert all(P == 1 and L % flex.BLOCK == 0 and L >= 2 * flex.BLOCK for P, L in shapes["flex"])
    assert any(P > 1 for P, _ in shapes["sdpa"])
    for a, b, c, d in zip(got_lp, want_lp, got_ent, want_ent):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, d, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_flex_under_autocast_matches_sdpa():
    """bf16 compute over float32 weights (torch.autocast): flex gets its inputs in bf16, as SDPA does."""
    batch = _batch(SPEC[:2])
    out = []
    for attn in ("sdpa", "flex_attention"):
        eng = TorchTrainingEngine(_model(attn), TrainEngineConfig(), total_steps=1, trainable=False,
                                  compute_dtype=torch.bfloat16)
        assert eng._autocast
        out.append(eng.logprobs(batch)[0])
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


@pytest.mark.slow  # transformers compiles its flex mask builder: ~8 s on 2 shared cores
def test_flex_without_packing_equals_sdpa():
    """packing=none: right-padded rows (to whole tiles) with transformers' own flex mask from the padding mask."""
    batch = _batch(SPEC[1:])
    want = _engine(_model("sdpa"), 2048, None).logprobs(batch)[0]
    eng = TorchTrainingEngine(_model("flex_attention"), TrainEngineConfig(packing="none", token_budget=2048),
                              total_steps=1, trainable=False)
    for a, b in zip(eng.logprobs(batch)[0], want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget,pack_length,sliding", [pytest.param(*LAYOUTS[0], False, marks=pytest.mark.slow),
                                                        (*LAYOUTS[1], False),
                                                        pytest.param(*LAYOUTS[1], True, marks=pytest.mark.slow)])
@pytest.mark.slow  # (over a second; the full `make test` runs it)
def test_flex_gradients_equal_sdpa(budget, pack_length, sliding, cpu_flex_backward):
    batch = _batch()
    loss = PolicyLoss(agg="seq-mean-token-mean")
    grads, metrics = {}, {}
    for attn in ("sdpa", "flex_attention"):
        eng = _engine(_model(attn, **(SLIDING if sliding else {})), budget, pack_length, trainable=True)
        got = []
        eng.optimizer.step = lambda: got.extend(p.grad.clone() for p in eng.model.parameters())
        metrics[attn] = eng.train_step(batch, loss, temperature=0.9, with_entropy=True)
        grads[attn] = got
    assert len(grads["flex_attention"]) == len(grads["sdpa"]) > 0
    for a, b in zip(grads["flex_attention"], grads["sdpa"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for key in ("actor/grad_norm", "actor/entropy"):
        assert metrics["flex_attention"][key] == pytest.approx(metrics["sdpa"][key], rel=1e-5)


@pytest.mark.slow  # (over a second; the full `make test` runs it)
@pytest.mark.parametrize("expand", [True, False])
def test_flex_with_key_value_heads_repeated_or_shared_gives_the_gradients_of_sdpa(expand, monkeypatch,
                                                                                  cpu_flex_backward):
    """flex.EXPAND_KV (the default): the key/value heads repeated to the query heads (4 / 2 here); off: the kernel
    maps them itself (enable_gqa). Either way the same log-probs and gradients as dense attention."""
    monkeypatch.setattr(flex, "EXPAND_KV", expand)
    test_flex_gradients_equal_sdpa(*LAYOUTS[1], False, cpu_flex_backward)


def test_training_with_flex_on_cpu_is_refused_without_a_backward():
    if flex.backward_supported(torch.device("cpu")):
        pytest.skip("this torch build has a FlexAttention backward on CPU")
    with pytest.raises(ValueError, match="no FlexAttention backward pass on cpu.*attn_implementation=sdpa"):
        _engine(_model("flex_attention"), 8192, None, trainable=True)
    _engine(_model("flex_attention"), 8192, None)  # a frozen engine (log-probs only) is fine


# ------------------------------------------------------------------ engine, CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("compute_dtype,options", [
    (torch.float32, {}), (torch.bfloat16, {}),
    (torch.bfloat16, dict(compile=True, fused_head=True, compute_copy=True)),  # the benchmark's fastest variant
    pytest.param(torch.bfloat16, dict(compile=True, fused_head=True, compute_copy=True, head_grad="vocab"),
                 id="head_grad-vocab"),
    pytest.param(torch.bfloat16, dict(compile=True, fused_head=True, compute_copy=True, head_grad="stored"),
                 id="head_grad-stored"),
])
def test_flex_update_on_cuda_matches_sdpa(compute_dtype, options):
    batch = _batch()
    loss = PolicyLoss(agg="seq-mean-token-mean")
    out = {}
    for attn in ("sdpa", "flex_attention"):
        cfg = TrainEngineConfig(token_budget=2048, pack_length=1024, optim=OptimConfig(lr=1e-2, max_grad_norm=None),
                                **options)
        eng = TorchTrainingEngine(_model(attn, device="cuda", **SLIDING), cfg, total_steps=1, device="cuda",
                                  compute_dtype=compute_dtype)
        lp = eng.logprobs(batch)[0]
        got = []
        eng.optimizer.step = lambda: got.extend(p.grad.float().clone() for p in eng.model.parameters())
        eng.train_step(batch, loss)
        out[attn] = (lp, got)
    tol = dict(atol=1e-4, rtol=1e-3) if compute_dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    for a, b in zip(out["flex_attention"][0], out["sdpa"][0]):
        torch.testing.assert_close(a, b, **tol)
    norm = {k: torch.cat([g.flatten() for g in v[1]]) for k, v in out.items()}
    rel = (norm["flex_attention"] - norm["sdpa"]).norm() / norm["sdpa"].norm()
    assert rel < (1e-4 if compute_dtype == torch.float32 else 3e-2), float(rel)


@cuda
def test_flex_compiles_once_across_micro_batch_lengths():
    from torch._dynamo.utils import counters

    eng = _engine(_model("flex_attention", device="cuda"), 8192, None, device="cuda")
    graphs = []
    for k, spec in enumerate([SPEC, SPEC[:2], [(3, 20, 400, 500)], [(2, 10, 5, 9)], [(5, 300, 50, 700)]]):
        eng.logprobs(_batch(spec, seed=k))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[0], graphs  # one compilation (no grad, full mask) serves every length


# ------------------------------------------------------------------ how a run selects it
def test_the_rollout_decodes_with_sdpa_and_cpu_runs_are_refused(tiny_dir):
    from relayrl.config.loader import ConfigError, load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.rollout_worker import RolloutWorker
    from relayrl.workflows.trainer_workers import ReferenceWorker

    rollout = RolloutWorker(str(tiny_dir), attn_implementation="flex_attention", device="cpu", threads=1)
    assert rollout.engine.model.config._attn_implementation == "sdpa"
    ref = ReferenceWorker(str(tiny_dir), TrainEngineConfig(), attn_implementation="flex_attention", device="cpu")
    assert ref.engine.attn_impl == flex.ATTN
    assert load_config(Config, None, ["model.attn_implementation=flex_attention", "model.device=cuda"])
    with pytest.raises(ConfigError, match="set model.attn_implementation=sdpa on CPU"):
        load_config(Config, None, ["model.attn_implementation=flex_attention", "model.device=cpu"])
