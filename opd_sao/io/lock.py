"""One run per run directory: an exclusive lock held by `opd-sao run` and `run --resume` for the whole run.

Two runs writing one directory interleave their steps, and a resume next to the live original trains its
trajectories twice. The lock is filelock's `FileLock` on RUN_DIR/.lock (`fcntl.flock`), so the kernel drops it when
its holder dies (kill -9 too): a lock left by a dead process is simply taken by the next run, which rewrites the
holder's name (pid and host) in the file, what a refused run reports. (flock is per host on NFS: two hosts are not
excluded there.) A failed write of the name (a full disk) is ignored: the lock is the flock, not the name, and a
fresh run that fails must still hold it while it removes what it created (before, the write's ENOSPC escaped
before that cleanup and left the directory with its `.lock`).
"""
from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout

from opd_sao.errors import UsageError

LOCK = ".lock"


class RunDirLocked(UsageError):
    """Another live run holds the directory (one line naming it)."""


@contextmanager
def locked_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold RUN_DIR/.lock for the block; refuse (RunDirLocked) when a live process holds it."""
    path = Path(run_dir) / LOCK
    lock = FileLock(path, blocking=False, preserve_lock_file=True, on_acquired=_write_holder)
    try:
        lock.acquire()
    except Timeout:
        raise RunDirLocked(f"run directory {str(run_dir)!r} is in use by the opd-sao run of {_holder(path)}; wait "
                           f"for it to end or stop it, then resume") from None
    try:
        yield
    finally:
        lock.release()


def _write_holder(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
    except OSError:  # a refused run then says "has not written its name yet"
        pass


def _holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_bytes())
        return f"pid {holder['pid']} on host {holder['host']} (since {holder['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its name yet)"
