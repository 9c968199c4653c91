"""Exceptions the cache raises for conditions a caller must act on (re-score, or use another cache)."""

from __future__ import annotations

from opd_sao.errors import OpdSaoError, UsageError


class CorruptRecordError(Exception):
    """Stored records failed their checksum or could not be decoded.

    The caller re-scores ``traj_ids`` (after ``TeacherCache.invalidate``); the data is never returned.
    """

    def __init__(self, traj_ids: list[str], reason: str):
        self.traj_ids = list(traj_ids)
        self.reason = reason
        super().__init__(f"corrupt logit-cache record(s) {self.traj_ids}: {reason}")


class CacheMismatchError(OpdSaoError):
    """An existing teacher cache was written for a different teacher, checkpoint, tokenizer or format.

    ``differences`` maps each differing field to ``(stored, requested)``; ``field`` is the first of them.
    """

    def __init__(self, path: str, differences: dict[str, tuple[object, object]]):
        self.path = path
        self.differences = dict(differences)
        self.field = next(iter(self.differences))
        detail = "; ".join(
            f"{name} differs: cache has {stored!r}, requested {requested!r}"
            for name, (stored, requested) in self.differences.items()
        )
        super().__init__(f"logit cache {path} refused: {detail}")


class CacheDamagedError(OpdSaoError):
    """A teacher store's metadata (a zarr.json, index.log) is missing or unreadable: its records cannot be trusted.

    ``problems`` holds one line per damaged file, each starting with its path. The OPD stage rebuilds the
    teacher's store (``LogitCache.rebuild_teacher``) and re-scores; ``opd-sao cache verify`` reports them.
    """

    def __init__(self, path: str, problems: list[str]):
        self.path = path
        self.problems = list(problems)
        super().__init__(f"logit cache {path} is damaged: " + "; ".join(self.problems))


class CacheReadOnlyError(UsageError):
    """A write (gc, storing re-scored records, a rebuild) was needed in a cache directory we may not write.

    A ValueError: it is the user's opd.cache_dir that is unusable, so CLIs report it in one line. Reading a
    read-only cache needs no write and works.
    """

    def __init__(self, path: str, action: str, reason: str):
        self.path = path
        super().__init__(f"logit cache {path} is read-only ({reason}): {action} needs write access; make it "
                         f"writable or set opd.cache_dir to a writable directory")
