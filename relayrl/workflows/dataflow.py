"""GRPO as a streaming dataflow: workers on the dock, stages that start per prompt group, periodic asynchrony.

Seed 003's Algorithm 1, with seed 002's streaming loaders between the stages. One step::

    open partition p (P prompt groups of n rows)
    sample:      the rollout writes each group into p as soon as its n responses are done
    score:       for each group in p with responses         -> rewards        (the scorer; with
                 reward.stream=sample each response is scored as it lands, a group's rewards written
                 once all its rows are scored)
    reference:   for each group with responses              -> ref_logprobs   (reference group; KL only)
    old:         for each group with responses              -> old_logprobs   (actor; > 1 update per batch)
    values:      for each group with responses              -> values         (critic; PPO)
    advantages:  for each group with rewards [, ref, values] -> advantages    (group-relative estimators;
                 batch-whitened ones wait for the whole batch)
    update:      sync:     once every group has advantages, the update (mini-batches, epochs)
                 periodic: forward + backward on each group with advantages as it arrives,
                           one optimizer step when the batch is consumed (the same update)
    relay weights actor -> rollout; close p

Every stage is a thread of the driver that leases ready groups from the dock's controller (metadata only),
hands their row indexes to its worker group (a reader and slots), and publishes the receipt the worker
returns: no sample tensor passes through the driver (``dock/driver_bytes``). Stages whose group shares a
pool with the rollout wait for generation to end (a colocated device is time-shared); stages on other pools
start on the first group. ``trainer.mode=periodic`` (rollout on its own pool) is seed 003's periodic
asynchrony: the trainer consumes groups in arrival order while later groups are generated, and the weights
go to the rollout once per step, so it stays strictly on-policy.

Resume: checkpoints are taken between steps. A run killed inside a step resumes from the last checkpoint
and regenerates that step's partition from the checkpoint's data position and sampler state (nothing of a
half-consumed period is kept; the optimizer never stepped on it).

DAPO's dynamic sampling: the partition has room for every resample round. The score stage drops a group
whose rewards are all equal (it writes no rewards for it) and retires its rows from the dock, so no later
stage waits for them (the forward-only stages then also wait for a group's rewards); the sample stage
generates replacement prompts in further rounds until ``P`` groups are kept or ``max_resample_rounds``, and
retires the rows no round used. The kept groups are trained exactly as in the synchronous loop.

ReMax: once the groups are sampled (and kept), the rollout generates one greedy response per prompt into
the group's rows (``baseline_ids``); a stage scores it into ``baseline``, which the advantages read.

Multi-turn episodes (``env.name``): the rollout runs episodes instead of single responses and writes a
group when its last episode ends (``loss_mask``, ``env_rewards``: see :mod:`relayrl.workflows.dataplane`);
the score stage takes the episodes' rewards, and the advantages and the update read the loss mask.

The colocated synchronous default runs ``grpo.py``'s loop.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Callable

import torch

from relayrl.algorithms.dapo import dynamic_sampling_filter
from relayrl.cluster import ClusterConfig, ResourcePool, compute, make_group
from relayrl.config.schema import Config, available_devices
from relayrl.dock import Dock
from relayrl.environments.episodes import episode_metrics
from relayrl.workflows.dataplane import (DockCriticWorker, DockPolicyWorker, DockReferenceWorker,
                                         ScoreWorker, StreamingRollout)
from relayrl.workflows.grpo import GRPOWorkflow, sample_metrics
from relayrl.workflows.episodes import log_episode_errors
from relayrl.workflows.relay import relay_weights

__all__ = ["DataflowGRPO", "Flow"]

# worker-group methods whose arguments or results are weights or checkpoints, not samples
_NOT_SAMPLES = frozenset({"named_weights", "update_weights", "receive_weights", "share_weights", "state",
                          "load_state", "param_shapes", "save_pretrained", "rng_state", "set_rng_state"})


def placed_config(cfg: Config) -> Config:
    """``cfg`` with ``run.threads`` set to every rank's share of the cores when the run is on a CPU and
    declares pools (a CPU device is a share of the cores: cores / devices of all pools); unchanged when the
    run uses GPUs, or when ``run.threads`` is set."""
    kind, cores = available_devices(cfg)
    if kind != "CPU core" or not cfg.placement.pools or cfg.run.threads:
        return cfg
    per = max(1, cores // (cfg.cluster.devices + sum(cfg.placement.pools.values())))
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"threads": per})})


class Flow:
    """The stage threads of one step: each runs ``fn(flow)``; the first error stops them all and is raised
    by :meth:`run`. ``leases`` are metadata-only dock batches of ready rows."""

    def __init__(self, dock: Dock, part: str, step: int, state: dict | None = None) -> None:
        self.dock, self.part, self.step = dock, part, step
        self.state = state if state is not None else {}  # what the stages gather for the step's metrics
        self.stop = threading.Event()
        self.generated = threading.Event()  # the rollout has written every group
        self.produced = threading.Event()  # the producing stages (sample, score) have all returned
        self.errors: list[BaseException] = []

    def leases(self, stage: str, columns: list[str], *, batch_rows: int | None,
               after: threading.Event | None = None, whole_groups: bool = True):
        """Batches of whole ready groups for ``stage`` (indexes only, leased): ``batch_rows`` at most per batch
        as soon as one group is ready (``None``: the whole partition at once); the caller acks each. ``after``: wait
        for this event first. ``whole_groups=False``: any ready rows, as soon as one is."""
        while after is not None and not after.wait(0.2):
            if self.stop.is_set():
                return
        self.dock.register_stage(stage, columns, whole_groups=whole_groups, token_columns=())
        total = self.dock.progress(self.part, stage)["rows"]
        eager = batch_rows is not None
        size = batch_rows if eager else total
        while not self.stop.is_set():
            try:
                b = self.dock.acquire(self.part, stage, batch_size=size, eager=eager, read=False,
                                      consumer_id=f"{stage}@{self.part}", timeout_s=0.2)
            except TimeoutError:
                continue
            if b is None:
                return
            yield b

    def run(self, stages: dict[str, Callable[["Flow"], None]]) -> None:
        def body(fn) -> None:
            try:
                fn(self)
            except BaseException as e:  # noqa: BLE001 - re-raised by run()
                self.errors.append(e)
                self.stop.set()
            finally:
                compute.wake()

        threads = [threading.Thread(target=body, args=(f,), name=f"stage-{n}", daemon=True)
                   for n, f in stages.items()]
        # the calling (main) thread runs the torch work the stages route to the driver's own workers
        compute.serve_until(lambda: [t.start() for t in threads], lambda: not any(t.is_alive() for t in threads))
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]


class DataflowGRPO(GRPOWorkflow):
    """GRPO/PPO whose step is a dataflow over the dock (see the module docstring)."""

    policy_cls, reference_cls, critic_cls, rollout_cls = (DockPolicyWorker, DockReferenceWorker, DockCriticWorker,
                                                          StreamingRollout)
    SCORE_CALLS = 8  # reward calls in flight at once (placement.reward=driver)
    SAMPLE_CALLS = 32  # the same with reward.stream=sample (calls of a row or a few each)
    partial = False  # on-policy: weights reach the rollout between batches only (off-policy may set it)

    def __init__(self, cfg: Config) -> None:
        pl = cfg.placement
        cfg = placed_config(cfg)
        if pl.split and cfg.dock.backend == "local":
            # the rollout runs in its own process and writes to the units itself: they must be reachable
            # (units in processes of their own on the local backend, Ray actors on Ray)
            backend = "ray" if cfg.cluster.backend == "ray" else "process"
            cfg = cfg.model_copy(update={"dock": cfg.dock.model_copy(update={"backend": backend})})
        self._pools: dict[str, ResourcePool] = {}
        super().__init__(cfg)
        a = cfg.algorithm
        scorer = dict(reward=self.s.reward, tokenizer=self.s.tokenizer, algorithm=a, shape=self._shaped)
        if pl.reward == "driver":  # threads of the driver: calls run concurrently, beside every pool's turns
            worker = ScoreWorker(**scorer)
            self.scorer, self._score = None, lambda method, *args: getattr(worker, method)(*args)
        else:  # a pool's devices (a reward model): its calls take that pool's turns
            self.scorer = make_group(cfg.cluster.model_copy(update={"in_process": True}), ScoreWorker,
                                     self._pool(pl.reward), "scorer", init_kwargs=scorer)
            self._score = self.scorer.one
        # accumulate per arriving group (periodic, off-policy) or update on the whole batch: the plan decides
        self.periodic = self.plan.update == "accumulate"

    # ------------------------------------------------------------ placement
    def _pool(self, name: str) -> ResourcePool:
        if name == "main":
            return self.s.pool
        if name not in self._pools:  # 'driver': the driver's own threads (turns of their own, no device)
            self._pools[name] = ResourcePool(name=name, devices=self.cfg.placement.pools.get(name, 1),
                                             device_kind="cpu" if name == "driver" else self.s.pool.device_kind,
                                             node=self.cfg.placement.nodes.get(name))
        return self._pools[name]

    def _rollout_pool(self, main: ResourcePool) -> ResourcePool:
        return self._pool(self.cfg.placement.rollout)

    def _reference_pool(self, main: ResourcePool) -> ResourcePool:
        return self._pool(self.cfg.placement.reference)

    def _critic_pool(self, main: ResourcePool) -> ResourcePool:
        return self._pool(self.cfg.placement.critic)

    def _rollout_cluster(self) -> ClusterConfig:
        # its own process when it has its own pool: generation then overlaps training instead of competing
        # with it for the driver's interpreter lock
        return self.cfg.cluster.model_copy(update={"in_process": not self.cfg.placement.split})

    # ------------------------------------------------------------------ step
    def step(self, step: int) -> dict[str, float]:
        """One step of seed 003's Algorithm 1 over the dock; returns its metrics."""
        t0 = time.perf_counter()
        self._phase_metrics = {}
        for g in self._groups():
            g.reset_bytes()
        f = self.open_step(step)
        try:
            f.run({**self.produce_stages(), **self.consume_stages()})
        finally:
            self.dock.close_partition(f.part)
        metrics = self.step_metrics(f)
        with self.s.span("relay", "rollout", step):
            metrics.update(relay_weights(self.actor, self.rollout, version=step, relay=self.relay))
        return self.perf(metrics, t0, self.flow_tokens(f), step)

    def open_step(self, step: int) -> Flow:
        """Draw the step's prompts and open its partition (``P`` groups of ``n`` rows)."""
        P, n, a = self.cfg.data.prompts_per_step, self.sampling.n, self.cfg.algorithm
        problems = self.s.prompts.take(P)
        part = f"step-{step}"
        # dynamic sampling: room for every resample round (the rows not needed are retired)
        groups = P * (1 + a.max_resample_rounds) if self.plan.group_filter else P
        self.dock.open_partition(part, rows=groups * n, group_size=n)
        return Flow(self.dock, part, step, {"problems": problems, "infos": [], "scores": [], "rewards": [],
                                            "metrics": {}, "update": {}, "kl": {}, "rounds": 0, "judged": 0,
                                            "kept": 0, "dropped": set(), "scored": threading.Condition(),
                                            "rows": {}, "baselines": []})

    def produce_stages(self) -> dict[str, Callable[[Flow], None]]:
        """The stages that fill a partition: generation and the reward (and ReMax's baseline reward)."""
        return {"sample": self.sample, "score": self.score, **({"baseline": self.baseline} if self.plan.baseline
                                                               else {})}

    def consume_stages(self) -> dict[str, Callable[[Flow], None]]:
        """The stages that read a filled partition: log-prob passes, advantages, the update."""
        stages = {"advantages": self.advantages_stage, "update": self.update_stage}
        if self.ref is not None:
            stages["reference"] = self.reference
        if self.recompute_old:
            stages["old"] = self.old_logprobs
        if self.critic is not None:
            stages["values"] = self.values
        return stages

    def step_metrics(self, f: Flow) -> dict[str, float]:
        """The step's sample, reward and update metrics, and ``dock/driver_bytes``."""
        metrics = self._metrics(f)
        metrics["dock/driver_bytes"] = float(sum(b for g in self._groups() for m, b in g.bytes_by_method.items()
                                                 if m not in _NOT_SAMPLES))
        return metrics

    @staticmethod
    def kept_infos(f: Flow) -> list[dict]:
        """The rollout's record of each prompt group the step trains on (dynamic sampling drops some)."""
        return [i for i in f.state["infos"] if i["group"] not in f.state["dropped"]]

    def flow_tokens(self, f: Flow) -> int:
        """Prompt + generated tokens of the partition's samples that the step trains on."""
        return sum(i["prompt_len"] * len(i["lengths"]) + sum(i["lengths"]) for i in self.kept_infos(f))

    def _groups(self):
        return [g for g in (self.actor, self.rollout, self.ref, self.critic, getattr(self, "scorer", None))
                if g is not None]

    def _device_gate(self, group, f: Flow) -> threading.Event | None:
        """Stages on the rollout's pool wait for generation to end (the device is time-shared)."""
        return f.generated if group.pool is self.rollout.pool else None

    # ---------------------------------------------------------------- stages
    def sample(self, f: Flow) -> None:
        """The rollout ranks generate; each finished group is written to the dock by its rank and published
        here (receipts only). With DAPO's dynamic sampling, groups the score stage drops are replaced by
        fresh prompts in further rounds, until ``P`` groups are kept or ``algorithm.max_resample_rounds``."""
        st, a, P = f.state, self.cfg.algorithm, self.cfg.data.prompts_per_step
        todo = list(range(len(st["problems"])))
        with self.phase("generate", self.rollout, f.step):
            while True:
                self._generate(f, todo)
                st["rounds"] += 1
                if not self.plan.group_filter or f.stop.is_set():
                    break
                with st["scored"]:  # every group of the round scored: kept or dropped (or the flow stopped)
                    while not st["scored"].wait_for(lambda: f.stop.is_set() or st["judged"] == len(st["problems"]),
                                                    timeout=0.5):
                        continue
                need = P - st["kept"]
                if need <= 0 or st["rounds"] > a.max_resample_rounds or f.stop.is_set():
                    break
                first = len(st["problems"])
                st["problems"] += self.s.prompts.take(need)
                todo = list(range(first, first + need))
            if self.plan.baseline and not f.stop.is_set():  # ReMax: a greedy response per kept prompt
                self._generate(f, [g for g in range(len(st["problems"])) if g not in st["dropped"]], baseline=True)
        if self.plan.group_filter and not f.stop.is_set():
            self.dock.retire(f.part)  # the rounds that were not needed
        f.generated.set()

    def _generate(self, f: Flow, groups: list[int], baseline: bool = False) -> None:
        """One generation round: prompt groups ``groups`` (indexes into the step's problems) streamed into the
        dock by the rollout ranks. ``baseline`` (ReMax): one greedy response per group, into its rows."""
        s, n = self.s, self.sampling.n
        problems, rows = f.state["problems"], f.state["rows"]
        if baseline:
            slots = [self.dock.slots(f.part, rows[g]) for g in groups]
        else:
            slots = [self.dock.reserve(f.part, n) for _ in groups]
            rows.update({g: sl.indexes for g, sl in zip(groups, slots)})
        params = self.greedy if baseline else self.sampling
        prompts = [s.encode(problems[g]) for g in groups]
        ranks = self.rollout.world_size
        chunks = [list(range(len(groups)))[r::ranks] for r in range(ranks)]
        for r, idx in enumerate(chunks):
            episodes = {} if self.episodes is None else dict(episodes=self.episodes,
                                                              problems=[problems[groups[i]] for i in idx])
            self.rollout.one("start_stream", [prompts[i] for i in idx], params, [slots[i] for i in idx],
                             [groups[i] for i in idx], partial=self.partial, baseline=baseline, **episodes,
                             per_sample=self.cfg.reward.stream == "sample" and not baseline, rank=r)
        live = set(range(ranks))
        while live and not f.stop.is_set():
            for r in sorted(live):
                got, done = self.rollout.one("poll_stream", 0.05 if ranks > 1 else 0.2, rank=r)
                for receipt, infos in got:
                    self.dock.publish(receipt)
                    f.state["infos"] += [i for i in infos if not i.get("baseline")]
                if done:
                    live.discard(r)
            self._while_generating(f)

    def _while_generating(self, f: Flow) -> None:
        """Called between two polls of the rollout ranks; on-policy steps have nothing to do there (the
        off-policy workflow hands over new weights for partial rollout)."""
        return None

    def score(self, f: Flow) -> None:
        """Score responses as they land; write a group's rewards once every row of it is scored.

        ``reward.stream=group``: one call per landed batch of whole groups (a verifier's latency is per call);
        ``sample``: the rollout writes each response the moment it ends and this stage scores it at once (seed
        003's producer scores every response as it returns), so a group's rewards wait only for the call of
        its last response. Up to ``SCORE_CALLS`` calls are in flight, so a slow one does not hold the rows
        behind it."""
        st, lock, n = f.state, threading.Lock(), self.sampling.n
        problems = st["problems"]
        pending: dict[int, dict[int, tuple[float, float]]] = {}  # group -> row -> (score, reward)

        def one(b) -> None:
            with self.s.span("reward", "reward", f.step):
                out = self._score("score_rows", self.dock.reader(f.part, b.indexes, cols), problems)
            b.ack()
            done = []
            with lock:
                for i, g, score, reward in zip(b.indexes, out.groups, out.scores, out.rewards):
                    pending.setdefault(g, {})[i] = (score, reward)
                for k, v in out.metrics.items():  # per-call reward metrics: a mean weighted by rows
                    st["metrics"].setdefault(k, []).append((v, len(b.indexes)))
                for g in dict.fromkeys(out.groups):
                    if len(pending[g]) == n:
                        done.append((g, sorted(pending.pop(g).items())))
            if done:
                self._judge(f, done, lock)

        # episodes: the environment gave the rewards (``env_rewards``), the score stage shapes and filters them
        cols = ["response_ids", "group"] + (["env_rewards"] if self.episodes is not None else [])
        per_sample = self.cfg.reward.stream == "sample"
        calls = (self.SAMPLE_CALLS if per_sample else self.SCORE_CALLS) if self.scorer is None else 1
        with ThreadPoolExecutor(calls, thread_name_prefix="score") as pool:
            running: set = set()
            for b in f.leases("score", cols, batch_rows=len(problems) * n, whole_groups=not per_sample):
                while len(running) >= calls:
                    done, running = wait(running, return_when=FIRST_COMPLETED)
                    for d in done:
                        d.result()
                running.add(pool.submit(one, b))
            for d in running:
                d.result()

    def _judge(self, f: Flow, done: list[tuple[int, list[tuple[int, tuple[float, float]]]]],
               lock: threading.Lock) -> None:
        """Groups whose every row is scored (``(group, [(row, (score, reward)), ...])``): write the rewards of
        those kept in one write; DAPO's dynamic sampling drops a group whose scores are all equal (it carries
        no signal): no rewards, its rows retired so no later stage waits for them."""
        st = f.state
        rows = [i for _, got in done for i, _ in got]
        groups = torch.tensor([g for g, got in done for _ in got])
        scores = torch.tensor([sr[0] for _, got in done for _, sr in got], dtype=torch.float32)
        rewards = [sr[1] for _, got in done for _, sr in got]
        keep = dynamic_sampling_filter(scores, groups)[0].tolist() if self.plan.group_filter \
            else [True] * len(rows)
        kept = [i for i, k in enumerate(keep) if k]
        if kept:
            self.dock.publish(self._score("write_rewards", self.dock.slots(f.part, [rows[i] for i in kept]),
                                          [rewards[i] for i in kept]))
        if len(kept) < len(rows):
            self.dock.retire(f.part, [r for r, k in zip(rows, keep) if not k])
        with lock:
            st["scores"] += [float(scores[i]) for i in kept]
            st["rewards"] += [rewards[i] for i in kept]
            st["dropped"] |= {int(g) for g, k in zip(groups.tolist(), keep) if not k}
        with st["scored"]:
            st["judged"] += len(done)
            st["kept"] += sum(1 for g, _ in done if g not in st["dropped"])
            st["scored"].notify_all()

    def baseline(self, f: Flow) -> None:
        """ReMax: score each group's greedy response as its baseline, as the greedy responses land."""
        problems = f.state["problems"]
        for b in f.leases("baseline", ["baseline_ids", "group"], batch_rows=self.sampling.n * len(problems)):
            with self.s.span("greedy_baseline", "reward", f.step):
                receipt, base = self._score("baseline_into", self.dock.reader(f.part, b.indexes, ["baseline_ids", "group"]),
                                            self.dock.slots(f.part, b.indexes), problems)
            self.dock.publish(receipt)
            f.state["baselines"] += base
            b.ack()

    def _pass(self, f: Flow, stage: str, group, span: str, method: str, *args) -> None:
        """A forward-only stage: each ready batch of groups -> ``method`` on every rank -> receipts published.
        With dynamic sampling it waits for a group's rewards too (a dropped group never gets them)."""
        cols = ["prompt_ids", "response_ids", "group"] + (["rewards"] if self.plan.group_filter else [])
        gate = self._device_gate(group, f)
        rows = None if gate is not None else self.sampling.n * self.cfg.trainer.stream_groups
        for b in f.leases(stage, cols, batch_rows=rows, after=gate):
            with self.phase(span, group, f.step):
                receipts = group.split(method, self._items(f.part, b.indexes, cols, group.world_size), *args)
            for r in receipts:
                self.dock.publish(r)
            b.ack()

    def reference(self, f: Flow) -> None:
        self._pass(f, "reference", self.ref, "ref_logprob", "logprobs_into", "ref_logprobs", self.temperature)

    def old_logprobs(self, f: Flow) -> None:
        self._pass(f, "old", self.actor, "old_logprob", "logprobs_into", "old_logprobs", self.temperature)

    def values(self, f: Flow) -> None:
        self._pass(f, "values", self.critic, "values", "values_into")

    def advantages_stage(self, f: Flow) -> None:
        a = self.cfg.algorithm
        cols = ["rewards", "response_ids", "group"] + (["gen_logprobs", "ref_logprobs"] if a.kl_in_reward and
                                                       self.ref is not None else []) \
            + (["values"] if self.plan.estimator.values else []) + (["baseline"] if self.plan.baseline else []) \
            + (["loss_mask"] if self.episodes is not None else [])
        rows = self.sampling.n * self.cfg.trainer.stream_groups if self.plan.estimator.group_relative else None
        for b in f.leases("advantages", cols, batch_rows=rows):
            with self.s.span("advantage", "driver", f.step):
                receipt, kl = self._score("advantages_into", self.dock.reader(f.part, b.indexes, cols),
                                          self.dock.slots(f.part, b.indexes))
            self.dock.publish(receipt)
            f.state["kl"].update(kl)
            b.ack()

    def update_stage(self, f: Flow) -> None:
        """sync: the update on the whole batch; periodic: accumulate each arriving group, step at the end."""
        a, t, step = self.cfg.algorithm, self.cfg.trainer, f.step
        fields = self.update_fields()
        critic_fields = ["values", "returns"] + (["loss_mask"] if self.episodes is not None else []) \
            if self.critic is not None else []
        cols = list(dict.fromkeys(["prompt_ids", "response_ids", "group", "truncated", *fields, *critic_fields]))
        kw = dict(temperature=self.temperature)
        actor_on = step > self.cfg.critic.warmup_steps or self.critic is None
        gate = self._device_gate(self.actor, f)
        if not self.periodic:
            for b in f.leases("update", cols, batch_rows=None, after=gate):
                if self._nothing_to_train(len(b.indexes), f):
                    b.ack()
                    continue
                with self.phase("update", self.actor, step):
                    opt = dict(mini_batches=t.mini_batches, epochs=t.epochs, seed=self.cfg.run.seed + step, **kw)
                    if self.critic is not None:
                        f.state["update"].update(self.critic.split(
                            "update_from", self._items(f.part, b.indexes, cols, self.critic.world_size),
                            self.value_loss, critic_fields, drop_truncated=a.overlong_filter, **opt)[0])
                    if actor_on:
                        f.state["update"].update(self.actor.split(
                            "update_from", self._items(f.part, b.indexes, cols, self.actor.world_size), self.loss,
                            fields, drop_truncated=a.overlong_filter,
                            with_entropy="grad" if a.entropy_coef > 0 else True, **opt)[0])
                b.ack()
            return
        self.actor.all("begin_accumulation")
        rows, consumed = self.sampling.n * t.stream_groups, 0
        for b in f.leases("update", cols, batch_rows=rows, after=gate):
            with self.phase("update", self.actor, step):
                self.actor.split("accumulate_from", self._items(f.part, b.indexes, cols, self.actor.world_size),
                                 self.loss, fields, drop_truncated=a.overlong_filter,
                                 with_entropy="grad" if a.entropy_coef > 0 else True, **kw)
            consumed += len(b.indexes)
            b.ack()
        if f.stop.is_set() or consumed == 0 or self._nothing_to_train(consumed, f):
            return  # (the next begin_accumulation discards what was accumulated)
        with self.phase("update", self.actor, step):
            f.state["update"].update(self.actor.all("finish_accumulation")[0])

    def _nothing_to_train(self, rows: int, f: Flow) -> bool:
        """DAPO's overlong filter dropped every row of the batch: no optimizer step this step (said in the
        log, ``actor/skipped_update``), as the synchronous loop does."""
        truncated = sum(sum(i["truncated"]) for i in self.kept_infos(f))
        if self.cfg.algorithm.overlong_filter:
            f.state["update"]["actor/overlong_filtered"] = float(truncated)
        if not self.cfg.algorithm.overlong_filter or truncated < rows:
            return False
        self.s.tracker.write_text(f"step {f.step}: algorithm.overlong_filter dropped all {rows} responses (every "
                                  f"one was cut at rollout.max_new_tokens={self.sampling.max_new_tokens}; raise it); "
                                  f"no update this step")
        f.state["update"]["actor/skipped_update"] = 1.0
        return True

    def _items(self, part: str, indexes: list[int], cols: list[str], ranks: int) -> list:
        """One ``(reader, slots)`` per rank: contiguous whole groups of ``indexes``."""
        n = self.sampling.n
        groups = [indexes[i:i + n] for i in range(0, len(indexes), n)]
        per = [sum(groups[r::ranks], []) for r in range(ranks)] if ranks > 1 else [indexes]
        return [(self.dock.reader(part, idx, cols), self.dock.slots(part, idx)) if idx else (None, None)
                for idx in per]

    # --------------------------------------------------------------- metrics
    def _metrics(self, f: Flow) -> dict[str, float]:
        st, infos, a = f.state, self.kept_infos(f), self.cfg.algorithm
        lengths = torch.tensor([L for i in infos for L in i["lengths"]], dtype=torch.float32)
        truncated = torch.tensor([t for i in infos for t in i["truncated"]], dtype=torch.float32)
        scores, rewards = torch.tensor(st["scores"]), torch.tensor(st["rewards"])
        m: dict[str, float] = {k: sum(v * w for v, w in vs) / max(1, sum(w for _, w in vs))
                               for k, vs in st["metrics"].items()}
        if self.plan.group_filter:  # the same record as the synchronous loop's
            m.update({"dapo/dropped_groups": float(len(st["dropped"])), "dapo/sampled_groups": float(st["judged"]),
                      "dapo/rounds": float(st["rounds"]),
                      "dapo/missing_prompts": float(max(0, self.cfg.data.prompts_per_step - st["kept"]))})
        if st["baselines"]:
            m["remax/baseline_mean"] = sum(st["baselines"]) / len(st["baselines"])
        if self.episodes is not None:  # every episode generated, dropped groups too (as the synchronous loop)
            eps = [e for i in st["infos"] for e in i["episodes"]]
            log_episode_errors(self.s, eps, f.step)
            m.update(episode_metrics(eps))
        if len(scores):
            m.update(sample_metrics(scores, rewards, lengths, truncated))
        else:  # every group was uniform in every round: nothing to learn from this step
            self.s.tracker.write_text(f"step {f.step}: dynamic sampling found no group with differing rewards in "
                                      f"{st['rounds']} rounds; no update this step (raise "
                                      f"algorithm.max_resample_rounds or data.prompts_per_step)")
            m["dapo/skipped_step"] = 1.0
        m.update(st["update"])
        self.kl_metrics(m, st["kl"])
        m.update(self._phase_metrics)
        return m

    def shutdown(self) -> None:
        super().shutdown()
        if getattr(self, "scorer", None) is not None:
            self.scorer.shutdown()
