"""Telemetry: metric sinks (console, JSONL, TensorBoard, W&B), stage timelines, NaN guard, plots.

`relayrl.telemetry.plots` (matplotlib) is imported on demand, not here.
"""

from relayrl.telemetry.config import VALID_SINKS, TelemetryConfig
from relayrl.telemetry.finite import NonFiniteError, check_finite
from relayrl.telemetry.sinks import read_jsonl_records
from relayrl.telemetry.timeline import Span, Timeline, export_chrome_trace, read_spans
from relayrl.telemetry.tracker import DEFAULT_KEY_METRICS, Tracker

__all__ = [
    "DEFAULT_KEY_METRICS",
    "NonFiniteError",
    "Span",
    "TelemetryConfig",
    "Timeline",
    "Tracker",
    "VALID_SINKS",
    "check_finite",
    "export_chrome_trace",
    "read_jsonl_records",
    "read_spans",
]
