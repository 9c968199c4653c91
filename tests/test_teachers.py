"""Teachers: chunked scoring vs a dense reference, the registry's checks, prefetch and LRU, targets via the cache."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from opd_sao.cache import encode_full, encode_top_k, encode_top_p
from opd_sao.cache.cli import verify
from opd_sao.cache.encoding import LOGP_HALF_STEP, dequantise_logp
from opd_sao.checkpoints import (
    build_tiny_model,
    load_causal_lm,
    load_tokenizer,
    save_checkpoint,
)
from opd_sao.config import OPDConfig
from opd_sao.model.modeling import forward_logits
from opd_sao.teachers import (
    InProcessTeacher,
    Prefetcher,
    Teacher,
    TeacherIncompatibleError,
    TeacherSet,
    TeacherTargets,
    cache_key,
    copy_checkpoint,
    register_teacher,
    score_rows,
)
from opd_sao.teachers.base import TeacherSpec
from opd_sao.teachers.routing import describe
from opd_sao.trajectory import Trajectory

# ----------------------------------------------------------------------------
# chunked scoring == dense reference
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense_case():
    torch.manual_seed(0)
    n, h, v = 29, 12, 997  # vocab not a multiple of the chunk
    hidden, weight, bias = torch.randn(n, h), torch.randn(v, h) * 0.8, torch.randn(v) * 0.1
    targets = torch.randint(0, v, (n,))
    return hidden, weight, bias, targets, torch.log_softmax(hidden @ weight.T + bias, dim=-1)


@pytest.mark.parametrize("chunk", [64, 100, 4096])
def test_top_k_matches_dense(dense_case, chunk):
    hidden, weight, bias, targets, dense = dense_case
    rec = score_rows(hidden, weight, bias, targets, granularity="top_k", k=9, vocab_chunk=chunk, row_block=7).split(
        [len(targets)])[0]
    ref = encode_top_k(dense, 9, targets)
    assert (rec.ids == ref.ids).all() and (rec.offsets == ref.offsets).all()
    np.testing.assert_allclose(rec.logp, ref.logp, atol=2e-5)
    np.testing.assert_allclose(rec.tail_mass, ref.tail_mass, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(rec.sampled_logp, dense.gather(1, targets[:, None])[:, 0].numpy(), atol=2e-5)


@pytest.mark.parametrize("cap", [8, 997])  # 8: most nuclei are larger than the cap; 997: the whole vocabulary
def test_top_p_matches_dense_ragged(dense_case, cap):
    hidden, weight, bias, targets, dense = dense_case
    rec = score_rows(hidden, weight, bias, targets, granularity="top_p", p=0.9, max_support=cap,
                     vocab_chunk=128).split([len(targets)])[0]
    ref = encode_top_p(dense, 0.9, targets, cap)
    assert (rec.offsets == ref.offsets).all() and len(set(np.diff(rec.offsets))) > 1  # ragged
    assert np.diff(rec.offsets).max() <= cap
    assert (rec.ids == ref.ids).all()
    np.testing.assert_allclose(rec.logp, ref.logp, atol=2e-5)
    np.testing.assert_allclose(rec.tail_mass, ref.tail_mass, rtol=1e-4, atol=1e-7)
    kept = np.add.reduceat(np.exp(rec.logp), rec.offsets[:-1])
    assert np.allclose(kept + rec.tail_mass, 1.0, atol=1e-5)
    full = np.diff(rec.offsets) == cap
    assert (kept[~full] >= 0.9 - 1e-5).all() and (cap == 997 or (kept[full] < 0.9).any())  # only the cap stops short


@pytest.mark.parametrize("granularity", ["top_k", "top_p"])
def test_tied_logits_give_the_dense_values(granularity):
    """Whole chunks of equal logits (repeated weight rows), ties across the candidates' threshold: the kept
    values, the tail and the sampled logprob are the dense ones (ids among equal logits may differ)."""
    torch.manual_seed(1)
    n, v = 13, 300
    weight = torch.randn(5, 8)[torch.randint(0, 5, (v,))]  # 5 distinct logits per row, each ~60 times
    hidden, targets = torch.randn(n, 8), torch.randint(0, v, (n,))
    dense = torch.log_softmax(hidden @ weight.T, dim=-1)
    rec = score_rows(hidden, weight, None, targets, granularity=granularity, k=70, p=0.5, max_support=70,
                     vocab_chunk=32).split([n])[0]
    for row in range(n):
        got = np.sort(rec.logp[rec.offsets[row]:rec.offsets[row + 1]])
        ids = rec.ids[rec.offsets[row]:rec.offsets[row + 1]]
        assert len(set(ids)) == len(got)
        np.testing.assert_allclose(rec.logp[rec.offsets[row]:rec.offsets[row + 1]], dense[row, ids].numpy(), atol=2e-5)
        want = dense[row].sort(descending=True).values[:len(got)].numpy()
        np.testing.assert_allclose(got, np.sort(want), atol=2e-5)
        np.testing.assert_allclose(rec.tail_mass[row], 1 - np.exp(got).sum(), atol=1e-5)
    np.testing.assert_allclose(rec.sampled_logp, dense.gather(1, targets[:, None])[:, 0].numpy(), atol=2e-5)


def _assert_codes_match(codes: np.ndarray, exact: np.ndarray, atol: float) -> None:
    """Full rows come as the cache's codes: each decodes to within its level's half step of the exact logprob
    (plus the scoring's float error; deeper than the last level, -48.05, reads back as it)."""
    decoded = dequantise_logp(codes)
    assert codes.shape == exact.shape
    within = np.abs(decoded - exact) <= LOGP_HALF_STEP[codes] + atol
    assert within[exact >= -48.0].all()


def test_full_and_sampled_match_dense(dense_case):
    hidden, weight, bias, targets, dense = dense_case
    full = score_rows(hidden, weight, bias, targets, granularity="full", vocab_chunk=50).split([10, 19])
    ref = encode_full(dense, targets)
    assert all(r.logp is None and r.logp_codes.dtype == np.uint8 for r in full)  # the cache's codes, no floats
    _assert_codes_match(np.concatenate([r.logp_codes for r in full]), ref.logp, atol=2e-5)
    sampled = score_rows(hidden, weight, None, targets, granularity="sampled", vocab_chunk=50).split([29])[0]
    no_bias = torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None])[:, 0]
    np.testing.assert_allclose(sampled.sampled_logp, no_bias.numpy(), atol=2e-5)
    assert sampled.ids is None and sampled.tail_mass is None


def test_tiny_tail_keeps_relative_precision():
    # one dominant logit: the tail is ~1e-20, far below float32 rounding of 1 - kept
    hidden = torch.ones(1, 1)
    weight = torch.tensor([[60.0], [10.0], [12.0], [11.0]])
    rec = score_rows(hidden, weight, None, torch.tensor([0]), granularity="top_k", k=1, vocab_chunk=2).split([1])[0]
    expected = (math_exp(10 - 60) + math_exp(12 - 60) + math_exp(11 - 60))
    assert rec.tail_mass[0] == pytest.approx(expected, rel=1e-4)


def math_exp(x):
    import math

    return math.exp(x)


# ----------------------------------------------------------------------------
# the in-process teacher on a real tiny model
# ----------------------------------------------------------------------------

def _trajectories(tokenizer, n=5, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = [tokenizer.bos_token_id] + tokenizer.encode(f"rev {i}{i + 1}{i + 2}=", add_special_tokens=False)
        length = int(rng.integers(2, 6))
        tokens = rng.integers(5, 300, size=length).tolist()
        mask = [1] * length
        if length >= 4:  # an observation span in the middle: not scored
            mask[1] = 0
        out.append(Trajectory(traj_id=f"t{i}", domain="digits_reverse", prompt_ids=prompt, token_ids=tokens,
                              action_mask=mask, rollout_logp=[0.0] * length, versions=[0] * length,
                              rewards=[0.0] * length))
    return out


def _spec(path: Path, name="t", granularity="top_k", k=8, p=None, domains=("digits_reverse",), vocab=None,
          max_support=256):
    return TeacherSpec(name=name, kind="in_process", checkpoint=Path(path), domains=tuple(domains),
                       granularity=granularity, k=k if granularity == "top_k" else None,
                       p=p if granularity == "top_p" else None, checkpoint_hash=f"hash-{name}",
                       vocab_size=vocab or 0, tokenizer_hash="tok",
                       max_support=max_support if granularity == "top_p" else None)


@pytest.mark.parametrize("granularity", ["sampled", "top_k", "top_p", "full"])
def test_in_process_teacher_scores_action_tokens(tiny_model_dir, tokenizer, granularity):
    model = load_causal_lm(tiny_model_dir)
    vocab = model.config.vocab_size
    spec = _spec(tiny_model_dir, granularity=granularity, k=8, p=0.5, vocab=vocab)
    teacher = InProcessTeacher(spec, score_batch_size=2, vocab_chunk=100)
    teacher.load(tiny_model_dir)
    trajs = _trajectories(tokenizer)
    records = teacher.score(trajs)
    for traj, rec in zip(trajs, records):
        seq = torch.tensor([traj.prompt_ids + traj.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(forward_logits(model, seq, torch.ones_like(seq))[0].float(), -1)
        p = len(traj.prompt_ids)
        rows = [p + j - 1 for j, m in enumerate(traj.action_mask) if m]
        targets = [t for t, m in zip(traj.token_ids, traj.action_mask) if m]
        dense = logp[rows]
        assert rec.n_positions == traj.num_action_tokens
        np.testing.assert_allclose(rec.sampled_logp, dense[range(len(rows)), targets].numpy(), atol=1e-4)
        if granularity == "top_k":
            assert (rec.ids == encode_top_k(dense, 8, targets).ids).all()
        if granularity == "top_p":
            assert (rec.offsets == encode_top_p(dense, 0.5, targets, 256).offsets).all()
        if granularity == "full":
            _assert_codes_match(rec.logp_codes, dense.numpy(), atol=1e-4)
    teacher.unload()
    assert not teacher.loaded


# ----------------------------------------------------------------------------
# the registry: resolution and the up-front tokenizer / vocabulary check
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def other_tokenizer_model(tmp_path_factory):
    from opd_sao.config import TinyModelConfig

    texts = [f"completely different words {i} zebra quokka" for i in range(300)]
    shape = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    return build_tiny_model(tmp_path_factory.mktemp("other") / "tiny", texts, shape, seed=1)


def _opd(teachers, **kw):
    return OPDConfig(teachers=teachers, **kw)


def test_registry_resolves_and_routes(tiny_model_dir, tokenizer):
    opd = _opd([{"name": "a", "checkpoint": "stage_a", "domains": ["d1"]},
                {"name": "b", "checkpoint": str(tiny_model_dir), "domains": ["d2"], "granularity": "top_p"}],
               granularity="top_k", top_k=4, top_p=0.8)
    resolve = {"stage_a": tiny_model_dir}.get
    reg = TeacherSet.from_config(opd, domains=["d1", "d2"], resolve=lambda r: resolve(r) or Path(r),
                                      student_checkpoint=tiny_model_dir, student_tokenizer=tokenizer)
    assert reg.teacher_for("d1").name == "a" and reg.teacher_for("d2").name == "b"
    a, b = reg.specs["a"], reg.specs["b"]
    assert (a.granularity, a.k, a.p) == ("top_k", 4, None) and (b.granularity, b.k, b.p) == ("top_p", None, 0.8)
    assert a.cache_meta.checkpoint_hash == b.cache_meta.checkpoint_hash  # same weights
    with pytest.raises(KeyError, match="no teacher for domain 'd3'"):
        reg.teacher_for("d3")


def test_registry_refuses_other_tokenizer(tiny_model_dir, tokenizer, other_tokenizer_model):
    opd = _opd([{"name": "alien", "checkpoint": str(other_tokenizer_model), "domains": ["d1"]}])
    with pytest.raises(TeacherIncompatibleError) as err:
        TeacherSet.from_config(opd, domains=["d1"], resolve=Path, student_checkpoint=tiny_model_dir,
                                    student_tokenizer=tokenizer)
    message = str(err.value)
    assert "alien" in message and "cannot teach" in message and "needs a shared tokenizer" in message
    assert ("token ids map to different tokens" in message or "sizes differ" in message)


def test_registry_refuses_unknown_kind_and_foreign_domain(tiny_model_dir, tokenizer):
    opd = _opd([{"name": "a", "checkpoint": str(tiny_model_dir), "domains": ["d1"], "kind": "telepathy"}])
    with pytest.raises(KeyError, match="unknown teacher kind 'telepathy'"):
        TeacherSet.from_config(opd, domains=["d1"], resolve=Path, student_checkpoint=tiny_model_dir,
                                    student_tokenizer=tokenizer)
    opd = _opd([{"name": "a", "checkpoint": str(tiny_model_dir), "domains": ["d1", "elsewhere"]}])
    with pytest.raises(ValueError, match="elsewhere"):
        TeacherSet.from_config(opd, domains=["d1"], resolve=Path, student_checkpoint=tiny_model_dir,
                                    student_tokenizer=tokenizer)


# ----------------------------------------------------------------------------
# prefetch: background copy + load, LRU with a residency cap, stall accounting
# ----------------------------------------------------------------------------

class SlowTeacher(Teacher):
    """Loads in `load_s` seconds and tracks how many teachers are in memory at once."""

    live = 0
    peak = 0
    lock = threading.Lock()

    def __init__(self, spec, load_s=0.0, fail=False, **kw):
        super().__init__(spec, **kw)
        self.load_s, self.fail, self._loaded = load_s, fail, False

    def load(self, local_dir):
        assert (Path(local_dir) / "config.json").is_file()  # always from the local tier
        with SlowTeacher.lock:
            SlowTeacher.live += 1
            SlowTeacher.peak = max(SlowTeacher.peak, SlowTeacher.live)
        time.sleep(self.load_s)
        if self.fail:
            with SlowTeacher.lock:
                SlowTeacher.live -= 1
            raise OSError("disk on fire")
        self._loaded = True

    def unload(self):
        if self._loaded:
            with SlowTeacher.lock:
                SlowTeacher.live -= 1
        self._loaded = False

    @property
    def loaded(self):
        return self._loaded

    def score(self, trajectories):
        return []


@pytest.fixture
def checkpoints(tmp_path):
    paths = {}
    for name in "abc":
        path = tmp_path / "src" / name
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        (path / "model.safetensors").write_bytes(bytes(200_000))
        paths[name] = path
    SlowTeacher.live = SlowTeacher.peak = 0
    return paths


def _prefetcher(checkpoints, tmp_path, *, load_s=0.0, **kw):
    teachers = {n: SlowTeacher(_spec(p, name=n), load_s=load_s) for n, p in checkpoints.items()}
    return Prefetcher(teachers, local_dir=tmp_path / "tier", **kw)


def test_lru_eviction_and_residency_cap(checkpoints, tmp_path):
    pf = _prefetcher(checkpoints, tmp_path, max_resident=2, enabled=False)
    for name in "abab":
        with pf.use(name):
            pass
    assert pf.resident() == ["a", "b"] and pf.stats["loads"] == 2 and pf.stats["hits"] == 2
    with pf.use("c"):  # evicts a, the least recently used
        assert pf.resident() == ["b", "c"]
    with pf.use("b"):
        pass
    with pf.use("a"):  # evicts c now (b was used more recently)
        pass
    assert pf.resident() == ["b", "a"] and pf.stats["evictions"] == 2 and SlowTeacher.peak == 2
    assert pf.stats["copies"] == 3 and pf.stats["disk_hits"] >= 1  # a reloads from the local tier, no copy
    pf.close()
    assert SlowTeacher.live == 0


def test_prefetch_hides_loading(checkpoints, tmp_path):
    """With prefetch on, the next teacher loads while the current one is in use, and every use is a hit. The work
    between uses lasts until the prefetched teacher is resident (as scoring outlasts a load), not a fixed time a
    busy machine might not give the loader's thread; off, each use loads on demand and waits."""
    def run(enabled):
        pf = _prefetcher(checkpoints, tmp_path / str(enabled), load_s=0.25, max_resident=2, enabled=enabled)
        order = ["a", "b", "c"]

        def work_until_loaded(name):  # the first rollouts being generated, then scoring with the current teacher
            while enabled and name not in pf.resident():
                time.sleep(0.01)

        pf.prefetch("a")
        work_until_loaded("a")
        for i, name in enumerate(order):
            with pf.use(name):
                if i + 1 < len(order):
                    pf.prefetch(order[i + 1])
                    work_until_loaded(order[i + 1])
        stats = dict(pf.stats)
        pf.close()
        return stats, SlowTeacher.peak

    off, _ = run(False)
    SlowTeacher.peak = 0
    on, peak = run(True)
    assert off["misses"] == 3 and off["stall_s"] >= 0.5  # each loaded on demand (off means never prefetched)
    assert on["misses"] == 0 and on["hits"] == 3 and peak <= 2


def test_pinned_teacher_is_never_evicted(checkpoints, tmp_path):
    pf = _prefetcher(checkpoints, tmp_path, max_resident=1, enabled=True)
    with pf.use("a"):
        pf.prefetch("b")
        time.sleep(0.2)
        assert pf.resident() == ["a"]  # b waits for a slot: a is in use
    with pf.use("b"):
        assert pf.resident() == ["b"]
    pf.close()
    assert SlowTeacher.peak == 1


def test_load_failure_is_reported(checkpoints, tmp_path):
    teachers = {"a": SlowTeacher(_spec(checkpoints["a"], name="a"), fail=True)}
    pf = Prefetcher(teachers, local_dir=tmp_path / "tier", max_resident=1, enabled=True)
    with pytest.raises(RuntimeError, match="disk on fire"):
        with pf.use("a"):
            pass
    pf.close()


def test_copy_is_throttled_and_atomic(checkpoints, tmp_path):
    t0 = time.perf_counter()
    size = copy_checkpoint(checkpoints["a"], tmp_path / "copy", bandwidth=1e6)  # 200 KB at 1 MB/s
    took = time.perf_counter() - t0
    assert size == 200_002 and took >= 0.19
    assert (tmp_path / "copy" / "model.safetensors").stat().st_size == 200_000
    assert not (tmp_path / "copy.partial").exists()


# ----------------------------------------------------------------------------
# targets through the logit cache: write, read back, reuse, re-score corrupt records
# ----------------------------------------------------------------------------

class CountingTeacher(InProcessTeacher):
    scored = 0

    def score(self, trajectories):
        CountingTeacher.scored += len(trajectories)
        return super().score(trajectories)


register_teacher("counting_test")(CountingTeacher)


def _targets(tiny_model_dir, tokenizer, cache_dir, tmp_path, granularity="top_k"):
    opd = _opd([{"name": "rev", "checkpoint": str(tiny_model_dir), "domains": ["digits_reverse"],
                 "kind": "counting_test"}], granularity=granularity, top_k=8, score_batch_size=4, vocab_chunk=128)
    reg = TeacherSet.from_config(opd, domains=["digits_reverse"], resolve=Path, student_checkpoint=tiny_model_dir,
                                      student_tokenizer=tokenizer)
    pf = Prefetcher(reg.build_all(), local_dir=tmp_path / "tier", max_resident=1)
    return TeacherTargets(reg, pf, cache_dir)


def test_targets_write_then_read_back_and_reuse(tiny_model_dir, tokenizer, tmp_path):
    CountingTeacher.scored = 0
    targets = _targets(tiny_model_dir, tokenizer, tmp_path / "cache", tmp_path)
    trajs = _trajectories(tokenizer)
    first = targets.fetch(trajs)
    assert (first.hits, first.misses) == (0, 5) and CountingTeacher.scored == 5
    targets.flush()  # the commits run beside the trainer; flushed, they are on disk
    assert all(cache_key(t) in targets.caches["rev"] for t in trajs)
    # what the trainer gets is what the cache holds (quantised), not the teacher's raw float output
    raw = targets.prefetcher.teachers["rev"]
    with targets.prefetcher.use("rev"):
        fresh = raw.score(trajs[:1])[0]
    assert (first.records[0].ids == fresh.ids).all()
    assert not np.array_equal(first.records[0].logp, fresh.logp)  # quantised by the cache
    assert np.abs(np.exp(first.records[0].logp) - np.exp(fresh.logp)).max() <= 0.03
    again = targets.fetch(list(reversed(trajs)))
    assert (again.hits, again.misses) == (5, 0) and again.hit_rate == 1.0 and CountingTeacher.scored == 6
    targets.prefetcher.close()


def test_corrupt_record_is_rescored_never_used(tiny_model_dir, tokenizer, tmp_path):
    targets = _targets(tiny_model_dir, tokenizer, tmp_path / "cache", tmp_path)
    targets.writers["rev"].keep_bytes = 0  # read back from the store, as once more than keep_bytes were committed
    trajs = _trajectories(tokenizer)
    good = targets.fetch(trajs)
    targets.flush()
    chunks = [f for f in (tmp_path / "cache" / "rev").rglob("c/*") if f.is_file()]
    assert chunks
    for chunk in chunks:  # flip bytes in every chunk file
        data = bytearray(chunk.read_bytes())
        for i in range(len(data) // 2, len(data)):
            data[i] ^= 0xFF
        chunk.write_bytes(bytes(data))
    CountingTeacher.scored = 0
    again = targets.fetch(trajs)
    assert again.corrupt_rescored == 5 and CountingTeacher.scored == 5
    for a, b in zip(good.records, again.records):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_allclose(a.logp, b.logp)
    targets.prefetcher.close()


@pytest.mark.parametrize("damage, when", [
    ("zarr.json", "start"), ("logp/zarr.json", "start"), ("index.log", "start"), ("zarr.json garbage", "start"),
    ("index.log", "mid-run"),
])
def test_damaged_teacher_store_is_rebuilt_and_rescored(tiny_model_dir, tokenizer, tmp_path, caplog, damage, when):
    """Damaged metadata met when the stage opens the cache (start) or between batches (mid-run): the teacher's
    store is rebuilt, its trajectories re-scored, one warning names the file. Before: the stage stopped
    ("No group found in store", "error: logp", a bare FileNotFoundError, a JSON decode error)."""
    targets = _targets(tiny_model_dir, tokenizer, tmp_path / "cache", tmp_path)
    targets.writers["rev"].keep_bytes = 0  # read back from the store, as once more than keep_bytes were committed
    trajs = _trajectories(tokenizer)
    good = targets.fetch(trajs)
    targets.flush()
    damaged = tmp_path / "cache" / "rev" / damage.split()[0]
    if damage.endswith("garbage"):
        damaged.write_text("{ garbage")
    else:
        damaged.unlink()
    if when == "start":
        targets.prefetcher.close()
        targets = _targets(tiny_model_dir, tokenizer, tmp_path / "cache", tmp_path)
    CountingTeacher.scored = 0
    with caplog.at_level(logging.WARNING, logger="opd_sao.teachers.targets"):
        again = targets.fetch(trajs)
    assert (again.misses, CountingTeacher.scored) == (5, 5)
    for a, b in zip(good.records, again.records):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_allclose(a.logp, b.logp)
    assert len(caplog.records) == 1 and str(damaged) in caplog.text and "rebuilding teacher 'rev'" in caplog.text
    assert verify(tmp_path / "cache") == (True, [])
    targets.prefetcher.close()


def test_cache_of_another_checkpoint_is_refused(tiny_model_dir, tokenizer, tmp_path):
    _targets(tiny_model_dir, tokenizer, tmp_path / "cache", tmp_path).prefetcher.close()
    retrained = tmp_path / "retrained"
    model = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    save_checkpoint(model, load_tokenizer(tiny_model_dir), retrained)
    with pytest.raises(ValueError, match="checkpoint_hash differs"):
        _targets(retrained, tokenizer, tmp_path / "cache", tmp_path)


def test_a_bin_checkpoint_change_invalidates_the_cache(tiny_model_dir, tokenizer, tmp_path):
    """checkpoint_hash covers PyTorch .bin weights in a sub-folder, not only top-level safetensors."""
    from opd_sao.checkpoints import checkpoint_hash

    model, bin_ckpt = load_causal_lm(tiny_model_dir), tmp_path / "bin_ckpt"
    model.config.save_pretrained(bin_ckpt)  # a PyTorch-format checkpoint (transformers 5 writes only safetensors)
    load_tokenizer(tiny_model_dir).save_pretrained(bin_ckpt)
    torch.save(model.state_dict(), bin_ckpt / "pytorch_model.bin")
    _targets(bin_ckpt, tokenizer, tmp_path / "cache", tmp_path).prefetcher.close()
    first = checkpoint_hash(bin_ckpt)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    torch.save(model.state_dict(), bin_ckpt / "pytorch_model.bin")
    assert checkpoint_hash(bin_ckpt) != first
    with pytest.raises(ValueError, match="checkpoint_hash differs"):
        _targets(bin_ckpt, tokenizer, tmp_path / "cache", tmp_path)
    nested = tmp_path / "nested"  # weights in a sub-folder count too
    (nested / "weights").mkdir(parents=True)
    (nested / "weights" / "pytorch_model.bin").write_bytes((bin_ckpt / "pytorch_model.bin").read_bytes())
    before = checkpoint_hash(nested)
    (nested / "weights" / "pytorch_model.bin").write_bytes(b"other weights")
    assert checkpoint_hash(nested) != before


def test_checkpoint_hash_reads_settled_weights_once_and_a_rewritten_checkpoint_again(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    """The evaluator, the OPD stage and the teacher registry each ask for a finished checkpoint's hash (for a 7B
    policy, ~15 GB of sha256 each time): settled files are read once; a checkpoint saved again under the same
    path is read again and hashes differently; a file changed within the last 2 s is read every time."""
    from opd_sao import checkpoints

    reads = []
    real = checkpoints.file_hash
    monkeypatch.setattr(checkpoints, "file_hash", lambda *a, **k: reads.append(a) or real(*a, **k))
    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    ckpt = checkpoints.save_checkpoint(model, tok, tmp_path / "ckpt")
    fresh = [checkpoints.checkpoint_hash(ckpt) for _ in range(2)]
    assert len(reads) == 2 and fresh[0] == fresh[1]  # just written: racy, read each time
    time.sleep(checkpoints.RACY_NS / 1e9 + 0.1)
    settled = [checkpoints.checkpoint_hash(ckpt) for _ in range(3)]
    assert len(reads) == 3 and settled == [fresh[0]] * 3
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    checkpoints.save_checkpoint(model, tok, ckpt)  # same path, same sizes, new weights
    time.sleep(checkpoints.RACY_NS / 1e9 + 0.1)
    assert checkpoints.checkpoint_hash(ckpt) != fresh[0] and len(reads) == 4


def test_a_checkpoint_without_weight_files_is_refused(tmp_path):
    from opd_sao.checkpoints import checkpoint_hash

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no weight files to hash") as err:
        checkpoint_hash(tmp_path)
    assert "\n" not in str(err.value)


def test_best_teacher_is_the_highest_scoring_completed_stage(tiny_model_dir, tokenizer, tmp_path):
    from opd_sao.teachers.routing import best_stage

    summary = {"stages": [  # a crafted summary.json: held-out scores after each stage
        {"name": "warmup", "eval_after": {"arithmetic": 0.5, "code": 0.98, "chat": 0.3}},
        {"name": "reasoning", "eval_after": {"arithmetic": 0.9, "code": 0.94, "chat": 0.3}},
        {"name": "agent", "eval_after": {"arithmetic": 0.85, "code": 0.81, "chat": 0.35}},
        {"name": "chat", "eval_after": {"arithmetic": 0.55, "code": 0.4, "chat": 0.95}},
        {"name": "extra", "eval_after": {"arithmetic": 0.9}},  # ties go to the later stage
    ]}
    scores = {s["name"]: s["eval_after"] for s in summary["stages"]}
    assert best_stage(scores, "code") == ("warmup", 0.98)
    assert best_stage(scores, "chat") == ("chat", 0.95)
    assert best_stage(scores, "arithmetic") == ("extra", 0.9)
    with pytest.raises(ValueError, match="no completed stage has a held-out score on it"):
        best_stage(scores, "digits_sort")
    dirs = {name: tmp_path / name for name in scores}
    for name, path in dirs.items():
        save_checkpoint(load_causal_lm(tiny_model_dir), tokenizer, path)
    opd = _opd([{"name": "code_teacher", "checkpoint": "best", "domains": ["code"]},
                {"name": "chat_teacher", "checkpoint": "agent", "domains": ["chat"]}])
    reg = TeacherSet.from_config(opd, domains=["code", "chat"], resolve=dirs.__getitem__, stage_scores=scores,
                                 student_checkpoint=tiny_model_dir, student_tokenizer=tokenizer)
    assert reg.teacher_for("code").checkpoint == dirs["warmup"] and reg.teacher_for("chat").checkpoint == dirs["agent"]
    described = describe(reg)
    assert described["code_teacher"]["best"] == {"stage": "warmup", "domain": "code", "score": 0.98}
    assert "best" not in described["chat_teacher"]
