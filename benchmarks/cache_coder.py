"""The logit cache's support coder (cache/encoding.py: a per-record id dictionary and Exp-Golomb codes with one
order per class) against numcodecs' Delta + Zstd, on a real teacher's top-k supports of real text.

    opd-sao models fetch smollm2 DIR     # once: SmolLM2-135M-Instruct as a transformers directory
    python benchmarks/cache_coder.py --model DIR [--quick]

The teacher reads the repository's own README.md and docs/*.md in windows of 256 tokens (--quick: 4 windows,
1,024 positions; else 32, 8,192), one record per window as the cache stores one per trajectory, and keeps its
top-16, top-64 and top-256 at each position. Both coders store the same things losslessly: the ids, and the same
quantised sqrt(p) codes of their probabilities (so the KL error is the same). Ours: the ids and codes streams as the
store writes them (cache/encoding.py, then the store's blosc-lz4). numcodecs: Delta(int32) then Zstd over the ids
as they lie (ascending within each position), Zstd over the codes as bytes (uint8; uint16 where a row's step
needs it); each at Zstd level 3 (zarr's default) and 19.

The LAST line is one JSON object: for each top_k, `ours` and `delta_zstd_3` / `delta_zstd_19`, each with ids and
codes bytes per position, and encode / decode positions per second (records to bytes, bytes to ids and codes,
quantisation included; the best of 3 passes), plus `machine` and `commit`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from numcodecs import Blosc, Delta, Zstd

from opd_sao.cache.encoding import (
    _decode_support,
    _encode_support,
    dequantise_sqrt_p,
    quantise_sqrt_p,
    sqrt_step,
)

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 256
KS = (16, 64, 256)
IDS_CODEC, CODES_CODEC = Blosc("lz4", 5, Blosc.NOSHUFFLE), Blosc("lz4", 5, Blosc.BITSHUFFLE)  # the store's


def teacher_supports(model_dir: str, windows: int) -> tuple[dict[int, list[tuple[np.ndarray, np.ndarray]]], int]:
    """{k: [(ids [n, k] ascending in rows, logp [n, k]) per window]}, and the vocabulary size."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    ids = tokenizer(text)["input_ids"][: windows * WINDOW]
    if len(ids) < windows * WINDOW:
        raise SystemExit(f"only {len(ids)} tokens of text for {windows} windows of {WINDOW}")
    supports: dict[int, list] = {k: [] for k in KS}
    with torch.no_grad():
        for w in range(windows):
            window = torch.tensor([ids[w * WINDOW : (w + 1) * WINDOW]])
            logp = torch.log_softmax(model(input_ids=window).logits[0].double(), -1)
            for k in KS:
                top = logp.topk(k, -1)
                order = top.indices.argsort(-1)
                supports[k].append((top.indices.gather(-1, order).numpy(), top.values.gather(-1, order).numpy()))
    return supports, model.config.vocab_size


def ours(records, vocab_size: int) -> tuple[list[tuple[bytes, bytes]], callable, callable]:
    def encode(ids, logp):
        row_len = np.full(len(ids), ids.shape[1], np.int64)
        id_stream, code_stream = _encode_support(ids.reshape(-1).astype(np.int64), logp.reshape(-1), row_len)
        return IDS_CODEC.encode(id_stream), CODES_CODEC.encode(code_stream)

    def decode(blobs, n, k):
        row_len = np.full(n, k, np.int64)
        id_stream = np.frombuffer(IDS_CODEC.decode(blobs[0]), np.uint8)
        code_stream = np.frombuffer(CODES_CODEC.decode(blobs[1]), np.uint8)
        return _decode_support(id_stream, code_stream, row_len, vocab_size)

    return encode, decode


def delta_zstd(level: int):
    delta, zstd = Delta(dtype="<i4"), Zstd(level=level)

    def encode(ids, logp):
        step = sqrt_step(np.array([ids.shape[1]]))[0]
        codes = quantise_sqrt_p(logp.reshape(-1), step)
        codes = codes.astype(np.uint8 if codes.max() < 256 else np.uint16)
        return zstd.encode(delta.encode(ids.reshape(-1).astype(np.int32))), zstd.encode(codes)

    def decode(blobs, n, k):
        ids = delta.decode(zstd.decode(blobs[0])).astype(np.int64)
        raw = zstd.decode(blobs[1])
        codes = np.frombuffer(raw, np.uint8 if len(raw) == n * k else np.uint16)
        return ids, dequantise_sqrt_p(codes, sqrt_step(np.array([k]))[0])

    return encode, decode


def measure(coder, records, k: int) -> dict:
    """Bytes per position of each stream, positions per second each way (best of 3), checked lossless."""
    encode, decode = coder
    positions = sum(len(ids) for ids, _ in records)
    best_enc = best_dec = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        blobs = [encode(ids, logp) for ids, logp in records]
        best_enc = min(best_enc, time.perf_counter() - start)
        start = time.perf_counter()
        decoded = [decode(b, len(ids), k) for b, (ids, _) in zip(blobs, records)]
        best_dec = min(best_dec, time.perf_counter() - start)
    for (ids, _), (got, _) in zip(records, decoded):
        assert np.array_equal(np.asarray(got).reshape(-1), ids.reshape(-1)), "ids not read back as written"
    return {"ids_bytes_per_position": round(sum(len(b[0]) for b in blobs) / positions, 2),
            "codes_bytes_per_position": round(sum(len(b[1]) for b in blobs) / positions, 2),
            "encode_positions_per_s": round(positions / best_enc), "decode_positions_per_s": round(positions / best_dec)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a transformers causal-LM directory (the teacher)")
    parser.add_argument("--quick", action="store_true", help="4 windows of 256 tokens instead of 32")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    supports, vocab_size = teacher_supports(args.model, 4 if args.quick else 32)
    results = {}
    for k in KS:
        records = supports[k]
        results[f"top_{k}"] = {"ours": measure(ours(records, vocab_size), records, k),
                               "delta_zstd_3": measure(delta_zstd(3), records, k),
                               "delta_zstd_19": measure(delta_zstd(19), records, k)}
        print(json.dumps({f"top_{k}": results[f"top_{k}"]}), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    results.update(positions=sum(len(ids) for ids, _ in supports[KS[0]]), model=Path(args.model).name,
                   machine={"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                            "load_1min": os.getloadavg()[0]}, commit=commit.strip())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
