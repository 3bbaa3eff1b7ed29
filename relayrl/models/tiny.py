"""The embedded default model: a tiny Qwen2 and a tokenizer trained locally.

No hub is reachable here, so the default run builds both from nothing:

* a byte-level BPE tokenizer trained with the ``tokenizers`` library on the
  text of the built-in tasks, with every digit its own token (arithmetic is
  learnable only when digits are not merged), saved as a
  ``PreTrainedTokenizerFast``;
* a randomly initialised Qwen2-architecture causal LM of a few million
  parameters, saved with ``save_pretrained`` (with ``experts`` set, a Qwen3-MoE one: the same attention,
  a mixture of experts in every layer, for trying MoE features such as routing replay on a laptop).

Both are cached on disk under a key derived from their settings, so the second
call only loads them. Loading goes through :func:`relayrl.models.load.load_tokenizer`
with ``PreTrainedTokenizerFast`` (``AutoTokenizer`` would map this tokenizer to
``Qwen2Tokenizer`` and replace the trained pre-tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["TinyModelConfig", "SPECIAL_TOKENS", "build_tiny", "default_cache_dir"]

PAD, EOS, BOS = "<|pad|>", "<|endoftext|>", "<|bos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, EOS, BOS, IM_START, IM_END]

# A minimal ChatML template, so user datasets with chat messages work with the tiny model too.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TinyModelConfig(BaseModel):
    """Shape of the embedded default model (a Qwen2 architecture; a Qwen3-MoE one with ``experts``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    hidden_size: int = Field(256, ge=16, description="model width")
    num_layers: int = Field(4, ge=1, description="decoder layers")
    num_heads: int = Field(4, ge=1, description="attention heads (as many key/value heads)")
    intermediate_size: int = Field(1024, ge=16, description="width of the MLP's hidden layer")
    vocab_size: int = Field(512, ge=64, description="upper bound for the trained BPE vocabulary")
    max_position_embeddings: int = Field(512, ge=32, description="longest prompt plus response, in tokens")
    seed: int = Field(0, description="seed of the random initialisation")
    experts: int = Field(0, ge=0, description="0: a dense Qwen2; E >= 2: a Qwen3-MoE model, every layer a mixture "
                         "of E experts with experts_per_token routed per token, each expert intermediate_size / "
                         "experts_per_token wide (the same compute per token as the dense model)")
    experts_per_token: int = Field(2, ge=1, description="with experts: experts each token is routed to")
    shape: Literal["tiny", "qwen2-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b"] = Field(
        "tiny", description="a published model's shape with random weights and the local tokenizer, for GPU runs "
        "and benchmarks with nothing downloaded (it learns nothing useful): qwen2-0.5b (494M parameters, 24 "
        "layers, hidden 896, 14 query and 2 key/value heads, vocabulary 151936), qwen2.5-1.5b, qwen2.5-3b, "
        "qwen2.5-7b (7.6B, 28 layers, hidden 3584, untied head). The other fields then apply to the tokenizer "
        "only. Shapes past 0.5B are built on the GPU when there is one and saved in bfloat16")

    @model_validator(mode="after")
    def _experts_fit(self) -> "TinyModelConfig":
        if self.experts == 0:
            if "experts_per_token" in self.model_fields_set:  # (a dense model routes nothing: nothing reads it)
                raise ValueError(f"model.tiny.experts_per_token={self.experts_per_token} routes each token of a "
                                 f"mixture of experts, and model.tiny.experts=0 builds a dense model: set "
                                 f"model.tiny.experts (e.g. 8) or drop model.tiny.experts_per_token")
            return self
        if self.shape != "tiny":
            raise ValueError(f"model.tiny.experts={self.experts} builds a tiny mixture of experts; "
                             f"model.tiny.shape={self.shape} is a published dense shape: drop one of them")
        if self.experts < 2 or not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(f"model.tiny.experts={self.experts} with experts_per_token={self.experts_per_token}: "
                             "set experts >= 2 and 1 <= experts_per_token <= experts")
        return self

    @model_validator(mode="after")
    def _heads_fit(self) -> "TinyModelConfig":
        """Each attention head gets ``hidden_size / num_heads`` dimensions: a whole number, and even (rotary
        position embeddings turn pairs of dimensions). Checked here, not when the model is built."""
        h, n = self.hidden_size, self.num_heads
        if self.shape != "tiny" or (h % n == 0 and h // n % 2 == 0):
            return self
        fits = [k for k in range(1, h + 1) if h % k == 0 and h // k % 2 == 0]
        what = (f"num_heads={n} does not divide hidden_size={h} (each head gets hidden_size / num_heads dimensions)"
                if h % n else f"hidden_size={h} / num_heads={n} gives heads of {h // n} dimensions, an odd number "
                f"(rotary position embeddings turn pairs of dimensions)")
        raise ValueError(f"{what}; set model.tiny.num_heads to one of {fits} (or change model.tiny.hidden_size)")


# Qwen2-0.5B's config (its published shape): what a 0.5B GPU run allocates, reads and computes.
QWEN2_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                  rms_norm_eps=1e-6)
# The Qwen2.5 family's published shapes (same architecture; 7B unties the output head).
_QWEN25 = dict(max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
SHAPES = {
    "qwen2-0.5b": dict(QWEN2_0_5B, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


def default_cache_dir() -> Path:
    """Where built models are cached: ``$RELAYRL_CACHE`` or ``~/.cache/relayrl``."""
    return Path(os.environ.get("RELAYRL_CACHE", Path.home() / ".cache" / "relayrl"))


def _tokenizer_corpus() -> list[str]:
    from relayrl.data.tasks import TASKS

    lines: list[str] = []
    for name, cls in TASKS.items():
        lines += cls().corpus(4000, seed=99)
    # A little English so user prompts in plain words tokenize to something sensible.
    lines += [
        "Question: what is the sum of the numbers? Answer: the result is",
        "Solve the problem step by step and give the final answer.",
        "user assistant system The answer is",
    ] * 20
    return lines


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        padding_side="left",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny(cfg: TinyModelConfig | None = None, cache_dir: Path | None = None, *, verbose: bool = True) -> Path:
    """Build (or find in the cache) the tiny model + tokenizer; return its directory.

    The directory is a regular Hugging Face model directory: it loads with
    ``AutoModelForCausalLM.from_pretrained`` and ``PreTrainedTokenizerFast.from_pretrained``.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.models.load import progress_bars

    cfg = cfg or TinyModelConfig()
    settings = cfg.model_dump(exclude={"experts", "experts_per_token"} if not cfg.experts else set())  # (the dense
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]  # models' keys as before)
    out = (cache_dir or default_cache_dir()) / f"tiny-{'qwen3moe' if cfg.experts else 'qwen2'}-{key}"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    if verbose:
        print(f"relayrl: building the tiny default model in {out} ...", flush=True)
    tokenizer = _train_tokenizer(cfg.vocab_size)
    shape = dict(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                 num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                 num_key_value_heads=cfg.num_heads, max_position_embeddings=cfg.max_position_embeddings,
                 rope_theta=10000.0, tie_word_embeddings=True)
    shape = SHAPES.get(cfg.shape, shape)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if cfg.experts:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        mcfg = Qwen3MoeConfig(**shape, **ids, head_dim=cfg.hidden_size // cfg.num_heads, num_experts=cfg.experts,
                              num_experts_per_tok=cfg.experts_per_token, norm_topk_prob=True,
                              moe_intermediate_size=max(1, cfg.intermediate_size // cfg.experts_per_token))
        model_cls = Qwen3MoeForCausalLM
    else:
        mcfg, model_cls = Qwen2Config(**shape, **ids), Qwen2ForCausalLM
    torch.manual_seed(cfg.seed)
    # Billions of parameters: initialised on the GPU (seconds, not minutes on the CPU) and saved in bfloat16.
    big = cfg.shape not in ("tiny", "qwen2-0.5b")
    device = "cuda" if big and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = model_cls(mcfg)
    if big:
        model = model.to(torch.bfloat16)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    with progress_bars(sum(p.numel() * p.element_size() for p in model.parameters())):
        model.save_pretrained(tmp)
    del model
    tokenizer.save_pretrained(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process built it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
