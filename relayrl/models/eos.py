"""The token ids that end a response: the tokenizer's EOS and the model's ``generation_config`` ``eos_token_id``.

Instruct checkpoints list more end-of-sequence ids in ``generation_config.json`` than the tokenizer's one EOS
(Qwen2.5-Instruct ``[151645, 151643]``, ``<|im_end|>`` and ``<|endoftext|>``; Llama-3-Instruct adds ``<|eot_id|>``;
Gemma-it ``<end_of_turn>``), and Hugging Face ``generate`` and vLLM stop at every one of them. relayrl's engines stop
at the union (:func:`eos_ids`): a response that ends at any of them ends as at the EOS, the id kept, with
``finish_reason`` ``stop``.

The generation config is the model's (``model.generation_config``, which ``from_pretrained`` reads from the
directory) or, for an engine that holds only the directory (vLLM), :func:`checkpoint_generation_config`: the same
file read the same way, with nothing fetched from a hub.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["eos_ids", "config_eos_ids", "checkpoint_generation_config"]


def config_eos_ids(config) -> set[int]:
    """The ids of a (generation) config's ``eos_token_id``: one id, a list of them, or none."""
    value = getattr(config, "eos_token_id", None)
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value if v is not None}


def eos_ids(tokenizer, generation_config=None) -> set[int]:
    """The ids that end a response as EOS: the tokenizer's EOS and those of ``generation_config`` (see the module
    docstring)."""
    own = set() if tokenizer.eos_token_id is None else {int(tokenizer.eos_token_id)}
    return own | config_eos_ids(generation_config)


def checkpoint_generation_config(model_dir: str | Path):
    """The generation config ``from_pretrained`` gives a model of ``model_dir``: its ``generation_config.json``,
    else (absent or unreadable, which ``from_pretrained`` skips too) one made from its ``config.json``."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir, local_files_only=True))
