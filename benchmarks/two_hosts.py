"""GRPO on a two-host Ray cluster against one host, the same job: step time, weight relay across the link,
dock put/get across the link, and a run that loses its rollout host mid-way.

The two hosts are network namespaces of this machine joined by a virtual ethernet pair, each running a Ray
node (``tests/cluster/two_hosts.py``; needs root). The driver runs on the head host. Runs, all from the
demo's SFT model with the same seed, ``trainer.mode=periodic`` with the rollout on a pool of its own:

* ``one host``: both pools pinned to the head (``placement.nodes.main`` = ``placement.nodes.gen`` = head);
* ``two hosts``: the rollout pinned to the other host, so every weight update crosses the link (Ray's
  object store) and every sample goes rollout host -> storage unit -> trainer;
* ``two hosts, host lost``: the same with ``run.max_restarts=1``; the rollout host is killed after a random
  step and joins again 3 s later; the run resumes from its last checkpoint (``run.save_every``) and finishes.

Dock: 2048 samples (13 MB, ``dock_flow.py``'s workload) written by four producer actors on the head host
into one storage unit and read back by the driver, the unit on the head host (one host) or on the other host
(both the puts and the gets cross the link). Figures are printed, not asserted. Run (as root):
``.venv/bin/python benchmarks/two_hosts.py [--steps 100]``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
FIXTURE = REPO / "tests" / "cluster"
for p in (REPO, HERE, FIXTURE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from demo_models import sft_model  # noqa: E402
from two_hosts import TwoHosts, start_two_hosts, usable  # noqa: E402


def grpo_cmd(hosts: TwoHosts, model: Path, run_dir: Path, rollout_host: str, a: argparse.Namespace,
             *extra: str) -> list[str]:
    return [sys.executable, "-m", "relayrl.cli.main", "train", str(REPO / "recipes" / "arith_grpo.yaml"),
            "cluster.backend=ray", f"cluster.ray_address={hosts.address}", "placement.pools.gen=1",
            "placement.rollout=gen", f"placement.nodes.main={hosts.head}", f"placement.nodes.gen={rollout_host}",
            "trainer.mode=periodic", f"trainer.init_from={model}", f"trainer.steps={a.steps}",
            f"eval.every={a.eval_every}", f"eval.size={a.eval_size}", f"run.save_every={a.save_every}",
            f"run.seed={a.seed}", "run.threads=1", f"run.dir={run_dir}", "telemetry.sinks=[jsonl]", *extra]


def summary(run_dir: Path, warmup: int = 2) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "perf/step_time_s" in r and r["step"] > warmup]
    relayed = [r for r in steps if r.get("relay/time_s", 0) > 0]
    return {"step_s": statistics.mean(r["perf/step_time_s"] for r in steps),
            "relay_mb_s": sum(r["relay/bytes"] for r in relayed) / 1e6 / max(sum(r["relay/time_s"] for r in relayed), 1e-9),
            "relay_mb": statistics.mean(r["relay/bytes"] for r in relayed) / 1e6 if relayed else 0.0,
            "driver_bytes": max(r.get("dock/driver_bytes", 0) for r in steps),
            "accuracy": [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r],
            "restarts": max((r.get("run/restarts", 0) for r in rows), default=0)}


def run_grpo(hosts: TwoHosts, cmd: list[str]) -> None:
    out = hosts.run(cmd, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"two_hosts: run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return max((json.loads(x)["step"] for x in path.read_text().splitlines() if "perf/step_time_s" in x), default=0)


def run_losing_host(hosts: TwoHosts, cmd: list[str], run_dir: Path, kill_after: int) -> None:
    proc = subprocess.Popen(hosts.exec("head", cmd), env={**os.environ, **hosts.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        while steps_done(run_dir) < kill_after:
            if proc.poll() is not None:
                raise SystemExit(f"two_hosts: the run ended before step {kill_after}:\n{proc.stdout.read()[-3000:]}")
            time.sleep(0.5)
        print(f"two_hosts: killing the rollout host after step {kill_after}", flush=True)
        hosts.kill_node("worker")
        time.sleep(3)
        hosts.start_node("worker")
        out, _ = proc.communicate(timeout=3600)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise SystemExit(f"two_hosts: the run did not survive the lost host:\n{out[-3000:]}")


DOCK = """
import json, sys, statistics
import ray
import dock_flow as df
from relayrl.dock import Dock
address, producer_node, unit_node, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
producers = [df.Producer.options(resources={f"node:{producer_node}": 1e-3}).remote(p) for p in range(df.PRODUCERS)]
dock = Dock(units=1, backend="ray", ray_address=address, nodes=(unit_node,), lease_s=60)
res = [df.step_dock_procs(dock, producers, s) for s in range(steps + 1)][1:]
print(json.dumps({"put_s": statistics.median(r.put_s for r in res), "get_s": statistics.median(r.get_s for r in res),
                  "mb": df.nbytes(df.make_workload()) / 1e6}))
"""


def dock_across(hosts: TwoHosts, unit_host: str, steps: int) -> dict:
    out = hosts.run([sys.executable, "-c", textwrap.dedent(DOCK), hosts.address, hosts.head, unit_host, str(steps)],
                    timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"two_hosts: dock measurement failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dock-steps", type=int, default=3)
    a = ap.parse_args()
    why = usable()
    if why:
        raise SystemExit(f"two_hosts: {why}")
    model = sft_model(a.seed)
    hosts = start_two_hosts({"PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), str(FIXTURE)]),
                             "RELAYRL_CACHE": str(model.parents[2])})
    res: dict[str, dict] = {}
    try:
        print(f"two_hosts: head {hosts.head}, worker {hosts.worker}", flush=True)
        with tempfile.TemporaryDirectory(prefix="two_hosts-") as tmp:
            for name, host in (("one host", hosts.head), ("two hosts", hosts.worker)):
                print(f"two_hosts: GRPO, {name} ({a.steps} steps) ...", flush=True)
                run_dir = Path(tmp) / name.replace(" ", "_")
                run_grpo(hosts, grpo_cmd(hosts, model, run_dir, host, a))
                res[name] = summary(run_dir)
            kill_after = random.Random(a.seed).randint(a.steps // 5, 4 * a.steps // 5)
            print(f"two_hosts: GRPO, two hosts, the rollout host lost after step {kill_after} ...", flush=True)
            run_dir = Path(tmp) / "lost"
            run_losing_host(hosts, grpo_cmd(hosts, model, run_dir, hosts.worker, a, "run.max_restarts=1",
                                            "cluster.start_timeout_s=300"), run_dir, kill_after)
            res["two hosts, host lost"] = summary(run_dir)
        dock = {name: dock_across(hosts, host, a.dock_steps) for name, host in (("one host", hosts.head),
                                                                                ("two hosts", hosts.worker))}
    finally:
        hosts.close()
    print(f"\n{'run':<22}{'step s':>8}{'relay MB/s':>11}{'driver B':>9}{'restarts':>9}  held-out accuracy by step")
    for name, r in res.items():
        traj = " ".join(f"{s}:{100 * x:.1f}%" for s, x in r["accuracy"])
        print(f"{name:<22}{r['step_s']:>8.3f}{r['relay_mb_s']:>11.1f}{r['driver_bytes']:>9.0f}{r['restarts']:>9}  {traj}")
    for name, d in dock.items():
        print(f"dock, unit on {'the head' if name == 'one host' else 'the other host'}: {d['mb']:.1f} MB put "
              f"{d['put_s']:.3f} s ({d['mb'] / d['put_s']:.0f} MB/s), get {d['get_s']:.3f} s "
              f"({d['mb'] / d['get_s']:.0f} MB/s)")
    one, two, lost = res["one host"], res["two hosts"], res["two hosts, host lost"]
    print(f"two_hosts: step time two/one host {two['step_s'] / one['step_s']:.2f}; relay {two['relay_mb_s']:.0f} MB/s "
          f"across the link ({one['relay_mb_s']:.0f} on one host); dock put/get across the link "
          f"{dock['two hosts']['put_s']:.2f}/{dock['two hosts']['get_s']:.2f} s "
          f"({dock['one host']['put_s']:.2f}/{dock['one host']['get_s']:.2f} on one host); host lost after step "
          f"{kill_after}: accuracy {100 * lost['accuracy'][-1][1]:.1f}% vs {100 * two['accuracy'][-1][1]:.1f}% "
          f"uninterrupted")


if __name__ == "__main__":
    main()
