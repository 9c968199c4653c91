"""The data a run started with, recorded in the run directory so `--resume` refuses data that changed since.

A resumed stage reuses its buffered trajectories and its saved state; after the dataset file was replaced, those
belong to other tasks. Each stage's data files (a directory: every file in it) are recorded with size, mtime
and sha256; a resume compares sizes and hashes (a file touched but not changed passes).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from opd_sao.errors import UsageError
from opd_sao.io.files import write_json
from opd_sao.regular_files import UnreadableFile, open_regular

RECORD = "data.fingerprint.json"


def file_fingerprint(path: Path) -> dict:
    """Only of a regular file (UnreadableFile naming it otherwise: a FIFO hung here, an unreadable file was
    reported as an unwritable run directory)."""
    digest = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        stat = os.fstat(f.fileno())
    return {"size": stat.st_size, "mtime": stat.st_mtime, "sha256": digest.hexdigest()}


def data_fingerprint(paths: list[str]) -> dict[str, dict]:
    """file -> {size, mtime, sha256} for every file named or inside a directory named (sorted); a named file
    that does not exist is left to the environment to report."""
    out = {}
    for name in sorted(set(paths)):
        path = Path(name)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if os.path.exists(file):
                out[str(file)] = file_fingerprint(file)
    return out


def stage_fingerprints(stage_files: dict[str, list[str]]) -> dict[str, dict[str, dict]]:
    """stage -> its data_fingerprint; a file that cannot be fingerprinted is one line naming the stage and file."""
    out = {}
    for stage, files in stage_files.items():
        try:
            out[stage] = data_fingerprint(files)
        except UnreadableFile as err:
            raise UsageError(f"stage {stage!r}: data file {err}") from None
    return out


def write_data_record(stage_files: dict[str, list[str]], run_dir: Path) -> None:
    write_json(Path(run_dir) / RECORD, stage_fingerprints(stage_files), indent=1)


def check_data_record(stage_files: dict[str, list[str]], run_dir: Path) -> None:
    """Raise ValueError (one line naming the stage and the file) when a stage's data changed since the run started;
    a run without a record (started before records existed) gets one now."""
    path = Path(run_dir) / RECORD
    if not path.is_file():
        write_data_record(stage_files, run_dir)
        return
    recorded = json.loads(path.read_text())
    for stage, now in stage_fingerprints(stage_files).items():
        change = first_change(recorded.get(stage, {}), now)
        if change is not None:
            raise UsageError(f"stage {stage!r}: data file {change[0]} {change[1]} since the run started; a resume "
                             f"continues on the data it started with (restore the file, or start a new run)")


def first_change(before: dict[str, dict], now: dict[str, dict]) -> tuple[str, str] | None:
    """(file, what) for the first file (sorted) that is gone, new, or of another size or hash; None if none."""
    for file in sorted(before.keys() | now.keys()):
        old, new = before.get(file), now.get(file)
        if old is None or new is None or (old["size"], old["sha256"]) != (new["size"], new["sha256"]):
            return file, "is gone" if new is None else "is new" if old is None else \
                f"changed (size {old['size']} -> {new['size']}, sha256 {old['sha256'][:12]} -> {new['sha256'][:12]})"
    return None
