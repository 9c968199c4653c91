"""The training buffer: finished trajectories wait here, in arrival order, until a train step takes them.

SAO (group size 1) releases each trajectory the moment it arrives; group mode releases a group only
when all of its members have finished. Trajectories older than the staleness bound are dropped (and
counted) when a batch is taken. Groups stay whole: a group with one stale member is dropped whole
(`dropped_stale_groups`), and a batch is whole groups, so GRPO's z-scores never see part of a group.

With a spill directory, every arriving trajectory is also appended to `buffer.jsonl` there: beyond
`memory_budget` waiting trajectories only their index stays in host memory (the seeds' hierarchical
local cache), and after a crash the log tells which trajectories were waiting (`recover`).
"""
from __future__ import annotations

import json
import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from opd_sao.trajectory import Trajectory


@dataclass
class _Entry:
    traj_id: str
    min_version: int
    group: int  # the group's id in group mode; entries of one group are consecutive in the buffer
    offset: int = -1  # byte offset of its line in the spill log
    length: int = 0  # the line's bytes
    traj: Optional[Trajectory] = None  # None once spilled out of memory


def _max_version(traj: Trajectory) -> int:
    return max((v for v, m in zip(traj.versions, traj.action_mask) if m), default=-1)


def is_fresh(traj: Trajectory, current_version: int, max_staleness: int) -> bool:
    """Usable at `current_version`: not too old, and not sampled by weights newer than the trainer's."""
    return current_version - traj.min_version <= max_staleness and _max_version(traj) <= current_version


class TrajectoryBuffer:
    def __init__(self, group_size: int = 1, *, spill_dir: Optional[Path] = None, memory_budget: int = 4096):
        self.group_size, self.memory_budget = group_size, memory_budget
        self._ready: list[_Entry] = []
        self._partial_groups: dict[int, list[Trajectory]] = defaultdict(list)
        self._cond = threading.Condition()
        self._log_path = Path(spill_dir) / "buffer.jsonl" if spill_dir else None
        self._log: Optional[int] = None  # the log's descriptor (O_APPEND: one write per line, no buffer to flush)
        if self._log_path:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = os.open(self._log_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._end: Optional[int] = None  # the log's length after this buffer's last complete write
        self._in_memory = 0  # ready entries whose trajectory is held in memory
        self.dropped_stale = 0  # trajectories
        self.dropped_stale_groups = 0  # group mode: groups dropped whole
        self.received = 0
        self.spilled = 0

    def put(self, traj: Trajectory) -> None:
        with self._cond:
            self.received += 1
            where = self._append_to_log(traj)
            entries = [(traj, where)]
            if self.group_size > 1:
                group = self._partial_groups[traj.meta["group"]]
                group.append((traj, where))
                if len(group) < self.group_size:
                    return
                entries = self._partial_groups.pop(traj.meta["group"])
            for member, (offset, length) in entries:
                in_memory = self._in_memory < self.memory_budget or self._log is None
                self.spilled += not in_memory
                self._in_memory += in_memory
                self._ready.append(_Entry(member.traj_id, member.min_version, member.meta.get("group", -1),
                                          offset, length, member if in_memory else None))
            self._cond.notify_all()

    def _append_to_log(self, traj: Trajectory) -> tuple[int, int]:
        """(offset, length) of the trajectory's line, written to the OS before the trajectory can be taken."""
        if self._log is None:
            return -1, 0
        line = (traj.to_json() + "\n").encode()
        if self._end is None:  # the file's end, whatever an earlier failed write left
            self._end = os.lseek(self._log, 0, os.SEEK_END)
        offset, self._end = self._end, None
        written = os.write(self._log, line)
        while written < len(line):  # a short write (a signal, a full pipe): the rest, in order
            written += os.write(self._log, line[written:])
        self._end = offset + len(line)  # only this buffer appends: no seek while every write completes
        return offset, len(line)

    def _load(self, entry: _Entry) -> Trajectory:
        if entry.traj is not None:
            return entry.traj
        return Trajectory.from_json(os.pread(self._log, entry.length, entry.offset).decode())

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready)

    def take(self, n: int, current_version: int, max_staleness: int, timeout: float) -> list[Trajectory] | None:
        """The oldest n fresh trajectories, or None if they did not arrive within `timeout` seconds.

        In group mode n is a multiple of the group size and the batch is n / group_size whole groups."""
        if n % self.group_size:
            raise ValueError(f"a batch of {n} cannot hold whole groups of {self.group_size}")
        with self._cond:
            if not self._cond.wait_for(lambda: self._drop_stale(current_version, max_staleness) >= n, timeout=timeout):
                return None
            batch, self._ready = self._ready[:n], self._ready[n:]
            self._in_memory -= sum(e.traj is not None for e in batch)
            return [self._load(entry) for entry in batch]

    def _drop_stale(self, current_version: int, max_staleness: int) -> int:
        """Drop what is too old (in group mode: every group with a stale member, whole); the fresh count."""
        stale = {e.traj_id if self.group_size == 1 else e.group for e in self._ready
                 if current_version - e.min_version > max_staleness}
        if not stale:
            return len(self._ready)
        fresh = [e for e in self._ready if (e.traj_id if self.group_size == 1 else e.group) not in stale]
        self.dropped_stale += len(self._ready) - len(fresh)
        self._in_memory = sum(e.traj is not None for e in fresh)
        self.dropped_stale_groups += len(stale) if self.group_size > 1 else 0
        self._ready = fresh
        return len(fresh)

    def close(self) -> None:
        if self._log is not None:
            os.close(self._log)
            self._log = None


def recover(spill_dir: Path, trained_ids: set[str], current_version: int,
            max_staleness: int, group_size: int = 1) -> tuple[list[Trajectory], int]:
    """After a crash: the logged trajectories not yet trained on, split into (reusable, number dropped).

    A trajectory is reused only if the staleness rule still admits it at the resumed version; one
    sampled by weights that were lost with the crash (newer than the checkpoint) is dropped too. In group
    mode a group is reused whole or not at all (a group with one unusable member is dropped whole).
    The log is emptied: the reused ones are logged again when they re-enter a buffer.
    """
    path = Path(spill_dir) / "buffer.jsonl"
    if not path.exists():
        return [], 0
    waiting = []
    for line in path.read_text().splitlines():
        try:
            traj = Trajectory.from_json(line)
        except (json.JSONDecodeError, TypeError):  # the line a kill -9 tore
            continue
        if traj.traj_id not in trained_ids:
            waiting.append(traj)
    reused = [t for t in waiting if is_fresh(t, current_version, max_staleness)]
    if group_size > 1:
        unusable = {t.meta["group"] for t in waiting if not is_fresh(t, current_version, max_staleness)}
        reused = [t for t in reused if t.meta["group"] not in unusable]
    path.unlink()
    return reused, len(waiting) - len(reused)
