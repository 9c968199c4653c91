"""Teacher targets for a batch of student trajectories, persisted in the logit cache beside the trainer.

For each trajectory: its domain's teacher; if neither the teacher's cache nor its writer's queue has a record
for it, the teacher scores it (teachers one after another, the next one prefetched while the current one
scores). A fresh record is quantised in memory (`cache.quantised`: exactly what the cache will return for it)
and handed to the trainer at once, while the teacher's `cache.BackgroundWriter` commits it beside the training
(encoding, checksum and zarr appends, batched over steps). So the trainer trains on what the cache holds, never
on the teacher's raw float output, whether the record was just scored or read back. `flush` (the OPD learner's
resumable-state saves, the stage's end) returns once every record is on disk: a crash loses at most the
records since the last flush, which a resume finds missing and re-scores.

A record read back that fails verification (`CorruptRecordError`) is never used: the teacher's cache is
garbage-collected (every failing record and the chunks only they used are dropped, since a damaged chunk
cannot even be appended to) and those trajectories are re-scored. A valid record is reused: records are keyed
by a hash of the trajectory's tokens and action mask, so a trajectory the student samples again (or one
replayed after a resume) costs no teacher forward, and a record can never be applied to a different token
sequence. A teacher store whose metadata is damaged (`CacheDamagedError`: a zarr.json or index.log missing or
unreadable, met when opening or reading it) is rebuilt empty, with a one-line warning, and its trajectories
re-scored: the stage goes on.

Teacher order within a batch: teachers already in host memory first (least recently used first), then
the others in config order; right after a teacher is taken, the next one that has work is prefetched.
With n teachers and max_resident m >= 2 this loads n - m teachers per batch, the fewest possible when
every batch needs every teacher (plain LRU over a fixed order would reload all n).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from opd_sao.cache import (
    BackgroundWriter,
    CacheDamagedError,
    CacheMismatchError,
    CorruptRecordError,
    LogitCache,
    TeacherCache,
    TeacherRecord,
    quantised_many,
)
from opd_sao.errors import UsageError
from opd_sao.teachers.routing import TeacherSet
from opd_sao.trajectory import Trajectory

from .prefetch import Prefetcher

logger = logging.getLogger(__name__)


def cache_key(traj: Trajectory) -> str:
    """Content address of what a teacher record depends on: the token sequence and which tokens are actions."""
    payload = json.dumps([traj.prompt_ids, traj.token_ids, traj.action_mask], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


@dataclass
class Targets:
    """Teacher outputs aligned with a batch's trajectories, and what it took to get them."""

    teachers: list[str]  # teacher name per trajectory
    records: list[TeacherRecord]  # per trajectory, as the cache holds it (read back, or quantised in memory)
    hits: int = 0  # trajectories whose record was already cached (and valid)
    misses: int = 0  # trajectories the teachers scored for this batch
    corrupt_rescored: int = 0  # records that failed verification on read and were re-scored
    stall_s: float = 0.0  # time spent waiting for a teacher to be loaded
    score_s: float = 0.0  # teacher forward passes
    cache_write_s: float = 0.0  # quantising fresh records and queueing them (the commit runs beside)
    cache_read_s: float = 0.0  # reading back the records of sequences seen before

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class TeacherTargets:
    def __init__(self, registry: TeacherSet, prefetcher: Prefetcher, cache_dir: Path):
        self.registry, self.prefetcher = registry, prefetcher
        self.cache = LogitCache(cache_dir)
        self.caches: dict[str, TeacherCache] = {}
        self.writers: dict[str, BackgroundWriter] = {}
        for name, spec in registry.specs.items():
            try:
                self.caches[name] = self.cache.open_teacher(spec.cache_meta)
            except CacheMismatchError as err:
                raise UsageError(f"{err} (teacher {name!r}: delete that directory or set opd.cache_dir "
                                 f"to a fresh one)") from None
            except CacheDamagedError as err:
                self._rebuild(name, err)
            else:
                self.writers[name] = _writer(self.caches[name])

    def _rebuild(self, name: str, err: CacheDamagedError) -> None:
        """Replace teacher ``name``'s damaged store by an empty one: its trajectories are scored again (the
        records its writer still held are dropped with it)."""
        logger.warning("logit cache: %s; rebuilding teacher %r's store, its trajectories are re-scored",
                       err, name)
        if name in self.writers:
            try:
                self.writers.pop(name).close()
            except Exception:  # its commits failed on the damaged store, which is being replaced
                pass
        self.caches[name] = self.cache.rebuild_teacher(self.registry.specs[name].cache_meta)
        self.writers[name] = _writer(self.caches[name])

    def flush(self) -> None:
        """Return once every record handed to the trainer is committed to the cache."""
        for writer in self.writers.values():
            writer.flush()

    def close(self) -> None:
        """Flush and stop the writers (the stage's end)."""
        for writer in self.writers.values():
            writer.close()

    def _damaged_teacher(self, err: CacheDamagedError) -> str:
        """The teacher whose store ``err`` is about (it names the store or a file in it)."""
        for name, teacher in self.caches.items():
            if err.path == str(teacher.path) or err.path.startswith(f"{teacher.path}/"):
                return name
        raise err

    def order(self, names: set[str]) -> list[str]:
        resident = [n for n in self.prefetcher.resident() if n in names]
        return resident + [n for n in self.registry.specs if n in names and n not in resident]

    def warm_up(self) -> None:
        """Stage start: copy every teacher to the local tier and load the first ones, in the background."""
        names = list(self.registry.specs)
        for name in names[: self.prefetcher.max_resident]:
            self.prefetcher.prefetch(name)
        self.prefetcher.stage_to_disk(names[self.prefetcher.max_resident:])

    def _score_into_cache(self, name: str, trajs: list[Trajectory], out: Targets,
                          next_name: str | None) -> dict[str, TeacherRecord]:
        stall_before = self.prefetcher.stats["stall_s"]
        with self.prefetcher.use(name) as teacher:
            if next_name is not None:
                self.prefetcher.prefetch(next_name)
            t0 = time.perf_counter()
            records = teacher.score(trajs)
            out.score_s += time.perf_counter() - t0
        out.stall_s += self.prefetcher.stats["stall_s"] - stall_before
        t0 = time.perf_counter()
        meta = self.caches[name].meta
        held = dict(zip(map(cache_key, trajs), quantised_many(meta, records)))
        self.writers[name].submit(held)
        out.cache_write_s += time.perf_counter() - t0
        return held

    def fetch(self, trajectories: list[Trajectory]) -> Targets:
        """Targets of every trajectory, read back from the cache; a store found damaged on the way is rebuilt
        and the batch fetched again (once per teacher at most: damage that comes back propagates)."""
        rebuilt: set[str] = set()
        while True:
            try:
                return self._fetch(trajectories)
            except CacheDamagedError as err:
                name = self._damaged_teacher(err)
                if name in rebuilt:
                    raise
                rebuilt.add(name)
                self._rebuild(name, err)

    def _fetch(self, trajectories: list[Trajectory]) -> Targets:
        names = [self.registry.teacher_for(t.domain).name for t in trajectories]
        keys = [cache_key(t) for t in trajectories]
        out = Targets(teachers=names, records=[None] * len(trajectories))  # type: ignore[list-item]
        stored, missing, unheld = [], [], {}
        for i, (name, key) in enumerate(zip(names, keys)):
            held = self.writers[name].get(key)  # scored, its commit under way (or kept after it)
            if held is not None:
                out.records[i] = held
            else:
                unheld.setdefault(name, []).append(i)
        for name, index in unheld.items():
            for i, present in zip(index, self.caches[name].contains_many([keys[i] for i in index])):
                (stored if present else missing).append(i)
        stored.sort()
        missing.sort()
        out.misses = len(missing)
        self._score(trajectories, names, keys, missing, out)
        corrupt = self._read(names, keys, stored, out)
        if corrupt:
            # Drop every record that fails verification and the chunks only they used (a damaged chunk cannot
            # even be appended to), then re-score them.
            for name in sorted({names[i] for i in corrupt}):
                self.writers[name].flush()
                self.caches[name].collect_garbage()
            out.corrupt_rescored = len(corrupt)
            self._score(trajectories, names, keys, corrupt, out)
        out.hits = len(trajectories) - out.misses - out.corrupt_rescored
        return out

    def _score(self, trajectories, names, keys, index: list[int], out: Targets) -> None:
        """Score trajectories[index] teacher by teacher (next one prefetched) into out.records, and queue them
        for commit."""
        by_teacher: dict[str, dict[str, Trajectory]] = {}
        for i in index:  # a batch may hold the same sequence twice: scored once
            by_teacher.setdefault(names[i], {})[keys[i]] = trajectories[i]
        order = self.order(set(by_teacher))
        held = {}
        for j, name in enumerate(order):
            held[name] = self._score_into_cache(name, list(by_teacher[name].values()), out,
                                                order[j + 1] if j + 1 < len(order) else None)
        for i in index:
            out.records[i] = held[names[i]][keys[i]]

    def _read(self, names, keys, index, out: Targets) -> list[int]:
        """Read records back from the cache into out.records; returns the indices that failed verification."""
        t0, corrupt = time.perf_counter(), []
        by_teacher: dict[str, list[int]] = {}
        for i in index:
            by_teacher.setdefault(names[i], []).append(i)
        for name, rows in by_teacher.items():
            try:
                records = self.caches[name].get_many([keys[i] for i in rows])
            except CorruptRecordError as err:
                bad = set(err.traj_ids)
                corrupt += [i for i in rows if keys[i] in bad]
                rows = [i for i in rows if keys[i] not in bad]
                records = self.caches[name].get_many([keys[i] for i in rows])
            for i, record in zip(rows, records):
                out.records[i] = record
        out.cache_read_s += time.perf_counter() - t0
        return sorted(corrupt)


def _writer(cache: TeacherCache) -> BackgroundWriter:
    """A teacher's writer: full-vocabulary records are ~V bytes per position, so fewer of them wait."""
    if cache.meta.granularity == "full":  # nothing kept after its commit: a stage's memory stays one batch's
        return BackgroundWriter(cache, batch_records=8, max_pending=32, keep_bytes=0)
    return BackgroundWriter(cache)
