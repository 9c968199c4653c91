"""Opening a file that a config, a user or a damaged store names: only a regular file, never a blocking open.

A FIFO blocks `open` (and `read`) forever, `/dev/zero` never ends, and a symlink can lead out of a store, so a
reader that expects a file of bytes would hang or run out of memory. `open_regular` opens without blocking and
then checks what it opened (`fstat` of the descriptor, so the file cannot be swapped between check and read),
its size before anything is read, and, when a `root` is given, that the path resolves inside it. A refusal is
`UnreadableFile`: one line starting with the path (a permission error too, so it names the file, not the run
directory a disk-error handler would blame). A missing file stays FileNotFoundError and a directory
IsADirectoryError: callers give those their own meaning.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from opd_sao.errors import UsageError

KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
         stat.S_IFSOCK: "a socket"}


class UnreadableFile(UsageError):
    """A file that is not a regular file, is over its size limit, lies outside its root or cannot be opened."""


def open_regular(path: str | Path, *, limit: int | None = None, root: str | Path | None = None) -> BinaryIO:
    """`path` opened for binary reading, refused (UnreadableFile) unless it is a regular file (inside `root`, at
    most `limit` bytes)."""
    path = Path(path)
    if root is not None:
        resolved, base = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([resolved, base]) != base:
            raise UnreadableFile(f"{path}: a link out of {root} (to {resolved})")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise
    except OSError as err:
        raise UnreadableFile(f"{path}: cannot be read ({err.strerror})") from None
    try:
        status = os.fstat(fd)
        if stat.S_ISDIR(status.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(status.st_mode):
            raise UnreadableFile(f"{path}: not a regular file ({KINDS.get(stat.S_IFMT(status.st_mode), 'special')})")
        if limit is not None and status.st_size > limit:
            raise UnreadableFile(f"{path}: {status.st_size} bytes, more than the {limit} allowed here")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path, *, limit: int, root: str | Path | None = None) -> bytes:
    """The whole content of a regular file of at most `limit` bytes (one that grows past it while read is refused)."""
    with open_regular(path, limit=limit, root=root) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnreadableFile(f"{path}: grew past the {limit} bytes allowed here while it was read")
    return data
