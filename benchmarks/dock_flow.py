"""One GRPO step's sample flow through the dock, a centralized buffer and TransferQueue.

Workload: 2048 samples (128 prompts x 16 responses), prompt length ~U(32,128),
response length ~U(64,512). Four producer threads fill the columns stage by
stage (prompt+response ids, then old log-probs, then reference log-probs,
then per-token advantages), each in puts of 128 rows (8 prompts); then an
update stage reads all columns in batches of 256 and acknowledges them.

Systems, same workload, same process, same Ray cluster:
* ``dock/local``: relayrl dock, in-process units (1, 2, 4).
* ``dock/ray``: relayrl dock, units as Ray actors (1, 2, 4).
* ``centralized``: one Ray actor holding everything; a put ships one flat
  numpy buffer + lengths per column, a get returns the same.
* ``... procs``: the same puts made by four producer processes (Ray actors,
  as rollout workers would be) instead of driver threads: they write straight
  into the dock's units (``Slots.write``; the driver reserves rows and
  publishes the receipts) or into the centralized actor. The driver then no
  longer packs every put, which is what limits the thread runs.
* ``transferqueue``: PyPI ``transferqueue`` 0.1.11 (AsyncFlow's TransferQueue),
  SimpleStorage with 1 unit, polling-mode controller, ragged
  columns as jagged nested tensors.

Put time is the wall time of all four producers; get time the wall time of
the update stage's loop; "busy" the machine's CPU time over the step's wall
time (all processes: driver, Ray, units), which shows when the machine rather
than the store limits a step. Figures are printed, not asserted. Run:
``.venv/bin/python benchmarks/dock_flow.py [--steps 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import ray
import torch

from relayrl.dock import Dock
from relayrl.dock.columns import normalize_column, pack

PROMPTS, N = 128, 16
ROWS = PROMPTS * N
PRODUCERS, CHUNK_PROMPTS, BATCH = 4, 8, 256
PHASES = [("prompt_ids", "response_ids"), ("old_logprobs",), ("ref_logprobs",), ("advantages",)]
ALL_COLUMNS = [c for ph in PHASES for c in ph]


def make_workload(seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """Row-ordered columns: prompt/response ids int64, log-probs and advantages float32 per response token."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(32, 129, (PROMPTS,), generator=g).tolist()
    rlen = torch.randint(64, 513, (ROWS,), generator=g).tolist()
    prompts = [torch.randint(0, 32000, (n,), generator=g) for n in plen]
    cols: dict[str, list[torch.Tensor]] = {c: [] for c in ALL_COLUMNS}
    for r, n in enumerate(rlen):
        cols["prompt_ids"].append(prompts[r // N])
        cols["response_ids"].append(torch.randint(0, 32000, (n,), generator=g))
        for c in ("old_logprobs", "ref_logprobs", "advantages"):
            cols[c].append(torch.randn(n, generator=g))
    return cols


def nbytes(cols: dict[str, list[torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for v in cols.values() for t in v)


def busy_cpu_s() -> float | None:
    """CPU seconds all processes of this machine have used since boot (Linux ``/proc/stat``), else None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    name: str
    put_s: float
    get_s: float
    put_lat: list[float] = field(default_factory=list)
    get_lat: list[float] = field(default_factory=list)
    cores: float | None = None  # machine-wide CPU seconds per wall second during the step

    @property
    def total(self) -> float:
        return self.put_s + self.get_s


def chunks_of(p: int) -> list[list[int]]:
    """Row numbers (workload order) of producer ``p``'s puts."""
    lo = p * (PROMPTS // PRODUCERS) * N
    per = CHUNK_PROMPTS * N
    return [list(range(s, s + per)) for s in range(lo, lo + (PROMPTS // PRODUCERS) * N, per)]


def run_producers(put_new, put_cols, cols) -> tuple[float, list[float]]:
    """Four producer threads; ``put_new(chunk_cols) -> handle``, ``put_cols(handle, chunk_cols)``."""
    lat: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def producer(p: int) -> None:
        try:
            handles = []
            for k, phase in enumerate(PHASES):
                for j, rows in enumerate(chunks_of(p)):
                    data = {c: [cols[c][r] for r in rows] for c in phase}
                    t = time.perf_counter()
                    if k == 0:
                        handles.append(put_new(data))
                    else:
                        put_cols(handles[j], data)
                    with lock:
                        lat.append(time.perf_counter() - t)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(PRODUCERS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, lat


# --- systems ------------------------------------------------------------------------------
def step_dock(dock: Dock, cols, step: int) -> Result:
    part = f"step-{step}"
    dock.open_partition(part, rows=ROWS, group_size=N)
    put_s, put_lat = run_producers(lambda d: dock.put(part, d), lambda h, d: dock.put(part, d, indexes=h), cols)
    get_s, get_lat = read_all(dock, part)
    dock.close_partition(part)
    return Result("", put_s, get_s, put_lat, get_lat)


@ray.remote(num_cpus=0)
class CentralBuffer:
    """Baseline: every row of every column in one actor; flat buffer + lengths per column on the wire."""

    def __init__(self) -> None:
        self.rows = 0
        self.cols: dict[str, dict] = {}

    def put(self, columns: dict, indexes: np.ndarray | None) -> np.ndarray:
        if indexes is None:
            n = len(next(iter(columns.values()))[1])
            indexes = np.arange(self.rows, self.rows + n)
            self.rows += n
        for c, (flat, lengths) in columns.items():
            st = self.cols.setdefault(c, {"chunks": [], "where": {}})
            ends = np.cumsum(lengths)
            k = len(st["chunks"])
            st["chunks"].append(flat)
            for i, e, ln in zip(indexes.tolist(), ends.tolist(), lengths.tolist()):
                st["where"][i] = (k, e - ln, e)
        return indexes

    def get(self, columns: list[str], indexes: list[int]) -> dict:
        out = {}
        for c in columns:
            st = self.cols[c]
            parts = [st["chunks"][k][s:e] for k, s, e in (st["where"][i] for i in indexes)]
            out[c] = (np.concatenate(parts), np.array([len(p) for p in parts]))
        return out

    def clear(self) -> None:
        self.rows, self.cols = 0, {}


def central_reads(buf) -> tuple[float, list[float]]:
    get_lat = []
    t0 = time.perf_counter()
    for s in range(0, ROWS, BATCH):
        t = time.perf_counter()
        got = ray.get(buf.get.remote(ALL_COLUMNS, list(range(s, s + BATCH))))
        batch = {c: torch.from_numpy(np.array(flat)).split(ln.tolist()) for c, (flat, ln) in got.items()}
        assert len(batch["response_ids"]) == BATCH
        get_lat.append(time.perf_counter() - t)
    get_s = time.perf_counter() - t0
    ray.get(buf.clear.remote())
    return get_s, get_lat


def step_central(buf, cols) -> Result:
    put_s, put_lat = run_producers(lambda d: ray.get(buf.put.remote(ship(d), None)),
                                   lambda h, d: ray.get(buf.put.remote(ship(d), h)), cols)
    get_s, get_lat = central_reads(buf)
    return Result("", put_s, get_s, put_lat, get_lat)


def ship(d: dict) -> dict:
    """A put of the centralized buffer: one flat numpy buffer + lengths per column."""
    out = {}
    for c, v in d.items():
        rows, schema, lengths = normalize_column(c, v, None)
        pk = pack(rows, schema, lengths)
        out[c] = (pk.flat, pk.lengths)
    return out


@ray.remote(num_cpus=0)
class Producer:
    """A rollout worker in its own process: it holds its share of the samples and writes them itself."""

    def __init__(self, p: int) -> None:
        torch.set_num_threads(1)
        self.p, self.cols = p, make_workload()

    def _puts(self):
        for k, phase in enumerate(PHASES):
            for j, rows in enumerate(chunks_of(self.p)):
                yield k, j, {c: [self.cols[c][r] for r in rows] for c in phase}

    def to_dock(self, slots: list):
        """Write every put into the units (``slots[j]``: the rows of chunk j); yield (receipt, seconds) per put."""
        for _, j, data in self._puts():
            t = time.perf_counter()
            receipt = slots[j].write(data)
            yield receipt, time.perf_counter() - t

    def to_central(self, buf) -> list[float]:
        handles, lat = [], []
        for k, j, data in self._puts():
            t = time.perf_counter()
            if k == 0:
                handles.append(ray.get(buf.put.remote(ship(data), None)))
            else:
                ray.get(buf.put.remote(ship(data), handles[j]))
            lat.append(time.perf_counter() - t)
        return lat


def read_all(dock: Dock, part: str) -> tuple[float, list[float]]:
    get_lat, n = [], 0
    t0 = time.perf_counter()
    loader = dock.stream(part, "update", ALL_COLUMNS, batch_size=BATCH, timeout_s=60)
    while True:
        t = time.perf_counter()
        try:
            b = next(loader)
        except StopIteration:
            break
        n += len(b.ack())
        get_lat.append(time.perf_counter() - t)
    assert n == ROWS, n
    return time.perf_counter() - t0, get_lat


def step_dock_procs(dock: Dock, producers, step: int) -> Result:
    """Producers in their own processes write to the units; the driver reserves rows and publishes receipts."""
    part = f"procs-{step}"
    dock.open_partition(part, rows=ROWS, group_size=N)
    lat: list[float] = []
    lock = threading.Lock()

    def publish(gen) -> None:  # one driver thread per producer: receipts are published as they arrive
        for ref in gen:
            receipt, dt = ray.get(ref)
            dock.publish(receipt)
            with lock:
                lat.append(dt)

    t0 = time.perf_counter()
    gens = [pr.to_dock.remote([dock.reserve(part, CHUNK_PROMPTS * N) for _ in chunks_of(p)])
            for p, pr in enumerate(producers)]
    threads = [threading.Thread(target=publish, args=(g,)) for g in gens]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    put_s = time.perf_counter() - t0
    get_s, get_lat = read_all(dock, part)
    dock.close_partition(part)
    return Result("", put_s, get_s, lat, get_lat)


def step_central_procs(buf, producers) -> Result:
    t0 = time.perf_counter()
    lat = [x for xs in ray.get([pr.to_central.remote(buf) for pr in producers]) for x in xs]
    put_s = time.perf_counter() - t0
    get_s, get_lat = central_reads(buf)
    return Result("", put_s, get_s, lat, get_lat)


def tq_start(units: int):
    import logging

    import transfer_queue as tq
    from omegaconf import OmegaConf

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("transfer_queue"):
            logging.getLogger(name).setLevel(logging.ERROR)

    conf = OmegaConf.create({"controller": {"polling_mode": True},
                             "backend": {"SimpleStorage": {"num_data_storage_units": units}}})
    tq.init(conf)
    return tq, tq.get_client()


def step_tq(client, cols, step: int) -> Result:
    from tensordict import TensorDict

    part = f"step-{step}"

    def td(d):
        n = len(next(iter(d.values())))
        return TensorDict({c: torch.nested.as_nested_tensor(v, layout=torch.jagged) for c, v in d.items()}, batch_size=[n])

    put_s, put_lat = run_producers(lambda d: client.put(td(d), partition_id=part),
                                   lambda h, d: client.put(td(d), metadata=h), cols)
    get_lat, n = [], 0
    t0 = time.perf_counter()
    while n < ROWS:
        t = time.perf_counter()
        meta = client.get_meta(data_fields=ALL_COLUMNS, batch_size=BATCH, partition_id=part, mode="fetch",
                               task_name="update")
        if meta.size == 0:
            continue  # polling mode: not enough ready rows yet (all are ready here)
        data = client.get_data(meta)
        n += data.batch_size[0]
        get_lat.append(time.perf_counter() - t)
    get_s = time.perf_counter() - t0
    client.clear_partition(part)
    return Result("", put_s, get_s, put_lat, get_lat)


# --- driver -------------------------------------------------------------------------------
def measure_all(systems: list[tuple[str, str, object]], steps: int) -> dict[str, Result]:
    """Warm each system up, then run ``steps`` rounds visiting every system once per round
    (interleaved, so drift of a shared machine hits all systems alike); keep each one's median step."""
    runs: dict[str, list[Result]] = {key: [] for key, _, _ in systems}
    for _, _, fn in systems:
        fn(-1)
    for s in range(steps):
        for key, _, fn in systems:
            c0, t0 = busy_cpu_s(), time.perf_counter()
            r = fn(s)
            c1, t1 = busy_cpu_s(), time.perf_counter()
            r.cores = None if c0 is None else (c1 - c0) / (t1 - t0)
            runs[key].append(r)
    out = {}
    for key, name, _ in systems:
        r = sorted(runs[key], key=lambda r: r.total)[len(runs[key]) // 2]
        r.name = name
        out[key] = r
    return out


def report(r: Result, mb: float) -> None:
    # Cores kept busy (machine-wide CPU time over the step's wall time): near the core count, the
    # machine, not the store, limits the step, and more storage units cannot make it faster.
    cores = "" if r.cores is None else f" | busy {r.cores:4.2f} of {os.cpu_count()} cores"

    def lat(xs):
        return f"{1e3 * statistics.mean(xs):7.2f} / {1e3 * sorted(xs)[int(0.95 * (len(xs) - 1))]:7.2f}"

    print(f"{r.name:<26} put {r.put_s:6.3f}s {ROWS / r.put_s:8.0f} rows/s {mb / r.put_s:7.1f} MB/s | "
          f"get {r.get_s:6.3f}s {ROWS / r.get_s:8.0f} rows/s {mb / r.get_s:7.1f} MB/s | "
          f"put call ms mean/p95 {lat(r.put_lat)} | get call ms {lat(r.get_lat)} | total {r.total:6.3f}s{cores}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-tq", action="store_true", help="skip TransferQueue")
    ap.add_argument("--no-procs", action="store_true", help="skip the runs with producers in their own processes")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cols = make_workload()
    mb = nbytes(cols) / 1e6
    print(f"workload: {ROWS} rows, {mb:.1f} MB, {PRODUCERS} producers x {len(PHASES)} phases x puts of "
          f"{CHUNK_PROMPTS * N} rows, update batches of {BATCH}")
    # More logical CPUs than cores: TransferQueue's controller and units each reserve one.
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    systems: list[tuple[str, str, object]] = []
    docks = []
    for backend in ("local", "ray"):
        for units in (1, 2, 4):
            d = Dock(units=units, backend=backend, lease_s=60)
            docks.append(d)
            systems.append((f"{backend}{units}", f"dock/{backend} units={units}", lambda s, d=d: step_dock(d, cols, s)))
    buf = CentralBuffer.remote()
    systems.append(("central", "centralized actor", lambda s: step_central(buf, cols)))
    producers = []
    if not args.no_procs:  # the same puts from four rollout-worker processes, writing straight to the store
        producers = [Producer.remote(p) for p in range(PRODUCERS)]
        for units in (1, 2, 4):
            d = Dock(units=units, backend="ray", lease_s=60)
            docks.append(d)
            systems.append((f"procs{units}", f"dock/ray units={units} procs",
                            lambda s, d=d: step_dock_procs(d, producers, s)))
        systems.append(("central_procs", "centralized actor procs", lambda s: step_central_procs(buf, producers)))
    tq_note = ""
    if not args.no_tq:
        try:
            tq, client = tq_start(1)
            systems.append(("tq1", "transferqueue units=1", lambda s: step_tq(client, cols, s)))
        except Exception as e:  # noqa: BLE001 - report exactly why the peer could not run
            traceback.print_exc()
            tq_note = f"transferqueue could not start: {type(e).__name__}: {e}"
    try:
        res = measure_all(systems, args.steps)
    except Exception as e:  # noqa: BLE001
        if "tq1" not in [k for k, _, _ in systems]:
            raise
        traceback.print_exc()
        tq_note = f"transferqueue failed during the run: {type(e).__name__}: {e}"
        res = measure_all([s for s in systems if s[0] != "tq1"], args.steps)
    for key, _, _ in systems:
        if key in res:
            report(res[key], mb)
    if tq_note:
        print(tq_note)
    if "tq1" in res:
        tq.close()
    for d in docks:
        d.shutdown()
    for a in [buf, *producers]:
        ray.kill(a)
    if producers:
        c = res["central_procs"].total
        print(f"dock_flow (producer processes): dock/centralized time ratio P1 {res['procs1'].total / c:.2f} (1 unit), "
              f"P2 {res['procs2'].total / c:.2f}, P4 {res['procs4'].total / c:.2f} (4 units)")
    r1 = res["ray1"].total / res["central"].total
    r4 = res["ray4"].total / res["central"].total
    t1 = f"{res['ray1'].total / res['tq1'].total:.2f}" if "tq1" in res else "n/a"
    print(f"dock_flow: dock/centralized time ratio R1 {r1:.2f} (1 unit), R4 {r4:.2f} (4 units); dock/transferqueue T1 {t1}")


if __name__ == "__main__":
    main()
