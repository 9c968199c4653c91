"""Local logit cache: teacher logprobs on the student's rollouts, stored for OPD replay.

Writing (teacher scoring)::

    cache = LogitCache("runs/x/logit_cache")
    teacher = cache.open_teacher(CacheMeta("chat-rl", ckpt_hash, vocab_size, tok_hash, "top_k", k=64))
    teacher.put(traj.traj_id, record_from_logprobs(teacher.meta, logp_rows, sampled_ids))

Reading (trainer), from any thread or process::

    records = teacher.get_many(traj_ids)        # CorruptRecordError(traj_ids) -> invalidate, re-score, put
                                                # CacheDamagedError (metadata) -> rebuild_teacher, re-score

API:
  LogitCache(root).open_teacher(meta) -> TeacherCache    create or validate (CacheMismatchError names the field)
  LogitCache(root).teachers() -> {name: CacheMeta}, teacher_dirs(), open_dir(path), rebuild_teacher(meta)
  TeacherCache.put(traj_id, record) / get(traj_id) / get_many(traj_ids) / invalidate(traj_id)
  TeacherCache: `in`, len(), traj_ids(), n_tokens(), verify(), bad_index_lines(), collect_garbage()
  encode_top_k(logp_rows, k, sampled_ids), encode_top_p(logp_rows, p, sampled_ids, max_support),
  encode_full(logp_rows, sampled_ids), record_from_logprobs(meta, logp_rows, sampled_ids) -> TeacherRecord
  capped_nucleus_size(logp_desc, p, max_support), nucleus_cut(row_len, tail_mass, p, max_support): the top-p cap
  quantised(meta, record), quantised_many(meta, records): what the cache will return, without the byte coding
  BackgroundWriter(teacher_cache).submit(records) / get(traj_id) / flush() / close(): commits beside the trainer
  opd_sao.cache.cli: inspect(path), verify(path), gc(path), main(argv)

The byte encoding and its error bounds are documented in ``opd_sao.cache.encoding``; the storage layout and commit
protocol in ``opd_sao.cache.store``.
"""

from .encoding import quantised, quantised_many
from .errors import CacheDamagedError, CacheMismatchError, CacheReadOnlyError, CorruptRecordError
from .records import CacheMeta, TeacherRecord
from .store import LogitCache, TeacherCache
from .writer import BackgroundWriter

# The encoders run where a teacher's rows live, so `support` imports torch (~2 CPU-s): it is imported on first use
# of one of its names, and the cache's own command (`opd-sao cache inspect|verify|gc`) and a reader never pay it.
_SUPPORT = frozenset({"capped_nucleus_size", "encode_full", "encode_top_k", "encode_top_p", "nucleus_cut",
                      "record_from_logprobs"})


def __getattr__(name: str):
    if name in _SUPPORT:
        from . import support
        return getattr(support, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BackgroundWriter",
    "CacheDamagedError",
    "CacheMeta",
    "CacheMismatchError",
    "CacheReadOnlyError",
    "CorruptRecordError",
    "LogitCache",
    "TeacherCache",
    "TeacherRecord",
    "capped_nucleus_size",
    "encode_full",
    "encode_top_k",
    "encode_top_p",
    "nucleus_cut",
    "quantised",
    "quantised_many",
    "record_from_logprobs",
]
