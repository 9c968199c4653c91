"""Atomic file writes: a reader (or a resumed run after kill -9) sees the old file or the new one, never half."""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from opd_sao.errors import UsageError


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary sibling to write to (a file, or a directory that replaces an absent or empty one); it replaces
    `path` only if the block finishes without an error."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write, flush to disk, then rename over `path`."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: str | Path, data, indent: int = 2) -> None:
    atomic_write(path, json.dumps(data, indent=indent))


def inside(root: str | Path, path: str | Path) -> Path:
    """`path` (relative paths are under `root`), refused unless it resolves, symlinks followed, to `root` itself or
    below it: every place that writes or deletes a run's, a stage's or a teacher copy's files goes through this, so
    no name or link makes it touch anything outside."""
    root, path = Path(root), Path(root) / path
    real_root, real = root.resolve(), path.resolve()
    if real != real_root and real_root not in real.parents:
        raise UsageError(f"{str(path)!r} leads outside {str(root)!r} (to {str(real)!r}); refused to write or delete it")
    return path
