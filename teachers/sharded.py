"""A teacher sharded across the run's ranks with DeepSpeed ZeRO-3 inference: in-process teachers past one device.

`deepspeed.initialize` with a ZeRO-3 config and no optimizer partitions the teacher's weights over every rank
of the launch (each holds 1/world of them); a forward gathers one layer at a time. All ranks run every
teacher call together: rank 0 announces it (`trainers.deepspeed_backend.on_every_rank`, from the trainer
thread, where OPD scores), each rank scores its contiguous share of the trajectories (the same number of
decoder forwards on every rank, a one-token stand-in where a share has run out), the lm head weight is
gathered once for the chunked scoring (`scoring.score_rows`, as the in-process teacher) and rank 0 collects
the rows. So a teacher that needs N devices' memory scores on N ranks, data parallel, with the same records
an in-process teacher writes; in one process it is a world of one.

`load` (called on the prefetcher's thread) only notes the directory: the engine is built collectively at the
first `score`, and an evicted teacher's engines are dropped at the next collective call. Cache identity: the
checkpoint's hash, as for the in-process teacher.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from opd_sao.cache import TeacherRecord
from opd_sao.checkpoints import load_causal_lm
from opd_sao.model.actions import action_hidden_states
from opd_sao.model.modeling import lm_head, vocab_rows
from opd_sao.trajectory import Trajectory

from .base import Teacher, register_teacher
from .scoring import ScoredRows, score_rows

HERE = "opd_sao.teachers.sharded"
_ENGINES: dict[str, torch.nn.Module] = {}  # this rank's partition of each built teacher, by name
_DROPPED: set[str] = set()  # rank 0: evicted teachers whose engines the next collective call frees


def _build(name: str, local_dir: str, dtype: str, drop: list[str]) -> None:
    """Every rank: the teacher as a ZeRO-3 inference engine (no optimizer), partitioned over the ranks."""
    import deepspeed

    from opd_sao.trainers.deepspeed_backend import init_distributed

    _drop(drop)
    init_distributed()
    model = load_causal_lm(local_dir, dtype).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "bf16": {"enabled": dtype == "bfloat16"}, "steps_per_print": 10**9}
    _ENGINES[name] = deepspeed.initialize(model=model, config=config)[0]


def _drop(names: list[str]) -> None:
    for name in names:
        _ENGINES.pop(name, None)


@torch.no_grad()
def _score(name: str, trajectories: list[Trajectory], granularity: str, k: Optional[int], p: Optional[float],
           max_support: Optional[int], batch_size: int, vocab_chunk: int, drop: list[str],
           vocab_size: Optional[int] = None) -> Optional[ScoredRows]:
    """Every rank: score this rank's share of `trajectories`; rank 0 returns every rank's rows, in order."""
    import deepspeed
    import torch.distributed as dist

    _drop(drop)
    engine = _ENGINES[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    per = -(-len(trajectories) // world)
    share = trajectories[rank * per:(rank + 1) * per]
    stand_in = Trajectory("stand-in", "", trajectories[0].prompt_ids[:1], trajectories[0].prompt_ids[:1], [1],
                          [0.0], [0], [0.0])
    hidden = []
    for first in range(0, per, batch_size):  # every rank runs as many forwards: ZeRO-3 gathers collectively
        chunk = share[first:first + batch_size]
        rows = action_hidden_states(engine.module, chunk or [stand_in], batch_size=batch_size)
        hidden.append(rows if chunk else rows[:0])
    weight, bias = lm_head(engine.module)
    gathered = [w for w in (weight, bias) if w is not None]
    with deepspeed.zero.GatheredParameters(gathered):
        hidden = torch.cat(hidden)
        targets = torch.tensor([tok for t in share for tok, m in zip(t.token_ids, t.action_mask) if m],
                               dtype=torch.long, device=hidden.device)
        rows = score_rows(hidden, *vocab_rows(weight, bias, vocab_size), targets, granularity=granularity, k=k, p=p,
                          max_support=max_support,
                          vocab_chunk=vocab_chunk)
    parts = [None] * world if rank == 0 else None
    dist.gather_object(rows, parts, dst=0)
    if rank != 0:
        return None
    return ScoredRows(*(None if getattr(parts[0], f) is None else torch.cat([getattr(x, f) for x in parts])
                        for f in ("sampled_logp", "ids", "logp", "row_len", "tail_mass", "logp_codes")))


@register_teacher("zero3")
class ShardedTeacher(Teacher):
    def __init__(self, spec, *, score_batch_size: int = 32, vocab_chunk: int = 8192, dtype: str = "float32"):
        super().__init__(spec, score_batch_size=score_batch_size, vocab_chunk=vocab_chunk)
        self.dtype = dtype
        self.local_dir: Optional[Path] = None
        self.built = False

    def load(self, local_dir: Path) -> None:
        self.local_dir = Path(local_dir)

    def unload(self) -> None:
        if self.built:
            _DROPPED.add(self.name)
        self.local_dir, self.built = None, False

    @property
    def loaded(self) -> bool:
        return self.local_dir is not None

    def score(self, trajectories: list[Trajectory]) -> list[TeacherRecord]:
        from opd_sao.trainers.deepspeed_backend import on_every_rank

        if self.local_dir is None:
            raise RuntimeError(f"teacher {self.name!r} is not loaded")
        if not trajectories:
            return []
        drop = sorted(_DROPPED - {self.name})
        _DROPPED.difference_update(drop)
        if not self.built:
            _DROPPED.discard(self.name)  # its earlier engine is replaced, not dropped later
            on_every_rank(f"{HERE}:_build", name=self.name, local_dir=str(self.local_dir), dtype=self.dtype,
                          drop=drop)
            self.built, drop = True, []
        spec = self.spec
        rows = on_every_rank(f"{HERE}:_score", name=self.name, trajectories=trajectories,
                             granularity=spec.granularity, k=spec.k, p=spec.p, max_support=spec.max_support,
                             batch_size=self.score_batch_size, vocab_chunk=self.vocab_chunk, drop=drop,
                             vocab_size=spec.vocab_size)  # padded rows carry no probability
        return rows.split([t.num_action_tokens for t in trajectories])
