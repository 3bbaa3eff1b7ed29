"""`relayrl plot RUN_DIR`: PNG figures of a run's metrics and its stage timeline.

Reads RUN_DIR/metrics.jsonl and RUN_DIR/spans.jsonl and writes, with
matplotlib's Agg backend (no display needed):

* one PNG per metric family present (reward & accuracy, response length &
  truncation, KL, entropy, clip fractions, logprob error, throughput,
  per-stage timings), then one PNG per remaining key prefix (actor/, sft/,
  dapo/, ...), so keys nobody planned for still get plotted;
* `timeline.png`, a Gantt chart of the spans of the last few steps: one row
  per worker group, one colour per stage (the shape of AsyncFlow's Figure 11);
  overlapping spans within a group are drawn in stacked lanes;
* `trace.json` in RUN_DIR (Chrome trace for Perfetto).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from relayrl.telemetry.sinks import METRICS_FILE, MetricsFileError, read_jsonl_records  # noqa: E402
from relayrl.telemetry.timeline import SPANS_FILE, Span, export_chrome_trace, read_spans  # noqa: E402

Series = dict[str, tuple[list[int], list[float]]]


@dataclass(frozen=True)
class Family:
    """A figure: the keys it takes, and whether they share one axes (same unit)."""

    filename: str
    title: str
    takes: Callable[[str], bool]
    shared_axes: bool = False


FAMILIES: tuple[Family, ...] = (
    Family("reward_accuracy.png", "Reward and accuracy",
           lambda k: k.startswith("reward/") or k.split("/")[-1].startswith(("accuracy", "pass@", "avg@"))
           or (k.startswith("eval/") and k.split("/")[1].startswith(("accuracy", "pass@", "avg@")))),  # (per source)
    Family("response_length.png", "Response length and truncation", lambda k: k.startswith("response/")),
    Family("off_policy.png", "Off-policy: staleness, rollout wait, importance weights",
           lambda k: k.startswith(("async/", "offpolicy/", "correction/"))),
    Family("kl.png", "KL divergence", lambda k: re.search(r"(^|[/_])kl($|[/_])", k) is not None),
    Family("entropy.png", "Entropy", lambda k: "entropy" in k),
    Family("clip_fractions.png", "Clip fractions", lambda k: "clip_frac" in k, shared_axes=True),
    Family("logprob_error.png", "Generator vs trainer log-prob error", lambda k: "logprob_error" in k),
    Family("episodes.png", "Multi-turn episodes: turns, tool calls, endings, errors",
           lambda k: k.startswith(("env/", "eval/env/"))),
    Family("throughput.png", "Throughput", lambda k: k.startswith("perf/")),
    Family("timings.png", "Per-stage timings (s)", lambda k: k.startswith("timing/"), shared_axes=True),
)


def load_series(run_dir: Path, warn: Callable[[str], None] | None = None) -> Series:
    """metrics.jsonl as {key: (steps, values)}; nulls (non-finite) become NaN gaps.

    A missing, empty or damaged file raises :class:`MetricsFileError`; a torn last line is skipped and
    reported through ``warn``."""
    path = Path(run_dir) / METRICS_FILE
    if not Path(run_dir).is_dir():
        raise MetricsFileError(f"{run_dir}: no such directory; give a run directory (the run.dir of a training run)")
    if not path.is_file():
        raise MetricsFileError(f"{path}: no metrics file; is {run_dir} a run directory (the run.dir of a training "
                               f"run)?")
    skipped: list[str] = []
    records = read_jsonl_records(path, skipped)
    for note in skipped:
        (warn or (lambda _: None))(note)
    if not records:
        raise MetricsFileError(f"{path}: holds no metrics records; the run logged nothing yet (plot it after its "
                               f"first evaluation or step)")
    series: Series = {}
    for record in records:
        step = int(record["step"])
        for key, value in record.items():
            if key == "step" or isinstance(value, (str, list, dict)):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(step)
            values.append(math.nan if value is None else float(value))
    if not series:
        raise MetricsFileError(f"{path}: its {len(records)} records hold no numeric metrics to plot")
    return series


def group_families(keys: Sequence[str]) -> list[tuple[Family, list[str]]]:
    """Assign each key to the first family that takes it; leftovers are grouped by prefix."""
    assigned: dict[str, list[str]] = {}
    left: list[str] = []
    for key in sorted(keys):
        fam = next((f for f in FAMILIES if f.takes(key)), None)
        if fam is None:
            left.append(key)
        else:
            assigned.setdefault(fam.filename, []).append(key)
    out = [(f, assigned[f.filename]) for f in FAMILIES if f.filename in assigned]
    by_prefix: dict[str, list[str]] = {}
    for key in left:
        prefix = key.split("/")[0] if "/" in key else "other"
        by_prefix.setdefault(prefix, []).append(key)
    for prefix, ks in by_prefix.items():
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", prefix)
        out.append((Family(f"{safe}.png", f"{prefix} metrics", lambda k: True), ks))
    return out


def _plot_family(series: Series, family: Family, keys: list[str], path: Path) -> None:
    if family.shared_axes:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            ax.plot(*series[key], marker="." if len(series[key][0]) < 30 else None, label=key)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        axes = [ax]
    else:
        cols = min(3, len(keys))
        rows = math.ceil(len(keys) / cols)
        fig, grid = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
        axes = list(grid.flat)
        for ax, key in zip(axes, keys):
            ax.plot(*series[key], marker="." if len(series[key][0]) < 30 else None)
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for ax in axes[len(keys):]:
            ax.set_visible(False)
    fig.suptitle(family.title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _lanes(spans: list[Span]) -> list[int]:
    """Greedy interval partitioning: lane index per span so that spans in a lane do not overlap."""
    ends: list[float] = []
    lane_of: list[int] = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda i: spans[i].wall_start):
        s = spans[i]
        for lane, end in enumerate(ends):
            if end <= s.wall_start + 1e-9:
                ends[lane] = s.wall_start + s.duration
                lane_of[i] = lane
                break
        else:
            ends.append(s.wall_start + s.duration)
            lane_of[i] = len(ends) - 1
    return lane_of


def plot_timeline(spans: list[Span], path: Path, *, last_steps: int = 3) -> None:
    """Gantt chart of the spans of the last `last_steps` steps: rows = groups, colour = stage."""
    steps = sorted({s.step for s in spans})[-last_steps:]
    chosen = [s for s in spans if s.step in set(steps)]
    if not chosen:
        raise ValueError("no spans to draw")
    origin = min(s.wall_start for s in chosen)
    groups = list(dict.fromkeys(s.group for s in sorted(chosen, key=lambda s: s.wall_start)))
    names = sorted({s.name for s in chosen})
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colour = {n: cmap(i % cmap.N) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.8 * len(groups)))
    for row, group in enumerate(groups):
        mine = [s for s in chosen if s.group == group]
        lane_of = _lanes(mine)
        n_lanes = max(lane_of) + 1
        height = 0.8 / n_lanes
        for s, lane in zip(mine, lane_of):
            y = row - 0.4 + lane * height
            ax.broken_barh([(s.wall_start - origin, s.duration)], (y, height * 0.95),
                           facecolors=colour[s.name], edgecolor="black", linewidth=0.3)
    for step in steps:
        t = min(s.wall_start for s in chosen if s.step == step) - origin
        ax.axvline(t, color="grey", linestyle=":", linewidth=0.8)
        ax.text(t, len(groups) - 0.45, f" step {step}", fontsize=8, color="grey", va="bottom")
    ax.set_yticks(range(len(groups)), groups)
    ax.set_ylim(-0.6, len(groups) - 0.1 + 0.3)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"Stage timeline, steps {steps[0]}-{steps[-1]}")
    ax.legend(handles=[Patch(color=colour[n], label=n) for n in names],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_run(run_dir: Path, out_dir: Path | None = None, *, timeline_steps: int = 3,
             warn: Callable[[str], None] | None = None) -> list[Path]:
    """Write the run's figures; returns the paths written (PNGs, then trace.json if spans exist).

    Args:
        run_dir: a run directory holding metrics.jsonl (and optionally spans.jsonl).
        out_dir: where the PNGs go; default RUN_DIR/plots.
        timeline_steps: how many of the last steps the Gantt chart shows.
        warn: receives a sentence per metrics line skipped (a torn last line).
    """
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    series = load_series(run_dir, warn)
    series = {k: v for k, v in series.items() if any(not math.isnan(x) for x in v[1])}
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for family, keys in group_families(list(series)):
        path = out / family.filename
        _plot_family(series, family, keys, path)
        written.append(path)
    if (run_dir / SPANS_FILE).exists():
        spans = read_spans(run_dir)
        if spans:
            path = out / "timeline.png"
            plot_timeline(spans, path, last_steps=timeline_steps)
            written.append(path)
            written.append(export_chrome_trace(run_dir))
    return written
