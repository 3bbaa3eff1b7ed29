"""Telemetry config: which metric sinks a run writes to, checked before any work starts.

A sink whose package is missing (TensorBoard, Weights & Biases) is refused
here, at config time, with the install command, instead of failing mid-run.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SinkName = Literal["console", "jsonl", "tensorboard", "wandb"]
VALID_SINKS: tuple[str, ...] = ("console", "jsonl", "tensorboard", "wandb")

# The import each optional sink needs, and how to get it.
_SINK_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class TelemetryConfig(BaseModel):
    """Where metrics go and how often the console prints a table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sinks: list[SinkName] = Field(
        default_factory=lambda: ["console", "jsonl"],
        description="Metric sinks, several at once: console, jsonl, tensorboard, wandb.",
    )
    console_table_every: int = Field(
        10, ge=0, description="Print a table of all metrics every N steps (0: never)."
    )
    samples_per_step: int = Field(
        0, ge=0, description="write this many of each step's sampled responses (the first scored: prompt, "
        "response, verifier score, shaped reward, length, prompt group) to RUN_DIR/samples.jsonl, and as a table "
        "'samples' with the wandb sink, to read what the policy writes as it trains (TRL's log_completions, "
        "verl's rollout_data_dir); 0: none"
    )
    wandb_project: str | None = Field(None, description="W&B project; None uses 'relayrl'.")
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        "offline", description="W&B mode; offline writes under RUN_DIR/wandb with no network (upload it later with "
        "wandb sync RUN_DIR/wandb/offline-run-*); online streams to wandb.ai (or WANDB_BASE_URL) and needs "
        "`wandb login` or WANDB_API_KEY; disabled writes nothing"
    )

    @field_validator("sinks", mode="before")
    @classmethod
    def _known_sinks(cls, value: object) -> object:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected a list of sink names from {list(VALID_SINKS)}, got {value!r}")
        unknown = [s for s in value if s not in VALID_SINKS]
        if unknown:
            raise ValueError(
                f"unknown sink(s) {unknown}; set telemetry.sinks to a list drawn from {list(VALID_SINKS)}"
            )
        seen: list[str] = []
        for s in value:
            if s not in seen:
                seen.append(s)
        return seen

    @model_validator(mode="after")
    def _sink_packages_installed(self) -> "TelemetryConfig":
        for sink in self.sinks:
            if sink == "wandb" and self.wandb_mode == "disabled":
                continue
            if sink in _SINK_PACKAGES:
                module, fix = _SINK_PACKAGES[sink]
                if not _installed(module):
                    raise ValueError(
                        f"telemetry.sinks includes '{sink}' but the '{module}' package is not "
                        f"installed; run `{fix}` or remove '{sink}' from telemetry.sinks"
                    )
        return self
