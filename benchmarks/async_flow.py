"""Streaming dataflow benchmark: synchronous colocated, synchronous split and periodic-async split GRPO on a
long-tail workload with a slow verifier (Periodic Asynchrony's comparison, on this machine).

Workload: the demo's models (the tiny Qwen2 pretrained on 2-digit sums, then SFT on a careless teacher;
built once and cached), GRPO on fresh sums with ``rollout.max_new_tokens`` well above the 3-token answers.
At temperature 1.0 the SFT model sometimes misses its end-of-sequence token and then runs on to the limit,
so response lengths are heavy-tailed: most responses are a few tokens, a few hit ``max_new_tokens``, and a
whole batch's generation lasts as long as its longest response. The reward checks every answer in a
subprocess that waits 20-200 ms first (``subprocess_verifier``: the latency of a test harness or a judge
call), so scoring has real latency.

Modes, each in its own process, same seed, same prompts and number of steps:

* ``sync-colocated``: today's default, everything on one pool with all the cores (``run.threads`` = cores);
* ``sync-split``: the rollout on a pool of its own (half the cores, its own process), the trainer on the
  other half; stages stream per group, the update waits for the whole batch;
* ``periodic-split``: the same placement, ``trainer.mode=periodic``: the trainer runs forward and backward
  on each group as it arrives and steps once per batch (the same update);
* ``offpolicy-k1``, ``offpolicy-k2``: the same placement, ``trainer.off_policy_steps=k``: the rollout runs
  up to k weight versions ahead of the trainer, with truncated importance weights (``algorithm.tis_cap=2``,
  or ``--correction``'s keys of ``algorithm.correction``; the table gives the shares it masked and capped);
* ``offpolicy-k1-partial``, ``offpolicy-k2-partial``: the same with ``rollout.partial=true``: the trainer's
  new weights reach responses still being generated (paused, prefilled again, continued).

Figures: tokens trained per second per device (TPSPD, Periodic Asynchrony: prompt + response tokens of the step's
samples / step time / devices, a device being a core here, so every mode has 2) and the mean step time,
both over the steps after ``--warmup``; held-out greedy accuracy after the last step. Printed, not asserted.
The last line is::

    async_flow: periodic/sync-split R_s, periodic/sync-colocated R_c; accuracy periodic A_p% sync A_s% \
        offpolicy/sync-colocated R_o (k=1, partial)

Run it with::

    .venv/bin/python benchmarks/async_flow.py               # 30 steps per mode (~20 min on 2 cores)
    .venv/bin/python benchmarks/async_flow.py --steps 100   # the accuracy comparison (~45 min)

``--rounds K`` cuts every mode's steps into K rounds and runs the modes' rounds in turn, each round resuming
its mode's checkpoint (resume is exact: the same samples and weights as one run), so that a machine that
speeds up or slows down during the run does so for every mode alike.
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

_CHECK = 'sleep "$3"; [ "$1" = "$2" ]'  # the harness: wait for the "judge", then compare


def subprocess_verifier(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """1.0 when the answer line matches, decided by a subprocess per response that first waits 20-200 ms
    (a test harness or a judge call: latency, little CPU). The calls of one batch run concurrently, as a
    client of a judge service sends them; the wait is a hash of the response, so every mode sees the same
    latencies for the same samples."""
    import zlib

    procs = []
    for r, a in zip(responses, answers):
        wait = 0.02 + (zlib.crc32(r.encode()) % 181) / 1000
        line = r.split("\n", 1)[0].strip().replace("\x00", "")  # (a sampled NUL byte cannot go in an argv)
        procs.append(subprocess.Popen(["sh", "-c", _CHECK, "sh", line, (a or "").strip(), f"{wait:.3f}"]))
    return [1.0 if p.wait(timeout=30) == 0 else 0.0 for p in procs]


SPLIT = ["placement.pools.gen=1", "placement.rollout=gen"]
MODES: dict[str, list[str]] = {
    "sync-colocated": [],
    "sync-split": [*SPLIT, "trainer.mode=sync"],
    "periodic-split": [*SPLIT, "trainer.mode=periodic"],
    **{f"offpolicy-k{k}{'-partial' if partial else ''}": [
        *SPLIT, f"trainer.off_policy_steps={k}", f"rollout.partial={str(partial).lower()}", "algorithm.tis_cap=2.0"]
       for k in (1, 2) for partial in (False, True)},
}


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


P_TAIL, MEAN_TAIL = 0.25, 24.0  # the teacher runs on after its answer in a quarter of rows, for ~24 tokens


def tail_sft_data(path: Path, rows: int, seed: int, p_tail: float, mean_tail: float) -> None:
    """SFT rows of the demo's careless teacher (arith, forget_carry=0.7) where a share ``p_tail`` of the
    answers go on after the answer line with a scratch line of random digits, its length geometric with mean
    ``mean_tail`` tokens: a model trained on it mostly stops after the answer and sometimes runs long."""
    import random

    from relayrl.data.tasks import make_task

    task = make_task("arith", min_digits=2, max_digits=2, forget_carry=0.7)
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            pr = task.sample(rng)
            answer = pr.answer
            if rng.random() < p_tail:
                k = 1
                while rng.random() > 1.0 / mean_tail:
                    k += 1
                answer += "\n" + " ".join(str(rng.randrange(10)) for _ in range(k))
            f.write(json.dumps({"prompt": pr.prompt, "answer": answer}) + "\n")


def demo_models(seed: int) -> Path:
    """The demo's pretrained model (stage 1 of ``relayrl demo``), then SFT on the long-tail teacher (see
    :func:`tail_sft_data`); built once into the cache."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.models.tiny import default_cache_dir
    from relayrl.workflows.sft import train_sft

    from demo_models import base_model

    root = default_cache_dir() / f"async_flow-seed{seed}"
    sft = root / f"tail{P_TAIL}-sft" / "model"
    if (sft / "config.json").is_file():
        return sft
    base = base_model(seed)
    root.mkdir(parents=True, exist_ok=True)
    data = root / f"tail{P_TAIL}_sft.jsonl"
    tail_sft_data(data, 20000, seed, p_tail=P_TAIL, mean_tail=MEAN_TAIL)
    print(f"async_flow: SFT on the long-tail teacher into {sft.parent} ...", flush=True)
    return train_sft(load_config(Config, REPO / "recipes" / "arith_sft.yaml", [
        f"run.dir={sft.parent}", f"run.seed={seed}", "run.overwrite=true", "telemetry.sinks=[jsonl]",
        "data.task=null", f"data.path={data}", f"trainer.init_from={base}",
        "trainer.steps=300", "eval.every=0", "eval.size=50", "rollout.max_new_tokens=48", "reward.verifier=exact"]))


def run_mode(name: str, model: Path, out: Path, a: argparse.Namespace, upto: int, after: int) -> float:
    """Train mode ``name`` from step ``after`` (0: a fresh run; else the checkpoint that its previous round
    ended with) up to step ``upto``, in its own process. Returns the wall seconds."""
    start = ["run.overwrite=true"] if after == 0 else [f"run.resume={out / name / 'checkpoints' / f'step-{after:06d}'}"]
    over = [
        f"trainer.init_from={model}", f"run.dir={out / name}", f"run.seed={a.seed}", *start,
        f"trainer.steps={upto}", "eval.every=0", f"eval.size={a.eval_size}", "run.save_every=0",
        f"rollout.max_new_tokens={a.max_new_tokens}", f"data.prompts_per_step={a.prompts}", f"rollout.n={a.n}",
        "reward.verifier=user", "reward.user_fn=async_flow:subprocess_verifier",
        "telemetry.sinks=[jsonl]", f"model.device={a.device}",
        *MODES[name],
    ]
    if a.correction and name.startswith("offpolicy"):  # the correction section instead of tis_cap
        over = [o for o in over if not o.startswith("algorithm.tis_cap=")]
        over += [f"algorithm.correction.{kv}" for kv in a.correction.split(",")]
    if a.devices:  # R rollout + T trainer devices: the split modes place them so, colocated runs R + T ranks
        r, t = a.devices
        if name == "sync-colocated":
            over += [f"cluster.devices={r + t}", f"run.threads={max(1, cores() // (r + t))}"]
        else:
            over += [f"placement.pools.gen={r}", f"cluster.devices={t}"]
    elif name == "sync-colocated":
        over.append(f"run.threads={cores()}")
    if a.extra and name != "sync-colocated":
        over += a.extra.split(",")
    cmd = [sys.executable, "-m", "relayrl.cli.main", "train", str(REPO / "recipes" / "arith_grpo.yaml"), *over]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")])}
    print(f"async_flow: {name} (steps {after + 1}-{upto}) ...", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"async_flow: {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    trained = {r["step"] for r in _metrics(out / name) if "perf/step_time_s" in r}
    if trained != set(range(1, upto + 1)):
        raise SystemExit(f"async_flow: {name}: after the round to step {upto}, {out / name}/metrics.jsonl has steps "
                         f"{sorted(trained)[:5]}... ({len(trained)}), not 1..{upto}")
    return time.perf_counter() - t0


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(name: str, out: Path, a: argparse.Namespace, starts: list[int], wall: float) -> dict:
    """A mode's figures over its steps, leaving out the first ``--warmup`` steps of every round (a round
    starts a fresh process)."""
    rows = _metrics(out / name)
    skip = {s + k for s in starts for k in range(a.warmup)}
    steps = [r for r in rows if r.get("step", 0) >= 1 and r["step"] not in skip and "perf/step_time_s" in r]
    acc = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    step_s = statistics.mean(r["perf/step_time_s"] for r in steps)
    tokens = sum(r["perf/tokens"] for r in steps)
    tpspd = tokens / (sum(r["perf/step_time_s"] for r in steps) * cores())
    lengths = [r["response/length_mean"] for r in steps]
    clip = [r["response/clip_ratio"] for r in steps]
    scored = scored_s(out / name / "spans.jsonl", {r["step"] for r in steps})
    return {"mode": name, "step_s": step_s, "tpspd": tpspd, "accuracy": acc[-1] if acc else float("nan"),
            "accuracy0": acc[0] if acc else float("nan"), "wall_s": wall, "length_mean": statistics.mean(lengths),
            "clip_ratio": statistics.mean(clip), "scored_s": scored,
            **{k: statistics.mean(r.get(f"timing/{k}_s", 0.0) for r in steps) for k in ("generate", "reward", "update")},
            "driver_bytes": max((r.get("dock/driver_bytes", 0) for r in steps), default=0.0),
            "staleness": statistics.mean(r.get("async/staleness_mean", 0.0) for r in steps),
            "multi_version": statistics.mean(r.get("async/multi_version_frac", 0.0) for r in steps),
            **{k: statistics.mean(r.get(f"correction/{k}_frac", 0.0) for r in steps)
               for k in ("token_masked", "seq_masked", "token_capped")}}


def round_ends(steps: int, rounds: int) -> list[int]:
    """The last step of each of ``rounds`` rounds of ``steps`` steps (as even as integers allow)."""
    return [round(steps * (j + 1) / rounds) for j in range(rounds)]


def scored_s(spans: Path, steps: set[int]) -> float:
    """Mean time from a step's start until its last sample is generated and scored (the end of its last
    generate, reward or advantage span), over ``steps``; nan without spans."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for line in spans.read_text().splitlines() if spans.is_file() else []:
        s = json.loads(line)
        if s.get("step") in steps:
            first[s["step"]] = min(first.get(s["step"], s["start"]), s["start"])
            if s["name"] in ("generate", "reward", "advantage"):
                last[s["step"]] = max(last.get(s["step"], s["end"]), s["end"])
    return statistics.mean(last[k] - first[k] for k in last) if last else float("nan")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the averages (at the start of "
                   "every round)")
    p.add_argument("--rounds", type=int, default=1, help="cut every mode's steps into this many rounds and run "
                   "the modes' rounds in turn (each round resumes its mode's checkpoint), so that the machine's "
                   "drift over the run falls on every mode alike")
    p.add_argument("--prompts", type=int, default=8, help="prompt groups per step")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="model.device of every mode (a device is a share of the cores "
                   "on a CPU)")
    p.add_argument("--correction", default="", help="the off-policy modes' rollout correction instead of "
                   "algorithm.tis_cap=2, as comma-separated algorithm.correction keys, e.g. level=token,mode=mask,"
                   "high=2,kl_threshold=0.1,negative_only=true")
    p.add_argument("--extra", default="", help="comma-separated config overrides for the split modes")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--results", default=None, help="a JSONL file: each mode's figures are appended to it once its "
                   "last round is done, and modes already in it are not run again (a long run that stops keeps "
                   "what it finished)")
    p.add_argument("--devices", default=None, metavar="R,T", help="R rollout and T trainer devices (a device is "
                   "cores / (R + T) threads on a CPU): the split modes get pools of R and T, sync-colocated R + T "
                   "ranks on one pool (default: one rank with every core colocated, 1 + 1 split)")
    a = p.parse_args(argv)
    if a.devices is not None:
        try:
            a.devices = tuple(int(x) for x in a.devices.split(","))
            assert len(a.devices) == 2 and min(a.devices) >= 1
        except (ValueError, AssertionError):
            raise SystemExit(f"--devices {a.devices!r}: give two device counts >= 1, as R,T (e.g. 4,4)") from None
    if a.rounds < 1 or a.steps // a.rounds <= a.warmup:
        raise SystemExit(f"--steps ({a.steps}) / --rounds ({a.rounds}) must exceed --warmup ({a.warmup}): every "
                         f"round leaves out its first --warmup steps")
    model = demo_models(a.seed)
    res: dict[str, dict] = {}
    saved = Path(a.results) if a.results else None
    if saved is not None and saved.is_file():
        res = {r["mode"]: r for r in map(json.loads, saved.read_text().splitlines()) if r["mode"] in a.modes.split(",")}
    todo = [m for m in a.modes.split(",") if m not in res]
    for name in res:
        print(f"async_flow: {name}: measured before, in {saved}", flush=True)
    ends = round_ends(a.steps, a.rounds)
    starts = [1] + [e + 1 for e in ends[:-1]]
    with tempfile.TemporaryDirectory(prefix="async_flow-") as tmp:
        wall = dict.fromkeys(todo, 0.0)
        for after, upto in zip([0, *ends[:-1]], ends):
            for name in todo:
                wall[name] += run_mode(name, model, Path(tmp), a, upto, after)
                if upto == a.steps:  # the mode's last round: its figures, kept at once
                    res[name] = summarize(name, Path(tmp), a, starts, wall[name])
                    if saved is not None:
                        with saved.open("a") as f:
                            f.write(json.dumps(res[name]) + "\n")
    print(f"\n{'mode':<22}{'step s':>8}{'TPSPD':>9}{'/colo':>7}{'acc %':>7}{'len':>6}{'clipped':>8}{'driver B':>9}"
          f"{'gen s':>7}{'reward s':>9}{'update s':>9}{'stale':>7}{'multi-v':>8}{'masked':>8}{'seq-m':>7}"
          f"{'capped':>8}")
    colo = res.get("sync-colocated")
    for r in res.values():
        ratio = r["tpspd"] / colo["tpspd"] if colo else float("nan")
        print(f"{r['mode']:<22}{r['step_s']:>8.3f}{r['tpspd']:>9.1f}{ratio:>7.2f}{100 * r['accuracy']:>7.1f}"
              f"{r['length_mean']:>6.1f}{r['clip_ratio']:>8.3f}{r['driver_bytes']:>9.0f}"
              f"{r['generate']:>7.3f}{r['reward']:>9.3f}{r['update']:>9.3f}{r['staleness']:>7.2f}"
              f"{r['multi_version']:>8.3f}{r.get('token_masked', 0):>8.3f}{r.get('seq_masked', 0):>7.3f}"
              f"{r.get('token_capped', 0):>8.3f}")
    print("(gen/reward/update s: summed stage time per step; in the split modes they overlap. stale: mean token "
          "staleness in versions; multi-v: share of samples whose tokens span several versions; masked, seq-m, "
          "capped: shares of tokens masked, of sequences masked whole and of tokens capped by the rollout "
          "correction)")
    print(f"(held-out accuracy before GRPO: {100 * next(iter(res.values()))['accuracy0']:.1f}%; TPSPD: tokens "
          f"trained per second per core, {cores()} cores in every mode)")
    if {"periodic-split", "sync-split", "sync-colocated"} <= set(res):
        per, ss, sc = res["periodic-split"], res["sync-split"], res["sync-colocated"]
        line = (f"async_flow: periodic/sync-split {per['tpspd'] / ss['tpspd']:.2f}, periodic/sync-colocated "
                f"{per['tpspd'] / sc['tpspd']:.2f}; accuracy periodic {100 * per['accuracy']:.1f}% sync "
                f"{100 * sc['accuracy']:.1f}%")
        # Periodic asynchrony trains the split synchronous run's samples: its step cannot end before they are
        # generated on the same rollout device and scored, so that time bounds both ratios whatever the trainer.
        if ss.get("scored_s", 0) > 0:
            bound = ss["step_s"] / ss["scored_s"]
            print(f"(ceiling: the split synchronous step's samples are generated and scored {ss['scored_s']:.3f} s "
                  f"into its {ss['step_s']:.3f} s; a periodic step takes at least about as long, so even with free "
                  f"training periodic/sync-split <= {bound:.2f}, periodic/sync-colocated <= "
                  f"{bound * ss['tpspd'] / sc['tpspd']:.2f})")
        if "offpolicy-k1-partial" in res:
            op = res["offpolicy-k1-partial"]
            line += (f" offpolicy/sync-colocated {op['tpspd'] / sc['tpspd']:.2f} (k=1, partial); accuracy "
                     f"offpolicy {100 * op['accuracy']:.1f}%")
        print(line)


if __name__ == "__main__":
    main()
