"""Logit cache: encoding bounds, round trips, concurrency, corruption detection, identity checks and gc."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from launchers import HANG_S

from opd_sao.cache import (
    BackgroundWriter,
    CacheDamagedError,
    CacheMeta,
    CacheMismatchError,
    CacheReadOnlyError,
    CorruptRecordError,
    LogitCache,
    TeacherRecord,
    encode_top_k,
    encode_top_p,
    encoding,
    nucleus_cut,
    quantised,
    quantised_many,
    record_from_logprobs,
)
from opd_sao.cache.cli import gc, inspect, main, verify
from opd_sao.cache.encoding import (
    LOGP_HALF_STEP,
    checksum,
    dequantise_logp,
    dequantise_sqrt_p,
    exp_golomb_decode,
    exp_golomb_encode,
    from_streams,
    quantise_logp,
    quantise_sqrt_p,
    sqrt_step,
    to_streams,
    to_streams_many,
)
from opd_sao.cache.store import _CommitLog

VOCAB = 384
FIXED_POINT_ERROR = 1 / 2048 + 1e-6


def teacher_rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, 1, generator=generator) * 6  # confident and flat positions
    logp = torch.log_softmax(scale * torch.randn(n, VOCAB, generator=generator), dim=-1)
    sampled = torch.randint(0, VOCAB, (n,), generator=generator)
    return logp, sampled


def make_meta(granularity: str = "top_k", **overrides) -> CacheMeta:
    extra = {"top_k": {"k": 16}, "top_p": {"p": 0.9, "max_support": VOCAB}}.get(granularity, {})
    fields = dict(teacher="reasoning-rl", checkpoint_hash="ckpt-1", vocab_size=VOCAB, tokenizer_hash="tok-1",
                  granularity=granularity, **extra)
    return CacheMeta(**{**fields, **overrides})


def ragged_record(rng: np.random.Generator, n: int) -> TeacherRecord:
    """A top_p-shaped record with a different support size at every position, built without a model."""
    sizes = rng.integers(1, 40, n)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    ids = np.concatenate([np.sort(rng.choice(VOCAB, size, replace=False)) for size in sizes])
    weights = rng.uniform(0.1, 1.0, len(ids))
    kept = rng.uniform(0.5, 0.99, n)
    probabilities = weights / np.repeat(np.add.reduceat(weights, offsets[:-1]) / kept, sizes)
    return TeacherRecord(
        sampled_logp=np.log(rng.uniform(0.01, 1.0, n)).astype(np.float32),
        ids=ids,
        logp=np.log(probabilities).astype(np.float32),
        offsets=offsets,
        tail_mass=(1 - kept).astype(np.float32),
    )


def chunk_files(teacher_dir: Path, stream: str) -> list[Path]:
    return sorted((teacher_dir / stream / "c").iterdir(), key=lambda path: int(path.name))


def test_logp_codes_stay_within_the_stated_bound():
    logp = -np.linspace(0.0, 48.0, 200_001, dtype=np.float32)
    codes = quantise_logp(logp)
    error = np.abs(dequantise_logp(codes) - logp)
    assert (error <= LOGP_HALF_STEP[codes] + 1e-6).all()
    assert error[logp >= -1.386].max() <= 1 / 128 + 1e-6
    assert error[logp >= -4.158].max() <= 1 / 32 + 1e-6
    assert error.max() <= 1 / 4 + 1e-6
    assert dequantise_logp(quantise_logp(np.array([-np.inf, -1e9], np.float32))).tolist() == [-48.046875] * 2


def test_sqrt_p_codes_stay_within_the_stated_bound():
    logp = np.concatenate([-np.linspace(0.0, 48.0, 100_001), [-np.inf, -1e9, 1e-7]]).astype(np.float32)
    for row_len in (1, 16, 64, 256, 7000):
        step = sqrt_step(np.array([row_len]))[0]
        assert step == 1 / (16 * np.ceil(np.sqrt(row_len)))
        back = dequantise_sqrt_p(quantise_sqrt_p(logp, step), step)
        assert np.isfinite(back).all() and (back <= 0).all()
        error = np.abs(np.exp(back.astype(np.float64) / 2) - np.exp(np.minimum(logp, 0).astype(np.float64) / 2))
        assert error.max() <= step / 2 + 1e-7


def test_exp_golomb_round_trips_small_large_and_empty():
    rng = np.random.default_rng(0)
    small, large, zeros, empty = rng.integers(0, 50, 1000), rng.integers(0, 2**32, 100), np.zeros(3), np.zeros(0)
    for values in (small, large, zeros.astype(np.int64), empty.astype(np.int64)):
        assert (exp_golomb_decode(exp_golomb_encode(values), len(values)) == values.astype(np.uint64)).all()


@pytest.mark.parametrize("granularity", ["sampled", "top_k", "top_p", "full"])
def test_round_trip_every_granularity(tmp_path, granularity):
    meta = make_meta(granularity)
    rows, sampled = teacher_rows(40)
    record = record_from_logprobs(meta, rows, sampled)
    LogitCache(tmp_path).open_teacher(meta).put("traj-1", record)

    back = LogitCache(tmp_path).open_teacher(meta).get("traj-1")  # a fresh reader
    assert np.abs(back.sampled_logp - rows[torch.arange(40), sampled].numpy()).max() <= FIXED_POINT_ERROR
    if granularity == "sampled":
        return
    if granularity == "full":
        assert back.logp is None and back.logp_codes.shape == (40, VOCAB)  # read back as the cache's codes
        back.logp = dequantise_logp(back.logp_codes)
        exact = rows.numpy()
    else:
        assert (back.ids == record.ids).all() and (back.offsets == record.offsets).all()
        exact = record.logp
        kept = np.add.reduceat(np.exp(exact.astype(np.float64)), record.offsets[:-1])
        assert np.allclose(record.tail_mass, 1 - kept, atol=1e-5)
        relative = np.abs(np.log(back.tail_mass) - np.log(record.tail_mass))
        assert relative[record.tail_mass > 1e-20].max() <= FIXED_POINT_ERROR
    if granularity == "full":
        above_floor = exact >= -48.0  # deeper logprobs read back as the floor, -48.05
        bound = LOGP_HALF_STEP[quantise_logp(exact)]
        assert (np.abs(back.logp - exact) <= bound + 1e-6)[above_floor].all()
    else:  # support logprobs: sqrt(p) within half a step of the row's sqrt(p) scale
        step = np.repeat(sqrt_step(np.diff(record.offsets)), np.diff(record.offsets))
        error = np.abs(np.exp(back.logp.astype(np.float64) / 2) - np.exp(exact.astype(np.float64) / 2))
        assert (error <= step / 2 + 1e-6).all()


def test_top_p_keeps_a_ragged_nucleus_per_position(tmp_path):
    meta = make_meta("top_p", p=0.9)
    rows, sampled = teacher_rows(64, seed=3)
    record = encode_top_p(rows, 0.9, sampled, VOCAB)
    sizes = np.diff(record.offsets)
    assert len(set(sizes.tolist())) > 5  # different support sizes per position
    for position in range(64):
        kept = record.logp[record.offsets[position] : record.offsets[position + 1]]
        probabilities = np.sort(np.exp(kept.astype(np.float64)))
        assert probabilities.sum() >= 0.9 - 1e-6 > probabilities[1:].sum()  # reaches p, and is the smallest set
        assert (np.diff(record.ids[record.offsets[position] : record.offsets[position + 1]]) > 0).all()

    teacher = LogitCache(tmp_path).open_teacher(meta)
    teacher.put("traj-1", record)
    back = teacher.get("traj-1")
    assert (back.offsets == record.offsets).all() and (back.ids == record.ids).all()


def test_top_p_nucleus_is_capped_at_max_support(tmp_path):
    """A flat teacher (the nucleus would be most of the vocabulary) keeps max_support ids, the rest is tail."""
    rows = torch.log_softmax(torch.zeros(2, 2000), dim=-1)  # uniform: 0.90025 needs 1800.5 of 2000 ids
    uncapped = encode_top_p(rows, 0.90025, torch.tensor([0, 1]), max_support=2000)
    assert np.diff(uncapped.offsets).tolist() == [1801, 1801]
    capped = encode_top_p(rows, 0.90025, torch.tensor([0, 1]), max_support=256)
    sizes = torch.from_numpy(np.diff(capped.offsets))
    assert sizes.tolist() == [256, 256]
    np.testing.assert_allclose(capped.tail_mass, 1 - 256 / 2000, rtol=1e-6)
    tail = torch.from_numpy(capped.tail_mass)
    assert nucleus_cut(sizes, tail, 0.90025, 256).tolist() == [True, True]
    assert nucleus_cut(torch.from_numpy(np.diff(uncapped.offsets)), torch.from_numpy(uncapped.tail_mass), 0.90025,
                       2000).tolist() == [False, False]
    teacher = LogitCache(tmp_path).open_teacher(make_meta("top_p", p=0.90025, max_support=256, vocab_size=2000))
    teacher.put("flat", capped)
    with pytest.raises(ValueError, match="max_support=256"):  # the cap is an invariant of the cache
        teacher.put("too-wide", uncapped)
    back = teacher.get("flat")
    assert np.diff(back.offsets).tolist() == [256, 256]
    np.testing.assert_allclose(back.tail_mass, 1 - 256 / 2000, rtol=1e-3)  # tail stored to ~5e-4 relative


def test_put_rejects_a_record_that_does_not_fit_the_cache(tmp_path):
    teacher = LogitCache(tmp_path).open_teacher(make_meta("top_k", k=16))
    rows, sampled = teacher_rows(4)
    with pytest.raises(ValueError, match="k=16"):
        teacher.put("traj-1", encode_top_k(rows, 8, sampled))


def test_concurrent_reader_only_sees_complete_records(tmp_path):
    meta = make_meta("top_p")
    writer = LogitCache(tmp_path).open_teacher(meta)
    reader = LogitCache(tmp_path).open_teacher(meta)
    rng, expected = np.random.default_rng(0), {}
    for i in range(60):
        record = ragged_record(rng, n=20 + i % 7)
        expected[f"traj-{i}"] = (record, from_streams(meta, record.n_positions, to_streams(meta, record)))
    checked, listed_counts, failures, done = set(), [], [], threading.Event()
    read_some = threading.Event()  # the reader has listed a part: the writer writes the rest only then

    def write():
        for i, (traj_id, (record, _)) in enumerate(expected.items()):
            if i == 30:
                read_some.wait(HANG_S)
            writer.put(traj_id, record)
        done.set()

    def read():
        while True:
            finished = done.is_set()
            listed = reader.traj_ids()
            listed_counts.append(len(listed))
            if 0 < len(listed) < 60:
                read_some.set()
            if reader.contains_many(listed + ["never-put"]) != [True] * len(listed) + [False]:
                failures.append("contains_many")  # one read of the log answers for every id
            for traj_id in set(listed) - checked:
                got, want = reader.get(traj_id), expected[traj_id][1]
                if not (np.array_equal(got.ids, want.ids) and np.array_equal(got.logp, want.logp)
                        and np.array_equal(got.tail_mass, want.tail_mass)):
                    failures.append(traj_id)
                checked.add(traj_id)
            if finished:
                return
            time.sleep(0.001)  # a trainer does work between reads; a spinning thread would starve the writer

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=HANG_S)
    assert not failures and len(checked) == 60
    assert any(0 < count < 60 for count in listed_counts)  # the reader read while the writer wrote


READER_PROCESS = """
import sys, time, numpy as np
from opd_sao.cache import CacheMeta, LogitCache
meta = CacheMeta("reasoning-rl", "ckpt-1", 384, "tok-1", "top_k", k=4)
teacher, seen = LogitCache(sys.argv[1]).open_teacher(meta), set()
while len(seen) < 40:
    for traj_id in set(teacher.traj_ids()) - seen:
        i, got = int(traj_id.split("-")[1]), teacher.get(traj_id)
        assert got.n_positions == 10 + i and (got.sampled_logp == -(i + 1) / 8).all(), traj_id
        assert (got.ids.reshape(-1, 4) == np.arange(4) * 7 + i).all(), traj_id
        seen.add(traj_id)
    time.sleep(0.001)
print(len(seen))
"""


def test_reader_in_another_process_only_sees_complete_records(tmp_path):
    meta = make_meta("top_k", k=4)
    writer = LogitCache(tmp_path).open_teacher(meta)
    reader = subprocess.Popen([sys.executable, "-c", READER_PROCESS, str(tmp_path)], stdout=subprocess.PIPE,
                              cwd=Path(__file__).resolve().parents[1], text=True)
    for i in range(40):
        n = 10 + i
        writer.put(f"traj-{i}", TeacherRecord(
            sampled_logp=np.full(n, -(i + 1) / 8, np.float32),
            ids=np.tile(np.arange(4) * 7 + i, n),
            logp=np.full(4 * n, -2.0, np.float32),
            offsets=np.arange(n + 1) * 4,
            tail_mass=np.full(n, 0.5, np.float32),
        ))
    output, _ = reader.communicate(timeout=HANG_S)
    assert reader.returncode == 0 and output.strip() == "40"


def big_top_k_teacher(tmp_path: Path) -> tuple[LogitCache, CacheMeta]:
    """One record whose logp stream spans more than one 2**17-byte chunk, so chunk 0 is its own and a later put
    starts past it."""
    meta = make_meta("top_k", k=64)
    rows, sampled = teacher_rows(4096, seed=5)
    LogitCache(tmp_path).open_teacher(meta).put("traj-big", encode_top_k(rows, 64, sampled))
    return LogitCache(tmp_path), meta


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_chunk_is_detected_reported_and_recoverable(tmp_path, capsys, damage):
    cache, meta = big_top_k_teacher(tmp_path)
    teacher = cache.open_teacher(meta)
    chunk, *rest = chunk_files(teacher.path, "logp")
    assert rest  # the damaged chunk holds traj-big's bytes only
    data = bytearray(chunk.read_bytes())
    if damage == "flip":
        for offset in range(len(data) // 2, len(data) // 2 + 64):
            data[offset] ^= 0xFF
        chunk.write_bytes(bytes(data))
    elif damage == "truncate":
        chunk.write_bytes(bytes(data[: len(data) // 2]))
    else:
        chunk.unlink()

    with pytest.raises(CorruptRecordError) as raised:
        teacher.get("traj-big")
    assert raised.value.traj_ids == ["traj-big"]
    with pytest.raises(CorruptRecordError):
        teacher.get_many(["traj-big"])
    ok, problems = verify(tmp_path)
    assert not ok and "traj-big" in problems[0]
    assert main(["verify", str(tmp_path)]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False

    teacher.invalidate("traj-big")
    assert "traj-big" not in teacher
    rows, sampled = teacher_rows(8, seed=6)
    teacher.put("traj-big", encode_top_k(rows, 64, sampled))
    assert teacher.get("traj-big").n_positions == 8
    assert main(["verify", str(tmp_path)]) == 0


def test_get_many_names_every_corrupt_trajectory(tmp_path):
    cache, meta = big_top_k_teacher(tmp_path)
    teacher = cache.open_teacher(meta)
    rows, sampled = teacher_rows(4, seed=2)
    teacher.put("traj-small", encode_top_k(rows, 64, sampled))  # shares chunk 0 of sampled_logp with traj-big
    for chunk in chunk_files(teacher.path, "sampled_logp"):
        chunk.write_bytes(chunk.read_bytes()[:20])
    with pytest.raises(CorruptRecordError) as raised:
        teacher.get_many(["traj-big", "traj-small"])
    assert raised.value.traj_ids == ["traj-big", "traj-small"]
    assert sorted(teacher.verify()) == ["traj-big", "traj-small"]
    report = gc(tmp_path)["teachers"]["reasoning-rl"]
    assert sorted(report["corrupt_records_dropped"]) == ["traj-big", "traj-small"]
    assert len(teacher) == 0 and verify(tmp_path) == (True, [])


def test_damaged_index_line_is_reported_and_never_used(tmp_path):
    meta = make_meta()
    teacher = LogitCache(tmp_path).open_teacher(meta)
    rows, sampled = teacher_rows(4)
    teacher.put("traj-1", encode_top_k(rows, 16, sampled))
    teacher.put("traj-2", encode_top_k(rows, 16, sampled))
    index = teacher.path / "index.log"
    lines = index.read_bytes().splitlines(keepends=True)
    index.write_bytes(lines[0].replace(b"traj-1", b"traj-X") + lines[1])

    reader = LogitCache(tmp_path).open_teacher(meta)
    assert reader.traj_ids() == ["traj-2"]
    assert verify(tmp_path) == (
        False, [f"{tmp_path / 'reasoning-rl' / 'index.log'}: line 1 fails its checksum; its record is lost"])


@pytest.mark.parametrize(
    "field, value", [("checkpoint_hash", "ckpt-2"), ("vocab_size", VOCAB + 1), ("tokenizer_hash", "tok-2")]
)
def test_cache_of_another_teacher_identity_is_refused(tmp_path, field, value):
    LogitCache(tmp_path).open_teacher(make_meta())
    with pytest.raises(CacheMismatchError) as raised:
        LogitCache(tmp_path).open_teacher(make_meta(**{field: value}))
    assert raised.value.field == field
    assert raised.value.differences == {field: (getattr(make_meta(), field), value)}
    assert field in str(raised.value) and repr(value) in str(raised.value)


def test_gc_removes_uncommitted_data_and_a_torn_index_line(tmp_path, monkeypatch):
    meta = make_meta("top_k", k=64)
    teacher = LogitCache(tmp_path).open_teacher(meta)
    rows, sampled = teacher_rows(16, seed=1)
    committed = encode_top_k(rows, 64, sampled)
    teacher.put("traj-committed", committed)

    def crash(self, entries):
        raise OSError("writer died before committing")

    big_rows, big_sampled = teacher_rows(8192, seed=2)
    with monkeypatch.context() as patch:
        patch.setattr(_CommitLog, "append", crash)
        with pytest.raises(OSError):
            teacher.put("traj-lost", encode_top_k(big_rows, 64, big_sampled))
    assert len(chunk_files(teacher.path, "logp")) == 3  # chunks 1 and 2 hold only uncommitted data
    with open(teacher.path / "index.log", "ab") as index:
        index.write(b"0badc0de {\"id\": \"traj-torn")
    (teacher.path / "logp" / "c" / "7.abc.partial").write_bytes(b"x" * 100)
    assert teacher.traj_ids() == ["traj-committed"]

    report = gc(tmp_path)
    freed = report["teachers"]["reasoning-rl"]
    assert freed["chunks_removed"] >= 2 and freed["bytes_freed"] > 100 and report["bytes_freed"] >= freed["bytes_freed"]
    assert [path.name for path in chunk_files(teacher.path, "logp")] == ["0"]
    assert (teacher.path / "index.log").read_bytes().endswith(b"\n")
    assert (teacher.get("traj-committed").ids == committed.ids).all()
    teacher.put("traj-after", committed)
    assert verify(tmp_path) == (True, [])


def test_inspect_reports_size_tokens_and_granularity(tmp_path, capsys):
    teacher = LogitCache(tmp_path).open_teacher(make_meta("top_p"))
    for i in range(3):
        rows, sampled = teacher_rows(10, seed=i)
        teacher.put(f"traj-{i}", encode_top_p(rows, 0.9, sampled, VOCAB))
    stats = inspect(tmp_path)["teachers"]["reasoning-rl"]
    assert (stats["records"], stats["tokens"], stats["granularity"], stats["p"]) == (3, 30, "top_p", 0.9)
    assert stats["bytes_on_disk"] > 0 and stats["bytes_per_token"] == stats["bytes_on_disk"] / 30
    assert main(["inspect", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["teachers"]["reasoning-rl"]["records"] == 3
    assert main(["inspect"]) == 2
    assert capsys.readouterr().err.startswith("usage: opd-sao cache")
    missing = tmp_path / "missing"
    assert main(["verify", str(missing)]) == 2
    not_a_cache = f"{missing} is not an opd-sao logit cache (no {missing / 'zarr.json'})"
    assert capsys.readouterr().err == f"opd-sao cache: error: {not_a_cache}\n"


def test_teacher_names_become_safe_directories_and_records_can_be_replaced(tmp_path):
    meta = make_meta("sampled", teacher="Qwen/Qwen3-8B")
    teacher = LogitCache(tmp_path).open_teacher(meta)
    teacher.put("traj-1", TeacherRecord(sampled_logp=np.array([-0.5, -2.0], np.float32)))
    teacher.put("traj-1", TeacherRecord(sampled_logp=np.array([-1.0], np.float32)))
    assert teacher.path.name == "Qwen%2FQwen3-8B"
    assert LogitCache(tmp_path).teachers() == {"Qwen/Qwen3-8B": meta}
    assert teacher.get("traj-1").sampled_logp.tolist() == [-1.0] and len(teacher) == 1
    with pytest.raises(KeyError):
        teacher.get("traj-2")


def test_get_many_reads_across_batches_in_any_order(tmp_path):
    cache, meta = big_top_k_teacher(tmp_path)
    teacher = cache.open_teacher(meta)
    for batch in range(3):
        rows = {f"t{batch}-{i}": teacher_rows(3 + i, seed=10 * batch + i) for i in range(4)}
        teacher.put_many({traj_id: encode_top_k(logits, 64, sampled) for traj_id, (logits, sampled) in rows.items()})
    wanted = ["t2-3", "t0-0", "t1-2", "t0-0", "t2-0"]
    together = teacher.get_many(wanted)
    for traj_id, record in zip(wanted, together):
        alone = teacher.get(traj_id)
        assert record.n_positions == alone.n_positions
        np.testing.assert_array_equal(record.ids, alone.ids)
        np.testing.assert_array_equal(record.logp, alone.logp)
        np.testing.assert_array_equal(record.tail_mass, alone.tail_mass)


# --- faults (issue 15): damaged metadata, a chunk replaced by a directory, a read-only cache ---

def _garbage(path: Path) -> Path:
    path.write_bytes(b"\xff\xfe{ not json")
    return path


def _delete(path: Path) -> Path:
    path.unlink()
    return path


METADATA_DAMAGE = {
    "group-zarr-json-deleted": lambda teacher: _delete(teacher / "zarr.json"),
    "logp-zarr-json-deleted": lambda teacher: _delete(teacher / "logp" / "zarr.json"),
    "index-log-deleted": lambda teacher: _delete(teacher / "index.log"),
    "garbage-in-group-zarr-json": lambda teacher: _garbage(teacher / "zarr.json"),
    "garbage-in-ids-zarr-json": lambda teacher: _garbage(teacher / "ids" / "zarr.json"),
}


@pytest.mark.parametrize("damage", list(METADATA_DAMAGE))
def test_damaged_metadata_is_reported_with_its_path_and_rebuilt(tmp_path, capsys, damage):
    """Before: a deleted group zarr.json passed verify (ok: true); the others gave "error: logp", a bare
    FileNotFoundError or a JSON/UTF-8 decode error naming no file, all with exit 2 (the usage code)."""
    meta = make_meta("top_k")
    cache = LogitCache(tmp_path)
    rows, sampled = teacher_rows(6)
    cache.open_teacher(meta).put("a", encode_top_k(rows, 16, sampled))
    damaged = METADATA_DAMAGE[damage](tmp_path / "reasoning-rl")

    ok, problems = verify(tmp_path)
    assert not ok and len(problems) == 1 and problems[0].startswith(f"{damaged}: "), problems
    assert main(["verify", str(tmp_path)]) == 1
    assert json.loads(capsys.readouterr().out) == {"ok": False, "problems": problems}
    for command in ("inspect", "gc"):
        assert main([command, str(tmp_path)]) == 1
        assert capsys.readouterr().err == f"opd-sao cache: error: damaged: {problems[0]}\n"
    with pytest.raises(CacheDamagedError, match=re.escape(str(damaged))):
        cache.open_teacher(meta)

    teacher = cache.rebuild_teacher(meta)  # what the OPD stage does before re-scoring
    assert len(teacher) == 0 and verify(tmp_path) == (True, [])
    teacher.put("a", encode_top_k(rows, 16, sampled))
    assert teacher.get("a").n_positions == 6 and not list(tmp_path.glob(".damaged-*"))


def test_gc_removes_a_chunk_replaced_by_a_directory(tmp_path):
    """Before: collect_garbage raised IsADirectoryError."""
    cache, meta = big_top_k_teacher(tmp_path)
    teacher = cache.open_teacher(meta)
    chunk = chunk_files(teacher.path, "logp")[0]
    chunk.unlink()
    chunk.mkdir()
    (chunk / "inside").write_bytes(b"x")
    assert teacher.verify() == ["traj-big"]
    report = gc(tmp_path)["teachers"]["reasoning-rl"]
    assert report["foreign_entries_removed"] == [str(chunk)] and report["corrupt_records_dropped"] == ["traj-big"]
    assert not chunk.exists() and verify(tmp_path) == (True, [])


@contextmanager
def read_only_mount(path: Path):
    """``path`` bind-mounted read-only over itself, so every write fails with EROFS. The tests run as root,
    where chmod -R a-w stops no write; a real read-only mount is what a read-only volume does."""
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", path, path], capture_output=True).returncode:
        pytest.skip("needs root to mount")
    try:
        subprocess.run(["mount", "--make-private", path], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", path], check=True)
        yield
    finally:
        subprocess.run(["umount", path], check=True)


def test_read_only_cache_is_readable_and_writes_say_so(tmp_path, capsys):
    """Before: reads worked, but `cache gc` raised EROFS on writer.lock with a traceback, as did a put (the OPD
    stage storing re-scored records)."""
    meta = make_meta("top_k")
    root = tmp_path / "cache"
    rows, sampled = teacher_rows(6)
    LogitCache(root).open_teacher(meta).put("a", encode_top_k(rows, 16, sampled))
    with read_only_mount(root):
        with pytest.raises(OSError, match="Read-only file system"):
            (root / "probe").write_bytes(b"")
        teacher = LogitCache(root).open_teacher(meta)
        assert teacher.get("a").n_positions == 6 and teacher.get_many(["a"])[0].n_positions == 6
        assert main(["verify", str(root)]) == 0 and main(["inspect", str(root)]) == 0
        capsys.readouterr()
        assert main(["gc", str(root)]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"logit cache {root / 'reasoning-rl'} is read-only" in err and "gc" in err
        with pytest.raises(CacheReadOnlyError, match=re.escape(f"{root / 'reasoning-rl'} is read-only")):
            teacher.put("b", encode_top_k(rows, 16, sampled))
        with pytest.raises(CacheReadOnlyError, match="creating the store of teacher 'other'"):
            LogitCache(root).open_teacher(make_meta("top_k", teacher="other"))


# ----------------------------------------------------------------------------
# committing beside the trainer: the in-memory record equals the stored one; batched, flushed, crash-safe
# ----------------------------------------------------------------------------

def _fields(record: TeacherRecord) -> dict:
    return {name: value for name, value in vars(record).items() if value is not None}


@pytest.mark.parametrize("granularity", ["sampled", "top_k", "top_p", "full"])
def test_quantised_record_is_what_the_cache_returns_and_stores_the_same_bytes(granularity):
    """The trainer trains on `quantised(record)` while the writer commits it: it must equal the read-back record
    bit for bit, and storing it must write exactly the bytes storing the raw record writes."""
    meta = make_meta(granularity)
    rows, sampled = teacher_rows(40, seed=3)
    record = record_from_logprobs(meta, rows, sampled)
    if granularity == "top_p":
        record = ragged_record(np.random.default_rng(0), 40)
        meta = make_meta("top_p", max_support=40)
    held = quantised(meta, record)
    streams = to_streams(meta, record)
    back = from_streams(meta, record.n_positions, streams)
    assert _fields(held).keys() == _fields(back).keys()
    for name, value in _fields(back).items():
        assert getattr(held, name).dtype == value.dtype, name
        np.testing.assert_array_equal(getattr(held, name), value, err_msg=name)
    for one, many in zip([held, quantised(meta, record)], quantised_many(meta, [held, record])):  # batched
        for name, value in _fields(one).items():
            np.testing.assert_array_equal(getattr(many, name), value, err_msg=name)
    again = to_streams(meta, held)
    assert again.keys() == streams.keys()
    for name in streams:
        np.testing.assert_array_equal(again[name], streams[name], err_msg=name)
    if granularity in ("top_k", "top_p"):  # what to_streams refuses, quantised refuses
        record.ids[[0, 1]] = record.ids[[1, 0]]
        with pytest.raises(ValueError, match="strictly ascending"):
            quantised(meta, record)


def _exact_record(n: int, k: int, seed: int) -> TeacherRecord:
    """A top_k record of whole numbers all the way: ids a fixed pattern (3, 7 and 40 in three rows of four: an id
    dictionary), logprobs exactly at sqrt(p) codes q * step, the fixed-point fields exactly at whole codes, so its
    bytes do not depend on a machine's exp and log."""
    rows = []
    for i in range(n):
        ids, j = ({3, 7, 40} if i % 4 else {7}), 0
        while len(ids) < k:
            ids.add((i * 37 + j * j * 11 + seed) % VOCAB)
            j += 1
        rows.append(sorted(ids))
    step = float(sqrt_step(np.array([k]))[0])
    q = np.array([1 + (i * 7 + seed) % 13 for i in range(n * k)], np.float64)
    return TeacherRecord(sampled_logp=-(np.arange(n) % 50 + 1).astype(np.float32) / 1024,
                         ids=np.array([x for row in rows for x in row], np.int64),
                         logp=(2 * np.log(q * step)).astype(np.float32), offsets=np.arange(n + 1) * k,
                         tail_mass=np.exp(-(np.arange(n) + 200) / 1024).astype(np.float32))


def test_the_byte_coding_is_format_2s():
    """The streams' checksums of three fixed records, as format 2's record-by-record coder (before the writer coded
    batches) wrote them: a cache written by either reads back the same, alone or coded together."""
    meta = make_meta("top_k")
    records = [_exact_record(24, 16, seed) for seed in range(3)]
    written_by_format_2 = [680123466, 3491262795, 2325778530]
    assert [checksum(to_streams(meta, record)) for record in records] == written_by_format_2
    assert [checksum(streams) for streams in to_streams_many(meta, records)] == written_by_format_2


@pytest.mark.parametrize("granularity, batch_entries", [("top_k", None), ("top_p", None), ("top_k", 300)])
def test_records_coded_together_are_the_bytes_each_gets_alone(granularity, batch_entries, monkeypatch):
    """The writer codes a step's records in one pass (`to_streams_many`; passes of at most BATCH_ENTRIES support
    entries): every stream of every record must be byte for byte what `to_streams` gives that record alone, whatever
    the records' sizes (an empty one too) and whether a record has an id dictionary; a record that does not fit is
    refused with its own error."""
    if batch_entries is not None:
        monkeypatch.setattr(encoding, "BATCH_ENTRIES", batch_entries)
    rng = np.random.default_rng(7)
    meta = make_meta(granularity) if granularity == "top_k" else make_meta("top_p", max_support=40)
    records = []
    for i, n in enumerate([5, 0, 1, 37, 12, 6, 60]):
        if granularity == "top_p":
            records.append(ragged_record(rng, n) if n else TeacherRecord(
                sampled_logp=np.zeros(0, np.float32), ids=np.zeros(0, np.int64), logp=np.zeros(0, np.float32),
                offsets=np.zeros(1, np.int64), tail_mass=np.zeros(0, np.float32)))
            continue
        rows, sampled = teacher_rows(n, seed=i)
        if i % 2:  # a few ids likely at every position: this record codes them through its dictionary
            rows = torch.log_softmax(rows + 6 * (torch.arange(VOCAB) < 5), dim=-1)
        records.append(record_from_logprobs(meta, rows, sampled))
    together = to_streams_many(meta, records)
    assert len(together) == len(records)
    for record, streams in zip(records, together):
        alone = to_streams(meta, record)
        assert streams.keys() == alone.keys()
        for name in alone:
            assert streams[name].dtype == alone[name].dtype, name
            np.testing.assert_array_equal(streams[name], alone[name], err_msg=name)
    records[3].ids[[0, 1]] = records[3].ids[[1, 0]]
    with pytest.raises(ValueError, match="strictly ascending"):
        to_streams_many(meta, records)


def _small_records(first: int, count: int) -> dict[str, TeacherRecord]:
    return {f"traj-{i}": TeacherRecord(sampled_logp=np.full(3, -(i + 1) / 8, np.float32),
                                       ids=np.tile(np.arange(4) * 5 + i % 7, 3), logp=np.full(12, -2.0, np.float32),
                                       offsets=np.arange(4) * 4, tail_mass=np.full(3, 0.5, np.float32))
            for i in range(first, first + count)}


def test_background_writer_batches_commits_and_flush_puts_everything_on_disk(tmp_path):
    meta = make_meta("top_k", k=4)
    teacher = LogitCache(tmp_path).open_teacher(meta)
    writer = BackgroundWriter(teacher, batch_records=10, max_pending=40)
    for step in range(6):  # 6 trainer steps of 3 records: 18 records, committed in batches of >= 10
        batch = _small_records(3 * step, 3)
        writer.submit(batch)
        for key in batch:  # visible at once, before or after its commit
            assert writer.get(key) is not None or key in teacher
    writer.flush()
    assert len(writer) == 0 and len(teacher) == 18
    assert 1 <= writer.commits <= 2  # not one commit per step
    fresh = LogitCache(tmp_path).open_teacher(meta)
    assert fresh.verify() == [] and fresh.get("traj-17").sampled_logp[0] == pytest.approx(-18 / 8, abs=1e-3)
    writer.submit(_small_records(100, 1))
    writer.close()
    assert "traj-100" in LogitCache(tmp_path).open_teacher(meta)
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(_small_records(200, 1))


def test_committed_records_stay_readable_from_memory_up_to_the_writers_budget(tmp_path):
    """After its commit a record is still served by the writer, the least recently used dropped first once the
    kept records pass `keep_bytes` (what is dropped the store still has); a budget of 0 keeps nothing."""
    meta = make_meta("top_k", k=4)
    records = _small_records(0, 6)
    size = sum(np.asarray(v).nbytes for v in vars(records["traj-0"]).values() if v is not None)
    writer = BackgroundWriter(LogitCache(tmp_path / "a").open_teacher(meta), batch_records=2, keep_bytes=4 * size)
    writer.submit(dict(list(records.items())[:4]))
    writer.flush()
    assert len(writer) == 0  # all committed
    assert writer.get("traj-0") is records["traj-0"]  # kept, and now the most recently used
    writer.submit(dict(list(records.items())[4:]))
    writer.flush()
    kept = [key for key in records if writer.get(key) is not None]
    assert kept == ["traj-0", "traj-3", "traj-4", "traj-5"]  # traj-1 and traj-2 were the least recently used
    assert all(key in writer.cache for key in records)
    writer.close()
    nothing = BackgroundWriter(LogitCache(tmp_path / "b").open_teacher(meta), batch_records=1, keep_bytes=0)
    nothing.submit(_small_records(0, 2))
    nothing.flush()
    assert nothing.get("traj-0") is None and "traj-0" in nothing.cache
    nothing.close()


def test_background_writer_raises_the_stores_error_to_the_trainer(tmp_path):
    meta = make_meta("top_k", k=4)
    teacher = LogitCache(tmp_path).open_teacher(meta)
    writer = BackgroundWriter(teacher, batch_records=1, max_pending=4)
    (teacher.path / "index.log").unlink()  # damaged metadata: the commit fails in the writer thread
    writer.submit(_small_records(0, 1))
    with pytest.raises(CacheDamagedError, match="index.log"):
        writer.flush()
    with pytest.raises(CacheDamagedError):
        writer.submit(_small_records(1, 1))


CRASHING_TRAINER = """
import os, sys
import numpy as np
sys.path.insert(0, "tests")
from test_logit_cache import _small_records, make_meta
from opd_sao.cache import BackgroundWriter, LogitCache
writer = BackgroundWriter(LogitCache(sys.argv[1]).open_teacher(make_meta("top_k", k=4)), batch_records=1000,
                          max_pending=4000)
writer.submit(_small_records(0, 30))
writer.flush()  # acknowledged: a resumable-state save
writer.submit(_small_records(30, 20))  # the unflushed tail
os._exit(9)  # a crash: no flush, no clean exit
"""


def test_a_crash_loses_only_the_unflushed_tail(tmp_path):
    """What was flushed is on disk and verifies; what was submitted after is simply absent (a resume finds it
    missing and re-scores it), never half there."""
    done = subprocess.run([sys.executable, "-c", CRASHING_TRAINER, str(tmp_path)], cwd=Path(__file__).parents[1])
    assert done.returncode == 9
    teacher = LogitCache(tmp_path).open_teacher(make_meta("top_k", k=4))
    assert teacher.verify() == [] and teacher.bad_index_lines() == []
    assert sorted(teacher.traj_ids(), key=lambda k: int(k.split("-")[1])) == [f"traj-{i}" for i in range(30)]
    teacher.put_many(_small_records(30, 20))  # the re-scored tail commits after the crash
    assert len(teacher) == 50 and teacher.verify() == []
