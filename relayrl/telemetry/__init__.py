"""Telemetry: metric sinks (console, JSONL, TensorBoard, W&B), stage timelines, NaN guard, plots.

`relayrl.telemetry.plots` (matplotlib) is imported on demand, not here.
"""

from relayrl.telemetry.config import VALID_SINKS, TelemetryConfig
from relayrl.telemetry.finite import UPDATE_METRICS, NonFiniteError, check_finite, check_updates
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
    "UPDATE_METRICS",
    "VALID_SINKS",
    "check_finite",
    "check_updates",
    "export_chrome_trace",
    "read_jsonl_records",
    "read_spans",
]
