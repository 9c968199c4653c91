"""Zarr (v3) storage of teacher records: append-only per-teacher stream arrays plus a checksummed commit log.

Layout of a cache directory::

    ROOT/zarr.json                  root group; attributes {"format": "opd-sao-logit-cache", "format_version"}
    ROOT/<teacher>/zarr.json        one group per teacher; attributes: the CacheMeta fields, encoding, format_version
    ROOT/<teacher>/<stream>/c/<i>   one 1-D array per stream (encoding.STREAMS); chunk i holds elements
                                    [i * C, (i + 1) * C), C = chunk_elements(granularity, stream)
    ROOT/<teacher>/index.log        the commit log
    ROOT/<teacher>/writer.lock      flock that serialises writers (put, invalidate, gc)

Records are packed back to back in the stream arrays, so a trajectory costs one index line (~150 bytes), not
an array or a file of its own. The arrays are declared with a fixed capacity of 2**48 elements: their metadata
never changes after creation, and only chunks that hold data exist on disk.

Commit protocol (one writer at a time, any number of reader threads or processes):
 1. Under the writer lock, the record's streams are written past the end of the committed data. zarr's
    LocalStore writes each chunk to a temporary file and renames it into place, so a reader sees every chunk
    whole, before or after the write, and a chunk shared with earlier records keeps their bytes.
 2. Then the line ``<crc32 of json, 8 hex> <json>\\n`` is appended to index.log, with json
    ``{"id", "n", "spans": {stream: [start, length]}, "crc"}``. A line counts once it is complete and its
    crc matches, so a reader never sees a record whose data is not fully written. The log is append-only
    because rewriting a whole index per commit would cost O(records); gc rewrites it (temp file, fsync,
    os.replace) and readers notice the new inode.
 3. ``invalidate`` appends ``{"drop": id}``; the newest line for an id wins.
Every read checks the record's CRC-32 (``encoding.checksum``) against its index line: a chunk that fails to
decode, is missing or was altered raises CorruptRecordError, never returns data. A crash between 1 and 2
leaves unreferenced data past the committed end, which the next put overwrites and gc deletes. Appends are
not fsynced: data lost in a power cut fails its checksum like any other corruption.

Damaged metadata (a missing or unparsable zarr.json, a missing index.log) raises CacheDamagedError naming
each file; the OPD stage then rebuilds that teacher's store and re-scores. Reading needs no write access
(no lock is taken), so a read-only cache stays readable; a needed write raises CacheReadOnlyError.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import os
import shutil
import stat
import struct
import tempfile
import threading
import time
import uuid
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import numpy as np
import zarr
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.codecs import BloscCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import LocalStore

from opd_sao.regular_files import UnreadableFile, open_regular, read_regular

from .encoding import (
    ENCODING,
    FORMAT_VERSION,
    STREAM_DTYPES,
    STREAMS,
    checksum,
    from_streams,
    to_streams_many,
)
from .errors import CacheDamagedError, CacheMismatchError, CacheReadOnlyError, CorruptRecordError
from .records import CacheMeta, TeacherRecord

ROOT_ATTRIBUTES = {"format": "opd-sao-logit-cache", "format_version": FORMAT_VERSION}
INDEX_FILE = "index.log"
LOCK_FILE = "writer.lock"
STAGING_PREFIX = ".staging-"
DAMAGED_PREFIX = ".damaged-"
READ_ONLY_ERRORS = (errno.EROFS, errno.EACCES, errno.EPERM)
CAPACITY = 2**48
POSITION_STREAMS = ("sampled_logp", "tail_mass", "row_len")
# Blosc-lz4 with the shuffle that measured smallest per stream (docs/benchmarks_logit_cache.md): bitshuffle
# turns the uint16 fixed-point values and the full-vocabulary logprob codes into mostly-constant bit planes.
# The top_k/top_p ids and logp streams are Exp-Golomb bytes (format 2), which lz4 barely shrinks under any
# shuffle; blosc is kept because it is a zarr v3 spec codec (numcodecs LZ4 is not).
COMPRESSORS = {
    "sampled_logp": BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"),
    "tail_mass": BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"),
    "row_len": BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
    "logp": BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"),
    "ids": BloscCodec(cname="lz4", clevel=5, shuffle="noshuffle"),
}


@dataclass(frozen=True)
class _Entry:
    n_positions: int
    spans: dict[str, tuple[int, int]]
    crc: int


def _index_line(entry: dict) -> bytes:
    payload = json.dumps(entry, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


class _CommitLog:
    """In-memory view of index.log, brought up to date by ``refresh`` (cheap when nothing was appended)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._reset(inode=None)

    def _reset(self, inode: int | None) -> None:
        self.records: dict[str, _Entry] = {}
        self.data_end: dict[str, int] = {}
        self.bad_lines: list[int] = []  # 1-based numbers of complete lines that fail their checksum
        self.line_count = 0
        self.offset = 0  # end of the last complete line read
        self._inode = inode

    def refresh(self) -> None:
        try:
            log = open_regular(self.path, root=self.path.parent)
        except FileNotFoundError:
            raise CacheDamagedError(str(self.path.parent), [f"{self.path}: missing (the commit log)"]) from None
        except UnreadableFile as error:
            raise CacheDamagedError(str(self.path.parent), [f"{error} (the commit log)"]) from None
        with self._lock, log:
            status = os.fstat(log.fileno())
            if status.st_ino != self._inode or status.st_size < self.offset:
                self._reset(status.st_ino)  # gc replaced the log
            if status.st_size == self.offset:
                return
            log.seek(self.offset)
            data = log.read()
            complete = data[: data.rfind(b"\n") + 1]
            for line in complete.splitlines():
                self._apply(line)
            self.offset += len(complete)

    def _apply(self, line: bytes) -> None:
        self.line_count += 1
        crc, _, payload = line.partition(b" ")
        try:
            entry = json.loads(payload) if int(crc, 16) == zlib.crc32(payload) else None
        except ValueError:
            entry = None
        if entry is None:
            self.bad_lines.append(self.line_count)
        elif "drop" in entry:
            self.records.pop(entry["drop"], None)
        else:
            spans = {name: (start, length) for name, (start, length) in entry["spans"].items()}
            self.records[entry["id"]] = _Entry(entry["n"], spans, entry["crc"])
            for name, (start, length) in spans.items():
                self.data_end[name] = max(self.data_end.get(name, 0), start + length)

    def append(self, entries: list[dict]) -> None:
        """Commit entries; the caller holds the writer lock and has called ``drop_torn_tail``."""
        with open(self.path, "ab") as log:
            log.write(b"".join(map(_index_line, entries)))
        self.refresh()

    def drop_torn_tail(self) -> int:
        """Cut a line a crashed writer left half written, so the next line starts clean. Needs the writer lock."""
        self.refresh()
        torn = self.path.stat().st_size - self.offset
        if torn:
            os.truncate(self.path, self.offset)
        return torn

    def rewrite(self, records: dict[str, _Entry]) -> None:
        """Replace the log by one line per record (gc); readers reload on the inode change."""
        handle, temporary = tempfile.mkstemp(prefix=f".{INDEX_FILE}.", dir=self.path.parent)
        with os.fdopen(handle, "wb") as log:
            for traj_id, entry in records.items():
                spans = {name: list(span) for name, span in entry.spans.items()}
                log.write(_index_line({"id": traj_id, "n": entry.n_positions, "spans": spans, "crc": entry.crc}))
            log.flush()
            os.fsync(log.fileno())
        os.replace(temporary, self.path)
        self.refresh()


def _check_identity(path: Path, attributes: dict, meta: CacheMeta) -> None:
    requested = {**meta.to_attrs(), "format_version": FORMAT_VERSION, "encoding": ENCODING}
    differences = {
        name: (attributes.get(name), value) for name, value in requested.items() if attributes.get(name) != value
    }
    if differences:
        raise CacheMismatchError(str(path), differences)


class _StoreFiles(LocalStore):
    """zarr's LocalStore reading only regular files inside the store, of at most FILE_LIMIT bytes: a chunk that is
    a FIFO hung every read, one linked to /dev/zero exhausted memory. Such a file raises UnreadableFile, which
    a record read reports as corrupt (CorruptRecordError) and a metadata read as damage."""

    async def get(self, key, prototype=None, byte_range=None):
        if not self._is_open:
            await self._open()
        try:
            return await asyncio.to_thread(self._read, key, prototype or default_buffer_prototype(), byte_range)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def _read(self, key: str, prototype, byte_range):
        data = read_regular(self.root / key, limit=FILE_LIMIT, root=self.root)
        if "/c/" in key and (len(data) < BLOSC_HEADER or struct.unpack_from("<I", data, 12)[0] != len(data)):
            # a blosc frame shorter than its header's size: numcodecs reads past the end (a truncated chunk
            # crashed the process with SIGSEGV)
            raise ValueError(f"{self.root / key}: {len(data)} bytes, not the blosc frame its header declares")
        if isinstance(byte_range, RangeByteRequest):
            data = data[byte_range.start : byte_range.end]
        elif isinstance(byte_range, OffsetByteRequest):
            data = data[byte_range.offset :]
        elif isinstance(byte_range, SuffixByteRequest):
            data = data[len(data) - min(byte_range.suffix, len(data)) :]
        return prototype.buffer.from_bytes(data)


def _read_metadata(path: Path) -> dict:
    """A zarr.json's content; CacheDamagedError naming the file if it is missing, not a regular file of the store
    (at most FILE_LIMIT bytes) or not a JSON object."""
    try:
        content = json.loads(read_regular(path, limit=FILE_LIMIT, root=path.parent))
        if not isinstance(content, dict):
            raise ValueError("not a JSON object")
        return content
    except FileNotFoundError:
        raise CacheDamagedError(str(path.parent), [f"{path}: missing"]) from None
    except UnreadableFile as error:
        raise CacheDamagedError(str(path.parent), [str(error)]) from None
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CacheDamagedError(str(path.parent), [f"{path}: unreadable ({error})"]) from None


def teacher_metadata_problems(path: Path) -> list[str]:
    """One line per damaged metadata file of a teacher directory (each starting with its path); [] if sound."""
    if not path.is_dir():
        return [f"{path}: missing"]
    try:
        granularity = _read_metadata(path / "zarr.json").get("attributes", {}).get("granularity")
    except CacheDamagedError as error:
        problems, granularity = error.problems, None
    else:
        problems = []
    streams = STREAMS.get(granularity) or sorted(child.name for child in path.iterdir() if child.name in STREAM_DTYPES)
    for name in streams:
        try:
            _read_metadata(path / name / "zarr.json")
        except CacheDamagedError as error:
            problems += error.problems
    try:
        open_regular(path / INDEX_FILE, root=path).close()
    except (FileNotFoundError, IsADirectoryError):
        problems.append(f"{path / INDEX_FILE}: missing (the commit log)")
    except UnreadableFile as error:
        problems.append(f"{error} (the commit log)")
    lock = path / LOCK_FILE  # created when missing; anything else there would hang or misdirect a writer
    if os.path.lexists(lock) and not stat.S_ISREG(os.lstat(lock).st_mode):
        problems.append(f"{lock}: not a regular file (the writers' lock)")
    return problems


class TeacherCache:
    """One teacher's records, keyed by trajectory id. Obtain it from ``LogitCache.open_teacher``.

    Thread-safe; several processes may open the same cache. Writers serialise on a file lock; readers take
    none, so a read-only cache can be read.
    """

    def __init__(self, path: Path, meta: CacheMeta):
        self.path = path
        self.meta = meta
        problems = teacher_metadata_problems(path)
        if problems:
            raise CacheDamagedError(str(path), problems)
        try:
            group = zarr.open_group(_StoreFiles(path), mode="r+")  # writes nothing: works read-only
            _check_identity(path, group.attrs.asdict(), meta)
            self._arrays = {name: group[name] for name in STREAMS[meta.granularity]}
        except (CacheMismatchError, CacheDamagedError):
            raise
        except Exception as error:  # valid JSON that zarr cannot use as metadata
            raise CacheDamagedError(str(path), [f"{path}: zarr cannot open its metadata ({error!r})"]) from None
        self._log = _CommitLog(path / INDEX_FILE)

    @contextmanager
    def _writing(self, action: str):
        path = self.path / LOCK_FILE
        try:  # non-blocking and not through a link: a FIFO or a link out of the store is damage, not a hang
            lock = os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW
                                     | os.O_CLOEXEC, 0o644), "ab")
        except OSError as error:
            if error.errno in READ_ONLY_ERRORS:
                raise CacheReadOnlyError(str(self.path), action, error.strerror) from None
            if error.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise CacheDamagedError(str(self.path), [f"{path}: not a regular file ({error.strerror})"]) from None
            raise
        with lock:
            if not stat.S_ISREG(os.fstat(lock.fileno()).st_mode):
                raise CacheDamagedError(str(self.path), [f"{path}: not a regular file"])
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield self._log.drop_torn_tail()

    def put(self, traj_id: str, record: TeacherRecord) -> None:
        """Append ``record`` and commit it; replaces an earlier record of ``traj_id``."""
        self.put_many({traj_id: record})

    def put_many(self, records: dict[str, TeacherRecord]) -> None:
        """Append and commit several records with one write per stream: a chunk shared by consecutive records
        is rewritten once per call, not once per record, and the records are coded together (`to_streams_many`:
        the same bytes), so batches write faster."""
        encoded = dict(zip(records, to_streams_many(self.meta, list(records.values()))))
        crcs = {traj_id: checksum(streams) for traj_id, streams in encoded.items()}
        with self._writing(f"storing the teacher records of {len(records)} trajectories"):
            end = {name: self._log.data_end.get(name, 0) for name in self._arrays}
            entries = []
            for traj_id, streams in encoded.items():
                spans = {}
                for name, data in streams.items():
                    spans[name] = [end[name], len(data)]
                    end[name] += len(data)
                entries.append({"id": traj_id, "n": records[traj_id].n_positions, "spans": spans, "crc": crcs[traj_id]})
            for name, array in self._arrays.items():
                start = self._log.data_end.get(name, 0)
                if end[name] > start:
                    array[start : end[name]] = np.concatenate([streams[name] for streams in encoded.values()])
            self._log.append(entries)

    def _read_streams(self, traj_id: str, entry: _Entry) -> dict[str, np.ndarray]:
        try:
            streams = {
                name: self._arrays[name][start : start + length] if length else np.zeros(0, STREAM_DTYPES[name])
                for name, (start, length) in entry.spans.items()
            }
        except Exception as error:  # any decode failure of a chunk means it is damaged
            raise CorruptRecordError([traj_id], f"unreadable chunk ({error!r})") from error
        if checksum(streams) != entry.crc:
            raise CorruptRecordError([traj_id], "checksum mismatch")
        return streams

    def _entry(self, traj_id: str) -> _Entry:
        self._log.refresh()
        entry = self._log.records.get(traj_id)
        if entry is None:
            raise KeyError(traj_id)
        return entry

    def get(self, traj_id: str) -> TeacherRecord:
        """The committed record; KeyError if absent, CorruptRecordError if its bytes fail verification."""
        entry = self._entry(traj_id)
        return from_streams(self.meta, entry.n_positions, self._read_streams(traj_id, entry))

    def get_many(self, traj_ids: list[str]) -> list[TeacherRecord]:
        """Records in order; one CorruptRecordError naming every corrupt id, so all are re-scored at once.

        Records committed together lie side by side, so each stream is read once over the span that covers
        them all (one zarr read per stream, not one per record) and sliced; each record's CRC is still
        checked on its own. A span that fails to decode falls back to record-by-record reads, which name
        the damaged records."""
        self._log.refresh()
        entries = {}
        for traj_id in traj_ids:
            entry = self._log.records.get(traj_id)
            if entry is None:
                raise KeyError(traj_id)
            entries[traj_id] = entry
        spans = self._read_covering_spans(list(entries.values()))
        records, corrupt = [], []
        for traj_id in traj_ids:
            entry = entries[traj_id]
            try:
                if spans is None:
                    streams = self._read_streams(traj_id, entry)
                else:
                    streams = {name: spans[name][1][start - spans[name][0]: start - spans[name][0] + length]
                               for name, (start, length) in entry.spans.items()}
                    if checksum(streams) != entry.crc:
                        raise CorruptRecordError([traj_id], "checksum mismatch")
                records.append(from_streams(self.meta, entry.n_positions, streams))
            except CorruptRecordError:
                corrupt.append(traj_id)
        if corrupt:
            raise CorruptRecordError(corrupt, "checksum mismatch or unreadable chunk")
        return records

    def _read_covering_spans(self, entries: list[_Entry]) -> dict[str, tuple[int, np.ndarray]] | None:
        """Per stream, (start, data) over the span covering every entry; None if that span is much longer than
        the entries' own data (records scattered through the cache) or does not decode."""
        out = {}
        for name in self._arrays:
            ranges = [entry.spans[name] for entry in entries if entry.spans.get(name, (0, 0))[1]]
            if not ranges:
                out[name] = (0, np.zeros(0, STREAM_DTYPES[name]))
                continue
            start, end = min(a for a, _ in ranges), max(a + n for a, n in ranges)
            if end - start > 4 * sum(n for _, n in ranges) + 4096:
                return None
            try:
                out[name] = (start, self._arrays[name][start:end])
            except Exception:  # a damaged chunk: let the per-record path say which records it hits
                return None
        return out

    def invalidate(self, traj_id: str) -> None:
        """Drop the record (e.g. a corrupt one) so it can be put again; a no-op for an absent id."""
        with self._writing("invalidating a record"):
            if traj_id in self._log.records:
                self._log.append([{"drop": traj_id}])

    def __contains__(self, traj_id: str) -> bool:
        return self.contains_many([traj_id])[0]

    def contains_many(self, traj_ids: list[str]) -> list[bool]:
        """`traj_id in self` for each, the commit log read once (one open and stat, not one per id)."""
        self._log.refresh()
        return [traj_id in self._log.records for traj_id in traj_ids]

    def __len__(self) -> int:
        self._log.refresh()
        return len(self._log.records)

    def traj_ids(self) -> list[str]:
        self._log.refresh()
        return list(self._log.records)

    def n_tokens(self) -> int:
        self._log.refresh()
        return sum(entry.n_positions for entry in self._log.records.values())

    def bad_index_lines(self) -> list[int]:
        """Index lines that fail their checksum; their records are unknown and must be re-scored."""
        self._log.refresh()
        return list(self._log.bad_lines)

    def verify(self) -> list[str]:
        """Ids of committed records whose data fails verification."""
        self._log.refresh()
        corrupt = []
        for traj_id, entry in list(self._log.records.items()):
            try:
                self._read_streams(traj_id, entry)
            except CorruptRecordError:
                corrupt.append(traj_id)
        return corrupt

    def collect_garbage(self) -> dict:
        """Drop corrupt records, compact the index and delete chunks and temporary files no record uses.

        A directory where a chunk belongs (no zarr write makes one) is removed and listed in the report."""
        foreign = []
        with self._writing("gc") as torn_index_bytes:
            corrupt = self.verify()
            live = {traj_id: entry for traj_id, entry in self._log.records.items() if traj_id not in corrupt}
            index_lines_dropped = self._log.line_count - len(live)
            self._log.rewrite(live)
            chunks_removed, bytes_freed = 0, torn_index_bytes
            for name, array in self._arrays.items():
                used = _chunks_in_use(live.values(), name, array.chunks[0])
                chunk_dir = self.path / name / "c"
                for chunk in chunk_dir.iterdir() if chunk_dir.is_dir() else ():
                    if chunk.is_dir() and not chunk.is_symlink():
                        foreign.append(str(chunk))
                        shutil.rmtree(chunk)
                        continue
                    if chunk.name.isdigit() and int(chunk.name) in used:
                        continue
                    bytes_freed += chunk.lstat().st_size
                    chunk.unlink()
                    chunks_removed += chunk.name.isdigit()
            for leftover in self.path.glob(f".{INDEX_FILE}.*"):
                bytes_freed += leftover.stat().st_size
                leftover.unlink()
        return {
            "corrupt_records_dropped": corrupt,
            "index_lines_dropped": index_lines_dropped,
            "chunks_removed": chunks_removed,
            "bytes_freed": bytes_freed,
            "foreign_entries_removed": foreign,
        }


def chunk_elements(granularity: str, stream: str) -> int:
    """Elements per chunk; each put rewrites the chunk it starts in, so smaller chunks write faster."""
    if stream in POSITION_STREAMS:
        return 2**13
    return 2**22 if granularity == "full" else 2**17  # full: ~28 positions per chunk instead of one


BLOSC_HEADER = 16  # version, flags, typesize, then uint32 nbytes, blocksize and cbytes (the frame's own length)
# The largest file the store reads: twice the largest chunk (blosc adds at most 16 bytes to incompressible data);
# zarr.json files are far smaller.
FILE_LIMIT = 2 * max(chunk_elements(granularity, stream) * STREAM_DTYPES[stream].itemsize
                     for granularity, streams in STREAMS.items() for stream in streams)


def _chunks_in_use(entries, stream: str, chunk: int) -> set[int]:
    used = set()
    for entry in entries:
        start, length = entry.spans.get(stream, (0, 0))
        if length:
            used.update(range(start // chunk, (start + length - 1) // chunk + 1))
    return used


def _directory_name(teacher: str) -> str:
    name = quote(teacher, safe="")
    return "%2E" + name[1:] if name.startswith(".") else name


class LogitCache:
    """A directory holding one zarr group per teacher."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def open_teacher(self, meta: CacheMeta) -> TeacherCache:
        """The teacher's cache, created if absent; CacheMismatchError if it was made for another identity,
        CacheDamagedError if its metadata is damaged (then ``rebuild_teacher``)."""
        path = self.root / _directory_name(meta.teacher)
        if not path.exists():  # a teacher dir appears whole (renamed into place): a partial one is damage
            self._create_teacher(path, meta)
        return TeacherCache(path, meta)

    def rebuild_teacher(self, meta: CacheMeta) -> TeacherCache:
        """Replace a damaged teacher store by an empty one (its records are to be re-scored).

        The damaged directory is first renamed aside, so a concurrent reader never sees it half deleted; if
        another process already rebuilt it, the sound store is kept."""
        path = self.root / _directory_name(meta.teacher)
        try:
            if path.exists() and teacher_metadata_problems(path):
                aside = self.root / f"{DAMAGED_PREFIX}{uuid.uuid4().hex}"
                os.rename(path, aside)
                shutil.rmtree(aside, ignore_errors=True)
        except OSError as error:
            if error.errno in READ_ONLY_ERRORS:
                raise CacheReadOnlyError(str(path), "rebuilding a damaged teacher store", error.strerror) from None
            raise
        return self.open_teacher(meta)

    def _create_teacher(self, path: Path, meta: CacheMeta) -> None:
        """Build the group in a staging directory and rename it into place, so nobody opens it half made."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            zarr.open_group(LocalStore(self.root), mode="a", attributes=ROOT_ATTRIBUTES)
            staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.root))
        except OSError as error:
            if error.errno in READ_ONLY_ERRORS:
                raise CacheReadOnlyError(str(self.root), f"creating the store of teacher {meta.teacher!r}",
                                         error.strerror) from None
            raise
        group = zarr.create_group(
            LocalStore(staging), attributes={**meta.to_attrs(), "format_version": FORMAT_VERSION, "encoding": ENCODING}
        )
        for name in STREAMS[meta.granularity]:
            group.create_array(
                name,
                shape=(CAPACITY,),
                chunks=(chunk_elements(meta.granularity, name),),
                dtype=STREAM_DTYPES[name],
                compressors=[COMPRESSORS[name]],
                fill_value=0,
                chunk_key_encoding={"name": "default", "separator": "/"},
            )
        (staging / INDEX_FILE).touch()
        (staging / LOCK_FILE).touch()
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, path)
        except OSError:  # another process created it first; open_teacher validates theirs
            shutil.rmtree(staging)

    def teacher_dirs(self) -> list[Path]:
        """Every teacher directory here; FileNotFoundError if this is not a logit cache, CacheDamagedError if
        its root metadata is unreadable."""
        root_meta = self.root / "zarr.json"
        if not root_meta.is_file():
            raise FileNotFoundError(f"{self.root} is not an opd-sao logit cache (no {root_meta})")
        if _read_metadata(root_meta).get("attributes", {}).get("format") != ROOT_ATTRIBUTES["format"]:
            raise FileNotFoundError(f"{self.root} is not an opd-sao logit cache ({root_meta} says otherwise)")
        return sorted(child for child in self.root.iterdir() if child.is_dir() and not child.name.startswith("."))

    def open_dir(self, path: Path) -> TeacherCache:
        """The teacher stored in ``path``, with the identity its metadata records; CacheDamagedError if damaged."""
        try:
            attributes = _read_metadata(path / "zarr.json").get("attributes", {})
            meta = CacheMeta.from_attrs(attributes)
        except (KeyError, TypeError, ValueError) as error:
            raise CacheDamagedError(str(path), [f"{path / 'zarr.json'}: no teacher identity ({error!r})"]) from None
        return TeacherCache(path, meta)

    def teachers(self) -> dict[str, CacheMeta]:
        """Identity of every teacher stored here; FileNotFoundError if this is not a logit cache,
        CacheDamagedError (every problem of every teacher) if some metadata is damaged."""
        metas, problems = {}, []
        for path in self.teacher_dirs():
            try:
                meta = self.open_dir(path).meta
            except CacheDamagedError as error:
                problems += error.problems
                continue
            metas[meta.teacher] = meta
        if problems:
            raise CacheDamagedError(str(self.root), problems)
        return metas

    def remove_stale_staging(self, older_than_s: float = 3600.0) -> int:
        """Delete staging directories an interrupted ``open_teacher`` left, and damaged stores an interrupted
        ``rebuild_teacher`` set aside; returns the bytes freed."""
        freed = 0
        for staging in [*self.root.glob(f"{STAGING_PREFIX}*"), *self.root.glob(f"{DAMAGED_PREFIX}*")]:
            if staging.name.startswith(DAMAGED_PREFIX) or time.time() - staging.stat().st_mtime > older_than_s:
                freed += sum(f.stat().st_size for f in staging.rglob("*") if f.is_file())
                shutil.rmtree(staging)
        return freed
