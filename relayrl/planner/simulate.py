"""A discrete-event model of GRPO steps for a placement and a step mode (the planner's time model): predicted
step time and busy time per pool; the peak memory per device comes from the memory model (:mod:`.memory`) with
the KV-cache peak the simulated generation reaches. The records it takes and returns are in :mod:`.placement`.

It follows the cost model of HybridFlow's auto-mapping (§6, Algorithm 1: the cost of each role's
stage on its devices, the step as the critical path through generation, preparation and training) and
AsyncFlow's resource planner (producer/consumer overlap between a rollout pool and a trainer pool),
with the step modes relayrl runs (docs/step-modes.md).

The step is scheduled on the pipeline's own stage graph (:func:`relayrl.config.plan.stage_graph`, the table
the pipeline's stage threads are built from): which stages run (sample, score, the forward-only passes,
advantages, update), what each reads, whether it takes each chunk of ``trainer.stream_groups`` groups as it
is ready or waits for the whole batch, and whether it waits for generation to end (its pool is the
rollout's). :func:`step_graph` builds it for a candidate placement from the workload's plan fields, with the
same function the pipeline's step plan calls, so a change to the pipeline's graph changes the prediction.
What the graph does not say, the placement does:

* ``sync-colocated``: every role on ``main``; the step is sequential (each stage waits for the one before),
  weights shared in place.
* ``sync-split``, ``periodic``: the rollout on a pool of its own; the update waits for the batch or
  accumulates per chunk; the weights are relayed, then the next batch starts (on-policy).
* ``offpolicy`` with ``k``: the rollout starts batch ``t`` once batch ``t-1`` is generated and update
  ``t-1-k`` is done (AsyncFlow's delayed parameter update, staleness bound k). ``partial``: each update that
  lands while a batch generates costs one prefill of the rows in flight (the native engine re-prefills with
  the new weights).

Generation is simulated row by row on the native engine's continuous batching: every row's length is drawn
from the workload's distribution, a decode step costs ``DecodeCost(rows in flight, context)``, a group is
done at its longest row, so the long tail decides when the batch ends. Reward calls take the function's cost
plus the longest outside latency of their rows.

ReMax's greedy responses are generated once sampling ends, one per group of the group's median length, and
scored as they land; the advantages of a group wait for its baseline. DAPO's dynamic sampling keeps each group
with the workload's ``keep_frac`` and resamples the missing ones in rounds (each once the round before is
scored), up to ``resample_rounds`` more; only kept groups go on to the forward passes and the update.

Where the model simplifies: the trainer's pool runs one call at a time, the earliest ready first; the
advantages cost nothing; a group is dropped by a draw, not by its rewards; the reward runs on the driver's
threads; data-parallel ranks get the groups of each chunk in turn; FSDP traffic (all-gathers in the compute
dtype, reduce-scatters of fp32 gradients) does not overlap compute: one gather and one reduction per optimizer
step with ``engine.dp_sync=step``, a gather forward and backward and a reduction per micro-batch with
``pass``, a gather per forward-only micro-batch; a training pass costs its micro-batches' padded tokens,
planned as the engine plans them (``_micro_batches``), and attention cost in training is linear in those
tokens; what a driver path adds (the engines slower inside worker processes beside the driver, fixed costs per
training call, per generation call, per streamed chunk and per step) is one factor per kind of work and one
constant per call kind, measured on two calibration workloads (``Profile.overhead``); while the two pools
compute at the same time on a CPU they slow each other: the factors move towards those of a fully concurrent
run in proportion to the share of each pool's busy time the other pool is busy too (a second pass of the
simulation).
"""

from __future__ import annotations

import heapq
import math
import random

from relayrl.config.plan import PARTIAL_POLL_S, Stage, stage_graph
from relayrl.models.packing import cut_group, fed_tokens, pack_units, plan_microbatches
from relayrl.planner.memory import memory_gib
from relayrl.planner.placement import Placement, Prediction
from relayrl.planner.profile import DeviceProfile, PathCost, Profile
from relayrl.planner.workload import Workload

__all__ = ["simulate", "simulate_batches", "overlap_shares", "generate_rank", "train_s", "optimizer_s", "path_key",
           "step_graph"]

# -- generation -----------------------------------------------------------------------------------

def generate_rank(dev: DeviceProfile, scale: float, prompt_tokens: int, groups: list[list[int]], max_batch: int,
                  start: float = 0.0, weight_times: list[float] | None = None) -> tuple[float, list[float], float]:
    """One rollout rank generates ``groups`` (response lengths per prompt group) with continuous batching.

    Returns (end time, finish time of each group, peak KV-cache context: rows in flight x context tokens).
    A prompt is admitted when ``n`` slots are free and prefilled once. With ``weight_times`` (partial
    rollout), a new weight version landing while rows are in flight costs one prefill of their contexts."""
    n = max(len(g) for g in groups)
    waiting = list(range(len(groups)))
    running: list[list[int]] = []  # [group, remaining tokens, generated tokens]
    left = [len(g) for g in groups]
    done = [0.0] * len(groups)
    t, peak = start, 0.0
    pending = sorted(w for w in (weight_times or []) if w > start)

    def admit() -> float:
        cost, free = 0.0, max_batch - len(running)
        batch = []
        while waiting and free >= min(n, max_batch):
            g = waiting.pop(0)
            batch.append(g)
            running.extend([g, length, 0] for length in groups[g])
            free -= len(groups[g])
        if batch:
            cost = scale * dev.prefill(prompt_tokens * len(batch))
        return cost

    t += admit()
    while running:
        rows = len(running)
        ctx = prompt_tokens + max(r[2] for r in running)
        m = min(r[1] for r in running)
        step = scale * dev.decode(rows, ctx)
        if pending and pending[0] < t + m * step:  # a version lands inside this stretch: stop there, refill
            m = max(1, min(m, math.ceil((pending[0] - t) / step)))
        # m sampling iterations: every row in flight gets m tokens, with a decode after each of the first
        # m - 1; a row that takes its last token is done then, and the decode after it skips it.
        finishing = sum(1 for r in running if r[1] == m)
        t += (m - 1) * step + scale * dev.decode.row_ctx_s * rows * (m - 1) * (m - 2) / 2
        peak = max(peak, rows * (ctx + m))
        for r in running:
            r[1] -= m
            r[2] += m
            if r[1] == 0:
                left[r[0]] -= 1
                if left[r[0]] == 0:
                    done[r[0]] = t
        running[:] = [r for r in running if r[1] > 0]
        if running:
            t += scale * dev.decode(rows - finishing, ctx + m - 1)
        if pending and pending[0] <= t:
            while pending and pending[0] <= t:
                pending.pop(0)
            if running:
                t += scale * dev.prefill(sum(prompt_tokens + r[2] for r in running))
        t += admit()
    return t, done, peak


# -- training -------------------------------------------------------------------------------------

def _micro_batches(units: list[int], budget: int, packing: str = "shared_prompt", pack_length: int = 0) -> list[int]:
    """Padded token counts of the micro-batches the training engine runs ``units`` (token lengths) in, by its
    own planning: units bin-packed into rows no longer than ``pack_length`` or else the longest unit
    (:func:`pack_units`; ``packing="none"``: each unit a row of its own), rows cut into micro-batches of at
    most ``budget`` padded tokens (:func:`plan_microbatches`), each micro-batch as many rows as it holds,
    padded to its longest. Uneven units (a long tail) pay their padding."""
    if not units:
        return []
    if packing == "none":
        rows = list(units)
    else:
        rows = [sum(units[k] for k in pack) for pack in pack_units(units, pack_length or max(units))]
    return [len(mb) * max(rows[k] for k in mb) for mb in plan_microbatches(rows, budget)]


def _fsdp_s(profile: Profile, w: Workload, dp: int, gathers: int = 2, reduce: bool = True) -> float:
    """FSDP traffic on one of ``dp`` ranks: ``gathers`` all-gathers of the weights in the compute dtype and
    (``reduce``) one reduce-scatter of the fp32 gradients, of the trained parameters only (LoRA: the adapters);
    under expert parallelism without the experts (:attr:`Workload.fsdp_params`)."""
    if dp == 1:
        return 0.0
    gathered, reduced = w.fsdp_params
    moved = (gathered * gathers * w.model.compute_bytes + reduced * 4 * reduce) * (dp - 1) / dp
    return (gathers + reduce) * profile.collective.base_s + profile.collective.per_s * moved


def _experts_s(profile: Profile, w: Workload, dp: int, tokens: int, backward: bool) -> float:
    """Expert parallelism's exchanges in one pass of a micro-batch of ``tokens`` on one of ``dp`` ranks: in every
    layer, each token's ``k`` hidden states to their experts' ranks and back (four all-to-alls: counts, indices,
    states, outputs), and the backward's two the other way, inside an expert group of ``e`` ranks
    (:meth:`Workload.experts_over`); a uniform router sends ``(e - 1) / e`` of them away."""
    e = w.experts_over(dp)
    if e == 1:
        return 0.0
    m = w.model
    calls = (4 + 2 * backward) * m.layers
    moved = tokens * m.experts_per_token * m.hidden * m.compute_bytes * 2 * (1 + backward) * m.layers * (e - 1) / e
    return calls * profile.collective.base_s + profile.collective.per_s * moved


def train_s(dev: DeviceProfile, profile: Profile, w: Workload, units: list[int], dp: int,
            forward_only: bool = False) -> float:
    """Forward + backward (or forward only) of ``units`` on one of ``dp`` ranks, without the optimizer.
    FSDP traffic per micro-batch: with ``dp_sync=pass`` every training pass gathers (forward, backward) and
    reduces; with ``step`` that happens once per optimizer step (:func:`optimizer_s`); a forward-only pass
    gathers once. Expert parallelism's token exchanges per micro-batch (:func:`_experts_s`)."""
    scale = profile.scale(w.model.compute_params)
    cost = dev.logprob if forward_only else dev.train
    if forward_only:
        per_pass = _fsdp_s(profile, w, dp, gathers=1, reduce=False)
    else:
        per_pass = _fsdp_s(profile, w, dp) if w.dp_sync == "pass" else 0.0
    return sum(scale * cost(mb) + per_pass + _experts_s(profile, w, dp, mb, backward=not forward_only)
               for mb in _micro_batches(units, w.token_budget, w.packing, w.pack_length))


def _replicas_s(profile: Profile, w: Workload, dp: int) -> float:
    """Expert parallelism in ``dp / e`` groups of ``e`` ranks: once a step each rank all-reduces its experts'
    fp32 gradients (``routed / e`` of them) over their ``r = dp / e`` replicas, two tensors a layer (a ring
    all-reduce sends ``2 (r - 1) / r`` of them); nothing with one group or frozen experts (LoRA)."""
    e = w.experts_over(dp)
    r = dp // e
    if e == 1 or r == 1 or w.model.trainable:
        return 0.0
    moved = w.model.routed / e * 4 * 2 * (r - 1) / r
    return 2 * w.model.layers * profile.collective.base_s + profile.collective.per_s * moved


def optimizer_s(dev: DeviceProfile, profile: Profile, w: Workload, dp: int) -> float:
    """The optimizer step on one of ``dp`` ranks (with ``dp_sync=step``, the step's one gather and
    reduction too; expert parallelism in several groups: the replicas' gradient sum, :func:`_replicas_s`)."""
    once = _fsdp_s(profile, w, dp, gathers=1) if w.dp_sync == "step" else 0.0
    return profile.scale(w.model.params) * dev.optimizer_s / dp + once + _replicas_s(profile, w, dp)


def _optimizers_s(dev: DeviceProfile, profile: Profile, w: Workload, dp: int) -> float:
    """The optimizer steps of a step: the actor's, and the critic's when one trains."""
    return optimizer_s(dev, profile, w, dp) * (2 if w.critic else 1)


def relay_s(profile: Profile, w: Workload) -> float:
    return profile.relay(w.model.params * w.model.compute_bytes)


# -- the step -------------------------------------------------------------------------------------

def _split(groups: list[list[int]], ranks: int) -> list[list[int]]:
    """Indexes of the prompt groups each rank generates (contiguous, equal shares)."""
    per = math.ceil(len(groups) / ranks)
    return [list(range(r * per, min(len(groups), (r + 1) * per))) for r in range(ranks) if r * per < len(groups)]


def _threads(profile: Profile, p: Placement) -> int:
    return max(1, profile.cores // p.devices) if profile.cores else 0


def simulate(profile: Profile, w: Workload, p: Placement, *, steps: int = 12, warmup: int = 2,
             seed: int = 0) -> Prediction:
    """Simulate ``steps`` steps with lengths and latencies drawn per step; the prediction is the mean step
    time after ``warmup`` steps (for the off-policy pipeline, the interval between optimizer steps)."""
    rng = random.Random(seed)
    batches = []
    for _ in range(steps):
        lengths = w.lengths.draw(rng, w.rows)
        lat = w.reward_latency.draw(rng, w.rows)
        batches.append(([lengths[i * w.n:(i + 1) * w.n] for i in range(w.prompts)],
                        [lat[i * w.n:(i + 1) * w.n] for i in range(w.prompts)]))
    return simulate_batches(profile, w, p, batches, warmup=warmup)


def simulate_batches(profile: Profile, w: Workload, p: Placement, batches: list[tuple[list[list[int]], list[list[float]]]],
                     *, warmup: int = 0) -> Prediction:
    """:func:`simulate` on given steps: per step, the response lengths of each prompt group and the outside
    reward latency of each response."""
    if len(batches) <= warmup:
        raise ValueError(f"simulate {len(batches)} steps with warmup={warmup}: simulate more steps than the warm-up")
    name, dev0 = profile.device_for(_threads(profile, p))
    path = _path(profile, p)
    base = profile
    profile = base.scaled(name, path.generate, path.train)
    dev = profile.devices[name]
    scale = profile.scale(w.model.compute_params)
    step_s, busy, phases, kv_peak, (fg, ft), tokens = _run(profile, dev, scale, w, p, batches, warmup)
    conc = base.overhead.concurrent
    if p.mode != "sync-colocated" and conc is not None:
        # the pools slow each other while both compute: blend towards the concurrent factors
        g = path.generate + (conc.generate - path.generate) * fg
        t = path.train + (conc.train - path.train) * ft
        profile = base.scaled(name, g, t)
        dev = profile.devices[name]
        step_s, busy, phases, kv_peak, _, tokens = _run(profile, dev, scale, w, p, batches, warmup)
    mem = memory_gib(w, p, kv_peak, gpu=dev.kind == "gpu")
    fits = all(v <= dev.memory_gib for v in mem.values())
    return Prediction(p, step_s, tokens, busy, mem, fits, phases, per=profile.cores if dev.kind == "cpu" else 0)


def overlap_shares(profile: Profile, w: Workload, p: Placement, batches, *, warmup: int = 2) -> tuple[float, float]:
    """Share of the rollout pool's and of the trainer's busy time during which the other pool computes too,
    for a split placement with the dataflow's factors (what :func:`simulate_batches` blends the concurrent
    factors by)."""
    name, _ = profile.device_for(_threads(profile, p))
    flow = profile.overhead.dataflow
    prof = profile.scaled(name, flow.generate, flow.train)
    return _run(prof, prof.devices[name], prof.scale(w.model.compute_params), w, p, batches, warmup)[4]


def path_key(p: Placement) -> str:
    """The field of :class:`~relayrl.planner.profile.Overhead` holding the driver path that runs ``p``."""
    if p.mode == "sync-colocated":
        return "colocated" if p.main == 1 else "colocated_dp"
    return "dataflow"


def _path(profile: Profile, p: Placement) -> PathCost:
    """The driver path that runs ``p`` and its measured factors and per-step cost."""
    return getattr(profile.overhead, path_key(p))


def _units(w: Workload, groups: list[list[int]]) -> list[int]:
    """Token lengths of the units the training engine makes of ``groups`` (response lengths per group). Shared-
    prompt packing: a group's prompt and its responses, a group over the token budget (or ``pack_length``) cut
    as :func:`plan_units` cuts it; ``sequences`` and ``none``: each response with its own copy of the prompt. A
    response's last token is fed only with :attr:`Workload.feed_last`."""
    fed = [[fed_tokens(r, w.feed_last) for r in g] for g in groups]
    if w.packing != "shared_prompt":
        return [w.prompt_tokens + r for g in fed for r in g]
    limit = min(w.pack_length or w.token_budget, w.token_budget)
    return [w.prompt_tokens + sum(g[k] for k in part) for g in fed for part in cut_group(w.prompt_tokens, g, limit)]


def step_graph(w: Workload, p: Placement) -> tuple[Stage, ...]:
    """The pipeline's stage graph (:func:`relayrl.config.plan.stage_graph`, the one the pipeline runs by) for
    ``w``'s step on placement ``p``: every trainer-side role on ``main``, the rollout on ``main`` (colocated) or
    on ``gen``, the reward on the driver's threads."""
    roles = ("actor", "rollout") + tuple(r for r, on in (("reference", "reference" in w.forward),
                                                         ("critic", w.critic), ("teacher", "teacher" in w.forward)) if on)
    pools = {r: "main" for r in roles}
    pools["rollout"] = "main" if p.mode == "sync-colocated" else "gen"
    update = "accumulate" if p.mode in ("periodic", "offpolicy") and w.accumulate else "batch"
    return stage_graph(roles=roles, pools=pools, reward_pool="driver", update=update,
                       sequential=p.mode == "sync-colocated" and not w.group_filter, group_filter=w.group_filter,
                       baseline=w.baseline, recompute_old="old" in w.forward, kl_in_reward=w.kl_in_reward,
                       group_relative=w.group_relative, token_stats=w.token_stats,
                       reads_reference=w.reads_reference)


def _shares(c: list[int], ranks: int) -> list[list[int]]:
    """Each data-parallel rank's groups of chunk ``c``: dealt out in turn, as the pipeline does."""
    return [c[r::ranks] for r in range(ranks) if c[r::ranks]]


def _trainer_task(dev, profile: Profile, w: Workload, p: Placement, stage: Stage, groups, c: list[int]) -> float:
    """Seconds of ``stage`` (a forward pass or the update) on chunk ``c`` on the trainer's pool: the slowest
    rank's share, each call paying the path's fixed cost; the update also reads its rows from the dock, pays the
    streamed chunk's cost, trains the critic and (tri-model) runs the reference's forward."""
    path = _path(profile, p)
    if stage.name != "update":
        return max(train_s(dev, profile, w, _units(w, [groups[i] for i in idx]), p.main, forward_only=True)
                   for idx in _shares(c, p.main)) + path.call_s
    def one(idx):
        units = _units(w, [groups[i] for i in idx])
        work = train_s(dev, profile, w, units, p.main) * (2 if w.critic else 1) + path.call_s * (2 if w.critic else 1)
        if w.ref_in_update:
            work += train_s(dev, profile, w, units, p.main, forward_only=True)
        return work
    cost = max(one(idx) for idx in _shares(c, p.main)) + profile.dock_get(len(c) * w.n / p.main)
    return cost + (profile.overhead.chunk_s if stage.per == "chunk" else 0.0)


def _rollout(dev, scale, profile: Profile, w: Workload, p: Placement, groups, lat, start: float, call_s: float,
             weight_times: list[float] | None, rng: random.Random):
    """One batch's generation on the rollout ranks from ``start``, each call paying ``call_s``: the sampling
    round(s), then ReMax's greedy responses. Returns (groups, latencies, finish time of each group, the kept
    groups, end of generation, when each group's greedy baseline is scored, peak KV context).

    Dynamic sampling (``group_filter``): each group is kept with probability ``keep_frac``; while fewer than
    ``prompts`` are kept and rounds remain, a next round generates as many new groups as are missing (the
    batch's own lengths again) once every group of the round before is scored. ReMax: one greedy response per
    kept group once sampling ends, of the group's median length, scored as it lands."""
    ranks = p.main if p.mode == "sync-colocated" else p.gen
    groups, lat = list(groups), list(lat)
    finish, kept, peak = [0.0] * len(groups), [], 0.0
    todo, t0, g_end = list(range(len(groups))), start, start
    for r in range(1 + (w.resample_rounds if w.group_filter else 0)):
        ends = []
        for idx in _split([groups[i] for i in todo], ranks):
            end, done, pk = generate_rank(dev, scale, w.prompt_tokens, [groups[todo[i]] for i in idx], w.max_batch,
                                          t0 + call_s, weight_times)
            for i, d in zip(idx, done):
                finish[todo[i]] = d
            ends.append(end)
            peak = max(peak, pk)
        g_end = max(ends)
        if not w.group_filter:
            kept = todo
            break
        kept += [g for g in todo if rng.random() < w.keep_frac]
        need = w.prompts - len(kept)
        if need <= 0 or r == w.resample_rounds:
            break
        t0 = max(finish[g] + profile.dock_put(w.n) + profile.reward.call_s + profile.reward.row_s * w.n
                 + max(lat[g], default=0.0) for g in todo)  # every group of the round judged
        todo = list(range(len(groups), len(groups) + need))
        groups += [groups[i % w.prompts] for i in range(need)]
        lat += [lat[i % w.prompts] for i in range(need)]
        finish += [0.0] * need
    ready_base = [start] * len(groups)
    if w.baseline and kept:
        greedy = [[sorted(groups[g])[len(groups[g]) // 2]] for g in kept]
        ends = []
        for idx in _split(greedy, ranks):
            end, done, _ = generate_rank(dev, scale, w.prompt_tokens, [greedy[i] for i in idx], w.max_batch,
                                         g_end + call_s)
            for i, d in zip(idx, done):
                g = kept[i]
                ready_base[g] = (d + profile.dock_put(1) + profile.reward.call_s + profile.reward.row_s
                                 + (lat[g][0] if lat[g] else 0.0))
            ends.append(end)
        g_end = max(ends)
    return groups, lat, finish, kept, g_end, ready_base, peak


def _run(profile, dev, scale, w: Workload, p: Placement, batches, warmup):
    """The steps of ``p`` scheduled on the pipeline's stage graph (:func:`step_graph`).

    Per batch: the rollout ranks generate (:func:`_rollout`: continuous batching, dynamic sampling's rounds,
    ReMax's greedy responses; a group is ready when its last response is written to the dock, or, in a
    sequential step, when generation ends); then every later stage (on the kept groups) takes each
    chunk of groups (``per='chunk'``: ``stream_groups`` groups; ``'batch'``: all of them) once the stages it
    ``reads`` are done with those groups and, when ``after_generation``, generation has ended. Stages compete
    for resources: the trainer's pool runs one call at a time (earliest ready first), reward calls take
    ``reward.concurrency`` slots on the driver, the advantages cost nothing. The update ends with the optimizer
    step; then the weights are relayed (on-policy; shared in place when colocated) and the next batch starts, or,
    with ``ahead`` k, the next batch starts once this one is generated and update ``t-1-k`` is done."""
    graph = step_graph(w, p)
    deps = {st.name: [(di, d) for di, d in enumerate(graph) if st.name in d.reads] for st in graph}
    colocated, k = p.mode == "sync-colocated", (p.k if p.mode == "offpolicy" else 0)
    relay = 0.0 if colocated else relay_s(profile, w)
    land = relay + PARTIAL_POLL_S / 2  # partial: an update reaches the generating ranks after a poll, relayed
    path = _path(profile, p)
    gen_end: list[float] = []
    upd_end: list[float] = []
    gen_busy = trn_busy = 0.0
    gen_iv: list[tuple[float, float]] = []
    trn_iv: list[tuple[float, float]] = []
    phases = {"generate": 0.0, "reward": 0.0, "update": 0.0}
    kv_peak, train_free, tokens = 0.0, 0.0, 0.0
    for t, (groups, lat) in enumerate(batches):
        if colocated:
            start = upd_end[-1] if upd_end else 0.0
        elif k == 0:
            start = upd_end[-1] + relay if upd_end else 0.0
        else:
            prev = gen_end[-1] if gen_end else 0.0
            start = max(prev, upd_end[t - 1 - k] if t - 1 - k >= 0 else 0.0)
            # the newest weights go to the rollout first, unless partial rollout took them in while the batch
            # before generated
            if not p.partial or any(prev < u + land <= start for u in upd_end):
                start += relay
        groups, lat, finish, kept, g_end, ready_base, peak = _rollout(
            dev, scale, profile, w, p, groups, lat, start, path.generate_call_s,
            [u + land for u in upd_end] if p.partial else None, random.Random(t))
        kv_peak = max(kv_peak, peak)
        gen_end.append(g_end)
        if graph[0].per == "batch":  # a sequential step: the rollout writes every group once generation ends
            finish = [g_end + profile.dock_put(w.rows)] * len(groups)
        else:
            finish = [d + profile.dock_put(w.n) for d in finish]
        # tasks: (stage index, chunk); a task is ready once every (read stage, group) of its chunk is done
        # (sampling and scoring see every group generated; the later stages only the kept ones)
        def split_up(st: Stage) -> list[list[int]]:
            gs = list(range(len(groups))) if st.name in ("sample", "score") else kept
            if st.per == "batch":
                return [gs]
            return [gs[i:i + w.stream_groups] for i in range(0, len(gs), w.stream_groups)]

        chunks = {st.name: split_up(st) for st in graph}
        task_of = {st.name: {g: ci for ci, c in enumerate(chunks[st.name]) for g in c} for st in graph}
        waiting = {(si, ci): len(st.reads) * len(c) for si, st in enumerate(graph) if si
                   for ci, c in enumerate(chunks[st.name])}
        avail = {key: g_end if graph[key[0]].after_generation else start for key in waiting}
        heap: list[tuple[float, int, int]] = []

        def resolve(name: str, gs: list[int], at: float) -> None:
            for di, d in deps[name]:
                for g in gs:
                    if g not in task_of[d.name]:  # a group dynamic sampling dropped goes no further
                        continue
                    key = (di, task_of[d.name][g])
                    avail[key] = max(avail[key], at)
                    waiting[key] -= 1
                    if waiting[key] == 0:
                        heapq.heappush(heap, (avail[key], di, key[1]))

        for g, at in enumerate(finish):
            resolve("sample", [g], at)
        slots = [0.0] * profile.reward.concurrency
        work = 0.0
        ivs: list[tuple[float, float]] = []
        end_train = max(train_free, 0.0 if k else start)
        last = g_end
        while heap:
            ready, si, ci = heapq.heappop(heap)
            st, c = graph[si], chunks[graph[si].name][ci]
            if st.name == "score":
                s_i = min(range(len(slots)), key=lambda j: slots[j])
                begin = max(ready, slots[s_i])
                rows = [x for i in c for x in lat[i]]
                end = slots[s_i] = (begin + profile.reward.call_s + profile.reward.row_s * len(rows)
                                    + max(rows, default=0.0) + profile.overhead.per_group_s)
                phases["reward"] += (end - ready) if t >= warmup else 0.0
            elif st.name == "baseline":  # the greedy responses' rewards, scored as they land
                end = max([ready] + [ready_base[i] for i in c])
            elif st.role == "scorer":  # the advantages on the driver: no device time
                end = ready
            else:
                begin = max(ready, end_train)
                cost = _trainer_task(dev, profile, w, p, st, groups, c)
                end = end_train = begin + cost
                work += cost
                ivs.append((begin, end))
            resolve(st.name, c, end)
            last = max(last, end)
        if not kept:  # dynamic sampling kept nothing: no update, the step ends once every group is judged
            end_train = max(end_train, last)
        opt = _optimizers_s(dev, profile, w, p.main) + (relay if k else 0.0)  # off-policy: stage to host buffers
        train_free = end_train + opt + path.step_s
        upd_end.append(train_free)
        if t >= warmup:
            tokens += sum(w.n * w.prompt_tokens + sum(groups[g]) for g in kept)
            gen_iv.append((start, g_end))
            trn_iv += ivs
            gen_busy += g_end - start
            trn_busy += work + opt
            phases["generate"] += g_end - start
            phases["update"] += work + opt
    span = upd_end[-1] - upd_end[warmup - 1] if warmup else upd_end[-1]
    n = len(batches) - warmup
    both = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in gen_iv for b0, b1 in trn_iv)
    overlap = (min(1.0, both / gen_busy) if gen_busy else 0.0, min(1.0, both / trn_busy) if trn_busy else 0.0)
    if colocated:
        busy = {"main": min(1.0, (gen_busy + trn_busy) / span)}
    else:
        busy = {"main": min(1.0, trn_busy / span), "gen": min(1.0, gen_busy / span)}  # spans end at updates
    return span / n, busy, {k_: v / n for k_, v in phases.items()}, kv_peak, overlap, tokens / n
