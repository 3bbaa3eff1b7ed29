"""Tiny random models of the decoder architectures users bring (Llama, Qwen3, Gemma 2/3/4, Phi-3, Granite, Cohere,
MoE models, ...), built from transformers' own config classes with nothing downloaded.

Their output heads are rescaled so the logits spread as a trained model's do (standard deviation about 4): at a
random initialisation they are near zero, and a missed soft cap or logit scale would not show in the log-probs.
A tied head stays tied (its embedding is rescaled with it).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=2, eos_token_id=1)

ARCHS = {
    "qwen2": dict(),
    "llama": dict(tie_word_embeddings=False),
    "qwen3": dict(head_dim=16),
    "mistral": dict(),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16),  # final_logit_softcapping=30
    "gemma3_text": dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16, final_logit_softcapping=30.0),
    "gemma4_text": dict(head_dim=16, sliding_window=4, hidden_size_per_layer_input=16),
    "phi3": dict(sliding_window=4),  # one window for every layer, no layer types (Phi-3-mini-4k's is 2047)
    "olmo2": dict(),
    "smollm3": dict(num_hidden_layers=4),  # every fourth layer without rotary embeddings (NoPE)
    "granite": dict(logits_scaling=8.0, residual_multiplier=0.22, embedding_multiplier=12.0,
                    attention_multiplier=0.015625),  # Granite 3's multipliers
    "cohere": dict(),  # logit_scale=0.0625
    "glm4": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "phi": dict(),
    "gpt_neox": dict(),
    "starcoder2": dict(),
    "gpt2": dict(),  # learned absolute positions; its projections are transformers' Conv1D (weights [in, out])
    # Qwen3.5: three Gated DeltaNet (linear attention) layers to one attention layer
    "qwen3_5_text": dict(head_dim=16, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16),
    # GPT-OSS: attention sinks, a mixture of experts, sliding and full attention alternating (eager attention only)
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4),
    # Falcon-H1: attention and Mamba-2 heads side by side in every layer (scaled logits, multipliers)
    "falcon_h1": dict(head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8),
    # LFM2: short convolution layers and attention layers
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"]),
    # Qwen3-Next: the same layers with a mixture of experts
    "qwen3_next": dict(head_dim=16, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32),
    # Jamba: Mamba layers and attention layers, a mixture of experts every other layer
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2, use_mamba_kernels=False),
    # Nemotron-H: Mamba-2, attention and MLP layers by a pattern
    "nemotron_h": dict(num_hidden_layers=4, hybrid_override_pattern="M*M-", mamba_num_heads=4, mamba_head_dim=16,
                       ssm_state_size=8, n_groups=1, head_dim=16),
}
"""model_type -> what its tiny config sets beside :data:`COMMON`."""
EAGER = {"gpt_oss"}
"""Architectures transformers runs with eager attention only."""


def build(name: str, seed: int = 0, logit_std: float = 4.0, vocab: int = VOCAB) -> torch.nn.Module:
    """A float32 tiny ``name`` model in eval mode (SDPA attention, or eager where only eager computes the model),
    its head scaled to ``logit_std``; ``vocab``: its vocabulary size (a tokenizer's, for a run)."""
    cfg = AutoConfig.for_model(name, **{**COMMON, "vocab_size": vocab, **ARCHS[name]})
    if getattr(cfg, "vocab_size_per_layer_input", None):  # (Gemma 4's per-layer input embeddings: over the model's
        cfg.vocab_size_per_layer_input = vocab            # vocabulary, not the default 262144 rows of 135M weights)
    # eager where the model caps its attention scores (Gemma 2): transformers' SDPA path drops the cap; and where
    # transformers has no SDPA path (GPT-OSS's attention sinks)
    eager = getattr(cfg, "attn_logit_softcapping", None) or name in EAGER
    cfg._attn_implementation = "eager" if eager else "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        std = float(model(torch.arange(3, 35)[None] % vocab).logits.float().std())
        head = model.get_output_embeddings()  # (a tied head scales the embedding too: the model stays tied,
        head.weight.mul_(logit_std / std)    # as vLLM's Gemma and Cohere always are)
        if getattr(head, "bias", None) is not None:
            head.bias.mul_(logit_std / std)
    return model


def own_logprobs(model: torch.nn.Module, prompt: torch.Tensor, response: torch.Tensor,
                 temperature: float = 1.0) -> torch.Tensor:
    """``response``'s log-probs after ``prompt`` from the model's own forward: the reference every path of relayrl
    is held to."""
    with torch.no_grad():
        logits = model(torch.cat([prompt, response])[None], use_cache=False).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, response[:, None]).squeeze(-1)
