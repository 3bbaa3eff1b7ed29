"""``relayrl plan --profile``: measure a :class:`~relayrl.planner.profile.Profile` on this machine with
relayrl's own engines (HybridFlow §6, auto device mapping, profiles each role's cost before it searches placements; this is that
step).

What is timed, each a few repetitions after one untimed call, the median kept (the machine may be shared;
the median is what a run beside the other work sees):

* decode: ``NativeGenerationEngine.generate`` with ``ignore_eos`` at several rows in flight and two response
  lengths; per-step cost = (time at length L2 - time at L1) / (L2 - L1), fitted to ``base + row * rows +
  row_ctx * rows * context`` by least squares;
* prefill: the same engine with one new token, several prompt counts;
* training: ``TorchTrainingEngine.accumulate`` (forward + backward, no optimizer) on batches shaped as the
  pipeline's (groups of 8 responses sharing a prompt), from one group of short responses (a streamed chunk)
  to a batch of long ones, the log-prob pass (``logprobs``) likewise, the optimizer step
  (``finish_accumulation``); every fit minimises the relative error, so a small call's fixed cost is kept;
* the weight relay (``WeightRelay.push`` of the model's weights into a generation engine), dock put/get of
  rows with prompt and response columns, a gloo all-gather between two processes;
* the user's reward function (or the built-in verifier) on 1, 8 and 32 rows;
* the driver paths: short real runs of ``relayrl train`` on each (the colocated loop on one rank and on one
  rank per core, the split dataflow) with two calibration workloads (:data:`HARNESS`, long responses, and
  :data:`SHORT`), each twice (every run in order, then again, a whole pass apart), the mean kept; per phase, the
  measured seconds fitted to the engines' costs times a factor plus a fixed cost per call give each path's
  factors and call costs, the rest of the step its fixed cost (``overhead``). ``overhead=False`` skips them (tests, quick looks).

Each device kind is measured once per thread count a placement can give a rank: 1 thread and all cores.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from relayrl.planner.profile import Affine, DecodeCost, DeviceProfile, Overhead, PathCost, Profile, RewardCost

__all__ = ["calibrate", "cores"]

REPO = Path(__file__).resolve().parents[2]


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _best(fn: Callable[[], object], reps: int) -> float:
    """The median time of ``reps`` calls after one untimed call (on a shared machine the median is what a run
    sees; the minimum would be the cost without interference, which runs there do not get)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _fit(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares of the relative error (each row weighted by 1 / its measured time: a 20 ms call counts
    as much as a 2 s one, so the per-call cost of small calls is not lost in the large ones) with
    non-negative coefficients (a coefficient that comes out negative is dropped and the rest refitted). A row
    measured at or below zero (a difference of two timings that noise on a loaded machine reversed) is left
    out: weighted by 1 / its time it would outweigh every other row."""
    a = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    if (y > 0).any():
        a, y = a[y > 0], y[y > 0]
    w = 1.0 / np.maximum(y, 1e-9)
    a, y = a * w[:, None], y * w
    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0] * a.shape[1]
            for i, c in zip(keep, coef):
                out[i] = max(0.0, float(c))
            return out
        keep.pop(int(np.argmin(coef)))


def _load(model_dir: str | None):
    from relayrl.models.load import load_model, load_tokenizer
    from relayrl.models.tiny import build_tiny

    path = model_dir or str(build_tiny(verbose=False))
    return path, load_model(path, attn_implementation="auto"), load_tokenizer(path)


def _prompts(tok, count: int, length: int) -> list[list[int]]:
    ids = [i for i in range(tok.vocab_size) if i not in (tok.eos_token_id, tok.pad_token_id)]
    return [[ids[(7 * p + 3 * j) % len(ids)] for j in range(length)] for p in range(count)]


def _device(model_dir: str, threads: int, reps: int, prompt_len: int) -> tuple[DeviceProfile, dict]:
    import copy

    from relayrl.engines.generation.base import SamplingParams
    from relayrl.engines.generation.native import NativeGenerationEngine
    from relayrl.engines.training.base import SequenceBatch
    from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
    from relayrl.models.load import load_model, load_tokenizer
    from relayrl.workflows.losses import SFTLoss

    torch.set_num_threads(threads)
    tok = load_tokenizer(model_dir)
    eng = NativeGenerationEngine(load_model(model_dir, attn_implementation="auto"), tok, device="cpu")
    gen = torch.Generator().manual_seed(0)
    run = lambda prompts, n, length: eng.generate(  # noqa: E731
        prompts, SamplingParams(n=n, max_new_tokens=length, ignore_eos=True), generator=gen)
    xs, ys = [], []
    l1, l2 = 8, 40
    for rows in (8, 32, 128):
        prompts = _prompts(tok, rows // 8, prompt_len)
        t1 = _best(lambda: run(prompts, 8, l1), reps)
        t2 = _best(lambda: run(prompts, 8, l2), reps)
        per = (t2 - t1) / (l2 - l1)
        xs.append([1.0, rows, rows * (prompt_len + (l1 + l2) / 2)])
        ys.append(per)
    xs.append([1.0, 32, 32 * (prompt_len + 136)])  # a long context
    prompts = _prompts(tok, 4, prompt_len + 130)
    ys.append((_best(lambda: run(prompts, 8, 40), reps) - _best(lambda: run(prompts, 8, 8), reps)) / 32)
    base, row, row_ctx = _fit(xs, ys)
    pre_x, pre_y = [], []
    for count in (1, 8, 32):
        prompts = _prompts(tok, count, prompt_len)
        pre_x.append([1.0, count * prompt_len])
        pre_y.append(_best(lambda: run(prompts, 1, 1), reps))
    prefill = _fit(pre_x, pre_y)

    model = load_model(model_dir, attn_implementation="auto")
    train = TorchTrainingEngine(copy.deepcopy(model), TrainEngineConfig(), total_steps=1000, device="cpu")
    loss = SFTLoss()
    tx, ty, lx, ly, opt = [], [], [], [], []
    # batches shaped as the pipeline's: groups of 8 responses sharing their prompt (one packed unit each),
    # from one group of short responses (a streamed chunk) to a whole batch of long ones
    for groups, resp in ((1, 4), (1, 16), (4, 8), (8, 16), (8, 32)):
        rows = 8 * groups
        prompts = [torch.tensor(p) for p in _prompts(tok, groups, prompt_len) for _ in range(8)]
        responses = [torch.tensor(p[:resp] * (resp // len(p[:resp]) + 1))[:resp] for p in _prompts(tok, rows, 4 * resp)]
        batch = SequenceBatch(prompts, responses, groups=[i // 8 for i in range(rows)])
        tokens = groups * prompt_len + rows * (resp - 1)  # what the engine feeds and the simulator counts: a
        # group's prompt once, each response without its last token (PackUnit.feed_last)

        def step():
            train.begin_accumulation()
            train.accumulate(batch, loss)
            return train

        fwd_bwd = []
        step()
        train.finish_accumulation()
        for _ in range(max(reps, 3)):
            t = time.perf_counter()
            step()
            fwd_bwd.append(time.perf_counter() - t)
            t = time.perf_counter()
            train.finish_accumulation()
            opt.append(time.perf_counter() - t)
        tx.append([1.0, tokens])
        ty.append(statistics.median(fwd_bwd))
        lx.append([1.0, tokens])
        ly.append(_best(lambda: train.logprobs(batch), max(reps, 3)))
    dev = DeviceProfile(kind="cpu", threads=threads, memory_gib=_memory_gib() / max(1, cores()) * threads,
                        decode=DecodeCost(base_s=base, row_s=row, row_ctx_s=row_ctx),
                        prefill=Affine(base_s=prefill[0], per_s=prefill[1]),
                        train=Affine(base_s=_fit(tx, ty)[0], per_s=_fit(tx, ty)[1]),
                        logprob=Affine(base_s=_fit(lx, ly)[0], per_s=_fit(lx, ly)[1]),
                        optimizer_s=statistics.median(opt))
    return dev, {"engine": eng, "train": train}


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 8.0


def _relay(engine, train, reps: int) -> Affine:
    from relayrl.weights.relay import WeightRelay

    relay = WeightRelay()
    weights = train.named_weights()
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    version = iter(range(1, 10**6))
    relay.push(weights, [engine], next(version))  # the layout is built once
    t = _best(lambda: relay.push(weights, [engine], next(version)), reps)
    return Affine(base_s=0.0, per_s=t / nbytes)


def _dock(reps: int) -> tuple[Affine, Affine]:
    from relayrl.dock import Dock

    dock = Dock(units=1, backend="local")
    px, py, gx, gy = [], [], [], []
    try:
        for i, rows in enumerate((8, 64, 256)):
            data = {"prompt_ids": [torch.arange(12)] * rows, "response_ids": [torch.arange(24)] * rows}
            puts = []
            for r in range(reps):
                name = f"cal{i}-{r}"
                dock.open_partition(name, rows)
                t = time.perf_counter()
                idx = dock.put(name, data)
                puts.append(time.perf_counter() - t)
                t = time.perf_counter()
                dock.get(name, idx, ["prompt_ids", "response_ids"])
                gy.append(time.perf_counter() - t)
                gx.append([1.0, rows])
                dock.close_partition(name)
            px.append([1.0, rows])
            py.append(min(puts))
    finally:
        dock.shutdown()
    put = _fit(px, py)
    get = _fit(gx, gy)
    return Affine(base_s=put[0], per_s=put[1]), Affine(base_s=get[0], per_s=get[1])


_GLOO = """
import sys, time, torch, torch.distributed as dist
rank, port, nbytes = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
out = {}
for size in (nbytes // 16, nbytes):
    x = torch.ones(size // 8)
    parts = [torch.empty_like(x) for _ in range(2)]
    best = 1e9
    for _ in range(4):
        dist.barrier(); t = time.perf_counter(); dist.all_gather(parts, x); best = min(best, time.perf_counter() - t)
    out[size] = best
if rank == 0:
    print(out[nbytes // 16], out[nbytes])
dist.destroy_process_group()
"""


def _collective(nbytes: int) -> Affine:
    """gloo all-gather between two processes of one thread each: moving ``nbytes`` (the weights in fp32) and a
    sixteenth of it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO, str(r), str(port), str(nbytes)], stdout=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("calibration: the gloo all-gather between two processes failed")
    small, big = map(float, outs[0].split())
    per = max(0.0, (big - small) / (nbytes - nbytes // 16))
    return Affine(base_s=max(0.0, small - per * nbytes / 16), per_s=per)


def _reward(fn_path: str, reps: int) -> RewardCost:
    from relayrl.engines.reward import RewardConfig, RewardEngine

    if fn_path == "task":
        from relayrl.data.tasks import make_task

        engine = RewardEngine(RewardConfig(verifier="task"), task=make_task("arith"))
    else:
        engine = RewardEngine(RewardConfig(verifier="user", user_fn=fn_path), task=None)
    # a field a function needs (a TRL reward function's solution column) holds the answer here
    need = engine.fields_needed
    xs, ys = [], []
    for rows in (1, 8, 32):
        prompts, responses, answers = ["1+2="] * rows, ["3"] * rows, ["3"] * rows
        fields = [{"prompt": "1+2=", **{k: "3" for k in need}}] * rows
        xs.append([1.0, rows])
        ys.append(_best(lambda: engine.score(prompts, responses, answers, columns=fields), reps))
    call, row = _fit(xs, ys)
    return RewardCost(fn=fn_path, call_s=call, row_s=row)


HARNESS = ["trainer.steps=16", "eval.every=0", "eval.size=10", "run.save_every=0", "rollout.max_new_tokens=16",
           "data.prompts_per_step=4", "rollout.n=8", "telemetry.sinks=[jsonl]", "model.device=cpu", "run.seed=0"]
"""The calibration workload of the driver paths: the recipe's tiny default model, untrained (its responses
mostly run to the 16-token limit), 4 prompts x 8 responses, the task's verifier, steps 3-16 averaged."""
SHORT = ["rollout.max_new_tokens=4", "data.prompts_per_step=8"]
"""The second calibration workload, on top of :data:`HARNESS`: twice the prompts and a quarter of the tokens,
so that a path's fixed cost per call and its factor on the engines' costs can be told apart."""


def _path_runs() -> dict[str, tuple[object, list[str]]]:
    from relayrl.planner.placement import Placement

    out = {"colocated": (Placement("sync-colocated", main=1), [f"run.threads={cores()}"]),
           "dataflow": (Placement("sync-split", main=1, gen=1), ["placement.pools.gen=1", "placement.rollout=gen"])}
    if cores() > 1:
        out["periodic"] = (Placement("periodic", main=1, gen=1), ["placement.pools.gen=1", "placement.rollout=gen",
                                                                  "trainer.mode=periodic"])
        out["colocated_dp"] = (Placement("sync-colocated", main=cores()), [f"cluster.devices={cores()}"])
        out["concurrent"] = (Placement("offpolicy", main=1, gen=1, k=1), [
            "placement.pools.gen=1", "placement.rollout=gen", "trainer.off_policy_steps=1", "algorithm.tis_cap=2.0"])
    return out


def _run_path(extra: list[str], run_dir: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "relayrl.cli.main", "train", str(REPO / "recipes" / "arith_grpo.yaml"),
           f"run.dir={run_dir}", *HARNESS, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"calibration: the run {' '.join(extra)} failed:\n{proc.stderr[-2000:]}")
    from relayrl.telemetry.sinks import METRICS_FILE

    rows = [json.loads(x) for x in (run_dir / METRICS_FILE).read_text().splitlines() if x.strip()]
    steps = [r for r in rows if r.get("step", 0) > 2 and "perf/step_time_s" in r]
    return {k: statistics.mean(r.get(m, 0.0) for r in steps) for k, m in
            (("step", "perf/step_time_s"), ("generate", "timing/generate_s"), ("update", "timing/update_s"))}


def _overlap(profile: Profile, w, placement) -> tuple[float, float]:
    """Overlap shares of the calibration workload's pools (zero reward latency, 8 steps)."""
    import random

    from relayrl.planner.simulate import overlap_shares

    rng = random.Random(0)
    batches = []
    for _ in range(8):
        lengths = w.lengths.draw(rng, w.rows)
        batches.append(([lengths[i * w.n:(i + 1) * w.n] for i in range(w.prompts)], [[0.0] * w.n] * w.prompts))
    return overlap_shares(profile, w, placement, batches)


def _terms(profile: Profile, w, placement, name: str) -> dict[str, tuple[float, float]]:
    """Per phase (generate, update): (what the engines' costs predict, how many fixed calls it pays) on the
    calibration workload ``w``: the simulator is linear in a path's factor and its fixed costs."""
    from relayrl.planner.simulate import simulate

    bare = profile.model_copy(update={"overhead": Overhead()})
    ones = profile.model_copy(update={"overhead": Overhead(**{name: PathCost(call_s=1.0, generate_call_s=1.0)})})
    e = simulate(bare, w, placement, steps=8, warmup=2).phases
    n = simulate(ones, w, placement, steps=8, warmup=2).phases
    return {k: (e[k], n[k] - e[k]) for k in ("generate", "update")}


def calibration_order(paths: list[str], workloads: list[str], passes: int) -> list[tuple[int, str, str]]:
    """The order of the calibration runs, as (pass, path, workload): every (path, workload) once per pass, each
    pass in the same order, so that the samples of one run are a whole pass apart."""
    return [(i, name, label) for i in range(passes) for name in paths for label in workloads]


def _overhead(profile: Profile, log: Callable[[str], None], passes: int = 2) -> Overhead:
    """Per driver path: short real runs on the two calibration workloads (:data:`HARNESS`, and with
    :data:`SHORT`), every run ``passes`` times and the mean kept: all in order, then all again in the same order,
    so that each run's samples are a whole pass apart (3 minutes on 2 cores) and a slow patch of a shared
    machine rarely takes both (in reverse order, the last run's two samples were back to back, and one slow
    patch made the off-policy path 25% slower than every run after it). For each phase the measured seconds are
    fitted to ``factor x engine cost + fixed cost x calls`` over the two workloads (relative least squares,
    non-negative); what the step has beyond the fitted phases is the path's per-step cost. Periodic runs give
    the streamed update's cost per chunk beyond the dataflow's fit (``chunk_s``, over both workloads; negative
    down to minus the dataflow's call cost); the concurrent factors (an off-policy run, both pools busy at
    once) are the mean over its two workloads, its fixed costs taken as the dataflow's."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.planner.from_config import workload_from_config
    from relayrl.planner.simulate import simulate

    paths: dict[str, PathCost] = {}
    chunk_s = 0.0
    with tempfile.TemporaryDirectory(prefix="relayrl-plan-") as tmp:
        torch.set_num_threads(1)
        shapes = {}
        for label, over in (("long", []), ("short", SHORT)):
            cfg = load_config(Config, REPO / "recipes" / "arith_grpo.yaml", [*HARNESS, *over, f"run.dir={tmp}/w"])
            shapes[label] = (workload_from_config(cfg, lengths="measure", measure_prompts=32), over)
        path_runs = _path_runs()
        measured: dict[tuple[str, str], list[dict[str, float]]] = {(n, lb): [] for n in path_runs for lb in shapes}
        for i, name, label in calibration_order(list(path_runs), list(shapes), passes):
            extra = path_runs[name][1]
            log(f"relayrl plan: a short run of the {name} path, {label} responses ({' '.join(extra)})"
                + (f", pass {i + 1} of {passes}" if passes > 1 else "") + " ...")
            m = _run_path([*shapes[label][1], *extra], Path(tmp) / f"{name}-{label}-{i}")
            log("relayrl plan:   " + ", ".join(f"{k} {m[k]:.3f} s" for k in ("generate", "update"))
                + f", step {m['step']:.3f} s")
            measured[name, label].append(m)
        for name, (placement, _) in path_runs.items():
            runs = []
            for label, (w, _) in shapes.items():
                terms = _terms(profile, w, placement, "dataflow" if name in ("periodic", "concurrent") else name)
                meas = {k: statistics.mean(m[k] for m in measured[name, label]) for k in measured[name, label][0]}
                log(f"relayrl plan: {name} path, {label} responses: " + ", ".join(
                    f"{k} {meas[k]:.3f} s (engines {terms[k][0]:.3f} s)" for k in ("generate", "update"))
                    + f", step {meas['step']:.3f} s")
                runs.append((w, terms, meas))
            if name == "periodic":  # the streamed update's extra cost per chunk, on the dataflow's fit
                flow = profile.model_copy(update={"overhead": Overhead(dataflow=paths["dataflow"])})
                extra_s = [(meas["update"] - simulate(flow, w, placement, steps=8, warmup=2).phases["update"],
                            w.prompts / w.stream_groups) for w, _, meas in runs]
                # (negative when the whole-batch runs' call cost overstates a streamed chunk's)
                fit = sum(e * c for e, c in extra_s) / sum(c * c for _, c in extra_s)
                chunk_s = max(-paths["dataflow"].call_s, fit)
                continue
            if name == "concurrent":  # extrapolate to both pools busy all the time from each run's overlap
                flow = paths["dataflow"]
                factors = []
                for w, terms, meas in runs:
                    fg, ft = _overlap(profile.model_copy(update={"overhead": Overhead(dataflow=flow)}), w, placement)
                    update = meas["update"] - chunk_s * w.prompts / w.stream_groups
                    gen = max(1e-3, meas["generate"] - flow.generate_call_s * terms["generate"][1]) / terms["generate"][0]
                    train = max(1e-3, update - flow.call_s * terms["update"][1]) / terms["update"][0]
                    factors.append((flow.generate + (gen - flow.generate) / max(fg, 0.25),
                                    flow.train + (train - flow.train) / max(ft, 0.25)))
                paths[name] = flow.model_copy(update={"generate": statistics.mean(f[0] for f in factors),
                                                      "train": statistics.mean(f[1] for f in factors)})
                continue
            gen, gen_call = _fit([list(t["generate"]) for _, t, _ in runs], [m["generate"] for _, _, m in runs])
            train, call = _fit([list(t["update"]) for _, t, _ in runs], [m["update"] for _, _, m in runs])
            cost = PathCost(generate=max(gen, 1e-3), train=max(train, 1e-3), call_s=call, generate_call_s=gen_call)
            fitted = profile.model_copy(update={"overhead": Overhead(**{name: cost})})
            rest = [m["step"] - simulate(fitted, w, placement, steps=8, warmup=2).step_s for w, _, m in runs]
            paths[name] = cost.model_copy(update={"step_s": max(0.0, statistics.mean(rest))})
    return Overhead(**paths, chunk_s=chunk_s)


def calibrate(model_dir: str | None = None, *, reward_fn: str = "task", reps: int = 3, prompt_len: int = 12,
              overhead: bool = True, log: Callable[[str], None] = print) -> Profile:
    """Measure a profile of this machine (see the module docstring); ``model_dir`` is the model the costs
    are measured with (default: the tiny model)."""
    t0 = time.perf_counter()
    path, model, tok = _load(model_dir)
    from relayrl.planner.workload import ModelShape

    shape = ModelShape.from_hf_config(model.config)
    n_params = sum(p.numel() for p in model.parameters())
    devices, handles = {}, {}
    for threads in sorted({1, cores()}):
        log(f"relayrl plan: calibrating with {threads} thread(s): decode, prefill, train, log-probs ...")
        devices[f"cpu-t{threads}"], handles = _device(path, threads, reps, prompt_len)
    torch.set_num_threads(1)
    log("relayrl plan: calibrating the weight relay, the dock, a gloo all-gather, the reward ...")
    relay = _relay(handles["engine"], handles["train"], reps)
    put, get = _dock(reps)
    coll = _collective(n_params * 4)
    reward = _reward(reward_fn, reps)
    profile = Profile(
        name=f"cpu-{cores()}core (calibrated)",
        source=f"relayrl plan --profile on {socket.gethostname()} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
               f", model {path}",
        cores=cores(), model_params=n_params, model_layers=shape.layers, model_hidden=shape.hidden,
        model_kv_dim=shape.kv_dim, devices=devices, relay=relay, dock_put=put, dock_get=get, collective=coll,
        reward=reward)
    if overhead:
        profile = profile.model_copy(update={"overhead": _overhead(profile, log)})
    log(f"relayrl plan: calibrated in {time.perf_counter() - t0:.0f} s")
    return profile
