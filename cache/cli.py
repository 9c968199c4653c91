"""``opd-sao cache inspect|verify|gc DIR``: functions returning plain data, and ``main`` that prints them as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .errors import CacheDamagedError, CacheReadOnlyError
from .store import LogitCache

USAGE = "usage: opd-sao cache {inspect|verify|gc} DIR"
ERROR = "opd-sao cache: error:"  # the prefix every other `opd-sao` command's one-line errors carry


def _disk_usage(path: Path) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of the files under ``path``."""
    apparent = allocated = 0
    for file in path.rglob("*"):
        if file.is_file():
            status = file.stat()
            apparent += status.st_size
            allocated += status.st_blocks * 512
    return apparent, allocated


def inspect(path: str | Path) -> dict:
    """Size on disk, bytes per token, records and tokens of every teacher, and what each stores."""
    cache = LogitCache(path)
    teachers = {}
    for name, meta in cache.teachers().items():
        teacher = cache.open_teacher(meta)
        apparent, allocated = _disk_usage(teacher.path)
        tokens = teacher.n_tokens()
        teachers[name] = {
            **meta.to_attrs(),
            "records": len(teacher),
            "tokens": tokens,
            "bytes_on_disk": apparent,
            "allocated_bytes": allocated,
            "bytes_per_token": apparent / tokens if tokens else None,
        }
    apparent, allocated = _disk_usage(Path(path))
    return {"path": str(path), "bytes_on_disk": apparent, "allocated_bytes": allocated, "teachers": teachers}


def verify(path: str | Path) -> tuple[bool, list[str]]:
    """Check every teacher's metadata, every record's checksum and every index line; ``problems`` holds one
    line per problem, starting with the path it concerns (a damaged store is rebuilt and re-scored by the
    OPD stage, a corrupt record re-scored)."""
    cache = LogitCache(path)
    problems = []
    try:
        directories = cache.teacher_dirs()
    except CacheDamagedError as error:
        return False, error.problems
    for directory in directories:
        try:
            teacher = cache.open_dir(directory)
        except CacheDamagedError as error:
            problems += error.problems
            continue
        problems += [f"{directory}: record {traj_id!r} is corrupt (checksum mismatch or unreadable chunk)"
                     for traj_id in teacher.verify()]
        problems += [f"{directory / 'index.log'}: line {line} fails its checksum; its record is lost"
                     for line in teacher.bad_index_lines()]
    return not problems, problems


def gc(path: str | Path) -> dict:
    """Drop corrupt records and delete uncommitted, orphaned and temporary data; reports what was freed."""
    cache = LogitCache(path)
    teachers = {name: cache.open_teacher(meta).collect_garbage() for name, meta in cache.teachers().items()}
    staging_bytes = cache.remove_stale_staging()
    return {
        "path": str(path),
        "bytes_freed": staging_bytes + sum(report["bytes_freed"] for report in teachers.values()),
        "teachers": teachers,
    }


def main(argv: list[str]) -> int:
    """Exit status 0 on success; 1 when verify finds corruption or damage, when inspect or gc meet damage, or
    when gc cannot write; 2 on bad usage or a directory that is no cache."""
    if len(argv) != 2 or argv[0] not in ("inspect", "verify", "gc"):
        print(USAGE, file=sys.stderr)
        return 2
    command, path = argv
    try:
        if command == "verify":
            ok, problems = verify(path)
            print(json.dumps({"ok": ok, "problems": problems}, indent=2))
            return 0 if ok else 1
        print(json.dumps(inspect(path) if command == "inspect" else gc(path), indent=2))
        return 0
    except FileNotFoundError as error:
        print(ERROR, error, file=sys.stderr)
        return 2
    except CacheDamagedError as error:
        print("\n".join(f"{ERROR} damaged: {problem}" for problem in error.problems), file=sys.stderr)
        return 1
    except CacheReadOnlyError as error:
        print(ERROR, error, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
