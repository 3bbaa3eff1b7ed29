"""Load Hugging Face causal LMs and tokenizers from a local directory.

No hub is reachable from relayrl's machines, so loading is always local
(``local_files_only=True``): a missing or incomplete directory is reported with
what is missing instead of an attempted download.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from relayrl.errors import UserError

__all__ = ["load_model", "load_tokenizer", "resolve_dtype", "ModelLoadError"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class ModelLoadError(UserError, ValueError):
    """A model or tokenizer directory that cannot be loaded, with the reason."""


def resolve_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _check_dir(path: Path, needed: tuple[str, ...]) -> None:
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory (relayrl loads models from local paths only)")
    missing = [f for f in needed if not (path / f).exists()]
    if missing:
        raise ModelLoadError(f"model directory {path} lacks {', '.join(missing)}")


def load_tokenizer(path: str | Path):
    """Load a tokenizer; left padding, with a pad token (EOS when it has none)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    _check_dir(path, ("tokenizer_config.json",))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    if cfg.get("tokenizer_class") == "PreTrainedTokenizerFast" and (path / "tokenizer.json").exists():
        # A tokenizer trained with `tokenizers` (like the tiny default): AutoTokenizer would swap its pre-tokenizer.
        tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelLoadError(f"tokenizer in {path} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(path: str | Path, *, dtype: str = "float32", device: str | torch.device = "cpu",
               attn_implementation: str = "sdpa"):
    """Load a causal LM from ``path`` in ``dtype`` on ``device``, in train mode."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    _check_dir(path, ("config.json",))
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ModelLoadError(f"model directory {path} has config.json but no *.safetensors or *.bin weights")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype), local_files_only=True, attn_implementation=attn_implementation
        )
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load model from {path}: {e}") from e
    return model.to(device)


def load_value_model(path: str | Path, *, dtype: str = "float32", device: str | torch.device = "cpu",
                     attn_implementation: str = "sdpa", bias: bool = True):
    """A critic: the causal LM at ``path`` with its output head replaced by a scalar value head
    (``Linear(hidden, 1)``, zero-initialised, so every value starts at 0). The engine reads the head
    through ``get_output_embeddings``, as for the policy. ``bias=False``: a head without bias (a reward
    model's, whose Bradley-Terry loss cannot see a bias; Hugging Face's sequence classifiers have none)."""
    from torch import nn

    model = load_model(path, dtype=dtype, device=device, attn_implementation=attn_implementation)
    hidden = model.get_output_embeddings().in_features
    head = nn.Linear(hidden, 1, bias=bias, device=device, dtype=resolve_dtype(dtype))
    nn.init.zeros_(head.weight)
    if bias:
        nn.init.zeros_(head.bias)
    model.config.tie_word_embeddings = False  # the value head is not the embedding matrix
    model.set_output_embeddings(head)
    return model
