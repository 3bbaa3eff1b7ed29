"""The one exception a failing worker surfaces as in the driver.

Whether the rank ran in the driver, in a spawned process or in a Ray actor,
and whether it raised or died, the driver sees a `WorkerError` naming the group,
the rank and the method, with the remote traceback text (or the exit reason).
When the rank's error was the user's to fix (`relayrl.errors.is_user_error`),
`user_message` holds its message, so the CLI can print one line instead of the
remote traceback; `other_ranks` lists the ranks that failed with the same message. Ranks that did not answer
within the call's limit (`cluster.call_timeout_s`, or `start_timeout_s` at start-up) surface as
`CallTimeout`, a `WorkerError` naming them and the ranks that did answer.
"""
from __future__ import annotations

from relayrl.errors import UserError


class WorkerError(RuntimeError):
    """A rank of a worker group raised or died while running a method.

    Attributes:
        group: the worker group's name.
        rank: the failing rank (0-based).
        method: the method being run (`"__init__"` for construction).
        remote_traceback: the traceback text from the rank, or why it died.
        user_message: the error's message when it is the user's to fix (bad data, model path, ...), else None.
        other_ranks: further ranks that failed in the same call with the same user message.
        lost: the rank's process (or Ray actor) died rather than raised: the worker is gone, which
            ``run.max_restarts`` may recover from by recreating the groups from the last checkpoint; also set
            when the rank raised because a process it depends on was lost (``relayrl.errors.ProcessLost``: a
            dock storage unit), which a restart recovers from too.
        node_id: Ray: the id of the node the lost rank ran on (a restart waits until Ray has marked it dead).
    """

    def __init__(self, group: str, rank: int, method: str, remote_traceback: str,
                 user_message: str | None = None, lost: bool = False, node_id: str | None = None) -> None:
        self.lost = lost
        self.node_id = node_id
        self.group = group
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        self.user_message = user_message
        self.other_ranks: list[int] = []
        super().__init__(
            f"worker group {group!r} rank {rank} failed in {method!r}:\n"
            f"--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}\n--- end remote traceback ---"
        )

    def __reduce__(self):  # keep the fields when pickled (e.g. through Ray)
        return (WorkerError, (self.group, self.rank, self.method, self.remote_traceback, self.user_message,
                              self.lost, self.node_id))

    def brief(self) -> str:
        """One line for the user: where it failed and the user message (or the last traceback line)."""
        ranks = [self.rank, *self.other_ranks]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, sorted(ranks)))}"
        last = self.user_message or (self.remote_traceback.strip().splitlines() or ["?"])[-1]
        return f"worker group {self.group!r} {who} failed in {self.method!r}: {last}"


class CallTimeout(WorkerError):
    """Ranks of a worker group did not answer a call (or their start-up) within its time limit: a method
    stuck in a loop, a deadlocked lock, a server that never answers. The backend has stopped the group's
    rank processes (Ray: killed its actors), so none is left running; the group is broken (create it again).

    Not a lost worker (``lost`` is False): a hang usually comes back, so ``run.max_restarts`` does not
    restart on it. ``user_message`` holds the one-line explanation the CLI prints.

    Attributes (beside :class:`WorkerError`'s; ``rank`` is the first rank that did not answer, ``other_ranks``
    the rest):
        ranks: the ranks that had not answered, ascending.
        answered: the ranks that had answered (not at fault), ascending.
        elapsed_s: seconds the driver waited.
        key: the config key that set the limit (``cluster.call_timeout_s``, ``cluster.start_timeout_s``).
        limit_s: its value.
    """

    def __init__(self, group: str, ranks: list[int], method: str, elapsed_s: float, key: str, limit_s: float,
                 answered: list[int] | tuple[int, ...] = ()) -> None:
        self.ranks, self.answered = sorted(ranks), sorted(answered)
        self.elapsed_s, self.key, self.limit_s = elapsed_s, key, limit_s
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {', '.join(map(str, self.ranks))}"
        done = (f"; {'rank' if len(self.answered) == 1 else 'ranks'} {', '.join(map(str, self.answered))} "
                f"answered" if self.answered else "")
        what = "start" if method == "__init__" else f"answer {method!r}"
        if method == "__init__":
            why = "start-up is this long on purpose (a large model to load, a busy cluster)"
            hangs = "what holds it (a worker's construction that hangs, a rank Ray cannot place, a rendezvous)"
        else:
            why = "the call is this long on purpose (a large generation, a checkpoint to slow storage)"
            hangs = "where it hangs (a loop, a lock, a server that never answers)"
        msg = (f"{who} did not {what} within {key}={limit_s:g} s (waited {elapsed_s:.1f} s){done}; the group's "
               f"rank processes were stopped. If {why}, raise {key}"
               + (" (null: no limit)" if key == "cluster.call_timeout_s" else "") + f"; otherwise find {hangs}")
        super().__init__(group, self.ranks[0], method, msg, user_message=msg)
        self.other_ranks = self.ranks[1:]
        RuntimeError.__init__(self, f"worker group {group!r} {msg}")  # (no remote traceback: the rank hangs)

    def __reduce__(self):
        return (CallTimeout, (self.group, self.ranks, self.method, self.elapsed_s, self.key, self.limit_s,
                              self.answered))

    def brief(self) -> str:
        return str(self)


class PlacementError(UserError, RuntimeError):
    """A resource pool asks for devices the cluster does not have (e.g. GPUs on a CPU-only cluster)."""
