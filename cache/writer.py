"""Persisting records beside the trainer: a writer thread that commits them to a ``TeacherCache`` in batches.

The trainer hands each batch's fresh records to ``submit`` and trains on them at once (quantised in memory by
``encoding.quantised``, equal to what the cache will return); the thread encodes, checksums and commits them
with one ``put_many`` per ``batch_records`` records (a chunk shared by consecutive records is rewritten once per
commit, not once per trainer step). Submitted records stay visible to ``get`` until committed, so a sequence seen
again before its commit is not scored twice; committed ones stay visible too, the most recently used first, up to
``keep_bytes``, so a sequence seen again soon (a short answer to a prompt that comes back) is not read back from the
store either (reading, checking and decoding a record cost more than a small teacher's forward).

Guarantees are the store's, for what is committed: ``flush`` returns once every submitted record is on disk (the
OPD learner flushes before each resumable-state save and at the stage's end), so a crash loses at most the
records submitted since the last flush, which a resume finds missing and re-scores. ``submit`` blocks while
``max_pending`` records wait (the queue is bounded). An error in the thread is raised by the next ``submit``,
``flush`` or ``close``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import numpy as np

from .records import TeacherRecord
from .store import TeacherCache


class BackgroundWriter:
    def __init__(self, cache: TeacherCache, *, batch_records: int = 512, max_pending: int = 4096,
                 keep_bytes: int = 64 << 20):
        if not 1 <= batch_records <= max_pending:
            raise ValueError(f"need 1 <= batch_records <= max_pending, got {batch_records} and {max_pending}")
        self.cache, self.batch_records, self.max_pending = cache, batch_records, max_pending
        self.keep_bytes = keep_bytes
        self._pending: dict[str, TeacherRecord] = {}  # submitted, not yet committed (in submission order)
        self._writing: dict[str, TeacherRecord] = {}  # taken by the thread, being committed
        self._kept: OrderedDict[str, TeacherRecord] = OrderedDict()  # committed, least recently used first
        self._kept_bytes = 0
        self._cond = threading.Condition()
        self._flushes = 0  # flush requests not yet served
        self._error: BaseException | None = None
        self._closed = False
        self.commits = 0
        self.cpu_s = 0.0  # the thread's own CPU time (encoding, checksums, zarr writes)
        self._thread = threading.Thread(target=self._run, name=f"cache-writer-{cache.meta.teacher}", daemon=True)
        self._thread.start()

    def _raise(self) -> None:
        if self._error is not None:  # the store's own error (e.g. CacheDamagedError), so callers can handle it
            raise self._error

    def submit(self, records: dict[str, TeacherRecord]) -> None:
        """Queue records for commit; blocks while the queue is full."""
        with self._cond:
            while len(self._pending) + len(self._writing) >= self.max_pending and self._error is None:
                self._cond.wait()
            self._raise()
            if self._closed:
                raise RuntimeError("the logit cache writer is closed")
            self._pending.update(records)
            self._cond.notify_all()

    def get(self, traj_id: str) -> TeacherRecord | None:
        """The record of ``traj_id`` if it was submitted and is not committed yet, or committed and still kept
        in memory; None: the store has it, or nobody does."""
        with self._cond:
            record = self._pending.get(traj_id) or self._writing.get(traj_id)
            if record is None and traj_id in self._kept:
                self._kept.move_to_end(traj_id)
                record = self._kept[traj_id]
            return record

    def _keep(self, records: dict[str, TeacherRecord]) -> None:
        """Hold committed records in memory, dropping the least recently used beyond ``keep_bytes``."""
        for traj_id, record in records.items():
            size = _nbytes(record)
            if traj_id in self._kept:
                self._kept_bytes -= _nbytes(self._kept.pop(traj_id))
            if size <= self.keep_bytes:
                self._kept[traj_id] = record
                self._kept_bytes += size
        while self._kept_bytes > self.keep_bytes:
            self._kept_bytes -= _nbytes(self._kept.popitem(last=False)[1])

    def __len__(self) -> int:
        with self._cond:
            return len(self._pending) + len(self._writing)

    def flush(self) -> None:
        """Return once every record submitted so far is committed."""
        with self._cond:
            self._flushes += 1
            self._cond.notify_all()
            while (self._pending or self._writing) and self._error is None:
                self._cond.wait()
            self._flushes -= 1
            self._raise()

    def close(self) -> None:
        """Flush, then stop the thread."""
        try:
            self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or len(self._pending) >= self.batch_records
                           or (self._pending and self._flushes)):
                    self._cond.wait()
                if not self._pending:  # closed, nothing left
                    return
                self._writing, self._pending = self._pending, {}
            started = time.thread_time()
            try:
                self.cache.put_many(self._writing)
            except BaseException as error:  # kept for the trainer's next call; the records stay uncommitted
                with self._cond:
                    self._error = error
                    self._cond.notify_all()
                return
            with self._cond:
                self._keep(self._writing)
                self._writing = {}
                self.commits += 1
                self.cpu_s += time.thread_time() - started
                self._cond.notify_all()


def _nbytes(record: TeacherRecord) -> int:
    return sum(np.asarray(value).nbytes for value in vars(record).values() if value is not None)
