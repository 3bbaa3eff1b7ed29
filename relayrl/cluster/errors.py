"""The one exception a failing worker surfaces as in the driver.

Whether the rank ran in the driver, in a spawned process or in a Ray actor,
and whether it raised or died, the driver sees a `WorkerError` naming the group,
the rank and the method, with the remote traceback text (or the exit reason).
"""
from __future__ import annotations


class WorkerError(RuntimeError):
    """A rank of a worker group raised or died while running a method.

    Attributes:
        group: the worker group's name.
        rank: the failing rank (0-based).
        method: the method being run (`"__init__"` for construction).
        remote_traceback: the traceback text from the rank, or why it died.
    """

    def __init__(self, group: str, rank: int, method: str, remote_traceback: str) -> None:
        self.group = group
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        super().__init__(
            f"worker group {group!r} rank {rank} failed in {method!r}:\n"
            f"--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}\n--- end remote traceback ---"
        )

    def __reduce__(self):  # keep the four fields when pickled (e.g. through Ray)
        return (WorkerError, (self.group, self.rank, self.method, self.remote_traceback))
