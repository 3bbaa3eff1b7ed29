"""Search placements and step modes for a device count, rank them by predicted throughput, print the plan.

HybridFlow's Algorithm 1 (§6) enumerates allocations of devices to roles and parallel sizes,
simulates each and keeps the fastest; here the candidates are relayrl's placements: every role on ``main``
(the colocated loop, data parallel over all devices), or the rollout on a pool of ``g`` devices and the
actor on the other ``N - g``, each with the step modes of the dataflow (synchronous, periodic, off-policy
``k`` in {1, 2} with and without partial rollout). Candidates whose peak memory does not fit a device are
listed as infeasible and never ranked first. The ranking is by tokens per second per device (Periodic Asynchrony's
TPSPD), which for a fixed device count is the inverse of the step time per token.

Simplifications: pool sizes are searched over every split for up to 16 devices and over powers of two
beyond; no tensor or pipeline parallelism (a model must fit one device for generation, and sharded state for
training); off-policy modes are ranked on throughput alone, although they trade freshness of the samples
for it (the table says so in the mode's name).
"""

from __future__ import annotations

from typing import Iterable

from relayrl.planner.placement import Placement, Prediction
from relayrl.planner.profile import Profile
from relayrl.planner.simulate import simulate
from relayrl.planner.workload import Workload

__all__ = ["candidates", "rank", "format_plan"]


def _splits(devices: int) -> list[int]:
    if devices <= 16:
        return list(range(1, devices))
    out, g = [], 1
    while g < devices:
        out += [g] + ([devices - g] if devices - g != g else [])
        g *= 2
    return sorted({g for g in out if 0 < g < devices})


def candidates(devices: int, *, offpolicy: bool = True, cpu: bool = False, rollout_tp: int = 1) -> list[Placement]:
    """Every placement and step mode relayrl runs on ``devices`` devices. ``cpu``: a device is a share of the
    cores, so the colocated loop may also run fewer ranks with more threads each (``cluster.devices`` below
    the count, every rank ``cores / ranks`` threads). ``rollout_tp`` N (``rollout.vllm.tensor_parallel_size``):
    only the placements whose rollout pool has a multiple of N devices (the config refuses the others)."""
    if devices < 1:
        raise ValueError(f"--devices {devices}: plan for at least one device")
    out = [Placement("sync-colocated", main=m) for m in (range(1, devices + 1) if cpu else [devices])]
    for gen in _splits(devices):
        main = devices - gen
        out += [Placement("sync-split", main=main, gen=gen), Placement("periodic", main=main, gen=gen)]
        if offpolicy:
            out += [Placement("offpolicy", main=main, gen=gen, k=k, partial=partial)
                    for k in (1, 2) for partial in (False, True)]
    return [p for p in out if (p.gen or p.main) % rollout_tp == 0]


def rank(profile: Profile, workload: Workload, placements: Iterable[Placement], *, steps: int = 12,
         seed: int = 0) -> list[Prediction]:
    """Predictions, feasible ones first, each part ordered by TPSPD (best first). Placements whose trainer
    ranks are not a multiple of ``workload.sequence_parallel`` are left out (the config refuses them)."""
    preds = [simulate(profile, workload, p, steps=steps, seed=seed) for p in placements
             if p.main % workload.sequence_parallel == 0]
    return sorted(preds, key=lambda r: (not r.fits, -r.tpspd))


NEAR_TIE = 0.05
"""Candidates predicted within this share of the best one's TPSPD are named as near-ties: the model's error
(up to about 20% per configuration on a calibrated CPU) cannot rank them."""


def format_plan(preds: list[Prediction], *, title: str, top: int = 12, base: list[str] | None = None) -> str:
    """The plan table and the overrides that run the best feasible placement."""
    lines = [title, f"{'#':>3}  {'placement':<14} {'mode':<22}{'step s':>9}{'TPSPD':>10}{'busy main/gen':>15}"
             f"{'mem GiB main/gen':>18}  fits"]
    for i, r in enumerate(preds[:top], 1):
        busy = "/".join(f"{r.busy.get(k, 0):.2f}" for k in ("main", "gen") if k in r.busy)
        mem = "/".join(f"{r.memory_gib[k]:.1f}" for k in ("main", "gen") if k in r.memory_gib)
        lines.append(f"{i:>3}  {r.placement.pools:<14} {r.placement.mode_name:<22}{r.step_s:>9.3f}"
                     f"{r.tpspd:>10.1f}{busy:>15}{mem:>18}  {'yes' if r.fits else 'NO'}")
    if len(preds) > top:
        lines.append(f"     ... {len(preds) - top} more")
    best = next((r for r in preds if r.fits), None)
    if best is None:
        lines.append("no placement fits the devices' memory: more devices, a smaller engine.token_budget or "
                     "rollout batch (fewer prompts per step) would be needed")
    else:
        close = [(i, r) for i, r in enumerate(preds, 1) if r.fits and r is not best
                 and r.tpspd >= (1 - NEAR_TIE) * best.tpspd]
        for i, r in close[:3]:
            lines.append(f"near-tie: #{i} ({r.placement.pools.strip()} {r.placement.mode_name}) is predicted within "
                         f"{100 * (1 - r.tpspd / best.tpspd):.1f}% of the best, closer than the model's error "
                         f"(docs/planner.md, 'How far to trust it'): measure both; its overrides: "
                         + " ".join([*(base or []), *r.placement.overrides()]))
        lines.append("best: " + " ".join([*(base or []), *best.placement.overrides()]))
    return "\n".join(lines)
