"""The training buffer: finished trajectories wait here, in arrival order, until a train step takes them.

SAO (group size 1) releases each trajectory the moment it arrives; group mode releases a group only
when all of its members have finished. Trajectories older than the staleness bound are dropped (and
counted) when a batch is taken.
"""
from __future__ import annotations

import threading
from collections import defaultdict

from .trajectory import Trajectory


class TrajectoryBuffer:
    def __init__(self, group_size: int = 1):
        self.group_size = group_size
        self._ready: list[Trajectory] = []
        self._partial_groups: dict[int, list[Trajectory]] = defaultdict(list)
        self._cond = threading.Condition()
        self.dropped_stale = 0
        self.received = 0

    def put(self, traj: Trajectory) -> None:
        with self._cond:
            self.received += 1
            if self.group_size == 1:
                self._ready.append(traj)
            else:
                group = self._partial_groups[traj.meta["group"]]
                group.append(traj)
                if len(group) < self.group_size:
                    return
                self._ready.extend(self._partial_groups.pop(traj.meta["group"]))
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready)

    def take(self, n: int, current_version: int, max_staleness: int, timeout: float) -> list[Trajectory] | None:
        """The oldest n fresh trajectories, or None if they did not arrive within `timeout` seconds."""
        with self._cond:
            deadline_hit = not self._cond.wait_for(
                lambda: self._drop_stale(current_version, max_staleness) >= n, timeout=timeout
            )
            if deadline_hit:
                return None
            batch, self._ready = self._ready[:n], self._ready[n:]
            return batch

    def _drop_stale(self, current_version: int, max_staleness: int) -> int:
        fresh = [t for t in self._ready if current_version - t.min_version <= max_staleness]
        self.dropped_stale += len(self._ready) - len(fresh)
        self._ready = fresh
        return len(fresh)
