"""Teacher prefetch: copy to a local disk tier and load into host memory in the background, at most N resident.

Two tiers below the scorer:

* disk: `local_dir/<teacher>-<checkpoint hash>/`, a copy of the teacher's checkpoint (written to a
  `.partial` directory and renamed, so a half-copied teacher is never loaded). Copies are kept for the
  whole stage, so a teacher evicted from memory reloads from local disk, not from the source, and
  removed when the stage ends (`close(remove_copies=True)`: at 70B a copy is 140 GB).
* host memory: at most `max_resident` loaded teachers (a teacher being loaded counts), evicted least
  recently used first; a teacher in use (`with prefetcher.use(name)`) is pinned and never evicted.

With prefetch on, one background thread works through a queue: `prefetch(name)` asks it to copy and
load `name` while the caller keeps scoring with the current teacher; `stage_to_disk(names)` asks it to
copy ahead without loading (disk is not the scarce tier). With prefetch off, `use` does the copy and the
load itself, in the caller's thread. Either way `use` measures the time the caller waited for its
teacher (`stats["stall_s"]`): the number prefetch exists to drive to zero.

`copy_bandwidth` (bytes/s) throttles the copy, to simulate slow shared storage honestly: the copy
really reads and writes every byte, and sleeps so that it never runs faster than the given rate.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from opd_sao.io.files import inside

from .base import Teacher

COPY_BLOCK = 1 << 20


def copy_checkpoint(src: Path, dst: Path, bandwidth: Optional[float] = None) -> int:
    """Copy the files of `src` to `dst` (atomically, via dst.partial); at most `bandwidth` bytes/s. Returns bytes."""
    src, dst = Path(src), Path(dst)
    partial = dst.with_name(dst.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    start, done = time.perf_counter(), 0
    for file in sorted(f for f in src.rglob("*") if f.is_file()):
        target = partial / file.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(file, "rb") as fin, open(target, "wb") as fout:
            while block := fin.read(COPY_BLOCK):
                fout.write(block)
                done += len(block)
                if bandwidth:
                    ahead = done / bandwidth - (time.perf_counter() - start)
                    if ahead > 0:
                        time.sleep(ahead)
    try:
        os.replace(partial, dst)
    except OSError:  # someone finished the same copy first
        shutil.rmtree(partial, ignore_errors=True)
    return done


class Prefetcher:
    def __init__(self, teachers: dict[str, Teacher], *, local_dir: Path, max_resident: int, enabled: bool = True,
                 copy_bandwidth: Optional[float] = None):
        if max_resident < 1:
            raise ValueError("max_resident must be >= 1")
        self.teachers, self.local_dir = dict(teachers), Path(local_dir)
        self.max_resident, self.enabled, self.copy_bandwidth = max_resident, enabled, copy_bandwidth
        self._cond = threading.Condition()
        self._resident: "OrderedDict[str, Teacher]" = OrderedDict()  # least recently used first
        self._loading: set[str] = set()
        self._pins: Counter = Counter()
        self._queue: list[tuple[str, str]] = []  # (job, name), job "load" or "copy"
        self._errors: dict[str, BaseException] = {}
        self._copy_locks = {name: threading.Lock() for name in self.teachers}
        self._stop = False
        self._worker: Optional[threading.Thread] = None
        self.stats = {"stall_s": 0.0, "hits": 0, "misses": 0, "loads": 0, "load_s": 0.0, "evictions": 0,
                      "copies": 0, "copy_s": 0.0, "copy_bytes": 0, "disk_hits": 0}
        self.events: list[dict] = []  # what happened when (for the benchmark and debugging)
        self._t0 = time.perf_counter()

    # ---- tiers ---------------------------------------------------------------------------------------

    def local_path(self, name: str) -> Path:
        spec = self.teachers[name].spec
        return inside(self.local_dir, f"{name}-{spec.checkpoint_hash}")

    def _event(self, what: str, name: str, **extra) -> None:
        self.events.append({"t": round(time.perf_counter() - self._t0, 4), "event": what, "teacher": name, **extra})

    def ensure_local(self, name: str) -> Path:
        """The teacher's local-tier copy, copying it first if absent (a teacher that holds no weights of its own, a
        served one, loads from its checkpoint directory as it is)."""
        if not self.teachers[name].copies_checkpoint:
            return self.teachers[name].spec.checkpoint
        path = self.local_path(name)
        with self._copy_locks[name]:
            if (path / "config.json").is_file():
                with self._cond:
                    self.stats["disk_hits"] += 1
                return path
            t0 = time.perf_counter()
            size = copy_checkpoint(self.teachers[name].spec.checkpoint, path, self.copy_bandwidth)
            took = time.perf_counter() - t0
            with self._cond:
                self.stats["copies"] += 1
                self.stats["copy_s"] += took
                self.stats["copy_bytes"] += size
                self._event("copied", name, seconds=round(took, 4), bytes=size)
        return path

    def resident(self) -> list[str]:
        """Loaded teachers, least recently used first."""
        with self._cond:
            return list(self._resident)

    def _make_room(self, blocking: bool) -> None:
        """Evict least recently used unpinned teachers until one more fits. Caller holds the lock."""
        while len(self._resident) + len(self._loading) >= self.max_resident:
            victim = next((n for n in self._resident if not self._pins[n]), None)
            if victim is None:
                if not blocking:
                    raise RuntimeError(f"all {self.max_resident} resident teachers are in use; raise opd.max_resident")
                self._cond.wait()
                continue
            self._resident.pop(victim).unload()
            self.stats["evictions"] += 1
            self._event("evicted", victim)

    def _load(self, name: str, path: Path) -> None:
        """Load outside the lock (a slot is reserved in _loading), then publish."""
        t0 = time.perf_counter()
        teacher = self.teachers[name]
        try:
            teacher.load(path)
        finally:
            with self._cond:
                self._loading.discard(name)
                self._cond.notify_all()
        took = time.perf_counter() - t0
        with self._cond:
            self._resident[name] = teacher
            self.stats["loads"] += 1
            self.stats["load_s"] += took
            self._event("loaded", name, seconds=round(took, 4))
            self._cond.notify_all()

    # ---- background worker ---------------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="teacher-prefetch", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._queue)
                if self._stop:
                    return
                job, name = self._queue.pop(0)
                if job == "load" and (name in self._resident or name in self._loading):
                    continue
            try:
                path = self.ensure_local(name)
                if job == "copy":
                    continue
                with self._cond:
                    if name in self._resident or name in self._loading:
                        continue
                    self._make_room(blocking=True)
                    if self._stop:
                        return
                    self._loading.add(name)
                self._load(name, path)
            except BaseException as err:  # reported to whoever waits for this teacher
                with self._cond:
                    self._errors[name] = err
                    self._cond.notify_all()

    def _enqueue(self, job: str, name: str, *, front: bool = False) -> None:
        if name not in self.teachers:
            raise KeyError(f"unknown teacher {name!r}; known: {sorted(self.teachers)}")
        with self._cond:
            if (job, name) in self._queue:
                self._queue.remove((job, name))
            elif job == "load" and (name in self._resident or name in self._loading):
                return
            self._queue.insert(0, (job, name)) if front else self._queue.append((job, name))
            self._cond.notify_all()
        self._ensure_worker()

    def prefetch(self, name: str) -> None:
        """Copy and load `name` in the background (no-op when resident, already coming, or prefetch is off)."""
        if self.enabled:
            self._enqueue("load", name)

    def stage_to_disk(self, names: list[str]) -> None:
        """Copy teachers to the local tier in the background, without loading them."""
        if self.enabled:
            for name in names:
                self._enqueue("copy", name)

    # ---- the caller's side ---------------------------------------------------------------------------

    @contextmanager
    def use(self, name: str) -> Iterator[Teacher]:
        """The loaded teacher, pinned for the duration; waits (and counts the stall) when it is not resident."""
        if name not in self.teachers:
            raise KeyError(f"unknown teacher {name!r}; known: {sorted(self.teachers)}")
        t0 = time.perf_counter()
        with self._cond:
            hit = name in self._resident
            self.stats["hits" if hit else "misses"] += 1
            if hit:
                self._pins[name] += 1
        if not hit:
            if self.enabled:
                self._enqueue("load", name, front=True)
                with self._cond:
                    self._cond.wait_for(lambda: name in self._resident or name in self._errors)
                    if name in self._errors:
                        raise RuntimeError(f"teacher {name!r} failed to load: {self._errors.pop(name)!r}")
                    self._pins[name] += 1
            else:
                path = self.ensure_local(name)
                with self._cond:
                    self._make_room(blocking=False)
                    self._loading.add(name)
                self._load(name, path)
                with self._cond:
                    self._pins[name] += 1
        stall = time.perf_counter() - t0
        with self._cond:
            self.stats["stall_s"] += stall
            self._resident.move_to_end(name)
        if not hit:
            self._event("stall", name, seconds=round(stall, 4))
        try:
            yield self._resident[name]
        finally:
            with self._cond:
                self._pins[name] -= 1
                self._resident.move_to_end(name)
                self._cond.notify_all()

    def close(self, *, remove_copies: bool = False) -> None:
        """Stop the worker and unload every teacher; `remove_copies`: delete the local tier's copies too (and
        `local_dir` itself once empty)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=60)
        with self._cond:
            for teacher in self._resident.values():
                teacher.unload()
            self._resident.clear()
        if remove_copies:
            for name in self.teachers:
                path = self.local_path(name)
                for copy in (path, path.with_name(path.name + ".partial")):
                    shutil.rmtree(copy, ignore_errors=True)
            if self.local_dir.is_dir() and not any(self.local_dir.iterdir()):
                self.local_dir.rmdir()
