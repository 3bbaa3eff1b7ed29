"""Which errors are the user's to fix.

Every module raises its own precise error (``ConfigError``, ``DatasetError``,
``CheckpointError``, ``ModelLoadError``, ``RewardError``, ...). Those that a
user fixes by changing a file, a config value or a command-line argument also
derive from :class:`UserError`, and the CLI prints their message (which names
the key, file or row and the fix) instead of a traceback. File-system errors
that carry a file name (a missing file, no permission, a full disk) count as
the user's too. Anything else is a bug in relayrl and keeps its traceback.

This module sits below every other relayrl module (it imports nothing of
relayrl), so the cluster layer can classify an error inside a rank process
and send only the verdict and the message across the wire.
"""

from __future__ import annotations

import errno

__all__ = ["UserError", "SettingError", "RunStopped", "ProcessLost", "is_user_error", "user_message"]

_USER_ERRNOS = frozenset({
    errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EISDIR, errno.ENOTDIR,
    errno.EEXIST, errno.ENOTEMPTY, errno.EDQUOT, errno.ENAMETOOLONG,
})


class UserError(Exception):
    """An error the user fixes; its message says what is wrong, where (key, file, row) and the fix."""


class SettingError(UserError, ValueError):
    """A setting the model or the machine at hand cannot run, found when a component starts (after the config
    validated: it needs the model's structure or the ranks); the message names the key and the fix. A rank
    reports it as one line, not a traceback."""


class RunStopped(UserError, RuntimeError):
    """The run stopped on purpose (e.g. a non-finite loss) after saving what it could; the message says how
    to go on."""


class ProcessLost(RuntimeError):
    """A process the run depends on, other than a worker rank (a dock storage unit), died or stopped
    answering. Nothing in the run's inputs to fix: ``run.max_restarts`` recovers from it as from a lost worker
    (:mod:`relayrl.workflows.restart`), whether the driver or a rank met it."""

    def __init__(self, *args: object, node_id: str | None = None) -> None:
        super().__init__(*args)
        self.node_id = node_id
        """Ray: the id of the node the lost process ran on, when known (a restart waits until Ray marks it
        dead)."""


def is_user_error(exc: BaseException) -> bool:
    """True for a :class:`UserError` and for a file-system error that names its file."""
    if isinstance(exc, UserError):
        return True
    return isinstance(exc, OSError) and exc.errno in _USER_ERRNOS and exc.filename is not None


def user_message(exc: BaseException) -> str:
    """The text to print for a user error: its message; for a file-system error, what and which file."""
    if isinstance(exc, OSError) and not isinstance(exc, UserError) and exc.filename is not None:
        where = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 else "")
        fix = {
            errno.ENOENT: "check the path",
            errno.EACCES: "check the file's permissions, or choose a directory you can write",
            errno.EPERM: "check the file's permissions, or choose a directory you can write",
            errno.ENOSPC: "free disk space or choose another run.dir",
            errno.EDQUOT: "free disk space or choose another run.dir",
            errno.EROFS: "choose a writable directory",
        }.get(exc.errno or 0)
        return f"{where}: {exc.strerror or exc}" + (f"; {fix}" if fix else "")
    return str(exc)


def exit_reason(code: int | None, *, running: str = "still running") -> str:
    """How a child process ended, from its exit code (``running`` when it has none yet): ``"killed by signal
    SIGKILL"``, ``"exited with code 3"``."""
    import signal

    if code is None:
        return running
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
