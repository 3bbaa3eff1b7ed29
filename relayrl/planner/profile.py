"""A hardware profile: what one device costs for each kind of work a GRPO step does.

HybridFlow's auto-mapping (§6, Algorithm 1) and AsyncFlow's resource planner both rest
on a cost model of the stages on a device; this is relayrl's. A profile is written by ``relayrl plan
--profile`` (a calibration with relayrl's own engines on the present machine, :mod:`.calibrate`) or by hand
for hardware one does not have (``relayrl/planner/profiles/h100_7b.yaml``): every field is a number a user
can read off a benchmark or a datasheet.

Each cost is affine in the work it is given, fitted to measurements:

* decode step (one token for every row in flight): ``base_s + row_s * rows + row_ctx_s * rows * context``;
* prefill of prompts (or a partial-rollout refill): ``base_s + token_s * tokens``;
* a training micro-batch, forward + backward: ``base_s + token_s * tokens``; a log-prob pass forward only;
* the optimizer step, the weight relay (``base_s + bytes / bytes_per_s``), a dock put/get per call and
  per row, a data-parallel collective (``base_s + bytes / bytes_per_s``);
* a reward call of the user's function: ``call_s + row_s * rows`` (the function's own CPU cost; latency of
  an outside judge or harness is part of the *workload*, :class:`relayrl.planner.workload.Workload`);
* per driver path (``overhead``): factors on those costs, a fixed cost per training call and per generation
  call, and a fixed per-step cost, measured by short real runs of each path on two calibration workloads
  (short and long responses, so that a fixed cost and a factor can be told apart; the engines run slower
  inside their worker processes, beside the driver, the dock and each other, than in a micro-benchmark:
  this is the harness's share).

Where this simplifies: costs are measured for one model (``model_params``) and scale linearly with the
parameter count for another (compute-bound); no kernel-level effects (batch sizes that fall off a GPU's
efficient tiles) beyond the affine fit; on a CPU the devices of concurrent pools are assumed not to slow
each other (a share of the cores each).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Affine", "DecodeCost", "DeviceProfile", "RewardCost", "Overhead", "PathCost", "Profile", "load_profile",
           "save_profile"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Affine(_Model):
    """``base_s + per_s * amount`` (seconds); ``amount`` is tokens, rows or bytes as the field says."""

    base_s: float = Field(0.0, ge=0.0, description="fixed cost of one call (seconds)")
    per_s: float = Field(0.0, ge=0.0, description="cost of one unit (token, row or byte) in seconds")

    def __call__(self, amount: float) -> float:
        return self.base_s + self.per_s * amount


class DecodeCost(_Model):
    """One decode step of the native engine: every row in flight gets one token."""

    base_s: float = Field(..., ge=0.0, description="fixed cost of a step (kernel launches, sampling, Python)")
    row_s: float = Field(..., ge=0.0, description="cost per row in flight (weights re-read amortised over rows)")
    row_ctx_s: float = Field(0.0, ge=0.0, description="cost per row per token of context (attention over the "
                             "KV cache)")

    def __call__(self, rows: float, context: float) -> float:
        return self.base_s + self.row_s * rows + self.row_ctx_s * rows * context


class PathCost(_Model):
    """How one driver path runs the engines: factors on the micro-benchmarked costs (the engine inside its
    worker process, beside the driver's threads, the dock and the other ranks, versus alone) and a fixed
    per-step cost of the driver. Measured by a short real run of the path (:mod:`.calibrate`)."""

    generate: float = Field(1.0, gt=0.0, description="factor on decode and prefill costs")
    train: float = Field(1.0, gt=0.0, description="factor on training, log-prob and optimizer costs")
    step_s: float = Field(0.0, ge=0.0, description="fixed per-step cost (dispatch, dock bookkeeping, metrics)")
    call_s: float = Field(0.0, ge=0.0, description="fixed cost of one training-pool call beyond the engine's "
                          "(reading its rows from the dock, the RL loss and its metrics, the dispatch): paid per "
                          "streamed chunk, per forward-only pass and per whole-batch update")
    generate_call_s: float = Field(0.0, ge=0.0, description="fixed cost of one rank's generation of a batch "
                                   "beyond the engine's decode and prefill (the call, the dock's reservations)")


class Overhead(_Model):
    """The driver's cost per path (:func:`relayrl.planner.simulate.path_key`): a synchronous colocated step on one
    rank (``colocated``) and on several (``colocated_dp``, data parallel), and every other placement
    (``dataflow``: split pools, periodic, off-policy). One step implementation runs them all
    (:mod:`relayrl.workflows.pipeline`); they cost differently because their stages wait for different things."""

    colocated: PathCost = PathCost()
    colocated_dp: PathCost = PathCost()
    dataflow: PathCost = PathCost()
    concurrent: PathCost | None = Field(None, description="CPU: the dataflow's factors while both pools compute "
                                        "at once (they share the cores); null: no slowdown")
    per_group_s: float = Field(0.0, ge=0.0, description="dataflow: stage dispatch per prompt group")
    chunk_s: float = Field(0.0, description="dataflow, streamed update (periodic, off-policy): the trainer's "
                           "time per chunk beyond a training call's (``dataflow.call_s``, fitted on whole-batch "
                           "runs), measured by periodic runs; down to -dataflow.call_s, when a chunk's call costs "
                           "less than a whole batch's")

    @model_validator(mode="after")
    def _chunk_not_below_a_free_call(self) -> "Overhead":
        if self.chunk_s < -self.dataflow.call_s - 1e-12:
            raise ValueError(f"overhead.chunk_s={self.chunk_s:g}: a streamed chunk's call would cost "
                             f"{self.dataflow.call_s + self.chunk_s:g} s, below 0 (chunk_s >= -dataflow.call_s="
                             f"{-self.dataflow.call_s:g})")
        return self


class DeviceProfile(_Model):
    """Costs on one device of a kind: a GPU, or on a CPU a share of the cores (``threads`` torch threads)."""

    kind: Literal["cpu", "gpu"]
    threads: int = Field(0, ge=0, description="CPU: torch threads of a rank on this device; 0 for a GPU")
    memory_gib: float = Field(..., gt=0, description="memory a rank may use on this device")
    decode: DecodeCost
    prefill: Affine = Field(..., description="prefill: per_s per prompt token")
    train: Affine = Field(..., description="forward + backward of one micro-batch: per_s per token")
    logprob: Affine = Field(..., description="forward-only log-prob pass of one micro-batch: per_s per token")
    optimizer_s: float = Field(..., ge=0.0, description="one AdamW step over all the model's parameters on one rank")


class RewardCost(_Model):
    """The user's reward function timed in the driver (its own CPU or process-spawn cost, no outside latency)."""

    fn: str = Field("task", description="what was timed: 'task' (the built-in verifier) or module:function")
    call_s: float = Field(0.0, ge=0.0)
    row_s: float = Field(0.0, ge=0.0)
    concurrency: int = Field(8, ge=1, description="reward calls in flight on the dataflow (placement.reward=driver)")


class Profile(_Model):
    """A machine's profile: device kinds and the costs shared by all of them (relay, dock, collectives)."""

    name: str = Field(..., description="what was measured, e.g. 'cpu-2core (calibrated)' or 'H100 SXM (assumed)'")
    source: str = Field(..., description="how the numbers were obtained: 'calibrated with relayrl plan --profile "
                        "on HOST at TIME' or the published figures and assumptions used")
    cores: int = Field(0, ge=0, description="CPU: cores of the machine (a device is a share of them)")
    model_params: int = Field(..., gt=0, description="parameters of the model the costs were measured with; "
                              "another model's costs scale by its parameter count")
    model_layers: int = Field(..., gt=0)
    model_hidden: int = Field(..., gt=0)
    model_kv_dim: int = Field(..., gt=0, description="key/value width per layer (kv heads x head dim)")
    devices: dict[str, DeviceProfile] = Field(..., description="device kinds by name; a CPU profile has one per "
                                              "thread count it measured ('cpu-t1', 'cpu-t2')")
    relay: Affine = Field(..., description="weight relay trainer -> rollout: per_s per byte")
    dock_put: Affine = Field(..., description="dock put: per_s per row")
    dock_get: Affine = Field(..., description="dock get: per_s per row")
    collective: Affine = Field(..., description="data-parallel all-gather / reduce-scatter: per_s per byte")
    reward: RewardCost = RewardCost()
    overhead: Overhead = Overhead()

    @model_validator(mode="after")
    def _check(self) -> "Profile":
        if not self.devices:
            raise ValueError("devices: a profile needs at least one device kind (e.g. devices.cpu-t1 or "
                             "devices.h100)")
        kinds = {d.kind for d in self.devices.values()}
        if len(kinds) > 1:
            raise ValueError(f"devices: mixes kinds {sorted(kinds)}; write one profile per machine kind")
        if "cpu" in kinds and not self.cores:
            raise ValueError("cores: a CPU profile must say how many cores the machine has (a device is a share)")
        return self

    def device_for(self, threads: int) -> tuple[str, DeviceProfile]:
        """The device kind a rank runs on: on a CPU the entry with ``threads`` threads (or the nearest one
        measured), on a GPU the one GPU kind."""
        items = list(self.devices.items())
        if items[0][1].kind == "gpu":
            return items[0]
        return min(items, key=lambda kv: (abs(kv[1].threads - threads), -kv[1].threads))

    def scaled(self, name: str, generate: float, train: float) -> "Profile":
        """This profile with device ``name``'s generation costs times ``generate`` and training costs times
        ``train``."""
        d = self.devices[name]
        mul = lambda a, f: a.model_copy(update={k: v * f for k, v in a.model_dump().items()})  # noqa: E731
        dev = d.model_copy(update={"decode": mul(d.decode, generate), "prefill": mul(d.prefill, generate),
                                   "train": mul(d.train, train), "logprob": mul(d.logprob, train),
                                   "optimizer_s": d.optimizer_s * train})
        return self.model_copy(update={"devices": {**self.devices, name: dev}})

    def scale(self, params: int) -> float:
        """Cost factor of a model with ``params`` parameters relative to the profiled one (compute-bound)."""
        return params / self.model_params


def load_profile(path: str | Path) -> Profile:
    """Read a profile from JSON or YAML; errors name the field."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"profile {p} does not exist: write one with `relayrl plan --profile --out {p}` "
                                f"or by hand (see relayrl/planner/profiles/h100_7b.yaml)")
    import yaml
    from pydantic import ValidationError

    kind = "YAML" if p.suffix in (".yaml", ".yml") else "JSON"
    try:
        text = p.read_text(encoding="utf-8")
        data = yaml.safe_load(text) if kind == "YAML" else json.loads(text)
    except (ValueError, yaml.YAMLError) as e:  # (undecodable bytes and JSON's errors are ValueErrors)
        raise ValueError(f"profile {p} is not valid {kind}: {e}") from None
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        from relayrl.config.loader import field_errors

        raise ValueError(f"profile {p}: {'; '.join(field_errors(e, Profile))}") from None


def save_profile(profile: Profile, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix in (".yaml", ".yml"):
        import yaml

        p.write_text(yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    else:
        p.write_text(json.dumps(profile.model_dump(mode="json"), indent=2) + "\n")
    return p
