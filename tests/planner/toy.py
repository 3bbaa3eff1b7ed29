"""A toy profile and workload with round numbers, for hand-worked simulator cases."""

from __future__ import annotations

from relayrl.planner.profile import Affine, DecodeCost, DeviceProfile, Profile, RewardCost
from relayrl.planner.workload import LengthDist, ModelShape, Workload

SHAPE = ModelShape(params=1000, layers=1, hidden=8, kv_dim=8, vocab=16)


def toy_profile(*, decode_s: float = 0.1, train_token_s: float = 0.0, kind: str = "gpu", memory_gib: float = 80.0,
                reward_row_s: float = 0.0, concurrency: int = 8, optimizer_s: float = 0.0) -> Profile:
    """Decode costs ``decode_s`` per step whatever the rows, training ``train_token_s`` per token; everything
    else free (no prefill, relay, dock, collective, overhead)."""
    dev = DeviceProfile(kind=kind, threads=1 if kind == "cpu" else 0, memory_gib=memory_gib,
                        decode=DecodeCost(base_s=decode_s, row_s=0.0), prefill=Affine(), train=Affine(per_s=train_token_s),
                        logprob=Affine(per_s=train_token_s / 3), optimizer_s=optimizer_s)
    return Profile(name="toy", source="hand-worked test numbers", cores=2 if kind == "cpu" else 0,
                   model_params=SHAPE.params, model_layers=1, model_hidden=8, model_kv_dim=8,
                   devices={"toy": dev}, relay=Affine(), dock_put=Affine(), dock_get=Affine(), collective=Affine(),
                   reward=RewardCost(row_s=reward_row_s, concurrency=concurrency))


def toy_workload(prompts: int = 2, n: int = 1, *, max_new_tokens: int = 64, shape: ModelShape = SHAPE,
                 **kw) -> Workload:
    kw.setdefault("lengths", LengthDist(kind="mixture", short=4, max_new_tokens=max_new_tokens))
    kw.setdefault("feed_last", True)  # units of the prompt + every response token: the tests' hand figures
    return Workload(prompts=prompts, n=n, prompt_tokens=1, model=shape, **kw)
