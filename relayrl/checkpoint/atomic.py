"""Directories that appear whole or not at all (the final ``model/`` of a run).

:func:`write_dir_atomically` lets a writer fill ``PARENT/.tmp-NAME-<pid>/``,
fsyncs every file in it and the directory, then renames it to ``NAME`` (one
``rename(2)``, atomic on POSIX filesystems). An existing ``NAME`` is first
renamed to ``.trash-NAME-<pid>`` and removed after the swap. A process killed
at any point leaves the old ``NAME`` (or none) plus a scratch directory, never a
half-written ``NAME``; the scratch directories of dead processes are removed on
the next write. Checkpoints (``relayrl.checkpoint.manager``) follow the same
protocol with their own names.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from relayrl.errors import UserError

__all__ = ["DiskFullError", "disk_full", "fsync_file", "fsync_dir", "pid_alive", "run_files_full",
           "write_dir_atomically"]

_NEARLY_FULL = 16 << 20
"""Free bytes under which a failed write is taken for a full disk: torch.save's own error does not say so
(``unexpected pos 576 vs 534``)."""


class DiskFullError(UserError, OSError):
    """A run's checkpoint or model did not fit on its file system (the partial write is removed)."""


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def disk_full(e: BaseException, where: Path, what: str, *, need: int | None = None,
              keep: int | None = None) -> DiskFullError | None:
    """The error to raise instead of ``e`` when writing ``what`` under ``where`` failed because the file system
    is full (ENOSPC in ``e``'s chain, or under 16 MiB left while the partial write still stands); else None.
    ``need``: the bytes the write takes, when known, for the message; ``keep``: ``run.keep_checkpoints``, when
    a checkpoint was written (1: there are no fewer to keep)."""
    full = _no_space(e) is not None
    free = _free(where)
    if not full and (free is None or free >= _NEARLY_FULL):
        return None
    size = f"; it takes about {_size(need)}" if need else ""
    left = f" ({_size(free)} left there)" if free is not None else ""
    if keep == 1:
        fix = ("Free space or give a run.dir on a larger disk: with run.keep_checkpoints=1 a save still needs room "
               "for the new checkpoint beside the last one, which is removed once the new one is complete")
    else:
        now = f" (now {keep})" if keep else ""
        fix = f"Free space, lower run.keep_checkpoints{now}, or give a run.dir on a larger disk"
    return DiskFullError(f"no space left on the file system of {where}{left} to write {what}{size}; the partial "
                         f"write was removed. {fix} (resume=auto goes on from the last complete checkpoint)")


def run_files_full(e: BaseException, run_dir: Path, step: int) -> DiskFullError | None:
    """The error to raise instead of ``e`` when the run's own files in ``run_dir`` (``metrics.jsonl``, spans,
    evaluation reports, samples) could not be written in ``step`` for a full disk or quota (ENOSPC or EDQUOT in
    ``e``'s chain, a file under ``run_dir`` if it names one, under 16 MiB left there); else None (another file
    system is full: ``/dev/shm``, say)."""
    cause = _no_space(e)
    free = _free(run_dir)
    if cause is None or free is None or free >= _NEARLY_FULL:
        return None
    name = getattr(cause, "filename", None)
    if name is not None and Path(run_dir).resolve() not in Path(name).resolve().parents:
        return None
    what = name or "metrics.jsonl, spans.jsonl, eval/ reports"  # (a buffered write's flush names no file)
    return DiskFullError(f"no space left on the file system of run.dir={run_dir} ({_size(free)} left there) to "
                         f"write the run's files in step {step} ({what}); the run stopped there. Free space, or "
                         f"give a run.dir on a larger disk (resume=auto goes on from the last complete checkpoint)")


def _no_space(e: BaseException) -> BaseException | None:
    """The error in ``e``'s chain that says the file system is full (ENOSPC) or the quota spent (EDQUOT)."""
    chain, seen = e, set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if getattr(chain, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(chain):
            return chain
        chain = chain.__cause__ or chain.__context__
    return None


def _free(where: Path) -> int | None:
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def fsync_file(path: Path) -> None:
    """Flush ``path`` (a file or a directory: its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_file  # a directory opens read-only and fsyncs the same way


def pid_alive(pid: int) -> bool:
    """True when process ``pid`` exists (ours counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_scratch(parent: Path, name: str) -> None:
    pattern = re.compile(rf"^\.(?:tmp|trash)-{re.escape(name)}-(\d+)$")
    for child in parent.iterdir():
        m = pattern.match(child.name)
        if m and child.is_dir() and (int(m.group(1)) == os.getpid() or not pid_alive(int(m.group(1)))):
            shutil.rmtree(child, ignore_errors=True)


def write_dir_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_dir)`` to fill a scratch directory, then swap it in as ``final``; returns ``final``.

    ``write`` may create ``tmp_dir`` itself or find it created; if it raises, the scratch directory is
    removed and ``final`` is left as it was.
    """
    final = Path(final)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_scratch(parent, final.name)
    tmp = parent / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        write(tmp)
        for root, _dirs, files in os.walk(tmp):
            for f in files:
                fsync_file(Path(root) / f)
            fsync_dir(Path(root))
        if final.exists():
            trash = parent / f".trash-{final.name}-{os.getpid()}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(parent)
    except BaseException as e:
        full = disk_full(e, parent, str(final)) if isinstance(e, Exception) else None
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from e
        raise
    return final
