"""``relayrl plan --from-run RUN_DIR``: the planner calibrated by a run's own record.

A run directory holds what its steps really cost: ``spans.jsonl`` (each stage's span per step and group),
``metrics.jsonl`` (the step time, response-length quantiles per step) and ``config.json``. From them:

1. **The run's placement** comes from the pipeline's own step plan (:func:`relayrl.config.plan.step_plan`),
   the object the pipeline runs by: colocated or split, ``ahead`` (off-policy k), whole-batch or
   accumulated update, partial rollout. A change to how the plan reads a config changes the placement the
   planner simulates.
2. **Lengths**: the response-length distribution is rebuilt from the per-step quantiles the run logged
   (``response/length_p10/p50/p90``, the max and the clip ratio), and moved along the run's length trend
   (a least-squares line through the per-step means): ``rest`` plans with the mean length predicted over the
   steps still to run, ``now`` with the last steps' lengths.
3. **Fit**: the profile's prediction for the run's own placement, on those lengths, is compared stage by stage
   with the spans of the last steps: the generation factor is measured generate time over predicted, the
   training factor measured training time (update and every forward pass) over predicted. Both factors scale
   every device of the profile, so every candidate placement is predicted with the costs this run showed
   (contention between pools included as far as the run's own placement had it; for the others the profile's
   contention model applies).
4. **Ranking**: every placement and step mode for the device count is simulated with the fitted profile, and
   the report names the run's measured step, the fitted model's prediction for it, and the best alternative
   with its overrides.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.planner.placement import Placement, Prediction
from relayrl.planner.profile import Profile
from relayrl.planner.simulate import simulate
from relayrl.planner.workload import LengthDist, Workload

__all__ = ["RunRecord", "read_run", "placement_of", "length_trend", "run_lengths", "fit_profile", "plan_from_run"]

TRAINING_STAGES = ("update", "logprob", "reference", "old", "values", "teacher", "critic")
"""Span names of training-pool work (forward and backward passes): fitted against the predicted update."""
QUANTILES = (("response/length_p10", 0.1), ("response/length_p50", 0.5), ("response/length_p90", 0.9))


@dataclass
class RunRecord:
    """What :func:`read_run` reads of a run directory."""

    run_dir: Path
    cfg: object
    step_s: dict[int, float] = field(default_factory=dict)
    """``perf/step_time_s`` per step."""
    stages: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per step: seconds of each stage name, the extent of its spans (first start to last end over ranks)."""
    lengths: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per step: the response-length metrics (``response/length_*`` and ``response/clip_ratio``)."""
    groups: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Per step: dynamic sampling's (groups sampled, groups dropped) (``dapo/sampled_groups``,
    ``dapo/dropped_groups``)."""

    @property
    def steps(self) -> list[int]:
        return sorted(set(self.step_s) & set(self.stages))


def keep_frac(rec: RunRecord, window: int = 5) -> float:
    """The share of sampled groups dynamic sampling kept over the run's last ``window`` steps (1.0 when it
    dropped none, or the run did not log the counts)."""
    counts = [rec.groups[s] for s in sorted(rec.groups)[-window:]]
    sampled = sum(c[0] for c in counts)
    return max(0.01, 1.0 - sum(c[1] for c in counts) / sampled) if sampled else 1.0


def read_run(run_dir: str | Path) -> RunRecord:
    """The run's config, step times, stage spans and length metrics; errors name the missing file."""
    from relayrl.config.schema import Config
    from relayrl.telemetry.sinks import METRICS_FILE, read_jsonl_records
    from relayrl.telemetry.timeline import SPANS_FILE, read_spans

    d = Path(run_dir)
    if not (d / "config.json").is_file():
        raise ValueError(f"--from-run {d}: no config.json there; give a run directory (run.dir of a relayrl train)")
    for name in (METRICS_FILE, SPANS_FILE):
        if not (d / name).is_file():
            raise ValueError(f"--from-run {d}: no {name} there (a run writes it from its first step; was the run "
                             f"started with telemetry.sinks including jsonl?)")
    from relayrl.config.loader import field_errors, without_defaults

    try:  # the saved config lists every key; keys left at their defaults are dropped so that the checks of
        # keys a user set see what the user set
        cfg = Config.model_validate(without_defaults(json.loads((d / "config.json").read_text()), Config()))
    except ValueError as e:
        errors = field_errors(e) if hasattr(e, "errors") else [str(e)]
        raise ValueError(f"--from-run {d}: config.json is not a config this relayrl reads: {'; '.join(errors)}") from None
    rec = RunRecord(d, cfg)
    for row in read_jsonl_records(d / METRICS_FILE):  # (a torn last line skipped; a damaged one elsewhere named)
        step = row["step"]
        if "perf/step_time_s" in row:
            rec.step_s[step] = float(row["perf/step_time_s"])
        lens = {k: float(v) for k, v in row.items() if k.startswith("response/length_") or k == "response/clip_ratio"}
        if lens:
            rec.lengths[step] = lens
        if "dapo/sampled_groups" in row:
            rec.groups[step] = (float(row["dapo/sampled_groups"]), float(row.get("dapo/dropped_groups", 0.0)))
    extent: dict[int, dict[str, list[float]]] = {}
    for s in read_spans(d):
        box = extent.setdefault(s.step, {}).setdefault(s.name, [s.start, s.end, 0.0])
        box[0], box[1], box[2] = min(box[0], s.start), max(box[1], s.end), box[2] + s.duration
    for step, names in extent.items():
        # a stage's seconds: the extent of its spans, unless they are a chain of shorter spans (streamed
        # chunks) whose durations add up to less
        rec.stages[step] = {n: min(b[1] - b[0], b[2]) for n, b in names.items()}
    if not rec.steps:
        raise ValueError(f"--from-run {d}: no step finished with both a step time and stage spans yet")
    return rec


def placement_of(cfg) -> Placement:
    """The simulator's placement of ``cfg``, read from the pipeline's step plan."""
    from relayrl.config.plan import rollout_pool, step_plan

    plan = step_plan(cfg)
    main = cfg.cluster.devices
    if plan.colocated:
        return Placement("sync-colocated", main=main)
    name, pools = rollout_pool(cfg)
    gen = pools.get(name, 1)
    if plan.ahead:
        return Placement("offpolicy", main=main, gen=gen, k=plan.ahead, partial=plan.partial)
    return Placement("periodic" if plan.update == "accumulate" else "sync-split", main=main, gen=gen)


def length_trend(rec: RunRecord) -> tuple[float, float]:
    """(slope in tokens per step, mean length at the last step) of a least-squares line through the per-step
    mean response lengths (slope 0 with fewer than three steps)."""
    pts = [(s, v["response/length_mean"]) for s, v in sorted(rec.lengths.items()) if "response/length_mean" in v]
    if not pts:
        raise ValueError(f"--from-run {rec.run_dir}: metrics.jsonl has no response/length_mean")
    if len(pts) < 3:
        return 0.0, pts[-1][1]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in pts) / max(1e-12, sum((x - mx) ** 2 for x in xs))
    return slope, my + slope * (xs[-1] - mx)


def run_lengths(rec: RunRecord, cap: int, *, window: int = 5, factor: float = 1.0) -> LengthDist:
    """An empirical length distribution from the last ``window`` steps' quantiles (p10/p50/p90, max, clip
    ratio), each length times ``factor`` (the trend), capped at ``cap``: per step, 100 lengths interpolated
    between the quantiles, the clipped share at ``cap``."""
    samples: list[int] = []
    for step in sorted(rec.lengths)[-window:]:
        m = rec.lengths[step]
        if not all(k in m for k, _ in QUANTILES):
            raise ValueError(f"--from-run {rec.run_dir}: step {step} logged no response/length_p10/p50/p90 (runs "
                             f"before relayrl logged them); plan it with `relayrl plan RECIPE --lengths ...` instead")
        top = m.get("response/length_max", m["response/length_p90"])
        pts = [(0.0, max(1.0, m["response/length_p10"] / 2)), *[(q, m[k]) for k, q in QUANTILES], (1.0, top)]
        clipped = m.get("response/clip_ratio", 0.0)
        for i in range(100):
            q = (i + 0.5) / 100
            if q >= 1.0 - clipped:
                value = float(cap)
            else:
                (q0, v0), (q1, v1) = next((a, b) for a, b in zip(pts, pts[1:]) if a[0] <= q <= b[0])
                value = v0 + (v1 - v0) * (q - q0) / max(1e-12, q1 - q0)
            samples.append(max(1, min(cap, round(value * factor))))
    return LengthDist(kind="empirical", samples=tuple(samples), max_new_tokens=cap)


def _measured(rec: RunRecord, steps: list[int]) -> dict[str, float]:
    """Mean seconds per step of generation, training-pool work and reward over ``steps``."""
    def mean(names: tuple[str, ...]) -> float:
        return statistics.mean(sum(rec.stages[s].get(n, 0.0) for n in names) for s in steps)

    return {"generate": mean(("generate",)), "update": mean(TRAINING_STAGES), "reward": mean(("reward",)),
            "step": statistics.mean(rec.step_s[s] for s in steps)}


def fit_profile(profile: Profile, w: Workload, placement: Placement, measured: dict[str, float], *,
                steps: int = 8) -> tuple[Profile, dict[str, float], Prediction]:
    """``profile`` with the generation and training costs of the device kind the run used (a GPU; on a CPU
    profile, the entry of the run's threads per rank) and the reward function's cost scaled so
    that the prediction for ``placement`` on ``w`` matches the ``measured`` stage seconds, and the fixed
    per-step cost of the run's driver path (or, below zero, the dock's costs) set to what the step time has
    beyond them; returns (fitted profile, factors, the unfitted
    prediction)."""
    from relayrl.planner.simulate import path_key

    before = simulate(profile, w, placement, steps=steps, warmup=2)
    factors = {}
    for key, phase in (("generate", "generate"), ("train", "update")):
        pred = before.phases.get(phase, 0.0)
        factors[key] = measured[phase] / pred if pred > 0 and measured[phase] > 0 else 1.0
    pred_reward = before.phases.get("reward", 0.0)  # the reward function's own cost (outside latency is workload)
    factors["reward"] = measured["reward"] / pred_reward if pred_reward > 0 else 1.0
    r = profile.reward
    fitted = profile.model_copy(update={"reward": r.model_copy(update={"call_s": r.call_s * factors["reward"],
                                                                        "row_s": r.row_s * factors["reward"]})})
    ran_on = profile.device_for(max(1, profile.cores // placement.devices) if profile.cores else 0)[0]
    fitted = fitted.scaled(ran_on, factors["generate"], factors["train"])  # the device kind the run used
    key = path_key(placement)
    path = getattr(fitted.overhead, key)
    rest = measured["step"] - simulate(fitted, w, placement, steps=steps, warmup=2).step_s
    factors["step_s"] = max(0.0, path.step_s + rest)
    overhead = fitted.overhead.model_copy(update={key: path.model_copy(update={"step_s": factors["step_s"]})})
    dock = {}
    if path.step_s + rest < 0:  # faster than the stages alone predict: the dock's calls cost less than profiled
        per_step = fitted.dock_put(w.rows) + fitted.dock_get(w.rows)
        d = max(0.0, 1.0 + (path.step_s + rest) / per_step) if per_step > 0 else 1.0
        dock = {k: getattr(fitted, k).model_copy(update={"base_s": getattr(fitted, k).base_s * d,
                                                          "per_s": getattr(fitted, k).per_s * d})
                for k in ("dock_put", "dock_get")}
        factors["dock"] = d
    fitted = fitted.model_copy(update={"overhead": overhead, **dock, "name": f"{profile.name}, fitted to a run", "source":
                                       f"{profile.source}; generation x{factors['generate']:.2f}, training "
                                       f"x{factors['train']:.2f} and {key} step_s {factors['step_s']:.3f} s from the run's spans"})
    return fitted, factors, before


def plan_from_run(run_dir: str | Path, profile: Profile, *, devices: int | None = None, lengths_at: str = "rest",
                  window: int = 5, top: int = 12, offpolicy: bool = True, prompt_tokens: int | None = None,
                  model_config: str | None = None) -> str:
    """The report of ``relayrl plan --from-run`` (see the module docstring)."""
    from relayrl.planner.from_config import workload_from_config
    from relayrl.planner.search import candidates, format_plan, rank

    if lengths_at not in ("rest", "now"):
        raise ValueError(f"--lengths-at {lengths_at!r}: rest (the trend over the steps still to run) or now")
    rec = read_run(run_dir)
    cfg = rec.cfg
    if cfg.env.name is not None:
        raise ValueError(f"--from-run {rec.run_dir}: a run of multi-turn episodes (env.name={cfg.env.name}) logs "
                         f"its lengths per episode (env/model_tokens_mean, env/turns_mean), not the per-response "
                         f"quantiles (response/length_*) the fit reads, and the simulator plans one turn a "
                         f"response: --from-run reads single-turn runs only. Plan the recipe instead (relayrl plan "
                         f"RECIPE --devices N), whose 'not simulated:' line says what it leaves out")
    steps = rec.steps[1:][-window:] or rec.steps  # the first step pays start-up
    placement = placement_of(cfg)
    slope, now = length_trend(rec)
    last, end = rec.steps[-1], cfg.trainer.steps
    target = (last + end) / 2 if lengths_at == "rest" and end > last else last
    ahead_mean = max(1.0, now + slope * (target - last))
    cap = cfg.rollout.max_new_tokens
    dist = run_lengths(rec, cap, window=window, factor=ahead_mean / max(1.0, now))
    w = workload_from_config(cfg, model_config=model_config, prompt_tokens=prompt_tokens, lengths="max")
    w = w.model_copy(update={"keep_frac": keep_frac(rec, window)})
    w_now = w.model_copy(update={"lengths": run_lengths(rec, cap, window=window)})
    measured = _measured(rec, steps)
    fitted, factors, before = fit_profile(profile, w_now, placement, measured)
    own = simulate(fitted, w_now, placement, steps=8, warmup=2)
    w_plan = w.model_copy(update={"lengths": dist})
    # on a CPU a device is a share of the cores, and a run on fewer ranks than cores used them all (threads)
    n_dev = devices or max(placement.devices, fitted.cores)
    preds = rank(fitted, w_plan, candidates(n_dev, offpolicy=offpolicy, cpu=fitted.cores > 0))
    err = own.step_s / measured["step"] - 1.0
    lines = [
        f"relayrl plan --from-run {rec.run_dir}: this run ({placement.pools}, {placement.mode_name}) took "
        f"{measured['step']:.3f} s/step over steps {steps[0]}-{steps[-1]} (generate {measured['generate']:.3f} s, "
        f"training {measured['update']:.3f} s, reward {measured['reward']:.3f} s)",
        f"  profile '{profile.name}' predicted {before.step_s:.3f} s for it; fitted to the run's spans (generation "
        f"x{factors['generate']:.2f}, training x{factors['train']:.2f}, fixed {factors['step_s']:.3f} s a step) it "
        f"predicts {own.step_s:.3f} s ({err:+.0%})",
        f"  response lengths: mean {now:.1f} tokens at step {last}, trend {slope:+.2f} tokens/step; planned with "
        f"mean {ahead_mean:.1f}" + (f" (predicted over steps {last + 1}-{end})" if target != last else
                                     " (the last steps')"),
    ]
    off = max(factors["generate"], factors["train"], 1 / factors["generate"], 1 / factors["train"])
    if off > 2.0:
        lines.append(f"  note: the profile was off by up to {off:.1f}x on this run (another model, machine or relayrl "
                     f"version?); the fit corrects the device kind this run used, but the other kinds (on a CPU, "
                     f"other threads per rank), the other driver paths and pool contention still come from the "
                     f"profile: calibrate it again with `relayrl plan --profile` on this machine for a ranking of "
                     f"the other modes to rely on")
    title = (f"relayrl plan: PREDICTED for {n_dev} device(s) with the fitted profile "
             f"({w.prompts} prompts x {w.n}, {w.prompt_tokens} prompt tokens)")
    table = format_plan(preds, title=title, top=top)
    best = next((r for r in preds if r.fits), None)
    lines.append(table)
    if best is not None:
        mine = next((r for r in preds if r.placement == placement), None)
        if best.placement == placement:
            lines.append("the run's own placement is predicted the fastest")
        elif mine is not None:
            lines.append(f"predicted {best.step_s:.3f} s/step for {best.placement.pools} {best.placement.mode_name} "
                         f"against {mine.step_s:.3f} s for the run's own placement on the same lengths: "
                         f"{mine.step_s / best.step_s:.2f}x; resume or rerun with "
                         f"{' '.join(best.placement.overrides())}")
        else:
            lines.append(f"predicted {best.step_s:.3f} s/step for {best.placement.pools} {best.placement.mode_name}; "
                         f"run it with {' '.join(best.placement.overrides())}")
    return "\n".join(lines)
