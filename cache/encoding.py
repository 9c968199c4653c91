"""Byte encoding of a ``TeacherRecord`` into flat streams, and back. Pure functions, no I/O.

A record becomes up to five streams, each appended to a per-teacher zarr array by ``cache.store``:

``sampled_logp``  uint16 [n]: ``round(-logp * 1024)`` clamped to 65535. Error <= 1/2048 nats for
                  logp >= -64; lower logprobs read back as -63.999 (the OPD advantage needs precision here).
``tail_mass``     uint16 [n]: the same fixed point applied to ``-log(tail)``, so the tail mass has a relative
                  error <= exp(1/2048) - 1 ~= 4.9e-4 for tails >= e^-64 (smaller tails read back as ~1.6e-28).
``row_len``       uint32 [n]: support size of each position (top_p only; top_k rows all hold k).
``logp``          uint8 [total] (top_k, top_p) or [n * vocab] (full): index into ``LOGP_DEPTHS``, 256 levels of
                  -logp. The spacing is 1/64 nats at logp = 0 and doubles every 2 ln 2 nats (step ~ p^-1/2, the
                  spacing at which every level costs about the same KL), capped at 1/2 nats; the deepest level
                  is -48.05. Error bound: |logp - decoded| <= ``LOGP_HALF_STEP[code]`` = half the step at the decoded
                  level, i.e. <= 1/128 nats for logp >= -1.39, <= 1/32 for logp >= -4.16 and <= 1/4 everywhere
                  down to -48 (below, p < 1.5e-21, it reads back as -48.05).
``ids``           uint8 [bytes] (top_k, top_p): ids ascending within each position; gaps ``id - previous - 1``
                  (the first id of a position as is) Exp-Golomb coded with the order that minimises the size.
                  Byte 0 holds the order, then the unary prefixes, then the payload bits (LSB first).
                  Lossless; ids must be < 2**32.

What each step earns, measured for top-64 on Zipf-like synthetic teachers (docs/benchmarks_logit_cache.md): the
gap code takes 75.7 bytes per position after lz4 (9.5 bits per id) against 90.4 for uint32 deltas under blosc
shuffle; the logprob table 49.6 bytes at a KL error of 1.4e-4 nats, against 49.9 bytes at 5.7e-4 for a uniform
256-level scale over the same range and 101.4 bytes for float16.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

from .records import CacheMeta, TeacherRecord

FORMAT_VERSION = 1

FIXED_POINT_SCALE = 1024  # codes per nat for sampled_logp and tail_mass
FIXED_POINT_MAX_CODE = np.iinfo(np.uint16).max

LOGP_FINEST_STEP = 1 / 64
LOGP_COARSEST_STEP = 1 / 2
LOGP_STEP_DOUBLING_NATS = 2 * math.log(2)


def _logp_depths() -> np.ndarray:
    depths = [0.0]
    while len(depths) < 256:
        doublings = math.floor(depths[-1] / LOGP_STEP_DOUBLING_NATS)
        depths.append(depths[-1] + min(LOGP_FINEST_STEP * 2.0**doublings, LOGP_COARSEST_STEP))
    return np.array(depths)


LOGP_DEPTHS = _logp_depths()  # code c decodes to logp = -LOGP_DEPTHS[c]
LOGP_HALF_STEP = np.append(np.diff(LOGP_DEPTHS), LOGP_COARSEST_STEP) / 2  # error bound per code
_LOGP_CELL_EDGES = (LOGP_DEPTHS[1:] + LOGP_DEPTHS[:-1]) / 2

STREAM_DTYPES = {
    "sampled_logp": np.dtype(np.uint16),
    "tail_mass": np.dtype(np.uint16),
    "row_len": np.dtype(np.uint32),
    "logp": np.dtype(np.uint8),
    "ids": np.dtype(np.uint8),
}
STREAMS = {
    "sampled": ("sampled_logp",),
    "top_k": ("sampled_logp", "tail_mass", "logp", "ids"),
    "top_p": ("sampled_logp", "tail_mass", "row_len", "logp", "ids"),
    "full": ("sampled_logp", "logp"),
}

# Stored in each teacher's attributes; a cache written with another encoding is refused.
ENCODING = {
    "name": "opd-sao-logit-cache",
    "sampled_logp": {"dtype": "uint16", "code": "round(-logp * scale)", "scale": FIXED_POINT_SCALE},
    "tail_mass": {"dtype": "uint16", "code": "round(-log(tail) * scale)", "scale": FIXED_POINT_SCALE},
    "row_len": {"dtype": "uint32", "code": "support size per position (top_p)"},
    "logp": {
        "dtype": "uint8",
        "code": "nearest of 256 levels of -logp",
        "finest_step": LOGP_FINEST_STEP,
        "coarsest_step": LOGP_COARSEST_STEP,
        "step_doubles_every_nats": LOGP_STEP_DOUBLING_NATS,
    },
    "ids": {"dtype": "uint8", "code": "ascending per position, gaps Exp-Golomb coded, order in byte 0"},
}


# Levels are multiples of 1/64 nats, so every cell edge lies on a 1/128 grid and a lookup by grid bin is exact.
_BINS_PER_NAT = 128
_CODE_OF_BIN = np.searchsorted(
    _LOGP_CELL_EDGES, (np.arange(math.ceil(LOGP_DEPTHS[-1] * _BINS_PER_NAT) + 1) + 0.5) / _BINS_PER_NAT
).astype(np.uint8)
_LOGP_OF_CODE = (-LOGP_DEPTHS).astype(np.float32)


def quantise_logp(logp: np.ndarray) -> np.ndarray:
    bins = np.clip(np.asarray(logp, dtype=np.float32) * -_BINS_PER_NAT, 0, len(_CODE_OF_BIN) - 1)
    return _CODE_OF_BIN[bins.astype(np.int32)]


def dequantise_logp(codes: np.ndarray) -> np.ndarray:
    return _LOGP_OF_CODE[codes]


def _to_fixed_point(depth: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(depth, 0.0, FIXED_POINT_MAX_CODE / FIXED_POINT_SCALE) * FIXED_POINT_SCALE).astype(np.uint16)


def _from_fixed_point(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.float64) / FIXED_POINT_SCALE


# --- Exp-Golomb coding of non-negative integers ------------------------------------------------------------

def _bit_length(values: np.ndarray) -> np.ndarray:
    return np.frexp(values.astype(np.float64))[1].astype(np.uint64)  # exact below 2**53


def _pack_bits(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """Concatenate the low ``widths[i]`` bits of ``values[i]`` (< 2**widths[i], widths <= 64), LSB first."""
    ends = np.cumsum(widths, dtype=np.uint64)
    starts = ends - widths
    total_bits = int(ends[-1]) if len(ends) else 0
    words = np.zeros(total_bits // 64 + 2, dtype="<u8")
    word, shift = (starts >> 6).astype(np.intp), starts & 63
    np.bitwise_or.at(words, word, values << shift)
    np.bitwise_or.at(words, word + 1, (values >> 1) >> (63 - shift))  # the bits that spill into the next word
    return words.view(np.uint8)[: (total_bits + 7) // 8]


def _unpack_bits(data: np.ndarray, widths: np.ndarray) -> np.ndarray:
    ends = np.cumsum(widths, dtype=np.uint64)
    starts = ends - widths
    padded = np.zeros((len(data) // 8 + 2) * 8, dtype=np.uint8)
    padded[: len(data)] = data
    words = padded.view("<u8")
    word, shift = (starts >> 6).astype(np.intp), starts & 63
    joined = (words[word] >> shift) | ((words[word + 1] << 1) << (63 - shift))
    return joined & ((np.uint64(1) << widths) - 1)


def _cheapest_order(values: np.ndarray) -> int:
    sample = values[:: max(1, len(values) // 4096)]
    costs = [int((2 * _bit_length((sample >> order) + 1) + order).sum()) for order in range(16)]
    return int(np.argmin(costs))


def exp_golomb_encode(values: np.ndarray) -> np.ndarray:
    values = values.astype(np.uint64)
    order = _cheapest_order(values)
    high = (values >> order) + 1
    prefix_bits = _bit_length(high) - 1
    unary = _pack_bits((np.uint64(1) << prefix_bits) - 1, prefix_bits + 1)  # prefix_bits ones, then a zero
    low_mask = np.uint64((1 << order) - 1)
    payload = ((high - (np.uint64(1) << prefix_bits)) << order) | (values & low_mask)
    return np.concatenate([np.array([order], dtype=np.uint8), unary, _pack_bits(payload, prefix_bits + order)])


def exp_golomb_decode(data: np.ndarray, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=np.uint64)
    order = np.uint64(data[0])
    prefix_ends = np.flatnonzero(np.unpackbits(data[1:], bitorder="little") == 0)[:count]
    if len(prefix_ends) < count:
        raise ValueError(f"id stream holds fewer than {count} codes")
    prefix_bits = (np.diff(prefix_ends, prepend=-1) - 1).astype(np.uint64)
    payload_start = 1 + (int(prefix_ends[-1]) + 8) // 8
    payload = _unpack_bits(data[payload_start:], prefix_bits + order)
    high = (np.uint64(1) << prefix_bits) + (payload >> order)
    return ((high - 1) << order) | (payload & ((np.uint64(1) << order) - 1))


# --- records <-> streams -----------------------------------------------------------------------------------

def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"invalid TeacherRecord: {message}")


def _support_gaps(meta: CacheMeta, record: TeacherRecord) -> np.ndarray:
    n = record.n_positions
    _require(record.ids is not None and record.logp is not None, "ids and logp are required")
    _require(record.offsets is not None and record.tail_mass is not None, "offsets and tail_mass are required")
    ids = np.asarray(record.ids, dtype=np.int64)
    offsets = np.asarray(record.offsets, dtype=np.int64)
    _require(offsets.shape == (n + 1,) and offsets[0] == 0, "offsets must be [n + 1] starting at 0")
    row_len = np.diff(offsets)
    _require(bool((row_len >= 0).all()), "offsets must not decrease")
    _require(offsets[-1] == len(ids) == len(record.logp), "offsets do not match ids and logp")
    _require(len(record.tail_mass) == n, "tail_mass must be [n]")
    if meta.granularity == "top_k":
        _require(bool((row_len == meta.k).all()), f"every top_k position must hold k={meta.k} ids")
    _require(len(ids) == 0 or (0 <= ids.min() and ids.max() < meta.vocab_size), "ids outside the vocabulary")
    previous = np.empty_like(ids)
    previous[1:] = ids[:-1]
    previous[offsets[:-1][row_len > 0]] = -1
    gaps = ids - previous - 1
    _require(bool((gaps >= 0).all()), "ids must be strictly ascending within each position")
    return gaps


def to_streams(meta: CacheMeta, record: TeacherRecord) -> dict[str, np.ndarray]:
    """Quantise and pack ``record``; raises ValueError when it does not fit ``meta``."""
    sampled = np.asarray(record.sampled_logp, dtype=np.float64)
    _require(sampled.ndim == 1 and not np.isnan(sampled).any(), "sampled_logp must be [n] without NaN")
    streams = {"sampled_logp": _to_fixed_point(-sampled)}
    if meta.granularity == "full":
        logp = np.asarray(record.logp)
        _require(logp.shape == (record.n_positions, meta.vocab_size), "full logp must be [n, vocab_size]")
        _require(not np.isnan(logp).any(), "logp holds NaN")
        streams["logp"] = quantise_logp(logp.reshape(-1))
    elif meta.granularity in ("top_k", "top_p"):
        gaps = _support_gaps(meta, record)
        _require(not np.isnan(record.logp).any(), "logp holds NaN")
        with np.errstate(divide="ignore"):
            streams["tail_mass"] = _to_fixed_point(-np.log(np.clip(np.asarray(record.tail_mass, np.float64), 0, 1)))
        if meta.granularity == "top_p":
            streams["row_len"] = np.diff(np.asarray(record.offsets)).astype(np.uint32)
        streams["logp"] = quantise_logp(record.logp)
        streams["ids"] = exp_golomb_encode(gaps)
    return streams


def from_streams(meta: CacheMeta, n_positions: int, streams: dict[str, np.ndarray]) -> TeacherRecord:
    sampled = (-_from_fixed_point(streams["sampled_logp"])).astype(np.float32)
    if meta.granularity == "sampled":
        return TeacherRecord(sampled_logp=sampled)
    logp = dequantise_logp(streams["logp"])
    if meta.granularity == "full":
        return TeacherRecord(sampled_logp=sampled, logp=logp.reshape(n_positions, meta.vocab_size))
    if meta.granularity == "top_k":
        row_len = np.full(n_positions, meta.k, dtype=np.int64)
    else:
        row_len = streams["row_len"].astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(row_len)])
    steps = exp_golomb_decode(streams["ids"], int(offsets[-1])).astype(np.int64) + 1
    running = np.cumsum(steps)
    before_row = np.concatenate([[0], running])[offsets[:-1]]
    ids = running - np.repeat(before_row, row_len) - 1
    tail = np.exp(-_from_fixed_point(streams["tail_mass"])).astype(np.float32)
    return TeacherRecord(sampled_logp=sampled, ids=ids, logp=logp, offsets=offsets, tail_mass=tail)


def checksum(streams: dict[str, np.ndarray]) -> int:
    """CRC-32 over the streams' bytes in name order; stored in the index, verified on every read."""
    crc = 0
    for name in sorted(streams):
        crc = zlib.crc32(np.ascontiguousarray(streams[name]).view(np.uint8), crc)
    return crc
