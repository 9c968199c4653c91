"""A GGUF file's header, read with the standard library alone: whether a path is a GGUF file, and its metadata keys.
The config schema asks (a chat template makes a run's prompt format chat) and must not import torch or transformers;
opd_sao/model_import.py converts the file."""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

from opd_sao.errors import UsageError

GGUF_MAGIC = b"GGUF"
GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
GGUF_STRING, GGUF_ARRAY = 8, 9


def gguf_keys(path: str | Path) -> list[str]:
    """A GGUF file's metadata keys, walked through the header (GGUF v2+) without parsing a value: milliseconds,
    where a full read of the tokenizer's arrays takes seconds (config validation asks for the chat template)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        def skip(kind: int, at: int) -> int:
            if kind == GGUF_STRING:
                return at + 8 + struct.unpack_from("<Q", m, at)[0]
            if kind != GGUF_ARRAY:
                return at + GGUF_SCALAR_BYTES[kind]
            item, count = struct.unpack_from("<IQ", m, at)
            at += 12
            if item in GGUF_SCALAR_BYTES:
                return at + count * GGUF_SCALAR_BYTES[item]
            for _ in range(count):
                at = skip(item, at)
            return at

        if m[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        (count,), at, keys = struct.unpack_from("<Q", m, 16), 24, []
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", m, at)
            keys.append(m[at + 8:at + 8 + length].decode())
            at = skip(struct.unpack_from("<I", m, at + 8 + length)[0], at + 12 + length)
    return keys


def gguf_has_chat_template(path: str | Path) -> bool:
    """Whether a GGUF file carries a chat template (False for a file that is not a readable GGUF: the checks before
    a run refuse it, in one line)."""
    try:
        return "tokenizer.chat_template" in gguf_keys(path)
    except (OSError, ValueError, KeyError, struct.error):
        return False


def check_gguf(path: str | Path) -> Path:
    """The path, when it is a readable GGUF file (by its magic bytes); otherwise one line saying why not."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path} is not a file" if path.exists() else f"{path} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise UsageError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    return path


def is_gguf_path(path: str | Path) -> bool:
    """`model.path` names a GGUF file (converted into the run's base_model/) rather than a model directory."""
    return str(path).lower().endswith(".gguf")
