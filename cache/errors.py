"""Exceptions the cache raises for conditions a caller must act on (re-score, or use another cache)."""

from __future__ import annotations


class CorruptRecordError(Exception):
    """Stored records failed their checksum or could not be decoded.

    The caller re-scores ``traj_ids`` (after ``TeacherCache.invalidate``); the data is never returned.
    """

    def __init__(self, traj_ids: list[str], reason: str):
        self.traj_ids = list(traj_ids)
        self.reason = reason
        super().__init__(f"corrupt logit-cache record(s) {self.traj_ids}: {reason}")


class CacheMismatchError(Exception):
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
