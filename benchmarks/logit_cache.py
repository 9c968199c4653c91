"""Logit-cache benchmark: bytes per token, write/read throughput and KL error of every granularity.

    python benchmarks/logit_cache.py [--quick] [--rank-jitter SIGMA]

``--quick`` stores 512 tokens (96 for full vocabulary) and finishes in under a minute on 2 CPU cores;
the default stores ~7k tokens (2k for full vocabulary). Progress, the synthetic data's statistics, the codec
measurement that chose each stream's compressor, what each encoding step earns and the record-layout
measurement go to stdout as JSON lines; the LAST line is one JSON object with keys top_k_16, top_k_64,
top_k_256, top_p_0.95, full, raw_fp32 and raw_fp16_int32, each holding:

  bytes_per_token      bytes of every file of that store (chunks, index, zarr metadata; apparent size) / tokens.
                       payload_bytes_per_token counts the data chunks only.
  write_tokens_per_s   tokens / wall time of the puts (quantisation, coding, checksum, compression, disk write),
                       one trajectory per put; write_batch_tokens_per_s: put_many of 8 trajectories at a time.
                       select_tokens_per_s is the support selection from dense logprobs (encode_top_k/top_p).
  read_tokens_per_s    tokens / wall time of the gets, in shuffled order from a freshly opened cache (checksum
                       verification and decoding included; the OS page cache is warm).
  kl_error             mean over positions of KL(P || Q) in nats. P is the exact teacher distribution bucketed
                       into the stored support plus ONE tail bucket holding 1 - (support probability); Q is the
                       decoded support probabilities exp(logp) plus the decoded tail mass as one bucket,
                       renormalised to sum 1. For full and raw_fp32 the support is the whole vocabulary, with no
                       tail. kl_error_p99 and kl_error_max are over positions.

Baselines, written as one file per trajectory (temp file + os.replace): raw_fp32 keeps the full-vocabulary
float32 logprobs; raw_fp16_int32 keeps the top-64 support as int32 ids and float16 logprobs plus the float16 tail
mass's logarithm (a float16 tail mass would underflow to 0 below 6e-8 and make the KL infinite). Both also keep
the sampled token's float32 logprob, as the cache does.

Synthetic teacher (vocabulary 151,936; see ``synthetic_teacher`` and ``set_token_frequencies``): Zipf token
frequencies, half confident and half flat positions, mean entropy ~1.4 nats; the statistics line reports the
measured values. --rank-jitter sets how far token ids stray from frequency ranks (default 1; 0: ids are ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zarr
from numcodecs import LZ4, Blosc
from zarr.storage import LocalStore

from opd_sao.cache import (
    CacheMeta,
    LogitCache,
    TeacherRecord,
    encode_full,
    encode_top_k,
    encode_top_p,
)
from opd_sao.cache.cli import inspect
from opd_sao.cache.encoding import (
    LOGP_DEPTHS,
    dequantise_logp,
    exp_golomb_encode,
    from_streams,
    quantise_logp,
    to_streams,
)
from opd_sao.cache.store import COMPRESSORS, chunk_elements

VOCAB = 151_936
CACHED = {
    "top_k_16": dict(granularity="top_k", k=16),
    "top_k_64": dict(granularity="top_k", k=64),
    "top_k_256": dict(granularity="top_k", k=256),
    "top_p_0.95": dict(granularity="top_p", p=0.95, max_support=VOCAB),  # uncapped: the nucleus as it comes
    "full": dict(granularity="full"),
}
SUPPORT = {**CACHED, "raw_fp32": CACHED["full"], "raw_fp16_int32": CACHED["top_k_64"]}
FULL_VOCAB = ("full", "raw_fp32")  # stored for the first trajectories only: ~0.1-0.6 MB per token


def set_token_frequencies(rank_jitter: float) -> None:
    """Zipf log-frequency per token id: p(rank) ~ 1 / (rank + 10). Ranks follow ids up to a lognormal factor
    exp(N(0, rank_jitter^2)), as BPE ids roughly follow merge order, i.e. frequency; 0 makes ids the ranks."""
    global LOG_FREQUENCY, CONTEXT_CDF
    rng = np.random.default_rng(0)
    order = np.argsort((np.arange(VOCAB) + 1) * rng.lognormal(0.0, rank_jitter, VOCAB))
    rank = np.empty(VOCAB)
    rank[order] = np.arange(VOCAB)
    log_frequency = torch.from_numpy(-np.log(rank + 10.0)).float()
    LOG_FREQUENCY = log_frequency - torch.logsumexp(log_frequency, 0)
    CONTEXT_CDF = torch.softmax(0.6 * LOG_FREQUENCY.double(), 0).cumsum(0)


set_token_frequencies(rank_jitter=1.0)


def synthetic_teacher(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, vocab] teacher logprobs and the student's sampled ids for one trajectory.

    logits = log-frequency + N(0, 1) noise + a boost for 256 context tokens drawn from frequency^0.6 and ranked
    by descending boost. Confident positions (half): boost 18 nats, falling ~1.5 nats per rank. Flat positions:
    boost 12 falling ~0.012 per rank, temperature 1.4, so the nucleus reaches hundreds or thousands of tokens.
    """
    generator = torch.Generator().manual_seed(seed)
    confident = torch.rand(n, generator=generator) < 0.5
    logits = LOG_FREQUENCY + torch.randn(n, VOCAB, generator=generator)
    context = torch.searchsorted(CONTEXT_CDF, torch.rand(n, 256, generator=generator, dtype=torch.float64))
    ranks = (2 * torch.rand(n, 256, generator=generator)).cumsum(-1)
    boost = torch.where(confident[:, None], 18 - 1.5 * ranks, 12 - 0.012 * ranks).clamp(min=0)
    logits.scatter_add_(1, context.clamp(max=VOCAB - 1), boost)
    temperature = torch.where(confident, 1.0, 1.4)
    logp = torch.log_softmax(logits / temperature[:, None], dim=-1)
    cdf = logp.exp().cumsum(-1)
    sampled = torch.searchsorted(cdf, torch.rand(n, 1, generator=generator) * cdf[:, -1:])[:, 0]
    return logp, sampled.clamp(max=VOCAB - 1)


def select(name: str, rows: torch.Tensor, sampled: torch.Tensor) -> TeacherRecord:
    config = SUPPORT[name]
    if config["granularity"] == "top_k":
        return encode_top_k(rows, config["k"], sampled)
    if config["granularity"] == "top_p":
        return encode_top_p(rows, config["p"], sampled, config["max_support"])
    return encode_full(rows, sampled)


def _segment_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return np.add.reduceat(values, offsets[:-1])  # every stored position holds at least one id


def bucketed_kl(exact: TeacherRecord, decoded_logp: np.ndarray, decoded_tail: np.ndarray) -> np.ndarray:
    """Per-position KL(P || Q) over support + one tail bucket (see the module docstring)."""
    offsets = exact.offsets
    p_support = np.exp(exact.logp.astype(np.float64))
    p_tail = exact.tail_mass.astype(np.float64)
    p_total = _segment_sum(p_support, offsets) + p_tail
    q_support = np.exp(decoded_logp.astype(np.float64))
    q_tail = decoded_tail.astype(np.float64)
    q_total = _segment_sum(q_support, offsets) + q_tail
    row = np.repeat(np.arange(len(p_tail)), np.diff(offsets))
    log_p = np.log(p_support) - np.log(p_total)[row]
    log_q = np.log(q_support) - np.log(q_total)[row]
    support_term = _segment_sum(np.exp(log_p) * (log_p - log_q), offsets)
    p_tail, q_tail = p_tail / p_total, q_tail / q_total
    with np.errstate(divide="ignore", invalid="ignore"):
        tail_term = np.where(p_tail > 0, p_tail * (np.log(p_tail) - np.log(q_tail)), 0.0)
    return support_term + tail_term


def full_kl(exact_logp: np.ndarray, decoded_logp: np.ndarray) -> np.ndarray:
    log_p = torch.log_softmax(torch.from_numpy(exact_logp).double(), -1)
    log_q = torch.log_softmax(torch.tensor(decoded_logp, dtype=torch.float64), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).numpy()


class RawFiles:
    """The uncompressed baselines: one file per trajectory, each array's bytes back to back."""

    def __init__(self, path: Path, dtypes: dict[str, np.dtype]):
        self.path, self.dtypes = path, dtypes
        path.mkdir(parents=True, exist_ok=True)

    def put(self, traj_id: str, record: TeacherRecord) -> None:
        arrays = _raw_arrays(record)
        temporary = self.path / f".{traj_id}.tmp"
        with open(temporary, "wb") as file:
            file.write(np.array([len(arrays[name]) for name in self.dtypes], dtype=np.int64).tobytes())
            for name, dtype in self.dtypes.items():
                file.write(np.ascontiguousarray(arrays[name], dtype=dtype).tobytes())
        os.replace(temporary, self.path / traj_id)

    def get(self, traj_id: str) -> dict[str, np.ndarray]:
        data = (self.path / traj_id).read_bytes()
        lengths = np.frombuffer(data, np.int64, len(self.dtypes))
        arrays, offset = {}, 8 * len(self.dtypes)
        for (name, dtype), length in zip(self.dtypes.items(), lengths):
            arrays[name] = np.frombuffer(data, dtype, int(length), offset)
            offset += int(length) * dtype.itemsize
        return arrays


RAW_DTYPES = {
    "raw_fp32": {"sampled_logp": np.dtype(np.float32), "logp": np.dtype(np.float32)},
    "raw_fp16_int32": {
        "sampled_logp": np.dtype(np.float32),
        "ids": np.dtype(np.int32),
        "logp": np.dtype(np.float16),
        "log_tail_mass": np.dtype(np.float16),
    },
}


def _raw_arrays(record: TeacherRecord) -> dict[str, np.ndarray]:
    arrays = {"sampled_logp": record.sampled_logp, "logp": record.logp.reshape(-1)}
    if record.ids is not None:
        with np.errstate(divide="ignore"):
            arrays.update(ids=record.ids, log_tail_mass=np.log(record.tail_mass))
    return arrays


def _store_bytes(path: Path) -> tuple[int, int]:
    files = [file for file in path.rglob("*") if file.is_file()]
    chunks = [file for file in files if file.parent.name == "c"]
    return sum(file.stat().st_size for file in files), sum(file.stat().st_size for file in chunks)


def codec_measurement(samples: dict[str, list[TeacherRecord]], metas: dict[str, CacheMeta]) -> dict:
    """Compressed size and speed of every stream under each lz4 option, chunk by chunk as the store lays out
    the records back to back."""
    candidates = {
        "numcodecs_lz4": LZ4(),
        "blosc_lz4_noshuffle": Blosc("lz4", 5, Blosc.NOSHUFFLE),
        "blosc_lz4_shuffle": Blosc("lz4", 5, Blosc.SHUFFLE),
        "blosc_lz4_bitshuffle": Blosc("lz4", 5, Blosc.BITSHUFFLE),
    }
    table = {}
    for name, records in samples.items():
        encoded = [to_streams(metas[name], record) for record in records]
        tokens = sum(record.n_positions for record in records)
        for stream in encoded[0]:
            data = np.concatenate([streams[stream] for streams in encoded])
            size = chunk_elements(metas[name].granularity, stream)
            chunks = [data[i : i + size] for i in range(0, len(data), size)]
            row = {}
            for codec_name, codec in candidates.items():
                start = time.perf_counter()
                blobs = [codec.encode(chunk) for chunk in chunks]
                encode_s = time.perf_counter() - start
                start = time.perf_counter()
                for blob in blobs:
                    codec.decode(blob)
                decode_s = time.perf_counter() - start
                row[codec_name] = {
                    "bytes_per_token": round(sum(map(len, blobs)) / tokens, 3),
                    "encode_MB_per_s": round(data.nbytes / encode_s / 1e6),
                    "decode_MB_per_s": round(data.nbytes / decode_s / 1e6),
                }
            row["raw_bytes_per_token"] = round(data.nbytes / tokens, 3)
            table[f"{name}/{stream}"] = row
    return table


def encoding_measurement(records: list[TeacherRecord]) -> dict:
    """What each step of the top-64 encoding earns: bytes per token after blosc-lz4 and the KL error it causes,
    against the plain alternatives (uint32 id deltas; a uniform 256-level or float16 logprob)."""
    shuffle, bitshuffle = Blosc("lz4", 5, Blosc.SHUFFLE), Blosc("lz4", 5, Blosc.BITSHUFFLE)
    tokens = sum(record.n_positions for record in records)
    ids = [record.ids.reshape(-1, 64) for record in records]
    logp = np.concatenate([record.logp for record in records])
    uniform_step = LOGP_DEPTHS[-1] / 255
    uniform_codes = np.rint(np.clip(-logp, 0, LOGP_DEPTHS[-1]) / uniform_step).astype(np.uint8)
    logp_options = {
        "table_uint8_bitshuffle": (bitshuffle, quantise_logp(logp), dequantise_logp(quantise_logp(logp))),
        "uniform_uint8_bitshuffle": (bitshuffle, uniform_codes, uniform_codes * -uniform_step),
        "float16_shuffle": (shuffle, logp.astype(np.float16), logp.astype(np.float16)),
    }
    report = {
        "ids_exp_golomb_gaps": round(sum(len(Blosc("lz4", 5, Blosc.NOSHUFFLE).encode(
            exp_golomb_encode(np.diff(rows, prepend=-1, axis=1).ravel() - 1))) for rows in ids) / tokens, 1),
        "ids_uint32_deltas_shuffle": round(sum(len(shuffle.encode(
            np.diff(rows, prepend=0, axis=1).astype(np.uint32))) for rows in ids) / tokens, 1),
    }
    meta = CacheMeta("measure", "c", VOCAB, "t", "top_k", k=64)
    streams = [to_streams(meta, record) for record in records]
    noshuffle = Blosc("lz4", 5, Blosc.NOSHUFFLE)
    report["ids_dictionary_slot_class_exp_golomb (chosen)"] = round(
        sum(len(noshuffle.encode(s["ids"])) for s in streams) / tokens, 1)
    kl = np.concatenate([bucketed_kl(record, from_streams(meta, record.n_positions, s).logp, record.tail_mass)
                         for record, s in zip(records, streams)])
    report["logp_sqrt_p_exp_golomb (chosen)"] = {
        "bytes_per_token": round(sum(len(noshuffle.encode(s["logp"])) for s in streams) / tokens, 1),
        "kl_error": float(kl.mean())}
    offsets = np.cumsum([0] + [len(record.logp) for record in records])
    for name, (codec, stored, decoded) in logp_options.items():
        kl = np.concatenate([bucketed_kl(record, decoded[start:end], record.tail_mass)
                             for record, start, end in zip(records, offsets[:-1], offsets[1:])])
        report[f"logp_{name}"] = {"bytes_per_token": round(len(codec.encode(stored)) / tokens, 1),
                                  "kl_error": float(kl.mean())}
    return report


def layout_measurement(directory: Path, rows: torch.Tensor, sampled: torch.Tensor) -> dict:
    """Packed records (the store) against one zarr group per trajectory, for short 32-token trajectories."""
    meta = CacheMeta("layout", "c", VOCAB, "t", "top_k", k=64)
    records = [encode_top_k(rows[i : i + 32], 64, sampled[i : i + 32]) for i in range(0, len(rows), 32)]
    packed = LogitCache(directory / "packed").open_teacher(meta)
    start = time.perf_counter()
    for i, record in enumerate(records):
        packed.put(f"traj-{i}", record)
    packed_s = time.perf_counter() - start
    start = time.perf_counter()
    for i, record in enumerate(records):
        group = zarr.open_group(LocalStore(directory / "per_trajectory" / f"traj-{i}"), mode="w")
        for stream, data in to_streams(meta, record).items():
            array = group.create_array(stream, shape=data.shape, chunks=data.shape, dtype=data.dtype,
                                       compressors=[COMPRESSORS[stream]])
            array[:] = data
    per_trajectory_s = time.perf_counter() - start
    tokens = len(rows)
    report = {}
    for layout, seconds in (("packed", packed_s), ("per_trajectory", per_trajectory_s)):
        path = directory / layout
        files = [file for file in path.rglob("*") if file.is_file()]
        report[layout] = {
            "files": len(files),
            "bytes_per_token": round(sum(f.stat().st_size for f in files) / tokens, 1),
            "allocated_bytes_per_token": round(sum(f.stat().st_blocks * 512 for f in files) / tokens, 1),
            "write_tokens_per_s": round(tokens / seconds),
        }
    return report


def _entropy_bits(symbols: np.ndarray) -> float:
    counts = np.unique(symbols, return_counts=True)[1]
    probabilities = counts / counts.sum()
    return float(-(probabilities * np.log2(probabilities)).sum())


def _timed(function, *args) -> tuple[object, float]:
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def run(quick: bool, workdir: Path) -> dict:
    lengths = [96, 160, 128, 128] if quick else [random.Random(7).randint(64, 448) for _ in range(32)]
    full_vocab_tokens = 96 if quick else 2048
    names = ["top_k_16", "top_k_64", "top_k_256", "top_p_0.95", "raw_fp16_int32", "full", "raw_fp32"]  # big last
    records: dict[str, dict[str, TeacherRecord]] = {name: {} for name in names}
    select_s = dict.fromkeys(names, 0.0)
    entropies, full_vocab_stored = [], 0
    for seed, length in enumerate(lengths):
        traj_id = f"traj-{seed:04d}"
        rows, sampled = synthetic_teacher(length, seed)
        entropies.append(-(rows.exp() * rows).sum(-1).numpy())
        keep_full_vocab = full_vocab_stored < full_vocab_tokens
        full_vocab_stored += length if keep_full_vocab else 0
        for name in names:
            if name in FULL_VOCAB and not keep_full_vocab:
                continue
            records[name][traj_id], seconds = _timed(select, name, rows, sampled)
            select_s[name] += seconds
        print(json.dumps({"progress": f"{seed + 1}/{len(lengths)} trajectories selected"}), flush=True)

    metas = {name: CacheMeta(name, "bench", VOCAB, "bench", **config) for name, config in CACHED.items()}
    results = {}
    for name in names:
        tokens = sum(record.n_positions for record in records[name].values())
        if name in CACHED:
            store = LogitCache(workdir / "cache").open_teacher(metas[name])
        else:
            store = RawFiles(workdir / name, RAW_DTYPES[name])
        write_s = sum(_timed(store.put, traj_id, record)[1] for traj_id, record in records[name].items())
        if name in CACHED:  # the same records in batches of 8 trajectories, as a teacher scoring a batch would
            batched = LogitCache(workdir / "batched").open_teacher(metas[name])
            items = list(records[name].items())
            batch_s = sum(_timed(batched.put_many, dict(items[i : i + 8]))[1] for i in range(0, len(items), 8))

        reader = LogitCache(workdir / "cache").open_teacher(metas[name]) if name in CACHED else store
        stored = list(records[name])
        random.Random(1).shuffle(stored)
        read_s, kl = 0.0, []
        for traj_id in stored:
            got, seconds = _timed(reader.get, traj_id)
            read_s += seconds
            exact = records[name][traj_id]
            if name == "full":  # read back as the cache's one-byte codes
                kl.append(full_kl(exact.logp, dequantise_logp(got.logp_codes)))
            elif name == "raw_fp32":
                kl.append(full_kl(exact.logp, got["logp"].reshape(exact.logp.shape)))
            elif name in CACHED:
                kl.append(bucketed_kl(exact, got.logp, got.tail_mass))
            else:
                kl.append(bucketed_kl(exact, got["logp"], np.exp(got["log_tail_mass"].astype(np.float64))))
        kl = np.concatenate(kl)

        all_bytes, chunk_bytes = _store_bytes(store.path)
        results[name] = {
            "bytes_per_token": round(all_bytes / tokens, 2),
            "payload_bytes_per_token": round((chunk_bytes if name in CACHED else all_bytes) / tokens, 2),
            "kl_error": float(kl.mean()),
            "kl_error_p99": float(np.quantile(kl, 0.99)),
            "kl_error_max": float(kl.max()),
            "write_tokens_per_s": round(tokens / write_s),
            "read_tokens_per_s": round(tokens / read_s),
            "select_tokens_per_s": round(tokens / select_s[name]),
            "tokens": tokens,
        }
        if name in CACHED:
            results[name]["write_batch_tokens_per_s"] = round(tokens / batch_s)
            assert inspect(workdir / "cache")["teachers"][name]["tokens"] == tokens
        print(json.dumps({"progress": f"{name} written and read"}), flush=True)

    entropy = np.concatenate(entropies)
    nucleus = np.concatenate([np.diff(record.offsets) for record in records["top_p_0.95"].values()])
    top_64 = records["top_k_64"].values()
    gaps = np.concatenate([np.diff(record.ids.reshape(-1, 64), prepend=-1, axis=1).ravel() - 1 for record in top_64])
    codes = quantise_logp(np.concatenate([record.logp for record in top_64]))
    print(json.dumps({"synthetic_teacher": {
        "positions": len(entropy),
        "mean_entropy_nats": round(float(entropy.mean()), 3),
        "entropy_quantiles_10_50_90": [round(float(q), 3) for q in np.quantile(entropy, [0.1, 0.5, 0.9])],
        "top_p_0.95_support_mean": round(float(nucleus.mean()), 1),
        "top_p_0.95_support_quantiles_50_90_99": [float(q) for q in np.quantile(nucleus, [0.5, 0.9, 0.99])],
        # what any coder of independent symbols needs for top-64 ids and logprob codes (+ 4 bytes per position)
        "top_k_64_order0_entropy_bytes_per_token": {
            "id_gaps": round(64 * _entropy_bits(gaps) / 8, 1), "logp_codes": round(64 * _entropy_bits(codes) / 8, 1)},
    }}))
    samples = {name: list(records[name].values()) for name in CACHED}
    print(json.dumps({"codec_measurement": codec_measurement(samples, metas)}))
    print(json.dumps({"encoding_measurement": encoding_measurement(samples["top_k_64"])}))
    rows, sampled = synthetic_teacher((8 if quick else 32) * 32, 10_000)
    print(json.dumps({"layout_measurement": layout_measurement(workdir / "layout", rows, sampled)}))
    print(json.dumps({"machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                                  "torch_threads": torch.get_num_threads()}}))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 tokens; under a minute on 2 CPU cores")
    parser.add_argument("--rank-jitter", type=float, default=1.0,
                        help="spread between token ids and frequency ranks (0: ids are ranks); default 1")
    args = parser.parse_args()
    set_token_frequencies(args.rank_jitter)
    with tempfile.TemporaryDirectory(prefix="logit-cache-bench-") as workdir:
        results = run(args.quick, Path(workdir))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
