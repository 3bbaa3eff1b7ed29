"""A Hugging Face model's forward with a key/value cache, under the cache's name in the installed transformers.

transformers up to 5.19 (at least) takes and returns the cache as ``past_key_values``; 5.24 names it
``cache`` (input keyword and output field) and still accepts the old name, with a FutureWarning on every
call site and a log line on reading ``out.past_key_values``. The name is read from the model's ``forward``
signature (``inspect.signature`` follows transformers' ``deprecate_kwarg`` wrapper to the real one), so
either release, and a model whose code still says ``past_key_values``, runs without a warning. The values
passed and returned are the same object under either name: the results are unchanged.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from relayrl.errors import SettingError

__all__ = ["cache_name", "forward_with_cache", "check_takes_cache"]


@functools.lru_cache(maxsize=None)
def _name_for(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


def cache_name(model: nn.Module) -> str:
    """``"cache"`` when ``model.forward`` takes the cache by that name, else ``"past_key_values"``."""
    return _name_for(type(model))


def forward_with_cache(model: nn.Module, cache, **inputs: torch.Tensor):
    """``model(**inputs, <cache name>=cache, use_cache=True)``; returns ``(output, the updated cache)``."""
    name = cache_name(model)
    out = model(**inputs, **{name: cache}, use_cache=True)
    return out, out[name]


def check_takes_cache(model: nn.Module) -> None:
    """Refuse a model whose ``forward`` takes no transformers cache under either name (a pure state-space model:
    Mamba's ``cache_params``), which the native engine's continuous batching cannot carry."""
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return
    if "past_key_values" not in params and "cache" not in params:
        own = [n for n in params if "cache" in n and n != "use_cache"] or ["a state of its own"]
        raise SettingError(f"rollout.engine=native decodes through transformers' cache (the model's past_key_values); "
                           f"{type(model).__name__}.forward takes none (it carries {', '.join(own)}): use "
                           f"rollout.engine=vllm for this model")
