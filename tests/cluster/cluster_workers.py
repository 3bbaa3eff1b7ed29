"""Worker classes used by the cluster tests (importable by spawned ranks and Ray actors)."""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from relayrl.cluster import Worker


@dataclass
class Rows:
    """A batch-like object with `split(n)` and a `concat` classmethod."""

    values: list

    def split(self, n: int) -> list["Rows"]:
        k, out = len(self.values), []
        for r in range(n):
            out.append(Rows(self.values[r * k // n:(r + 1) * k // n]))
        return out

    @classmethod
    def concat(cls, parts: list["Rows"]) -> "Rows":
        return cls([v for p in parts for v in p.values])


class Probe:
    """Shared (in-process only) record of which methods were running when."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.order: list[str] = []

    def enter(self, tag: str) -> None:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.order.append(tag)

    def leave(self) -> None:
        with self.lock:
            self.active -= 1


class Echo(Worker):
    def __init__(self, tag: str = "echo", probe: Probe | None = None, fail_init: bool = False) -> None:
        if fail_init:
            raise RuntimeError(f"init failed on rank {self.rank}")
        self.tag = tag
        self.probe = probe
        self.preloaded = "transformers.modeling_utils" in sys.modules

    def whoami(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
                "device": str(self.device), "group": self.group_name, "pid": os.getpid(), "tag": self.tag,
                "distributed": self.distributed, "env_rank": os.environ.get("RANK")}

    def owned(self) -> dict:
        """The devices this rank owns and its torch thread count."""
        return {"device": str(self.device), "devices": [str(d) for d in self.devices],
                "threads": torch.get_num_threads()}

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def start_method(self) -> str:
        import multiprocessing

        return multiprocessing.get_start_method(allow_none=True) or "?"

    def modules_at_start(self) -> bool:
        """Whether transformers was imported before this worker was constructed (a preloaded fork server)."""
        return self.preloaded

    def echo(self, x, scale: int = 1):
        return (self.rank, x * scale)

    def tag_items(self, items, offset: int = 0):
        return [(self.rank, i + offset) for i in items]

    def double(self, t):
        return t * 2

    def rows_plus_rank(self, rows: Rows) -> Rows:
        return Rows([v + 100 * self.rank for v in rows.values])

    def identity(self, obj):
        return obj

    def boom(self, on_rank: int | None = None):
        if on_rank is None or self.rank == on_rank:
            raise ValueError(f"boom on rank {self.rank}")
        return self.rank

    def user_mistake(self, path: str):
        """Every rank meets the same bad dataset row: a user error, whose message crosses the wire."""
        from relayrl.data.datasets import DatasetError

        raise DatasetError(f"{path} row 3: field 'answer' is missing (columns present: prompt)")

    def unpicklable(self):
        return threading.Lock()

    def lose_a_unit(self):
        """A dock storage unit this rank writes to is gone (relayrl.errors.ProcessLost)."""
        from relayrl.dock import UnitLostError

        raise UnitLostError("storage unit 0 (pid 4242) died (killed by signal SIGKILL); its rows are lost [put_many]",
                            node_id="node-of-the-unit")  # (Ray: a restart waits until this node is marked dead)

    def all_reduce_rank(self) -> float:
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    def all_gather_rank(self) -> list[int]:
        out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
        dist.all_gather(out, torch.tensor([self.rank * 10]))
        return [int(t.item()) for t in out]

    def exit_or_reduce(self, dying_rank: int, code: int = 7) -> float:
        if self.rank == dying_rank:
            os._exit(code)
        return self.all_reduce_rank()

    def sleep_then_reduce(self, sleeper: int, hold_s: float) -> float:
        """Rank ``sleeper`` sleeps ``hold_s``, the others wait for it in an all_reduce."""
        if self.rank == sleeper:
            time.sleep(hold_s)
        return self.all_reduce_rank()

    def timed(self, tag: str, hold_s: float = 0.05) -> str:
        self.probe.enter(tag)
        try:
            time.sleep(hold_s)
        finally:
            self.probe.leave()
        return tag

    def hold(self, release: threading.Event) -> str:
        if not release.wait(timeout=30):
            raise TimeoutError("never released")
        return "held"

    def block(self, on_ranks: tuple = (), hold_s: float = 0.0) -> int:
        """The ranks in ``on_ranks`` hang outside any collective (wait on an event nobody sets); the others
        sleep ``hold_s`` and answer their rank."""
        if self.rank in on_ranks:
            threading.Event().wait()
        time.sleep(hold_s)
        return self.rank

    def meet(self, barrier: threading.Barrier) -> int:
        return barrier.wait()  # raises BrokenBarrierError unless another group's rank meets it concurrently

    @staticmethod
    def add(a: int, b: int) -> int:
        return a + b

    @classmethod
    def kind(cls) -> str:
        return cls.__name__


class StuckStart(Worker):
    """Writes its pid to ``pid_dir/rank<r>``; rank ``hang_rank`` then never finishes its construction."""

    def __init__(self, pid_dir: str, hang_rank: int) -> None:
        with open(os.path.join(pid_dir, f"rank{self.rank}"), "w") as f:
            f.write(str(os.getpid()))
        if self.rank == hang_rank:
            threading.Event().wait()


class LoudEcho(Echo):
    """Inherits Echo's methods but ``echo``, which it overrides."""

    def echo(self, x, scale: int = 1):
        return ("loud", self.rank, x * scale)


class Bars(Worker):
    """Draws a tqdm progress bar in its rank process (as model loading does)."""

    def __init__(self) -> None:
        import tqdm

        list(tqdm.tqdm(range(3), disable=False))

    def ping(self) -> int:
        return self.rank


class CountsPickles:
    """A payload that counts how often the driver pickles it."""

    pickled = 0

    def __init__(self, value: int) -> None:
        self.value = value

    def __getstate__(self) -> dict:
        CountsPickles.pickled += 1
        return {"value": self.value}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CountsPickles) and other.value == self.value

    def __mul__(self, k: int) -> "CountsPickles":
        return CountsPickles(self.value * k)

    def __add__(self, k: int) -> "CountsPickles":
        return CountsPickles(self.value + k)


class TPEngine(Worker):
    """A rank that starts a vLLM engine over its ``devices`` (``tensor_parallel_size`` = how many it owns)."""

    def __init__(self, model_dir: str) -> None:
        from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine, VLLMSpec
        from relayrl.models.load import load_tokenizer
        from tests.vllm_cache import KV_CACHE_BYTES

        self.engine = VLLMGenerationEngine(model_dir, load_tokenizer(model_dir), max_batch=4, device=self.device,
                                           devices=self.devices,
                                           spec=VLLMSpec(memory_utilization=0.05, kv_cache_bytes=KV_CACHE_BYTES,
                                                         tensor_parallel_size=len(self.devices)))

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def children(self) -> list[int]:
        """The pids of this rank's live child processes (its vLLM workers among them)."""
        from tests.procs import descendants

        return descendants()

    def sample(self, prompt: list[int]) -> list[int]:
        """Four tokens sampled from ``prompt`` (seeded)."""
        from relayrl.engines.generation.base import SamplingParams

        out = self.engine.generate([prompt], SamplingParams(n=1, temperature=1.0, max_new_tokens=4),
                                   torch.Generator().manual_seed(0))
        return out[0].token_ids.tolist()

    def close(self) -> None:
        self.engine.close()


class Parent(Worker):
    """Starts processes of its own, as a rank starting a vLLM engine core or a user's reward server does."""

    def __init__(self) -> None:
        self.children: list = []

    def pid(self) -> int:
        return os.getpid()

    def start_child(self) -> int:
        """Start a child that would run for ten minutes; its pid."""
        import subprocess

        self.children.append(subprocess.Popen(["sleep", "600"]))
        return self.children[-1].pid

    def start_grandchild(self) -> tuple[int, int]:
        """Start a shell that starts a ten-minute child of its own (as a vLLM engine core starts its workers):
        (the shell's pid, its child's)."""
        import subprocess

        self.children.append(subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE,
                                              text=True))
        return self.children[-1].pid, int(self.children[-1].stdout.readline())

    def start_child_then_hang(self, pid_file: str) -> None:
        """Start a child, write its pid to ``pid_file``.<rank>, then hang (for ``cluster.call_timeout_s``)."""
        pid = self.start_child()
        with open(f"{pid_file}.{self.rank}", "w") as f:
            f.write(str(pid))
        threading.Event().wait()

    def start_child_then_sleep(self, pid_file: str, seconds: float) -> int:
        """Start a child, write its pid to ``pid_file``.<rank>, then work (sleep) for ``seconds``: a long call."""
        pid = self.start_child()
        with open(f"{pid_file}.{self.rank}", "w") as f:
            f.write(str(pid))
        time.sleep(seconds)
        return pid
