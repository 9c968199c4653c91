"""Atomic file writes: a reader (or a resumed run after kill -9) sees the old file or the new one, never half."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary sibling to write to; it replaces `path` only if the block finishes without an error."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write, flush to disk, then rename over `path`."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: str | Path, data, indent: int = 2) -> None:
    atomic_write(path, json.dumps(data, indent=indent))
