"""Byte encoding of a ``TeacherRecord`` into flat streams, and back. Pure functions, no I/O.

A record becomes up to five streams, each appended to a per-teacher zarr array by ``opd_sao.cache.store``:

``sampled_logp``  uint16 [n]: ``round(-logp * 1024)`` clamped to 65535. Error <= 1/2048 nats for
                  logp >= -64; lower logprobs read back as -63.999 (the OPD advantage needs precision here).
``tail_mass``     uint16 [n]: the same fixed point applied to ``-log(tail)``, so the tail mass has a relative
                  error <= exp(1/2048) - 1 ~= 4.9e-4 for tails >= e^-64 (smaller tails read back as ~1.6e-28).
``row_len``       uint32 [n]: support size of each position (top_p only; top_k rows all hold k).
``logp``          full: uint8 [n * vocab], index into ``LOGP_DEPTHS``, 256 levels of -logp. The spacing is 1/64
                  nats at logp = 0 and doubles every 2 ln 2 nats, capped at 1/2 nats; the deepest level is -48.05.
                  Error bound: |logp - decoded| <= ``LOGP_HALF_STEP[code]``, i.e. <= 1/128 nats for logp >= -1.39,
                  <= 1/32 for logp >= -4.16 and <= 1/4 everywhere down to -48 (below, it reads back as -48.05).
                  top_k / top_p: uint8 bytes. Each support probability is coded as q = round(sqrt(p) / step) with
                  step = 1 / (16 * ceil(sqrt(L))) for a row of L entries (top-64: 1/128; top-16: 1/64; top-256:
                  1/256). q >= 1 decodes to sqrt(p) = q * step, q = 0 (p < step^2 / 4) to sqrt(p) = step / sqrt(12).
                  Error bound: |sqrt(p) - sqrt(decoded p)| <= step / 2 for every entry (p clipped to <= 1), so
                  each entry adds at most ~2 (step/2)^2 and on average ~step^2 / 6 nats of KL: a row's expected
                  KL error is ~L step^2 / 6 <= 6.5e-4 nats whatever L is (measured ~5e-4 for top-16/64/256).
                  In logprob terms the step is ~2 / q nats: fine for probable tokens, coarse for p < 1e-4
                  (whose KL weight is tiny). Codes are stored dictionary ids first (see ``ids``), Exp-Golomb
                  coded with one order per class (row step, in/out of the dictionary).
``ids``           uint8 bytes (top_k, top_p), lossless, ids < 2**32. Per record, a dictionary: the ids present
                  in >= 10% (and >= 2) of its positions, ascending. Each row splits into the ids in the
                  dictionary (coded as gaps between their dictionary ranks) and the others (gaps between ids);
                  gaps are Exp-Golomb coded with one order per (part, place in the row in 64 classes), which
                  tracks that gaps grow along a row. Sections, each with its orders coded first: dictionary
                  size, dictionary gaps, per-row count of dictionary ids, rank gaps, other id gaps. Reads
                  return ids ascending within each position, as written.

What each step earns, measured for top-64 on Zipf-like synthetic teachers (docs/benchmarks_logit_cache.md): the
ids take ~62 bytes per position against 75.7 for one Exp-Golomb order over plain gaps (format 1) and 90.4 for
uint32 deltas; the sqrt(p) logprob codes ~30 bytes at a KL error of 5.0e-4 nats, against 49.6 bytes at 1.4e-4 for
the 256-level table (format 1, still used for full) and 101.4 bytes for float16.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

from .records import CacheMeta, TeacherRecord

FORMAT_VERSION = 2

FIXED_POINT_SCALE = 1024  # codes per nat for sampled_logp and tail_mass
FIXED_POINT_MAX_CODE = np.iinfo(np.uint16).max

LOGP_FINEST_STEP = 1 / 64
LOGP_COARSEST_STEP = 1 / 2
LOGP_STEP_DOUBLING_NATS = 2 * math.log(2)
SQRT_STEPS_PER_ROOT_LEN = 16  # a row of L entries gets sqrt(p) steps of 1 / (16 * ceil(sqrt(L)))
N_SLOT_CLASSES = 64
N_STEP_CLASSES = 18
DICTIONARY_MIN_SHARE = 0.1  # ids in at least this share of a record's positions (and >= 2) form its dictionary


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
        "full": {"code": "nearest of 256 levels of -logp", "finest_step": LOGP_FINEST_STEP,
                 "coarsest_step": LOGP_COARSEST_STEP, "step_doubles_every_nats": LOGP_STEP_DOUBLING_NATS},
        "support": {"code": "round(sqrt(p) / step), step = 1 / (s * ceil(sqrt(row_len))), per-class Exp-Golomb",
                    "s": SQRT_STEPS_PER_ROOT_LEN},
    },
    "ids": {"dtype": "uint8", "code": "record dictionary (ids in >= share of positions) + per-slot-class "
            "Exp-Golomb gaps of dictionary ranks and of the other ids", "dictionary_min_share": DICTIONARY_MIN_SHARE,
            "slot_classes": N_SLOT_CLASSES},
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
    return _pack_segments(values, widths, np.zeros(len(values), np.intp), 1)[0]

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


# --- sections: Exp-Golomb with one order per class ---------------------------------------------------------

_MAX_ORDER = 32
_ORDERS = np.arange(_MAX_ORDER + 1)
# Code length of a value of bit length b under order k: 2 * max(b - k, 0) + 1 + k (exact up to one carry bit)
_LENGTH_BY_ORDER = 2 * np.maximum(np.arange(_MAX_ORDER + 2)[:, None] - _ORDERS, 0) + 1 + _ORDERS


def _read_codes(data: np.ndarray, position: int, orders: np.ndarray) -> tuple[np.ndarray, int]:
    """Inverse of ``_write_codes`` for ``len(orders)`` values starting at byte ``position``."""
    count = len(orders)
    if count == 0:
        return np.zeros(0, dtype=np.uint64), position
    window = count // 2 + 16  # bytes of prefixes to scan; doubled until they hold ``count`` codes
    while True:
        prefix_ends = np.flatnonzero(np.unpackbits(data[position : position + window], bitorder="little") == 0)
        if len(prefix_ends) >= count or position + window >= len(data):
            break
        window *= 2
    prefix_ends = prefix_ends[:count]
    if len(prefix_ends) < count:
        raise ValueError(f"stream holds fewer than {count} codes")
    prefix_bits = (np.diff(prefix_ends, prepend=-1) - 1).astype(np.uint64)
    position += (int(prefix_ends[-1]) + 8) // 8
    widths = prefix_bits + orders
    payload_bytes = (int(widths.sum()) + 7) // 8
    if position + payload_bytes > len(data):
        raise ValueError("stream ends inside a payload")
    payload = _unpack_bits(data[position : position + payload_bytes], widths)
    high = (np.uint64(1) << prefix_bits) + (payload >> orders)
    values = ((high - np.uint64(1)) << orders) | (payload & ((np.uint64(1) << orders) - np.uint64(1)))
    return values, position + payload_bytes


def _read_section(data: np.ndarray, position: int, classes: np.ndarray, n_classes: int) -> tuple[np.ndarray, int]:
    zigzag, position = _read_codes(data, position, np.zeros(n_classes, np.uint64))
    zigzag = zigzag.astype(np.int64)
    orders = np.cumsum(np.where(zigzag % 2 == 0, zigzag // 2, -(zigzag + 1) // 2))
    if len(orders) and (orders.min() < 0 or orders.max() > _MAX_ORDER):
        raise ValueError("corrupt section header")
    return _read_codes(data, position, orders.astype(np.uint64)[classes])


# --- top_k / top_p support: sqrt(p) codes, per-record id dictionary -----------------------------------------



def sqrt_step(row_len: np.ndarray) -> np.ndarray:
    """The sqrt(p) quantisation step of a row of ``row_len`` entries."""
    return 1.0 / (SQRT_STEPS_PER_ROOT_LEN * np.ceil(np.sqrt(np.maximum(row_len, 1))))


def _step_classes(row_len: np.ndarray) -> np.ndarray:
    return np.minimum(_bit_length(np.ceil(np.sqrt(np.maximum(row_len, 1)))), N_STEP_CLASSES - 1).astype(np.int64)


def quantise_sqrt_p(logp: np.ndarray, step: np.ndarray) -> np.ndarray:
    root = np.exp(np.minimum(np.asarray(logp, dtype=np.float64), 0.0) / 2)
    return np.rint(root / step).astype(np.uint64)


def dequantise_sqrt_p(codes: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Code q >= 1 decodes to sqrt(p) = q * step; code 0 (sqrt(p) < step / 2) to sqrt(p) = step / sqrt(12)."""
    root = np.where(codes > 0, codes * step, step / math.sqrt(12))
    return (2 * np.log(root)).astype(np.float32)


def _slots(row_len: np.ndarray) -> np.ndarray:
    """Index of every element within its row."""
    starts = np.cumsum(row_len) - row_len
    return np.arange(int(row_len.sum())) - np.repeat(starts, row_len)


def _slot_classes(row_len: np.ndarray) -> np.ndarray:
    """Relative place of every element in its row, in N_SLOT_CLASSES classes."""
    return (_slots(row_len) * N_SLOT_CLASSES) // np.repeat(np.maximum(row_len, 1), row_len)


def _row_gaps(values: np.ndarray, row_len: np.ndarray) -> np.ndarray:
    """Values ascending within rows -> value - previous - 1 (the first of a row as is)."""
    previous = np.empty_like(values)
    previous[1:] = values[:-1]
    previous[(np.cumsum(row_len) - row_len)[row_len > 0]] = -1
    return values - previous - 1


def _row_ungap(gaps: np.ndarray, row_len: np.ndarray) -> np.ndarray:
    running = np.cumsum(gaps.astype(np.int64) + 1)
    before_row = np.concatenate([[0], running])[np.cumsum(row_len) - row_len]
    return running - np.repeat(before_row, row_len) - 1


def _encode_support(ids: np.ndarray, logp: np.ndarray, row_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids stream, logp stream) of a support whose ids ascend within rows."""
    return _encode_supports(ids, logp, row_len, np.array([len(row_len)]))[0]

# --- writing: many records in one pass (the writer commits a step's records together), each its own bytes ----

def _pack_segments(values: np.ndarray, widths: np.ndarray, segment: np.ndarray, n_segments: int) -> list[np.ndarray]:
    """``_pack_bits`` of each segment's values alone (``segment`` ascending: each segment contiguous), in one pass:
    every segment starts on a byte boundary, so its slice is byte for byte what ``_pack_bits`` gives it."""
    bits = np.bincount(segment, weights=widths.astype(np.float64), minlength=n_segments).astype(np.int64)
    seg_bytes = (bits + 7) // 8
    first_byte = np.cumsum(seg_bytes) - seg_bytes
    ends = np.cumsum(widths, dtype=np.uint64)
    bits_before = (np.cumsum(bits) - bits).astype(np.uint64)  # the segment's first value starts here in `ends`
    starts = (first_byte.astype(np.uint64) * np.uint64(8))[segment] + (ends - widths) - bits_before[segment]
    total = int(seg_bytes.sum())
    words = np.zeros(total // 8 + 2, dtype="<u8")
    word, shift = (starts >> np.uint64(6)).astype(np.intp), starts & np.uint64(63)
    np.bitwise_or.at(words, word, values << shift)
    np.bitwise_or.at(words, word + 1, (values >> np.uint64(1)) >> (np.uint64(63) - shift))
    data = words.view(np.uint8)
    return [data[first:first + size] for first, size in zip(first_byte.tolist(), seg_bytes.tolist())]


def _write_codes(values: np.ndarray, orders: np.ndarray, segment: np.ndarray, n_segments: int):
    """Unary prefixes, then payloads, of each segment's values (``orders[i]`` the order of ``values[i]``), each
    byte aligned: (unary blobs, payload blobs), one of each per segment."""
    high = (values >> orders) + np.uint64(1)
    prefix_bits = _bit_length(high) - np.uint64(1)
    unary = _pack_segments((np.uint64(1) << prefix_bits) - np.uint64(1), prefix_bits + np.uint64(1), segment,
                           n_segments)
    payload = ((high - (np.uint64(1) << prefix_bits)) << orders) | (values & ((np.uint64(1) << orders) - np.uint64(1)))
    return unary, _pack_segments(payload, prefix_bits + orders, segment, n_segments)


def _write_section(values: np.ndarray, classes: np.ndarray, n_classes: int, segment: np.ndarray,
                        n_segments: int) -> list[list[np.ndarray]]:
    """Each segment's values Exp-Golomb coded with the cheapest order of their class in that segment; its header:
    those orders as order-0 codes of their zigzagged differences. Four blob lists (header unary and payload, values
    unary and payload), one blob per segment."""
    values = values.astype(np.uint64)
    lengths = _bit_length(values).astype(np.int64)
    width = _MAX_ORDER + 2
    histogram = np.bincount((segment * n_classes + classes) * width + lengths, minlength=n_segments * n_classes * width)
    # float64 products are exact here (counts x code lengths << 2**53) and run in BLAS, which int64 matmul does not
    costs = histogram.reshape(n_segments, n_classes, width).astype(np.float64) @ _LENGTH_BY_ORDER.astype(np.float64)
    orders = costs.argmin(axis=2).astype(np.int64)
    steps = np.diff(orders, axis=1, prepend=0)
    zigzag = np.where(steps >= 0, 2 * steps, -2 * steps - 1).astype(np.uint64).reshape(-1)
    header = _write_codes(zigzag, np.zeros(len(zigzag), np.uint64), np.repeat(np.arange(n_segments), n_classes),
                               n_segments)
    body = _write_codes(values, orders.astype(np.uint64)[segment, classes], segment, n_segments)
    return [*header, *body]


def _encode_supports(ids: np.ndarray, logp: np.ndarray, row_len: np.ndarray, rows_per_record: np.ndarray
                     ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``_encode_support`` of each record, the records' rows concatenated (``rows_per_record`` [R]): the same
    bytes, with numpy's per-call overhead paid once per batch instead of once per record."""
    n_records = len(rows_per_record)
    record_of_row = np.repeat(np.arange(n_records), rows_per_record)
    record = np.repeat(record_of_row, row_len)  # of each entry
    row = np.repeat(np.arange(len(row_len)), row_len)
    span = int(ids.max()) + 1 if len(ids) else 1
    keys = record * span + ids
    unique, counts = np.unique(keys, return_counts=True)
    threshold = np.array([max(2, math.ceil(DICTIONARY_MIN_SHARE * int(n))) for n in rows_per_record], np.int64)
    dictionary = unique[counts >= threshold[unique // span]]  # (record, id) ascending
    dictionary_record = dictionary // span
    dictionary_size = np.bincount(dictionary_record, minlength=n_records)
    inside = np.isin(keys, dictionary)
    in_len = np.bincount(row[inside], minlength=len(row_len))
    out_len = row_len - in_len
    ranks = np.searchsorted(dictionary, keys[inside]) - (np.cumsum(dictionary_size) - dictionary_size)[record[inside]]
    zeros = lambda n: np.zeros(n, np.int64)
    sections = [
        _write_section(dictionary_size, zeros(n_records), 1, np.arange(n_records), n_records),
        _write_section(_row_gaps(dictionary % span, dictionary_size), zeros(len(dictionary)), 1,
                            dictionary_record, n_records),
        _write_section(in_len, zeros(len(row_len)), 1, record_of_row, n_records),
        _write_section(_row_gaps(ranks, in_len), _slot_classes(in_len), N_SLOT_CLASSES, record[inside],
                            n_records),
        _write_section(_row_gaps(ids[~inside], out_len), _slot_classes(out_len), N_SLOT_CLASSES,
                            record[~inside], n_records),
    ]
    step, step_class = np.repeat(sqrt_step(row_len), row_len), np.repeat(_step_classes(row_len), row_len)
    codes = quantise_sqrt_p(logp, step)
    order = np.lexsort((~inside, record))  # per record: dictionary ids first, each part in its order
    logp_section = _write_section(codes[order], step_class[order] + N_STEP_CLASSES * ~inside[order],
                                       2 * N_STEP_CLASSES, record[order], n_records)
    return [(np.concatenate([blobs[r] for section in sections for blobs in section]),
             np.concatenate([blobs[r] for blobs in logp_section])) for r in range(n_records)]


def _decode_support(ids_stream: np.ndarray, logp_stream: np.ndarray, row_len: np.ndarray, vocab_size: int):
    """(ids, logp) ascending within rows."""
    n = len(row_len)
    one = np.zeros(1, np.int64)
    size, position = _read_section(ids_stream, 0, one, 1)
    size = int(size[0])
    gaps, position = _read_section(ids_stream, position, np.zeros(size, np.int64), 1)
    dictionary = _row_ungap(gaps, np.array([size]))
    in_len, position = _read_section(ids_stream, position, np.zeros(n, np.int64), 1)
    in_len = in_len.astype(np.int64)
    out_len = row_len - in_len
    if (out_len < 0).any():
        raise ValueError("corrupt id stream")
    gaps, position = _read_section(ids_stream, position, _slot_classes(in_len), N_SLOT_CLASSES)
    ids_in = dictionary[_row_ungap(gaps, in_len)]
    gaps, position = _read_section(ids_stream, position, _slot_classes(out_len), N_SLOT_CLASSES)
    ids_out = _row_ungap(gaps, out_len)
    # both parts ascend by (row, id): merge them
    key_in = np.repeat(np.arange(n), in_len) * vocab_size + ids_in
    key_out = np.repeat(np.arange(n), out_len) * vocab_size + ids_out
    place_in = np.arange(len(key_in)) + np.searchsorted(key_out, key_in)
    place_out = np.arange(len(key_out)) + np.searchsorted(key_in, key_out)
    place = np.concatenate([place_in, place_out])
    inside = np.concatenate([np.ones(len(key_in), bool), np.zeros(len(key_out), bool)])
    rows = np.concatenate([np.repeat(np.arange(n), in_len), np.repeat(np.arange(n), out_len)])
    classes = _step_classes(row_len)[rows] + N_STEP_CLASSES * ~inside
    codes, _ = _read_section(logp_stream, 0, classes, 2 * N_STEP_CLASSES)
    ids = np.empty(len(place), np.int64)
    ids[place] = np.concatenate([ids_in, ids_out])
    logp = np.empty(len(place), np.float32)
    logp[place] = dequantise_sqrt_p(codes, sqrt_step(row_len)[rows])
    return ids, logp


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
    if meta.granularity == "top_p":
        _require(bool((row_len <= meta.max_support).all()), f"a top_p position holds more than "
                 f"max_support={meta.max_support} ids")
    _require(len(ids) == 0 or (0 <= ids.min() and ids.max() < meta.vocab_size), "ids outside the vocabulary")
    previous = np.empty_like(ids)
    previous[1:] = ids[:-1]
    previous[offsets[:-1][row_len > 0]] = -1
    gaps = ids - previous - 1
    _require(bool((gaps >= 0).all()), "ids must be strictly ascending within each position")
    return gaps


def full_codes(meta: CacheMeta, record: TeacherRecord) -> np.ndarray:
    """uint8 [n, vocab_size]: a full record's logprobs as the cache codes them (its codes when it holds them)."""
    shape = (record.n_positions, meta.vocab_size)
    if record.logp_codes is not None:
        codes = np.asarray(record.logp_codes)
        _require(codes.dtype == np.uint8 and codes.shape == shape, "full logp_codes must be uint8 [n, vocab_size]")
        return codes
    _require(record.logp is not None, "full records need logp or logp_codes")
    logp = np.asarray(record.logp)
    _require(logp.shape == shape, "full logp must be [n, vocab_size]")
    _require(not np.isnan(logp).any(), "logp holds NaN")
    return quantise_logp(logp)


def to_streams(meta: CacheMeta, record: TeacherRecord) -> dict[str, np.ndarray]:
    """Quantise and pack ``record``; raises ValueError when it does not fit ``meta``."""
    sampled = np.asarray(record.sampled_logp, dtype=np.float64)
    _require(sampled.ndim == 1 and not np.isnan(sampled).any(), "sampled_logp must be [n] without NaN")
    streams = {"sampled_logp": _to_fixed_point(-sampled)}
    if meta.granularity == "full":
        streams["logp"] = full_codes(meta, record).reshape(-1)
    elif meta.granularity in ("top_k", "top_p"):
        _support_gaps(meta, record)  # validates
        _require(not np.isnan(record.logp).any(), "logp holds NaN")
        with np.errstate(divide="ignore"):
            streams["tail_mass"] = _to_fixed_point(-np.log(np.clip(np.asarray(record.tail_mass, np.float64), 0, 1)))
        if meta.granularity == "top_p":
            streams["row_len"] = np.diff(np.asarray(record.offsets)).astype(np.uint32)
        row_len = np.diff(np.asarray(record.offsets, dtype=np.int64))
        streams["ids"], streams["logp"] = _encode_support(np.asarray(record.ids, np.int64), record.logp, row_len)
    return streams


BATCH_ENTRIES = 1 << 20  # support entries coded in one pass: its int64 temporaries stay around a hundred MB


def to_streams_many(meta: CacheMeta, records: list[TeacherRecord]) -> list[dict[str, np.ndarray]]:
    """``to_streams`` of each record, the same streams byte for byte, with the support's coding done for many
    records at once (``_encode_supports``, in passes of about ``BATCH_ENTRIES`` support entries: a writer's commit of
    512 records of 8k positions at top-64 would otherwise make gigabytes of temporaries); records that do not fit
    ``meta`` raise as ``to_streams`` does."""
    if meta.granularity not in ("top_k", "top_p") or len(records) < 2:
        return [to_streams(meta, record) for record in records]
    out, first, entries = [], 0, 0
    for i, record in enumerate(records):
        size = len(record.ids) if record.ids is not None else 0
        if entries and entries + size > BATCH_ENTRIES:
            out += _to_streams_together(meta, records[first:i])
            first, entries = i, 0
        entries += size
    return out + _to_streams_together(meta, records[first:])


def _to_streams_together(meta: CacheMeta, records: list[TeacherRecord]) -> list[dict[str, np.ndarray]]:
    if len(records) < 2:
        return [to_streams(meta, record) for record in records]
    try:
        joined, sizes, row_len = _joined_support(meta, records)
    except ValueError:
        return [to_streams(meta, record) for record in records]  # raises, naming what is wrong
    sampled = np.split(_to_fixed_point(-np.asarray(joined.sampled_logp, np.float64)), np.cumsum(sizes)[:-1])
    with np.errstate(divide="ignore"):
        tail = _to_fixed_point(-np.log(np.clip(np.asarray(joined.tail_mass, np.float64), 0, 1)))
    tails = np.split(tail, np.cumsum(sizes)[:-1])
    supports = _encode_supports(joined.ids, joined.logp, row_len, sizes)
    out = []
    for i, (ids_stream, logp_stream) in enumerate(supports):
        streams = {"sampled_logp": sampled[i], "tail_mass": tails[i]}
        if meta.granularity == "top_p":
            streams["row_len"] = np.diff(np.asarray(records[i].offsets)).astype(np.uint32)
        streams["ids"], streams["logp"] = ids_stream, logp_stream
        out.append(streams)
    return out


def _joined_support(meta: CacheMeta, records: list[TeacherRecord]) -> tuple[TeacherRecord, np.ndarray, np.ndarray]:
    """The records as one (rows concatenated), validated as ``to_streams`` validates each: (joined, positions per
    record, row lengths); ValueError when any record does not fit."""
    for record in records:
        n = len(record.sampled_logp) if record.sampled_logp is not None else -1
        _require(n >= 0 and np.ndim(record.sampled_logp) == 1, "sampled_logp must be [n]")
        _require(record.ids is not None and record.logp is not None and record.offsets is not None
                 and record.tail_mass is not None, "ids, logp, offsets and tail_mass are required")
        _require(len(record.offsets) == n + 1 and record.offsets[0] == 0 and record.offsets[-1] == len(record.ids)
                 == len(record.logp) and len(record.tail_mass) == n, "shapes do not match")
    sizes = np.array([len(record.sampled_logp) for record in records], np.int64)
    row_len = np.concatenate([np.diff(np.asarray(record.offsets, np.int64)) for record in records])
    joined = TeacherRecord(sampled_logp=np.concatenate([np.asarray(r.sampled_logp) for r in records]),
                           ids=np.concatenate([np.asarray(r.ids, np.int64) for r in records]),
                           logp=np.concatenate([np.asarray(r.logp) for r in records]),
                           offsets=np.concatenate([[0], np.cumsum(row_len)]),
                           tail_mass=np.concatenate([np.asarray(r.tail_mass) for r in records]))
    _require(not np.isnan(np.asarray(joined.sampled_logp, np.float64)).any(), "sampled_logp holds NaN")
    _support_gaps(meta, joined)
    _require(not np.isnan(joined.logp).any(), "logp holds NaN")
    return joined, sizes, row_len


def from_streams(meta: CacheMeta, n_positions: int, streams: dict[str, np.ndarray]) -> TeacherRecord:
    sampled = (-_from_fixed_point(streams["sampled_logp"])).astype(np.float32)
    if meta.granularity == "sampled":
        return TeacherRecord(sampled_logp=sampled)
    if meta.granularity == "full":
        return TeacherRecord(sampled_logp=sampled, logp_codes=streams["logp"].reshape(n_positions, meta.vocab_size))
    if meta.granularity == "top_k":
        row_len = np.full(n_positions, meta.k, dtype=np.int64)
    else:
        row_len = streams["row_len"].astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(row_len)])
    ids, logp = _decode_support(streams["ids"], streams["logp"], row_len, meta.vocab_size)
    tail = np.exp(-_from_fixed_point(streams["tail_mass"])).astype(np.float32)
    return TeacherRecord(sampled_logp=sampled, ids=ids, logp=logp, offsets=offsets, tail_mass=tail)


def quantised(meta: CacheMeta, record: TeacherRecord) -> TeacherRecord:
    """What the cache returns for ``record`` (``from_streams(to_streams(record))``, equal to the bit), without the
    byte coding: the trainer trains on this while the record is committed beside it (``opd_sao.cache.writer``).
    Raises ValueError where ``to_streams`` would."""
    sampled = np.asarray(record.sampled_logp, dtype=np.float64)
    _require(sampled.ndim == 1 and not np.isnan(sampled).any(), "sampled_logp must be [n] without NaN")
    sampled = (-_from_fixed_point(_to_fixed_point(-sampled))).astype(np.float32)
    if meta.granularity == "sampled":
        return TeacherRecord(sampled_logp=sampled)
    if meta.granularity == "full":
        return TeacherRecord(sampled_logp=sampled, logp_codes=full_codes(meta, record))
    _require(record.logp is not None and not np.isnan(record.logp).any(), "logp holds NaN")
    _support_gaps(meta, record)  # validates
    row_len = np.diff(np.asarray(record.offsets, dtype=np.int64))
    step = np.repeat(sqrt_step(row_len), row_len)
    logp = dequantise_sqrt_p(quantise_sqrt_p(record.logp, step), step)
    with np.errstate(divide="ignore"):
        depth = _to_fixed_point(-np.log(np.clip(np.asarray(record.tail_mass, np.float64), 0, 1)))
    tail = np.exp(-_from_fixed_point(depth)).astype(np.float32)
    return TeacherRecord(sampled_logp=sampled, ids=np.asarray(record.ids, np.int64), logp=logp,
                         offsets=np.concatenate([[0], np.cumsum(row_len)]), tail_mass=tail)


def quantised_many(meta: CacheMeta, records: list[TeacherRecord]) -> list[TeacherRecord]:
    """``quantised`` of each record, in one vectorised pass over their concatenation (a trainer step's records:
    per-record calls cost more in numpy overhead than in arithmetic)."""
    if meta.granularity in ("sampled", "full") or len(records) < 2:
        return [quantised(meta, record) for record in records]
    _require(all(r.offsets is not None and r.ids is not None and r.logp is not None and r.tail_mass is not None
                 for r in records), "ids, logp, offsets and tail_mass are required")
    row_len = [np.diff(np.asarray(r.offsets, dtype=np.int64)) for r in records]
    joined = quantised(meta, TeacherRecord(
        sampled_logp=np.concatenate([np.asarray(r.sampled_logp) for r in records]),
        ids=np.concatenate([np.asarray(r.ids) for r in records]),
        logp=np.concatenate([np.asarray(r.logp) for r in records]),
        offsets=np.concatenate([[0], np.cumsum(np.concatenate(row_len))]),
        tail_mass=np.concatenate([np.asarray(r.tail_mass) for r in records])))
    out, row, entry = [], 0, 0
    for lens in row_len:
        n, total = len(lens), int(lens.sum())
        out.append(TeacherRecord(sampled_logp=joined.sampled_logp[row:row + n], ids=joined.ids[entry:entry + total],
                                 logp=joined.logp[entry:entry + total],
                                 offsets=joined.offsets[row:row + n + 1] - entry,
                                 tail_mass=joined.tail_mass[row:row + n]))
        row, entry = row + n, entry + total
    return out


def checksum(streams: dict[str, np.ndarray]) -> int:
    """CRC-32 over the streams' bytes in name order; stored in the index, verified on every read."""
    crc = 0
    for name in sorted(streams):
        crc = zlib.crc32(np.ascontiguousarray(streams[name]).view(np.uint8), crc)
    return crc
