"""What a teacher cache holds: its identity (``CacheMeta``) and one trajectory's teacher outputs (``TeacherRecord``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal

import numpy as np

Granularity = Literal["sampled", "top_k", "top_p", "full"]
GRANULARITIES: tuple[str, ...] = ("sampled", "top_k", "top_p", "full")


@dataclass(frozen=True)
class CacheMeta:
    """Identity of one teacher's cache; every field must match for a cache to be reused."""

    teacher: str
    checkpoint_hash: str
    vocab_size: int
    tokenizer_hash: str
    granularity: Granularity
    k: int | None = None
    p: float | None = None
    max_support: int | None = None  # top_p: at most this many ids per position (the nucleus cap)
    # the teacher's lm-head rows when it has more than vocab_size (embedding padding past the shared tokenizer):
    # rows vocab_size.. were masked (no probability) before every softmax and top-k; None: nothing was masked
    model_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if not self.teacher:
            raise ValueError("teacher name must not be empty")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if (self.granularity == "top_k") != (self.k is not None):
            raise ValueError("k is required for granularity 'top_k' and only for it")
        if (self.granularity == "top_p") != (self.p is not None):
            raise ValueError("p is required for granularity 'top_p' and only for it")
        if (self.granularity == "top_p") != (self.max_support is not None):
            raise ValueError("max_support is required for granularity 'top_p' and only for it")
        if self.max_support is not None and not 1 <= self.max_support:
            raise ValueError(f"max_support must be >= 1, got {self.max_support}")
        if self.model_vocab_size is not None and self.model_vocab_size <= self.vocab_size:
            raise ValueError(f"model_vocab_size must exceed vocab_size {self.vocab_size} (else None), "
                             f"got {self.model_vocab_size}")
        if self.k is not None and not 1 <= self.k <= self.vocab_size:
            raise ValueError(f"k must be in [1, vocab_size], got {self.k}")
        if self.p is not None and not 0.0 < self.p <= 1.0:
            raise ValueError(f"p must be in (0, 1], got {self.p}")

    def to_attrs(self) -> dict:
        return asdict(self)

    @classmethod
    def from_attrs(cls, attrs: dict) -> "CacheMeta":
        return cls(**{f.name: attrs.get(f.name) for f in fields(cls)})  # a field newer than the cache: None


@dataclass
class TeacherRecord:
    """Teacher outputs on one trajectory's n action-token positions.

    sampled_logp: float32 [n], the teacher's logprob of the token the student sampled (every granularity).
    ids:          int64 [total], the support of each position, ascending within a position (top_k, top_p).
    logp:         float32 [total] teacher logprobs of ``ids`` (top_k, top_p), or [n, vocab] (full).
    offsets:      int64 [n + 1], position i owns ids[offsets[i]:offsets[i + 1]] (top_k, top_p).
    tail_mass:    float32 [n], 1 - the probability kept in the support (top_k, top_p).
    logp_codes:   uint8 [n, vocab] (full, instead of logp): the cache's own codes of -logp
                  (``encoding.LOGP_DEPTHS``), a quarter of the float32 bytes; what reading a full record returns.
    """

    sampled_logp: np.ndarray
    ids: np.ndarray | None = None
    logp: np.ndarray | None = None
    offsets: np.ndarray | None = None
    tail_mass: np.ndarray | None = None
    logp_codes: np.ndarray | None = None

    @property
    def n_positions(self) -> int:
        return len(self.sampled_logp)
