"""The base model and the OPD teachers a run started with, recorded in the run directory so `--resume` refuses
another one swapped in.

A resumed stage continues from saved state and checkpoints trained from that model; another model of the same shape
loads without a complaint and trains on, from weights that no longer match; a teacher replaced between a kill and
a resume would teach the rest of an OPD stage something other than what its cached scores came from. So at the start of a run every
file of `model.path` and of every teacher given as a checkpoint directory is recorded (`model.fingerprint.json`) and
a resume compares sizes and sampled hashes.

Hashing a 70B model whole (about 140 GB) would cost minutes per resume, so the hash samples: a file up to 16 MiB
(config, tokenizer) whole; a `.safetensors` file its header (every tensor's name, dtype, shape and offsets) and
the first and last 64 KiB of every tensor's data: about 90 MB for a 70B model (~720 tensors), read in well under
a second from disk. Any training or merge of a tensor rewrites its first and last elements, so another model of the
same shape differs there; a change confined to the middle of every tensor it touches is not seen (known limit).
Other large files (`.bin`, `.gguf`) hash their first and last MiB. mtime is recorded but not compared: a copy of
the same model passes.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from opd_sao.errors import UsageError
from opd_sao.io.data_fingerprint import first_change
from opd_sao.io.files import write_json
from opd_sao.regular_files import UnreadableFile, open_regular

RECORD = "model.fingerprint.json"
WHOLE = 16 << 20  # files up to this size are hashed whole
TENSOR_SAMPLE = 64 << 10  # bytes hashed at each end of every safetensors tensor
FILE_SAMPLE = 1 << 20  # bytes hashed at each end of another large file
MAX_HEADER = 100 << 20  # safetensors' own limit on its JSON header


def _read_at(f, offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


def _spans(f, size: int) -> list[tuple[int, int]]:
    """(offset, length) of what is hashed: the header and both ends of every tensor of a safetensors file, else
    both ends of the file."""
    header = _read_at(f, 0, 8)
    length = struct.unpack("<Q", header)[0] if len(header) == 8 else 0
    try:
        if not 0 < length <= min(MAX_HEADER, size - 8):
            raise ValueError("no safetensors header")
        tensors = json.loads(_read_at(f, 8, length))
        spans = [(0, 8 + length)]
        for begin, end in sorted(t["data_offsets"] for name, t in tensors.items() if name != "__metadata__"):
            begin, end = 8 + length + begin, min(8 + length + end, size)
            head = min(TENSOR_SAMPLE, end - begin)
            tail = max(begin + head, end - TENSOR_SAMPLE)
            spans += [(begin, head), (tail, end - tail)]
        return spans
    except (ValueError, TypeError, KeyError, AttributeError):
        return [(0, FILE_SAMPLE), (max(0, size - FILE_SAMPLE), min(FILE_SAMPLE, size))]


def file_fingerprint(path: Path) -> dict:
    """{size, mtime, sha256}: sha256 of the whole file up to WHOLE bytes, else of the sampled spans."""
    digest = hashlib.sha256()
    with open_regular(path) as f:
        status = os.fstat(f.fileno())
        spans = [(0, status.st_size)] if status.st_size <= WHOLE else _spans(f, status.st_size)
        for offset, length in spans:
            f.seek(offset)
            while length > 0 and (block := f.read(min(length, 1 << 20))):
                digest.update(block)
                length -= len(block)
    return {"size": status.st_size, "mtime": status.st_mtime, "sha256": digest.hexdigest()}


def model_fingerprint(model_dir: Path, what: str = "model.path") -> dict[str, dict]:
    """file (relative to the model dir) -> its fingerprint, for every file in it (hidden ones, e.g. a hub
    cache's `.cache/`, left out); `what` names the directory in an error."""
    out = {}
    for path in sorted(Path(model_dir).rglob("*")):
        relative = path.relative_to(model_dir)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            try:
                out[str(relative)] = file_fingerprint(path)
            except UnreadableFile as err:
                raise UsageError(f"{what}: {err}") from None
    return out


def write_model_record(model_dir: Path | None, run_dir: Path, teachers: dict[str, Path] | None = None) -> None:
    """Record `model_dir` (None: the run builds its own base model under the run directory: nothing to record) and
    `teachers` (their label in messages -> checkpoint directory)."""
    record = {} if model_dir is None else {"path": str(model_dir), "files": model_fingerprint(model_dir)}
    if teachers:
        record["teachers"] = {label: {"path": str(directory), "files": model_fingerprint(directory, label)}
                              for label, directory in teachers.items()}
    if record:
        write_json(Path(run_dir) / RECORD, record, indent=1)


def check_model_record(model_dir: Path | None, run_dir: Path, teachers: dict[str, Path] | None = None) -> None:
    """UsageError (one line naming the file) when the base model's or a teacher's files changed since the run
    started; what a run has no record of (a run started before records existed) is recorded now."""
    path, teachers = Path(run_dir) / RECORD, teachers or {}
    if model_dir is None and not teachers:
        return
    record = json.loads(path.read_text()) if path.is_file() else {}
    recorded = record.get("teachers", {})
    checks = [("model.path", model_dir, record["files"], "from the base model")] \
        if model_dir is not None and "files" in record else []
    checks += [(label, directory, recorded[label]["files"], "with the teachers")
               for label, directory in teachers.items() if label in recorded]
    for label, directory, files, keeps in checks:
        change = first_change(files, model_fingerprint(directory, label))
        if change is not None:
            name, what = change
            raise UsageError(f"{label}: {Path(directory) / name} {what} since the run started; a resume continues "
                             f"{keeps} it started with (restore it, or start a new run)")
    if (model_dir is not None and "files" not in record) or set(teachers) - set(recorded):
        write_model_record(model_dir, run_dir, teachers)
