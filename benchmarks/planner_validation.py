"""Validate ``relayrl plan``'s predictions against measured runs on this machine.

In one run: calibrate a profile (``relayrl.planner.calibrate``, with the long-tail model and a reward
function that spawns the verifier's subprocess without its wait), measure each workload's response lengths
by sampling its model, predict the step time of each configuration with the simulator, then run each
configuration for ``--steps`` (long tail) or ``--demo-steps`` steps with ``relayrl train``, ``--passes``
times (every configuration in order, then in reverse order: the machine's speed drifts over minutes), and
compare the mean step time after ``--warmup`` over the passes. When the passes of a workload's two fastest
configurations overlap (too close for them to tell apart), both are measured ``--decide`` more times,
alternating, before the fastest is named (the rule looks at the measurements only, not at the predictions).

Workloads (the models of ``benchmarks/async_flow.py``, built once and cached):

* ``demo``: the demo's GRPO step (``recipes/arith_grpo.yaml``: 8 prompts x 8, at most 5 new tokens, the task's
  verifier) from the demo's pretrained model;
* ``longtail``: async_flow's long-tail workload: the model SFT'd on a teacher that runs on in a quarter of
  answers, ``--max-new-tokens`` (64) new tokens, 8 prompts x 8, the subprocess verifier that answers after
  20-200 ms per response (its latency is the workload's ``reward_latency``, uniform 0.02-0.2 s).

Configurations (every one uses both cores): ``colo1`` colocated, one rank of 2 threads; ``colo2`` colocated,
two ranks (``cluster.devices=2``) of one thread (FSDP2); ``split`` the rollout on a pool of its own, synchronous;
``periodic``; ``offk1`` off-policy k=1; ``offk1p`` off-policy k=1 with partial rollout.

The last line::

    planner: max relative error E, mean M over N configs; best predicted = best measured: yes|no; fastest
    measured is the first choice or a near-tie named with it: yes|no

or, with ``--repeats R``, a table of each configuration's measured step time per repeat and its spread, each
repeat's line, and::

    planner: K of R repeats within max 25% / mean 12% with the best configuration predicted (L of R with the
    fastest the first choice or a near-tie named with it); worst ...

("best": per workload, the configuration with the highest predicted TPSPD is the one with the highest
measured TPSPD; "yes" when that holds for every workload run. "Near-tie": a configuration predicted within
``relayrl.planner.search.NEAR_TIE`` (5%) of the first choice's TPSPD, which ``relayrl plan`` names beside it
for the user to measure.) The machine may be shared: timings then swing, and the calibration (the fastest of a
few repetitions) sees less of it than the runs do.

    .venv/bin/python benchmarks/planner_validation.py                        # everything, ~11 min on 2 cores
    .venv/bin/python benchmarks/planner_validation.py --repeats 3            # three in a row, with the spread
    .venv/bin/python benchmarks/planner_validation.py --demo-steps 6 --configs colo1,split --workloads demo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for p in (REPO, HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from async_flow import cores, demo_models, subprocess_verifier  # noqa: E402,F401  (the verifier: runs import it)
from relayrl.planner.search import NEAR_TIE  # noqa: E402

SPLIT = ["placement.pools.gen=1", "placement.rollout=gen"]
CONFIGS: dict[str, list[str]] = {
    "colo1": ["cluster.devices=1"],
    "colo2": ["cluster.devices=2"],
    "split": [*SPLIT, "trainer.mode=sync"],
    "periodic": [*SPLIT, "trainer.mode=periodic"],
    "offk1": [*SPLIT, "trainer.off_policy_steps=1", "rollout.partial=false", "algorithm.tis_cap=2.0"],
    "offk1p": [*SPLIT, "trainer.off_policy_steps=1", "rollout.partial=true", "algorithm.tis_cap=2.0"],
}


def placement_of(name: str):
    from relayrl.planner.placement import Placement

    return {"colo1": Placement("sync-colocated", main=1), "colo2": Placement("sync-colocated", main=2),
            "split": Placement("sync-split", main=1, gen=1), "periodic": Placement("periodic", main=1, gen=1),
            "offk1": Placement("offpolicy", main=1, gen=1, k=1),
            "offk1p": Placement("offpolicy", main=1, gen=1, k=1, partial=True)}[name]


def spawn_verifier(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """``subprocess_verifier`` without its wait: what the reward function itself costs (a process per
    response); the wait is the workload's outside latency."""
    procs = [subprocess.Popen(["sh", "-c", '[ "$1" = "$2" ]', "sh", r.split("\n", 1)[0].strip(), (a or "").strip()])
             for r, a in zip(responses, answers)]
    return [1.0 if p.wait(timeout=30) == 0 else 0.0 for p in procs]


def workloads(a: argparse.Namespace) -> dict[str, dict]:
    tail = demo_models(a.seed)
    base = tail.parents[1] / "base" / "model"
    return {
        "demo": {"model": base, "over": ["rollout.max_new_tokens=5"], "latency": (0.0, 0.0), "reward": "task",
                 "steps": a.demo_steps},
        "longtail": {"model": tail, "over": [f"rollout.max_new_tokens={a.max_new_tokens}", "reward.verifier=user",
                                             "reward.user_fn=async_flow:subprocess_verifier"],
                     "latency": (0.02, 0.2), "reward": "planner_validation:spawn_verifier", "steps": a.steps},
    }


def common(a: argparse.Namespace, model: Path, run_dir: Path, steps: int) -> list[str]:
    return [f"trainer.init_from={model}", f"run.dir={run_dir}", f"run.seed={a.seed}", "run.overwrite=true",
            f"trainer.steps={steps}", "eval.every=0", "eval.size=10", "run.save_every=0",
            f"data.prompts_per_step={a.prompts}", f"rollout.n={a.n}", "telemetry.sinks=[jsonl]", "model.device=cpu"]


def measure(name: str, wl: dict, a: argparse.Namespace, tmp: Path) -> dict:
    run_dir = tmp / f"{wl['name']}-{name}"
    cmd = [sys.executable, "-m", "relayrl.cli.main", "train", str(REPO / "recipes" / "arith_grpo.yaml"),
           *common(a, wl["model"], run_dir, wl["steps"]), *wl["over"], *CONFIGS[name]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"planner_validation: {wl['name']}/{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if r.get("step", 0) > a.warmup and "perf/step_time_s" in r]
    step_s = statistics.mean(r["perf/step_time_s"] for r in steps)
    return {"step_s": step_s, "tokens": statistics.mean(r["perf/tokens"] for r in steps),
            "length": statistics.mean(r["response/length_mean"] for r in steps),
            **{k: statistics.mean(r.get(f"timing/{k}_s", 0.0) for r in steps) for k in ("generate", "reward", "update")}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="steps per run of the long-tail workload")
    p.add_argument("--demo-steps", type=int, default=30, help="steps per run of the demo workload (its steps take "
                   "0.1-0.4 s: more of them keep a run's measured part above a few seconds)")
    p.add_argument("--passes", type=int, default=2, help="measure every configuration this many times, alternating "
                   "the order (forward, reverse, ...); the mean is compared")
    p.add_argument("--decide", type=int, default=2, help="when a workload's two fastest measured configurations "
                   "overlap (the ranges of their passes' step times meet), measure both this many more times, "
                   "alternating, before naming the fastest (0: never)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the measured mean")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64, help="long-tail workload's rollout.max_new_tokens")
    p.add_argument("--sim-steps", type=int, default=64, help="steps the simulator draws lengths for (its prediction "
                   "is the mean after --warmup: the expected step, not one draw of 12)")
    p.add_argument("--repeats", type=int, default=1, help="independent runs (each calibrates and measures anew); "
                   "prints the spread of the measured step times and each repeat's errors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--workloads", default="demo,longtail")
    p.add_argument("--profile-out", default=None, help="also write the calibrated profile here")
    p.add_argument("--profile-in", default=None, help="development: reuse this profile instead of calibrating "
                   "(the figures of record calibrate in the same run)")
    a = p.parse_args(argv)
    if min(a.steps, a.demo_steps) <= a.warmup:
        raise SystemExit(f"--steps and --demo-steps ({a.steps}, {a.demo_steps}) must exceed --warmup ({a.warmup})")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")])
    summaries = []
    for rep in range(a.repeats):
        if a.repeats > 1:
            print(f"\nplanner_validation: repeat {rep + 1} of {a.repeats}", flush=True)
        summaries.append(one_run(a, profile_out=a.profile_out if rep == 0 else None))
    if a.repeats > 1:
        print(f"\n{'workload':<10}{'config':<10}{'meas s (each repeat)':>28}{'spread %':>10}{'err % (each repeat)':>26}")
        for key in summaries[0]["results"]:
            meas = [s["results"][key]["meas"] for s in summaries]
            errs = [s["results"][key]["err"] for s in summaries]
            print(f"{key[0]:<10}{key[1]:<10}{' '.join(f'{m:8.3f}' for m in meas):>28}"
                  f"{100 * (max(meas) - min(meas)) / statistics.mean(meas):>10.1f}"
                  f"{' '.join(f'{100 * e:7.1f}' for e in errs):>26}")
        for i, sm in enumerate(summaries, 1):
            print(f"repeat {i}: {sm['line']}")
        within = [sm["max"] <= 0.25 and sm["mean"] <= 0.12 for sm in summaries]
        ok = sum(w and sm["same"] for w, sm in zip(within, summaries))
        named = sum(w and sm["named"] for w, sm in zip(within, summaries))
        print(f"planner: {ok} of {a.repeats} repeats within max 25% / mean 12% with the best configuration "
              f"predicted ({named} of {a.repeats} with the fastest the first choice or a near-tie named with it); "
              f"worst max error {100 * max(sm['max'] for sm in summaries):.1f}%, worst mean "
              f"{100 * max(sm['mean'] for sm in summaries):.1f}%")


def one_run(a: argparse.Namespace, profile_out: str | None) -> dict:
    """Calibrate (or load the profile), predict every configuration and measure it ``--passes`` times; print
    the table."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.planner.calibrate import _reward, calibrate
    from relayrl.planner.from_config import workload_from_config
    from relayrl.planner.profile import save_profile
    from relayrl.planner.simulate import simulate

    wls = workloads(a)
    names = a.configs.split(",")
    t0 = time.perf_counter()
    if a.profile_in:
        from relayrl.planner.profile import load_profile

        prof = load_profile(a.profile_in)
    else:
        prof = calibrate(str(wls["longtail"]["model"]), reward_fn="planner_validation:spawn_verifier")
    if profile_out:
        save_profile(prof, profile_out)
    results, plans = [], {}
    with tempfile.TemporaryDirectory(prefix="planner_validation-") as tmp:
        for wname in a.workloads.split(","):
            wl = {**wls[wname], "name": wname}
            cfg = load_config(Config, REPO / "recipes" / "arith_grpo.yaml",
                              common(a, wl["model"], Path(tmp) / "x", wl["steps"])
                              + wl["over"])
            import torch

            torch.set_num_threads(cores())
            w = workload_from_config(cfg, lengths="measure", reward_latency=wl["latency"], measure_prompts=64)
            wprof = prof.model_copy(update={"reward": _reward(wl["reward"], 3)})
            lengths = w.lengths.samples
            print(f"planner_validation: {wname}: {w.prompts} x {w.n}, prompt {w.prompt_tokens} tokens, sampled "
                  f"lengths mean {statistics.mean(lengths):.1f} max {max(lengths)} "
                  f"(p90 {sorted(lengths)[int(0.9 * len(lengths))]})", flush=True)
            for name in names:
                plans[wname, name] = (wl, simulate(wprof, w, placement_of(name), steps=a.sim_steps, warmup=a.warmup))
        # every configuration once in order, then again in reverse order (the machine's speed drifts over
        # minutes; the mean of the passes is what is compared)
        order = list(plans)
        passes: dict[tuple[str, str], list[dict]] = {key: [] for key in order}
        for i in range(a.passes):
            for key in (order if i % 2 == 0 else order[::-1]):
                passes[key].append(measure(key[1], plans[key][0], a, Path(tmp)))
                print(f"planner_validation: pass {i + 1}: {key[0]:<9}{key[1]:<9} measured "
                      f"{passes[key][-1]['step_s']:7.3f} s", flush=True)
        for wname in dict.fromkeys(w for w, _ in order):
            pair = near_tie(wname, passes) if a.decide else None
            if pair is None:
                continue
            print(f"planner_validation: {wname}: {pair[0]} and {pair[1]} measured within each other's passes: "
                  f"{a.decide} more passes each, alternating", flush=True)
            for i in range(a.decide):
                for name in (pair if i % 2 == 0 else pair[::-1]):
                    passes[wname, name].append(measure(name, plans[wname, name][0], a, Path(tmp)))
                    print(f"planner_validation: decide {i + 1}: {wname:<9}{name:<9} measured "
                          f"{passes[wname, name][-1]['step_s']:7.3f} s", flush=True)
        for (wname, name), (wl, pred) in plans.items():
            runs = passes[wname, name]
            meas = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
            err = abs(pred.step_s - meas["step_s"]) / meas["step_s"]
            results.append({"workload": wname, "config": name, "pred": pred.step_s, "meas": meas["step_s"],
                            "err": err, "pred_tpspd": pred.tpspd,
                            "meas_tpspd": meas["tokens"] / (meas["step_s"] * cores()),
                            "pred_tokens": pred.tokens, "meas_tokens": meas["tokens"]})
            phases = " ".join(f"{k} {pred.phases[k]:.2f}/{meas[k]:.2f}" for k in ("generate", "reward", "update"))
            each = "/".join(f"{r['step_s']:.3f}" for r in runs)
            print(f"planner_validation: {wname:<9}{name:<9} predicted {pred.step_s:7.3f} s  measured "
                  f"{meas['step_s']:7.3f} s ({each})  error {100 * err:5.1f}%  (tokens/step predicted "
                  f"{pred.tokens:.0f}, measured {meas['tokens']:.0f}; s per step predicted/measured: {phases})",
                  flush=True)
    print(f"\n{'workload':<10}{'config':<10}{'pred s':>8}{'meas s':>8}{'err %':>7}{'pred TPSPD':>12}{'meas TPSPD':>12}")
    for r in results:
        print(f"{r['workload']:<10}{r['config']:<10}{r['pred']:>8.3f}{r['meas']:>8.3f}{100 * r['err']:>7.1f}"
              f"{r['pred_tpspd']:>12.1f}{r['meas_tpspd']:>12.1f}")
    same, named = [], []
    for wname in dict.fromkeys(r["workload"] for r in results):
        rs = [r for r in results if r["workload"] == wname]
        bp = max(rs, key=lambda r: r["pred_tpspd"])
        bm = max(rs, key=lambda r: r["meas_tpspd"])
        # the configurations `relayrl plan` prints as near-ties of its first choice (search.NEAR_TIE)
        ties = [r["config"] for r in rs if r is not bp and r["pred_tpspd"] >= (1 - NEAR_TIE) * bp["pred_tpspd"]]
        gap = "" if bp is bm else f" (the predicted best measured {100 * (1 - bp['meas_tpspd'] / bm['meas_tpspd']):.1f}% slower)"
        print(f"{wname}: best predicted {bp['config']}"
              + (f" (near-ties named with it: {', '.join(ties)})" if ties else "")
              + f", best measured {bm['config']}{gap}")
        same.append(bp is bm)
        named.append(bp is bm or bm["config"] in ties)
    errs = [r["err"] for r in results]
    print(f"(total {time.perf_counter() - t0:.0f} s; {cores()} cores; TPSPD: tokens trained per second per core)")
    line = (f"max relative error {100 * max(errs):.1f}%, mean {100 * statistics.mean(errs):.1f}% over "
            f"{len(errs)} configs; best predicted = best measured: {'yes' if all(same) else 'no'}; fastest "
            f"measured is the first choice or a near-tie named with it: {'yes' if all(named) else 'no'}")
    print(f"planner: {line}", flush=True)
    return {"results": {(r["workload"], r["config"]): r for r in results}, "max": max(errs),
            "mean": statistics.mean(errs), "same": all(same), "named": all(named), "line": line}


def near_tie(wname: str, passes: dict) -> tuple[str, str] | None:
    """The workload's two fastest configurations by mean measured TPSPD, when their passes cannot tell them
    apart (the ranges of their passes overlap: the second's fastest pass is at least as fast as the first's
    slowest); None otherwise. It does not look at the predictions."""
    def tpspd(r: dict) -> float:
        return r["tokens"] / r["step_s"]

    ranked = sorted((statistics.mean(tpspd(r) for r in runs), name) for (w, name), runs in passes.items()
                    if w == wname)[::-1]
    if len(ranked) < 2:
        return None
    (_, a), (_, b) = ranked[:2]
    return (a, b) if max(tpspd(r) for r in passes[wname, b]) >= min(tpspd(r) for r in passes[wname, a]) else None


if __name__ == "__main__":
    main()
