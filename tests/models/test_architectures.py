"""The decoder architectures users bring: relayrl's trainer and native generator give each model's own log-probs.

The trainer runs the decoder and then the output head itself (packed rows, a chunked head), and the static
decoder re-implements the decode step, so neither inherits what a model's forward does beyond Llama's shape:
Gemma's logit soft-capping, Cohere's and Granite's logit scales (relayrl.models.logits), Granite's multipliers,
GLM-4's extra norms, SmolLM3's layers without rotary embeddings. Each model here is a tiny random one of its
architecture (tests/models/architectures.py) with logits spread as a trained model's.
"""

import pytest
import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.engines.generation.static import step_mismatch
from relayrl.engines.generation.static_fit import StaticDecodeError, unsupported_reason
from relayrl.errors import SettingError, is_user_error
from relayrl.engines.training.base import SequenceBatch
from relayrl.engines.training.fsdp import ResponseLogits
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.models.load import decoder_layers
from relayrl.models.logits import HeadMismatchError, LogitTransform, check_head
from relayrl.models.lora import LoraConfig, apply_lora, linear_sides, merged_weights

from tests.models.architectures import ARCHS, VOCAB, build, own_logprobs

STATIC_REFUSED = {  # model_type -> what the static decoder's refusal names
    "gemma2": "norms the step does not apply", "gemma3_text": "norms the step does not apply",
    "gemma4_text": "norms the step does not apply", "glm4": "norms the step does not apply",
    "phi3": "not a Llama-style layer", "olmo2": "not a Llama-style layer", "cohere": "not a Llama-style layer",
    "smollm3": "no rotary position embedding", "granite": "embedding and residual stream",
    "phi": "lacks embed_tokens", "gpt_neox": "lacks embed_tokens", "qwen3_5_text": "not a Llama-style layer",
    "qwen3_next": "not a Llama-style layer", "gpt_oss": "sliding-window layers",
    "falcon_h1": "lacks embed_tokens, norm or rotary_emb", "lfm2": "lacks embed_tokens, norm or rotary_emb",
    "jamba": "lacks embed_tokens, norm or rotary_emb", "nemotron_h": "lacks embed_tokens, norm or rotary_emb",
    "gpt2": "no decoder with .layers",
}


def _groups(seed: int = 1) -> SequenceBatch:
    """Three prompt groups (3, 1 and 4 responses of 1-8 tokens)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, groups = [], [], []
    for gi, (n, length) in enumerate([(3, 5), (1, 2), (4, 7)]):
        p = torch.randint(3, VOCAB, (length,), generator=g)
        for _ in range(n):
            prompts.append(p.clone())
            responses.append(torch.randint(3, VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g))
            groups.append(gi)
    return SequenceBatch(prompts, responses, {}, groups)


class _Tok:
    """What the native engine reads of a tokenizer."""

    pad_token_id, eos_token_id = 0, 1

    def decode(self, ids, **_):
        return " ".join(map(str, ids))


def test_the_logit_transform_is_read_from_the_config():
    assert LogitTransform.of(build("qwen2").config).identity
    assert LogitTransform.of(build("gemma2").config) == LogitTransform(1.0, 30.0)
    assert LogitTransform.of(build("cohere").config) == LogitTransform(0.0625, None)
    assert LogitTransform.of(build("granite").config) == LogitTransform(1 / 8.0, None)
    z = torch.tensor([-100.0, 0.0, 3.0, 100.0])
    torch.testing.assert_close(LogitTransform(2.0, 30.0)(z), 30 * torch.tanh(2 * z / 30))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_trainer_gives_the_models_own_logprobs(arch):
    """Every packing (shared prompt, sequences, padded rows), with and without the chunked head: each response's
    log-probs are the model's own forward's at temperature 0.7 (before the logit transform was applied, Gemma 2
    and 3 were off by 1 nat, Cohere by 600 and Granite by 200; before packed rows applied a window set for every
    layer, Phi-3's tokens past its window of 4 were 7 nats off)."""
    model = build(arch)
    batch = _groups()
    want = [own_logprobs(model, p, r, 0.7) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    assert max(float(w.abs().max()) for w in want) > 10  # a trained model's spread, where a wrong head shows
    for packing in ("shared_prompt", "sequences", "none"):
        for chunk in (0, 16):
            eng = TorchTrainingEngine(model, TrainEngineConfig(packing=packing, token_budget=4096,
                                                               logprob_chunk=chunk), total_steps=1, trainable=False)
            got = eng.logprobs(batch, temperature=0.7)[0]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=5e-5, rtol=1e-5, msg=f"{arch} packing={packing} chunk={chunk}")


LINEAR_ATTENTION = {"qwen3_5_text", "qwen3_next", "falcon_h1", "lfm2", "jamba", "nemotron_h"}  # states along the
# row: no packed rows


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_packing_check_passes_every_attention_model_and_catches_linear_attention(arch):
    """relayrl/models/packing_check.py: a sequence packed after another has its own logits (to rounding) on every
    model whose layers mix tokens through attention only; Qwen3.5's and Qwen3-Next's Gated DeltaNet carry state
    across the boundary (over a nat off), Falcon-H1's Mamba heads and LFM2's short convolutions too (less), so
    the trainer would not pack them even without their layer types."""
    from relayrl.models.packing_check import leak_reason, packing_leak

    model = build(arch)
    diff, spread = packing_leak(model)
    assert (leak_reason(model) is None) == (arch not in LINEAR_ATTENTION), (diff, spread)
    assert diff < 1e-6 * spread if arch not in LINEAR_ATTENTION else diff > 1e-5 * spread  # (rounding: 3e-7)


def test_a_model_that_mixes_packed_sequences_outside_attention_trains_on_padded_rows():
    """A layer that mixes positions without the mask (here: each position also gets the running mean of the
    hidden states before it, as a recurrent layer would) gives packed rows another model's log-probs; the engine's
    check at start finds it, warns, and trains on padded rows, whose log-probs are the model's own."""
    from relayrl.models.packing_check import leak_reason

    model = build("qwen2")
    layer = model.model.layers[0]
    forward = type(layer).forward

    def leaky(self, hidden_states, *args, **kwargs):
        steps = torch.arange(1, hidden_states.shape[1] + 1, device=hidden_states.device)[None, :, None]
        return forward(self, hidden_states + 0.5 * hidden_states.cumsum(1) / steps, *args, **kwargs)

    layer.forward = leaky.__get__(layer)
    assert "mixes packed sequences outside attention" in leak_reason(model)
    batch = _groups()
    want = [own_logprobs(model, p, r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    with pytest.warns(UserWarning, match="packing='shared_prompt' disabled, using 'none': a sequence packed after"):
        eng = TorchTrainingEngine(model, TrainEngineConfig(packing="shared_prompt"), total_steps=1, trainable=False)
    assert eng.packing == "none"
    for g, w in zip(eng.logprobs(batch)[0], want):
        torch.testing.assert_close(g, w, atol=5e-5, rtol=1e-5)
    eng.packing = "shared_prompt"  # what the check prevented: packed rows, silently other log-probs
    assert max(float((g - w).abs().max()) for g, w in zip(eng.logprobs(batch)[0], want)) > 1e-2


@pytest.mark.parametrize("arch", ["gemma2", "cohere", "granite"])
def test_the_trainers_gradient_goes_through_the_transform(arch):
    """The trainer's decoder-then-head module (materialised logits, and the chunked head) gives the gradient of
    a response's summed log-prob that the model's own forward gives: the soft cap and the scale are
    differentiated through."""
    model = build(arch)
    batch = _groups()
    p, r = batch.prompt_ids[0], batch.response_ids[0]
    ids, rows = torch.cat([p, r])[None], torch.zeros(len(r), dtype=torch.long)
    cols = torch.arange(len(p) - 1, len(p) + len(r) - 1)
    weight = model.model.layers[-1].mlp.down_proj.weight

    def grad(logp_sum) -> torch.Tensor:
        model.zero_grad()
        logp_sum.backward()
        return weight.grad.clone()

    logits = model(ids, use_cache=False).logits[0, len(p) - 1:-1].float()
    want = grad(torch.log_softmax(logits, -1).gather(-1, r[:, None]).sum())
    net = ResponseLogits(model, transform=LogitTransform.of(model.config))
    got = {"materialised": grad(torch.log_softmax(net(ids, None, None, rows, cols), -1).gather(-1, r[:, None]).sum()),
           "chunked": grad(net(ids, None, None, rows, cols, targets=r, chunk=3)[0].sum())}
    for how, g in got.items():
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-4, msg=f"{arch}: {how}")
    plain = grad(ResponseLogits(model)(ids, None, None, rows, cols, targets=r, chunk=3)[0].sum())
    assert not torch.allclose(plain, want, atol=1e-4)  # without the transform: another gradient


def test_a_model_that_changes_its_logits_some_other_way_is_refused():
    """A forward that does more to its logits than relayrl knows (here: doubles them) is refused when the engine
    starts, naming the model, not trained on another model's log-probs."""
    model = build("qwen2")
    forward = type(model).forward

    def doubled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.forward = doubled.__get__(model)
    with pytest.raises(HeadMismatchError, match="Qwen2ForCausalLM's forward returns logits that differ"):
        TorchTrainingEngine(model, TrainEngineConfig(), total_steps=1, trainable=False)
    assert check_head(model, LogitTransform(scale=2.0)).scale == 2.0  # with the right transform it passes


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_native_generator_samples_from_the_models_own_distribution(arch):
    """Both decode paths: the log-probs kept with each sampled token are the model's own forward's at the
    sampling temperature; the static decoder either matches too or refuses the model with the reason."""
    model = build(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 6, 9)]
    params = SamplingParams(temperature=3.0, max_new_tokens=8, ignore_eos=True)
    reason = unsupported_reason(model) or step_mismatch(model)
    assert (reason is None) == (arch not in STATIC_REFUSED), reason
    if reason is not None:
        assert STATIC_REFUSED[arch] in reason
        with pytest.raises(StaticDecodeError, match="rollout.decode=static: .*use rollout.decode=dynamic") as e:
            NativeGenerationEngine(model, _Tok(), max_batch=2, decode="static")
        assert is_user_error(e.value)  # (the CLI's one line: it was a ValueError, printed as a rank's traceback)
    for decode in ("dynamic",) if reason else ("dynamic", "static"):
        eng = NativeGenerationEngine(model, _Tok(), max_batch=2, decode=decode)
        assert (eng.static is not None) == (decode == "static")
        for p, o in zip(prompts, eng.generate(prompts, params, torch.Generator().manual_seed(1))):
            want = own_logprobs(model, torch.tensor(p), o.token_ids, 3.0)
            torch.testing.assert_close(o.logprobs, want, atol=1e-4, rtol=1e-4, msg=f"{arch} decode={decode}")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_5_text", "gemma2", "gemma3_text", "phi3", "gpt_oss", "falcon_h1",
                                  "lfm2", "jamba", "nemotron_h"])
def test_continuous_batching_keeps_every_rows_cache_its_contexts(arch):
    """The dynamic path's row operations on the cache (relayrl/engines/generation/cache_rows.py): a prompt repeated
    for its samples, a longer prompt joining running rows (their attention columns left-padded), finished rows
    leaving and padding columns cut. After them each row's next-token logits are the model's own on its whole
    context, for attention layers (Qwen2), sliding-window ones (Gemma 3) and Gated DeltaNet's recurrent and
    convolution states (Qwen3.5, whose cache layers transformers cannot repeat or select)."""
    from relayrl.engines.generation.native import RunningBatch

    model = build(arch)
    eng = NativeGenerationEngine(model, _Tok(), max_batch=8, decode="dynamic")
    g = torch.Generator().manual_seed(5)
    batch = RunningBatch()

    def advance(steps: int) -> None:
        for _ in range(steps):
            tok = torch.multinomial(torch.softmax(batch.next_logits.float(), -1), 1, generator=g)[:, 0]
            for r, t in enumerate(tok.tolist()):
                batch.tokens[r].append(t)
            eng.advance(batch, tok)

    with torch.no_grad():
        eng.admit(batch, [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 5)], [0, 1], n=2)
        advance(3)
        eng.admit(batch, [torch.randint(3, VOCAB, (12,), generator=g).tolist()], [2], n=1)  # longer: a left pad
        advance(2)
        eng.retain(batch, [1, 2, 4])  # prompt 0's rows gone: prompt 1's shorter rows leave padding to cut
        advance(2)
        assert [r[0] for r in batch.rows] == [0, 1, 2]
        for r, (p, toks) in enumerate(zip(batch.prompts, batch.tokens)):
            want = model(torch.tensor([list(p) + toks]), use_cache=False).logits[0, -1].float()
            torch.testing.assert_close(batch.next_logits[r].float(), want, atol=1e-4, rtol=1e-4, msg=f"{arch} row {r}")


def test_the_static_probe_catches_what_the_structure_hides():
    """A layer whose forward computes more than its modules say (here: a doubled residual stream) passes the
    structural checks; decoding one probe token with both paths finds it."""
    model = build("llama")
    assert unsupported_reason(model) is None and step_mismatch(model) is None
    layer = model.model.layers[-1]
    forward = type(layer).forward
    layer.forward = lambda *a, **k: forward(layer, *a, **k) * 2
    assert unsupported_reason(model) is None
    why = step_mismatch(model)
    assert why is not None and "its decode step differs from LlamaForCausalLM's forward" in why


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_lora_by_default_adapts_every_linear_layer_of_the_decoder_layers(arch):
    """model.lora.target_modules=null: the linear layers of the decoder layers under whatever names the model
    gives them (Phi-3's qkv_proj, GPT-NeoX's query_key_value, an MoE model's attention), never the output head;
    the merged weights are the base's with ``W + (alpha / r) B A`` on exactly those layers."""
    model = build(arch)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    inside = {id(x) for layer in decoder_layers(model) for x in layer.modules()}
    every = {f"{n}.weight" for n, m in model.named_modules() if linear_sides(m) and id(m) in inside}  # (GPT-2: Conv1D)
    # Qwen3-Next: its shared expert's gate/up/down_proj are names peft reads as the fused experts', and its
    # shared-expert gate has one output (narrower than r); Falcon-H1: peft refuses its Mamba mixer's out_proj.
    # The default leaves those out
    left_out = {"qwen3_next": ("shared_expert.", "shared_expert_gate."), "falcon_h1": ("mamba.out_proj.",),
                "nemotron_h": ("mixer.out_proj.",)}.get(arch, ())  # (peft refuses a Mamba mixer's out_proj)
    want = {n for n in every if not any(x in n for x in left_out)}
    assert want and (want != every) == bool(left_out)
    apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8.0))
    adapted = {f"{n}.weight" for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == want
    for m in model.modules():  # B = 0 at the start: move it so the merge shows
        if hasattr(m, "lora_B"):
            torch.nn.init.normal_(m.lora_B["default"].weight, std=0.1)
    merged = dict(merged_weights(model))
    assert want <= set(merged) <= set(base)  # the base model's names, no adapter tensors
    for name, value in merged.items():
        assert torch.equal(value, base[name]) != (name in want), name


def test_lora_on_gpt2s_conv1d_projections_merges_to_the_adapted_model():
    """GPT-2's projections are transformers' Conv1D (a linear layer with its weight stored [in, out]), which peft
    adapts: LoRA was refused on GPT-2 ("no linear layer for an adapter"; named ones: "the layers an adapter can go
    on are []"). Its merged weights give the adapted model's logits."""
    model = build("gpt2")
    apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8.0))
    for m in model.modules():
        if hasattr(m, "lora_B"):
            torch.nn.init.normal_(m.lora_B["default"].weight, std=0.1)
    ids = torch.arange(3, 20)[None]
    with torch.no_grad():
        adapted = model(ids).logits
    merged = build("gpt2")
    missing, unexpected = merged.load_state_dict(dict(merged_weights(model)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # (tied to the embedding: one parameter)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, atol=1e-4, rtol=1e-4)
        assert (merged(ids).logits - build("gpt2")(ids).logits).abs().max() > 0.1  # (the adapters moved it)


def test_gemma2s_attention_cap_needs_eager_attention_and_the_packed_trainer_computes_it(tmp_path):
    """Gemma 2 caps its attention scores (attn_logit_softcapping), which transformers applies in eager attention
    only: loading it with SDPA is refused naming the key; with eager, scores far past the cap give the packed
    trainer's log-probs the model's own (the shared-prompt mask added to the capped scores)."""
    from relayrl.models.load import ModelLoadError, load_model

    model = build("gemma2")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(40.0)
            layer.self_attn.k_proj.weight.mul_(40.0)
    model.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping=50.*set model.attn_implementation=eager"):
        load_model(tmp_path)
    model = load_model(tmp_path, attn_implementation="eager").eval()
    batch = _groups()
    want = [own_logprobs(model, p, r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    eng = TorchTrainingEngine(model, TrainEngineConfig(packing="shared_prompt"), total_steps=1, trainable=False)
    for g, w in zip(eng.logprobs(batch)[0], want):
        torch.testing.assert_close(g, w, atol=5e-5, rtol=1e-5)
    model.config._attn_implementation = "sdpa"  # what SDPA would have trained: another model
    dropped = [own_logprobs(model, p, r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    assert max(float((a - b).abs().max()) for a, b in zip(dropped, want)) > 0.1


def test_a_model_without_sdpa_attention_is_refused_naming_the_key(tmp_path):
    """GPT-OSS has no SDPA attention in transformers (its attention sinks): loading it with the default is refused
    with relayrl's key to set, not only transformers' words."""
    from relayrl.models.load import ModelLoadError, load_model

    build("gpt_oss").save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="with model.attn_implementation=sdpa: transformers has no sdpa "
                                             "attention for this architecture; set model.attn_implementation=eager"):
        load_model(tmp_path, attn_implementation="sdpa")
    assert type(load_model(tmp_path, attn_implementation="eager")).__name__ == "GptOssForCausalLM"


def test_a_model_that_takes_no_transformers_cache_is_refused_by_the_native_engine():
    """Mamba carries its own state (cache_params), which the native engine's continuous batching cannot: refused
    when the engine is built, naming the engine to use, instead of a KeyError at the first decode step."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("mamba", vocab_size=VOCAB, hidden_size=32,
                                                                  num_hidden_layers=2, state_size=8))
    with pytest.raises(SettingError, match="MambaForCausalLM.forward takes none \\(it carries cache_params\\): use "
                                           "rollout.engine=vllm") as e:
        NativeGenerationEngine(model, _Tok())
    assert is_user_error(e.value)  # (a rank prints it as one line; a ValueError was printed as its traceback)
