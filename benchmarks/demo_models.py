"""The demo's models for benchmarks, built once into the cache: the tiny Qwen2 pretrained on correct 2-digit
sums (stage 1 of ``relayrl demo``) and its SFT on the careless teacher (stage 2). GRPO benchmarks start from
the SFT model, as the demo's third stage does."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _stage(recipe: str, run_dir: Path, seed: int, *extra: str) -> Path:
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.sft import train_sft

    return train_sft(load_config(Config, REPO / "recipes" / recipe, [
        f"run.dir={run_dir}", f"run.seed={seed}", "run.overwrite=true", "telemetry.sinks=[jsonl]", *extra]))


def base_model(seed: int = 0, overrides: tuple[str, ...] = ()) -> Path:
    """The pretrained base (``recipes/arith_base.yaml``); ``overrides`` (e.g. ``run.threads=1``) apply when it
    is built, and change nothing in the model's recipe."""
    from relayrl.models.tiny import default_cache_dir

    base = default_cache_dir() / f"async_flow-seed{seed}" / "base" / "model"  # (the name predates this module)
    if not (base / "config.json").is_file():
        print(f"demo_models: pretraining the demo's base model into {base.parent} ...", flush=True)
        _stage("arith_base.yaml", base.parent, seed, *overrides)
    return base


def sft_model(seed: int = 0, overrides: tuple[str, ...] = ()) -> Path:
    """The demo's SFT model (``recipes/arith_sft.yaml`` from :func:`base_model`); ``overrides`` as there."""
    from relayrl.models.tiny import default_cache_dir

    sft = default_cache_dir() / f"demo-seed{seed}" / "sft" / "model"
    if not (sft / "config.json").is_file():
        base = base_model(seed, overrides)
        print(f"demo_models: SFT on the careless teacher into {sft.parent} ...", flush=True)
        _stage("arith_sft.yaml", sft.parent, seed, f"trainer.init_from={base}", *overrides)
    return sft
