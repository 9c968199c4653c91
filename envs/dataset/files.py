"""Reading task rows from local files: JSONL, JSON, Parquet, or a `datasets.save_to_disk` directory.

Rows are streamed (JSONL line by line, Parquet batch by batch through pyarrow, a saved dataset through its
memory-mapped Arrow table), never loaded whole, except a `.json` file, which is one JSON array. A data file (and
every file of a saved dataset's directory, inside it) must be a regular file (a FIFO would block the read forever,
/dev/zero never ends: opd_sao.regular_files), a `.json` at most MAX_JSON_BYTES and a JSONL line at most
MAX_LINE_BYTES, checked before they are read. A row the
mapping cannot read (bad JSON, a missing or mistyped field, a duplicate id) is a `BadRow`: one line naming
the file, the row (1-based) and the field. The environment skips and counts those up to `max_bad_rows` and
refuses the file past that.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional

from opd_sao.errors import UsageError
from opd_sao.regular_files import UnreadableFile, open_regular, read_regular

BATCH_ROWS = 1024  # rows per Parquet / Arrow batch
MAX_JSON_BYTES = 1 << 30  # a .json file is parsed whole (several times its size in memory): larger, use .jsonl
MAX_LINE_BYTES = 64 << 20  # one JSONL row; a prompt is refused at stage start long before this (max_context_tokens)


class DatasetError(UsageError):
    """A file that cannot be read as a dataset, or that holds more malformed rows than allowed (one line)."""


class BadRow(UsageError):
    """One malformed row; the message names the file, the row and the field."""


def iter_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(1-based row number, row) for every row of the file, streamed; a row is whatever the file holds there
    (a dict when well formed), or a BadRow for a line that is not JSON."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    if path.is_dir():
        yield from _saved_dataset_rows(path)
        return
    readers = {".jsonl": _jsonl_rows, ".ndjson": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_rows,
               ".pq": _parquet_rows}
    if path.suffix not in readers:
        raise DatasetError(f"dataset file {str(path)!r}: unknown format {path.suffix!r} "
                           f"(use .jsonl, .json, .parquet, or a datasets save_to_disk directory)")
    try:
        opened = open_regular(path, limit=MAX_JSON_BYTES if path.suffix == ".json" else None)
    except UnreadableFile as err:
        raise DatasetError(f"dataset file {err}") from None
    with opened:
        yield from readers[path.suffix](path, opened)


def _jsonl_rows(path: Path, lines) -> Iterator[tuple[int, Any]]:
    number = 0
    while raw := lines.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := lines.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass  # the rest of the line, never held whole
            yield number, BadRow(f"{path}: row {number}: longer than {MAX_LINE_BYTES} bytes")
            continue
        if number == 1 and raw.startswith(codecs.BOM_UTF8):  # written by Windows tools: not part of the row
            raw = raw[len(codecs.BOM_UTF8):]
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield number, BadRow(f"{path}: row {number}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at "
                                 f"column {err.start + 1})")
            continue
        if not line.strip():
            continue
        problem = _json_problem(line)
        yield number, BadRow(f"{path}: row {number}: {problem}") if isinstance(problem, str) else problem[0]


def _json_problem(text: str) -> tuple[Any] | str:
    """(the parsed value,), or why the text is not JSON Python can hold: a syntax error, nesting past the
    recursion limit, an integer past Python's digit limit."""
    try:
        return (json.loads(text),)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at {f'line {err.lineno} ' if err.lineno > 1 else ''}column {err.colno})"
    except RecursionError:
        return "not valid JSON here (nested too deeply)"
    except ValueError as err:  # "Exceeds the limit (4300 digits) for integer string conversion"
        return f"not valid JSON here ({str(err).split(';')[0]})"


def _json_rows(path: Path, opened) -> Iterator[tuple[int, Any]]:
    raw = opened.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DatasetError(f"{path}: line {line}: not valid UTF-8 (byte 0x{raw[err.start]:02x})") from None
    problem = _json_problem(text)
    if isinstance(problem, str):
        raise DatasetError(f"{path}: {problem}; a .json dataset is one array of row objects (use .jsonl for one "
                           f"row per line)")
    data = problem[0]
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a .json dataset must be one array of row objects (got {type(data).__name__})")
    yield from enumerate(data, 1)


def _parquet_rows(path: Path, opened) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(opened)
    except Exception as err:  # pyarrow raises several kinds for a file that is not Parquet
        raise DatasetError(f"{path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
    number = 0
    for batch in table.iter_batches(batch_size=BATCH_ROWS):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def _saved_dataset_rows(path: Path) -> Iterator[tuple[int, Any]]:
    if (path / "dataset_dict.json").is_file():
        try:
            text = read_regular(path / "dataset_dict.json", limit=MAX_LINE_BYTES)
        except UnreadableFile as err:
            raise DatasetError(str(err)) from None
        info = _json_problem(text.decode("utf-8-sig", errors="replace"))
        splits = info[0].get("splits", []) if isinstance(info, tuple) and isinstance(info[0], dict) else []
        if not isinstance(info, tuple) or not isinstance(info[0], dict) or not isinstance(splits, list):
            raise DatasetError(f"{path / 'dataset_dict.json'}: not a DatasetDict's description (a JSON object with "
                               f"a list of `splits`); point the path at one split's folder")
        raise DatasetError(f"{path} holds a DatasetDict with splits {splits}; point the path at one split's "
                           f"folder (e.g. {path / (str(splits[0]) if splits else 'train')})")
    if not (path / "dataset_info.json").is_file():
        raise DatasetError(f"{path} is a directory but not one written by datasets' save_to_disk "
                           f"(no dataset_info.json)")
    _check_saved_files(path)
    import datasets

    table = datasets.load_from_disk(str(path))  # memory-mapped: batches are read as they are iterated
    number = 0
    for batch in table.iter(batch_size=BATCH_ROWS):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys)):
            number += 1
            yield number, dict(zip(keys, values))


def _check_saved_files(path: Path) -> None:
    """Every file of a save_to_disk directory is a regular file inside it, as the other formats' files must be:
    `datasets` memory-maps the Arrow files itself, and a FIFO there hangs it, a link to a device or out of the
    directory is read as data."""
    for folder, dirs, files in os.walk(path):
        for name in [*files, *(d for d in dirs if os.path.islink(os.path.join(folder, d)))]:
            try:
                open_regular(Path(folder) / name, root=path).close()
            except IsADirectoryError:  # a link to a folder inside the directory: its files are walked as its own
                continue
            except UnreadableFile as err:
                raise DatasetError(f"dataset file {err}") from None


def stable_fraction(task_id: str) -> float:
    """A number in [0, 1) fixed by the id alone (across processes and Python versions): the split key."""
    return int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big") / 2**64


def field(path: Path, number: int, row: dict, key: str, kind: type | tuple, required: bool = True) -> Optional[Any]:
    """row[key] checked for its type; a BadRow naming the field when it is missing or of the wrong type."""
    if key not in row or row[key] is None:
        if required:
            raise BadRow(f"{path}: row {number}: missing field {key!r} (fields: {sorted(row)})")
        return None
    value = row[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRow(f"{path}: row {number}: field {key!r} must be {names} (got {type(value).__name__})")
    return value
