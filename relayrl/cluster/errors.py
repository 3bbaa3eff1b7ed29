"""The one exception a failing worker surfaces as in the driver.

Whether the rank ran in the driver, in a spawned process or in a Ray actor,
and whether it raised or died, the driver sees a `WorkerError` naming the group,
the rank and the method, with the remote traceback text (or the exit reason).
When the rank's error was the user's to fix (`relayrl.errors.is_user_error`),
`user_message` holds its message, so the CLI can print one line instead of the
remote traceback; `other_ranks` lists the ranks that failed with the same message.
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


class PlacementError(UserError, RuntimeError):
    """A resource pool asks for devices the cluster does not have (e.g. GPUs on a CPU-only cluster)."""
