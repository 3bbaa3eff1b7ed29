"""How one vLLM engine spans several devices (``rollout.vllm.tensor_parallel_size`` N > 1): the devices its
worker processes see, the environment they start with, and how a weight update reaches every one of them. A
model on vLLM's Transformers backend runs its one worker in a process of its own the same way (N = 1; the
reason is in :mod:`relayrl.engines.generation.vllm_engine`).

vLLM's multiprocess executor (``distributed_executor_backend="mp"``) starts one worker per device and splits
every layer over them (Megatron-LM's column- and row-parallel layers: each worker holds 1/N of the weights and
key/value heads, two all-reduces per layer). The engine core stays in the rollout rank's process
(:mod:`relayrl.engines.generation.vllm_engine`); this module is what differs from a single in-process worker:

- **Devices.** The rank's own (:attr:`relayrl.cluster.RankInfo.devices`): on CUDA the workers see exactly
  those GPUs (``CUDA_VISIBLE_DEVICES`` while the engine starts them, worker i on the i-th); on CPU each runs its
  device's share of the rank's torch threads, not pinned to cores (``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless
  set). relayrl's own ``RANK``/``LOCAL_RANK``/... are left out of their environment.
- **Weights.** Every worker gets every full Hugging Face tensor and vLLM's weight loaders keep its shard (they
  narrow the split dimensions). :func:`send` hands them over in buckets of at most :data:`BUCKET_BYTES` through
  ``collective_rpc``, between one ``initialize_layerwise_reload`` and one ``finalize_layerwise_reload`` on every
  worker: what ``model_runner.reload_weights`` does in one call, cut so no message holds the whole model. On CPU
  the tensors' bytes go through vLLM's shared-memory queue; on CUDA each tensor is copied to the rank's first
  GPU and sent as a CUDA IPC handle, which every worker opens on that GPU (found by its UUID) before its loader
  copies its shard to its own GPU. verl's and vLLM's own IPC weight transfer hand each worker a copy on its own
  GPU instead (from the trainer rank colocated there); here the rank holds one copy.
- Sleep, wake-up and the prefix cache need nothing of this: vLLM's executor sends sleep and wake-up to every
  worker, and the prefix cache is the scheduler's, in the engine core's process.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterable, Iterator, Sequence

import torch

from relayrl.errors import UserError

__all__ = ["BUCKET_BYTES", "RANK_ENV", "tp_devices", "worker_env", "check_heads_split", "send", "encoded", "buckets",
           "ipc_handle", "open_tensor", "begin_reload", "load_bucket", "finish_reload", "forget_cpu_moe_kernels"]

BUCKET_BYTES = 1 << 30
"""Most bytes of weights one ``collective_rpc`` carries to the workers (on CUDA: also the most a rank copies to
its first GPU at once)."""


def tp_devices(device: torch.device, devices: Sequence[str | torch.device] | None, tp: int) -> tuple[torch.device, ...]:
    """The ``tp`` devices the engine's workers run on: ``devices`` (a rank's, ``device`` first), or on CPU ``tp``
    times the CPU, on CUDA ``device`` and the GPUs after it."""
    if devices is None:
        devices = [device] * tp if device.type == "cpu" else [f"cuda:{(device.index or 0) + i}" for i in range(tp)]
    out = tuple(torch.device(d) for d in devices)
    if len(out) != tp:
        raise UserError(f"rollout.vllm.tensor_parallel_size={tp}, but this rollout rank owns {len(out)} device(s) "
                        f"({', '.join(map(str, out))}): the group must give each rank {tp} devices")
    if out[0] != device and not (device.type == out[0].type == "cuda" and device.index is None):
        raise ValueError(f"the engine's device {device} is not the first of its devices {list(map(str, out))}")
    return out


RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""torch.distributed's variables, which a relayrl rank process holds for its own group."""


@contextlib.contextmanager
def worker_env(devices: tuple[torch.device, ...], apart: bool | None = None) -> Iterator[None]:
    """The environment vLLM's worker processes start with, set while the engine starts them (one per device;
    nothing when the single device's worker runs in this process: ``apart`` False, by default with one device):
    on CUDA ``CUDA_VISIBLE_DEVICES`` lists exactly this rank's GPUs (worker i takes the i-th), on CPU each runs
    its device's share of this process's torch threads (a CPU device is a share of the cores), unpinned unless
    ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise. The variables of relayrl's own process group (``RANK``,
    ``LOCAL_RANK``, ...: this rank's place among the rollout ranks) are left out: the workers form vLLM's group,
    and vLLM reads ``LOCAL_RANK`` as the place of the process it runs in."""
    if not (len(devices) > 1 if apart is None else apart):
        yield
        return
    threads = torch.get_num_threads()
    if devices[0].type == "cuda":
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [i.strip() for i in seen.split(",")] if seen else [str(i) for i in range(torch.cuda.device_count())]
        env = {"CUDA_VISIBLE_DEVICES": ",".join(ids[d.index or 0] for d in devices)}
    else:
        env = {"OMP_NUM_THREADS": str(max(1, threads // len(devices))),
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    # (on CUDA vLLM sets OMP_NUM_THREADS and this process's torch threads for its workers: both come back too)
    old = {k: os.environ.get(k) for k in (*env, "OMP_NUM_THREADS", *RANK_ENV)}
    for k in RANK_ENV:
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def check_heads_split(model_dir: str, tp: int) -> None:
    """vLLM splits the attention heads evenly over its tensor-parallel workers; say so before it starts them."""
    from transformers import AutoConfig

    heads = AutoConfig.from_pretrained(model_dir, local_files_only=True).num_attention_heads
    if heads % tp:
        fits = [n for n in range(1, heads + 1) if heads % n == 0]
        raise UserError(f"rollout.vllm.tensor_parallel_size={tp}: vLLM splits the model's {heads} attention heads "
                        f"evenly over its {tp} workers; the model in {model_dir} cannot be split so: set "
                        f"rollout.vllm.tensor_parallel_size to one of {fits} (and the rollout's pool to a multiple)")


def send(rpc: Callable, named: Iterable[tuple[str, torch.Tensor]], devices: tuple[torch.device, ...]) -> None:
    """Every worker of the engine on ``devices`` loads every ``(name, tensor)`` of ``named`` (Hugging Face names,
    read once: a stream is cut into buckets as it comes, one bucket held at a time), bucket by bucket, between
    one start and one finish of vLLM's layerwise reload. ``rpc``: the engine's
    ``collective_rpc``, which runs a function on every worker and returns one result per worker."""
    rpc(begin_reload)
    for bucket in buckets(named, BUCKET_BYTES):
        with encoded(bucket, devices[0]) as payload:
            counts = rpc(load_bucket, args=(payload,))  # one count per worker
        if counts != [len(bucket)] * len(devices):
            raise RuntimeError(f"vLLM tensor-parallel workers loaded {counts} of a bucket of {len(bucket)} "
                               f"tensors (each should load all)")
    rpc(finish_reload)


@contextlib.contextmanager
def encoded(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> Iterator[list]:
    """``bucket`` as ``collective_rpc`` carries it to the worker processes: on CPU the tensors (their bytes go
    through vLLM's shared-memory queue); on CUDA CUDA IPC handles of copies on ``device`` (the rank's first GPU),
    kept alive here until every worker has loaded them."""
    if device.type != "cuda":
        yield [(n, t.detach()) for n, t in bucket]
        return
    held = [(n, t.detach().to(device).contiguous()) for n, t in bucket]
    torch.cuda.synchronize(device)  # the copies are complete before another process reads them
    try:
        yield [(n, ipc_handle(t)) for n, t in held]
    finally:
        del held
        torch.cuda.ipc_collect()  # (the copies' memory goes back once the workers have let go of it)


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``named`` in order, cut into lists of at most ``max_bytes`` (a tensor larger than that is a list alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def ipc_handle(t: torch.Tensor) -> tuple[str, tuple]:
    """A CUDA tensor as another process opens it: (its GPU's UUID, ``rebuild_cuda_tensor``'s arguments)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    return str(torch.cuda.get_device_properties(t.device).uuid), args


def open_tensor(x, device: torch.device) -> torch.Tensor:
    """A tensor sent by :func:`encoded`, in a worker process: a CPU tensor as it came; an
    IPC handle opened on the GPU it names (the sender's first GPU, among this worker's visible ones)."""
    if isinstance(x, torch.Tensor):
        return x
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid, args = x
    index = next((i for i in range(torch.cuda.device_count())
                  if str(torch.cuda.get_device_properties(i).uuid) == uuid), None)
    if index is None:
        raise RuntimeError(f"vLLM worker on {device}: the weights' GPU {uuid} is not among its visible GPUs")
    args = list(args)
    args[6] = index  # (rebuild_cuda_tensor's storage device, in this process's numbering)
    return rebuild_cuda_tensor(*args)


def begin_reload(worker) -> bool:
    """Runs on every tensor-parallel worker: start vLLM's layerwise reload (weights then come in buckets)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    model = worker.model_runner.get_model()
    forget_cpu_moe_kernels(model, worker.device)
    initialize_layerwise_reload(model)
    return True


def forget_cpu_moe_kernels(model: torch.nn.Module, device: torch.device) -> int:
    """Runs on a vLLM worker before a reload: on CPU, drop each MoE layer's kernel so that the reload sets it up
    as the first load did. vLLM 0.32 repacks an MoE layer's experts into its CPU kernel's layout only on the first
    load (``_setup_kernel`` skips ``fused_experts.process_weights_after_loading`` once a kernel exists), so a
    reload copied the new experts in the checkpoint's layout into storage the kernel reads as packed: its
    log-probs were 22 nats off after one update. Without a kernel the reload packs them again, then copies the
    packed tensors into the storage the model holds. GPUs keep their kernel (they pack nothing, and CUDA graphs
    hold its tensors). Returns how many kernels were dropped."""
    if torch.device(device).type != "cpu":
        return 0
    dropped = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None and hasattr(method, "_setup_kernel"):
            method.moe_kernel = None
            dropped += 1
    return dropped


def load_bucket(worker, bucket: list) -> int:
    """Runs on every tensor-parallel worker: load a bucket of full Hugging Face tensors (its loaders keep the
    worker's shard); returns how many it was given."""
    model = worker.model_runner.get_model()
    model.load_weights([(name, open_tensor(x, worker.device)) for name, x in bucket])
    return len(bucket)


def finish_reload(worker) -> bool:
    """Runs on every tensor-parallel worker: finish the layerwise reload (the loaded weights replace the old)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(worker.model_runner.get_model(), worker.model_runner.model_config)
    return True
