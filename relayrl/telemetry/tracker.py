"""Tracker: one `log(step, metrics)` call fans out to every configured sink.

Metric values are validated once here (numbers only: Python/NumPy scalars and
0-d tensors are accepted and converted), so every sink sees plain ints and
floats. Steps must not go backwards within a run; the same step may be logged
more than once (e.g. train metrics, then eval metrics), giving one JSONL line
per call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from relayrl.telemetry.config import TelemetryConfig
from relayrl.telemetry.sinks import (METRICS_FILE, ConsoleSink, JsonlSink, Number, SampleSink, Sink, TensorBoardSink,
                                     WandbSink)

DEFAULT_KEY_METRICS: tuple[str, ...] = (
    "reward/mean",
    "eval/accuracy",
    "response/length_mean",
    "perf/step_time_s",
)


def as_number(key: str, value: object) -> Number:
    """`value` as an int or float; raises TypeError naming `key` for anything else.

    bool -> int; NumPy scalars and single-element tensors (anything with
    `.item()`) are unwrapped.
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except (ValueError, RuntimeError) as exc:  # multi-element array/tensor
            raise TypeError(f"metric '{key}' is not a scalar ({exc})") from exc
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, (int, float)):
            return value
    raise TypeError(f"metric '{key}' has a value of type {type(value).__name__}; metrics must be numbers")


class Tracker:
    """Fans metrics out to the sinks chosen in `cfg.sinks`.

    Files: RUN_DIR/metrics.jsonl, RUN_DIR/tensorboard/, RUN_DIR/wandb/, RUN_DIR/samples.jsonl (samples_per_step).
    Use as a context manager, or call `close()`.
    """

    def __init__(
        self,
        run_dir: Path,
        cfg: TelemetryConfig,
        total_steps: int,
        *,
        key_metrics: Sequence[str] = DEFAULT_KEY_METRICS,
        start_step: int = 0,
        run_config: Mapping[str, Any] | None = None,
        console_stream: IO[str] | None = None,
    ) -> None:
        if total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {total_steps}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.total_steps = total_steps
        self._last_step = start_step
        self._console: ConsoleSink | None = None
        self._sinks: list[Sink] = []
        self._samples: SampleSink | None = None
        try:
            if cfg.samples_per_step:
                self._samples = SampleSink(self.run_dir / "samples.jsonl", start_step=start_step)
            for name in cfg.sinks:
                if name == "console":
                    self._console = ConsoleSink(
                        total_steps,
                        key_metrics=key_metrics,
                        table_every=cfg.console_table_every,
                        start_step=start_step,
                        stream=console_stream,
                    )
                    self._sinks.append(self._console)
                elif name == "jsonl":
                    self._sinks.append(JsonlSink(self.run_dir / METRICS_FILE, start_step=start_step))
                elif name == "tensorboard":
                    self._sinks.append(
                        TensorBoardSink(self.run_dir / "tensorboard", start_step=start_step, run_config=run_config)
                    )
                elif name == "wandb" and cfg.wandb_mode != "disabled":
                    self._sinks.append(
                        WandbSink(self.run_dir, project=cfg.wandb_project, mode=cfg.wandb_mode, run_config=run_config)
                    )
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        """Send one step's metrics to every sink. `step` must be >= the last logged step."""
        if step < self._last_step:
            raise ValueError(f"step {step} is before the last logged step {self._last_step}; steps must not go back")
        if "step" in metrics:
            raise ValueError("metrics must not contain the key 'step'; pass the step as the first argument")
        clean = {key: as_number(key, value) for key, value in metrics.items()}
        for sink in self._sinks:
            sink.log(step, clean)
        self._last_step = step

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """A step's sampled responses (``telemetry.samples_per_step``; else nothing) to RUN_DIR/samples.jsonl
        and, with the wandb sink, a W&B table; before the step's metrics (W&B's steps only go forward). Every
        sample gets every field any of them has (``None`` where it lacks one: a ``log_extra`` column logged for
        some rows only), so the step's rows share one set of columns."""
        if self._samples is None or not samples:
            return
        keys = list(dict.fromkeys(k for s in samples for k in s))
        samples = [{k: s.get(k) for k in keys} for s in samples]
        self._samples.write(step, samples)
        for sink in self._sinks:
            if isinstance(sink, WandbSink):
                sink.log_samples(step, samples)

    def write_text(self, msg: str) -> None:
        """Print a message without breaking the progress bar."""
        if self._console is not None:
            self._console.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()
        if self._samples is not None:
            self._samples.close()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

