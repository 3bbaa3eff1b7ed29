"""The worker roles of a GRPO-family step as a table: a new role is one entry and its worker class.

Each role names its worker class, the placement key of its pool, and the engine settings it is built with;
which roles a run has is the step plan's answer (:attr:`relayrl.config.plan.StepPlan.roles`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from relayrl.cluster import ClusterConfig, ResourcePool, WorkerGroup, check_fit, make_group
from relayrl.config.plan import StepPlan
from relayrl.config.rollout_devices import pool_pack
from relayrl.config.schema import Config, available_devices
from relayrl.errors import SettingError
from relayrl.workflows.precision import role_precision
from relayrl.workflows.rollout_worker import RolloutWorker
from relayrl.workflows.trainer_workers import CriticWorker, PolicyWorker, ReferenceWorker

__all__ = ["Role", "ROLES", "build_roles", "role_common", "rollout_init", "Pools", "placed_config", "check_teacher"]


@dataclass(frozen=True)
class Role:
    name: str
    worker: type
    init: Callable[[Config, StepPlan, dict, str, dict], dict]
    """``init(cfg, plan, precision, model_path, common)``: the worker's constructor arguments."""
    own_process: bool = False
    """On a pool of its own, the role runs in its own process (generation then overlaps training instead of
    competing with it for the driver's interpreter)."""
    devices_per_rank: Callable[[Config], int] = lambda cfg: 1
    """Devices each rank of the role owns (the rollout's vLLM engine with tensor parallelism spans several)."""


def _updates(cfg: Config) -> int:
    return cfg.trainer.steps * cfg.trainer.mini_batches * cfg.trainer.epochs


def _rollout(cfg: Config, prec: dict, path: str, common: dict) -> dict:
    return dict(model_path=path, max_batch=cfg.rollout.max_batch, seed=cfg.run.seed, decode=cfg.rollout.decode,
                decode_compile=cfg.rollout.decode_compile, remote=cfg.rollout.remote(), vllm=cfg.rollout.vllm_spec(),
                vllm_logprobs=cfg.rollout.vllm_logprobs(),
                chat_template=cfg.model.template(), **prec["rollout"], **common)


def _adapter(cfg: Config):
    """``rollout.lora_sync=adapter``: the ``model.lora`` whose adapters the actor relays and the rollout's vLLM
    engine loads (None: merged weights)."""
    return cfg.model.lora if cfg.rollout.lora_sync == "adapter" else None


def _replays(cfg: Config) -> bool:
    """MoE routing replay (``algorithm.routing_replay``): the actor replays routing (and records it: ``old``)."""
    return cfg.algorithm.routing_replay in ("rollout", "old")


def _records_rollout(cfg: Config) -> bool:
    """R3 (and ``measure``): the rollout records each token's experts for the actor to replay (or compare)."""
    return cfg.algorithm.routes_from_rollout


def role_common(cfg: Config) -> dict:
    """The engine settings every role is built with."""
    m = cfg.model
    return dict(device=m.device, attn_implementation=m.attn_implementation, threads=cfg.run.threads)


def rollout_init(cfg: Config, model_path: str) -> dict:
    """The rollout role's constructor arguments outside a step plan (``relayrl eval --recipe``)."""
    return _rollout(cfg, role_precision(cfg.model, cfg.rollout), model_path, role_common(cfg))


ROLES: tuple[Role, ...] = (
    Role("actor", PolicyWorker, lambda cfg, plan, prec, path, common: dict(
        model_path=path, engine=cfg.train_engine(), total_steps=_updates(cfg), seed=cfg.run.seed, tri_model=plan.tri_model,
        lora=cfg.model.lora, chat_template=cfg.model.template(), routing_replay=_replays(cfg),
        routing_compare=cfg.algorithm.routing_replay == "measure", export_dtype=cfg.model.export_dtype,
        relay_adapter=_adapter(cfg) is not None, **prec["trained"], **common)),
    Role("critic", CriticWorker, lambda cfg, plan, prec, path, common: dict(
        model_path=path, engine=cfg.train_engine(optim=cfg.critic.optim), total_steps=_updates(cfg),
        seed=cfg.run.seed, lora=cfg.model.lora, **prec["trained"], **common)),
    Role("rollout", RolloutWorker, lambda cfg, plan, prec, path, common: dict(
        _rollout(cfg, prec, path, common), record_routing=_records_rollout(cfg), adapter=_adapter(cfg)),
         own_process=True, devices_per_rank=lambda cfg: cfg.rollout.devices_per_rank),
    Role("reference", ReferenceWorker, lambda cfg, plan, prec, path, common: dict(
        model_path=path, engine=cfg.engine, **prec["frozen"], **common)),
    Role("teacher", ReferenceWorker, lambda cfg, plan, prec, path, common: dict(  # a frozen model's log-probs
        model_path=cfg.algorithm.distill.teacher, engine=cfg.engine, **prec["frozen"], **common)),
)


class Pools:
    """The run's resource pools by name: ``main`` (the actor's) and the placement's others."""

    def __init__(self, cfg: Config, main: ResourcePool) -> None:
        self.cfg, self.main, self._pools = cfg, main, {}

    def __call__(self, name: str) -> ResourcePool:
        if name == "main":
            return self.main
        if name not in self._pools:  # 'driver': the driver's own threads (turns of their own, no device)
            pl = self.cfg.placement
            self._pools[name] = ResourcePool(name=name, devices=pl.pools.get(name, 1),
                                             device_kind="cpu" if name == "driver" else self.main.device_kind,
                                             node=pl.nodes.get(name), pack=pool_pack(self.cfg, name))
        return self._pools[name]

    def of(self, plan: StepPlan) -> list[ResourcePool]:
        """The pools the groups of ``plan`` are placed on, each once (colocated roles share one), the reward
        scorer's too when it has one (``placement.reward``)."""
        names = [plan.pools[r] for r in plan.roles] + [self.cfg.placement.reward]
        return [self(n) for n in dict.fromkeys(names) if n != "driver"]


def build_roles(cfg: Config, plan: StepPlan, pools: Pools, model_path: str) -> dict[str, WorkerGroup]:
    """A worker group for every role of ``plan``, each on its pool (in :data:`ROLES` order), once the pools are
    known to fit together (on Ray: refused before any model loads, naming them all)."""
    check_fit(cfg.cluster, pools.of(plan))
    common = role_common(cfg)
    prec = role_precision(cfg.model, cfg.rollout)
    groups: dict[str, WorkerGroup] = {}
    for role in ROLES:
        if role.name not in plan.roles:
            continue
        pool = plan.pools[role.name]
        cluster: ClusterConfig = cfg.cluster
        if role.own_process and pool != "main":
            cluster = cluster.model_copy(update={"in_process": False})
        groups[role.name] = make_group(cluster, role.worker, pools(pool), role.name,
                                       init_kwargs=role.init(cfg, plan, prec, model_path, common),
                                       devices_per_rank=role.devices_per_rank(cfg))
    return groups


def placed_config(cfg: Config) -> Config:
    """``cfg`` ready to place: ``run.threads`` set to every rank's share of the cores when the run is on a CPU
    and declares pools (a CPU device is a share of the cores), and the dock's storage units reachable from a
    rollout in its own process (units in processes of their own on the local backend, Ray actors on Ray)."""
    pl, cl = cfg.placement, cfg.cluster
    # some rank lives outside the driver (on Ray every group is an actor: the rollout on main, the scorer of
    # placement.reward's pool)
    outside = pl.split or cl.devices * cl.nodes > 1 or not cl.in_process or cl.backend == "ray"
    if outside and cfg.dock.backend == "local":
        backend = "ray" if cfg.cluster.backend == "ray" else "process"
        cfg = cfg.model_copy(update={"dock": cfg.dock.model_copy(update={"backend": backend})})
    kind, cores = available_devices(cfg)
    if kind != "CPU core" or not pl.pools or cfg.run.threads:
        return cfg
    per = max(1, cores // (cfg.cluster.devices + sum(pl.pools.values())))
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"threads": per})})


def check_teacher(path: str, tokenizer) -> None:
    """Refuse a teacher whose tokenizer differs from the student's: its log-probs would score other tokens."""
    from relayrl.models.load import load_tokenizer

    if load_tokenizer(path).get_vocab() != tokenizer.get_vocab():
        raise SettingError(f"algorithm.distill.teacher={path!r} has a tokenizer other than the student's (model.path "
                           f"or the tiny default): on-policy distillation compares the two models token by token; "
                           f"give a teacher with the student's tokenizer")
