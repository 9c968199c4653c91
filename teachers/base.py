"""What a teacher is: a resolved spec from the config, and the `Teacher` interface its implementations follow.

A teacher is bound to the domains it teaches; the OPD stage sends each student trajectory to its domain's
teacher. Implementations are registered by kind (`TeacherConfig.kind`, default `in_process`) so a new way
to score (another runtime, a remote scorer) is one registered class; the prefetcher, the logit cache and
the OPD stage do not change. A teacher is loaded from its local-tier copy when the prefetcher says so and
dropped when evicted; a served one (`served.py`) only connects to its server, which stays up.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from pydantic import BaseModel

from opd_sao.cache import CacheMeta, TeacherRecord
from opd_sao.checkpoints import checkpoint_hash
from opd_sao.errors import UsageError
from opd_sao.registry import NoOptions, Registry, parse_options
from opd_sao.trajectory import Trajectory

TEACHER_KINDS: Registry[type["Teacher"]] = Registry("teacher kind")
register_teacher = TEACHER_KINDS.register


class TeacherIncompatibleError(UsageError):
    """A teacher does not share the student's tokenizer or vocabulary (OPD compares token ids)."""


@dataclass(frozen=True)
class TeacherSpec:
    name: str
    kind: str
    checkpoint: Path  # the source checkpoint (an earlier stage's, or an external HF directory)
    domains: tuple[str, ...]
    granularity: str
    k: Optional[int]  # top_k only
    p: Optional[float]  # top_p only
    checkpoint_hash: str
    vocab_size: int  # the scored vocabulary: the shared tokenizer's ids; lm-head rows past it are masked
    tokenizer_hash: str  # fingerprint of the vocabulary (token -> id) and special tokens
    max_support: Optional[int] = None  # top_p only: the nucleus cap
    device: Optional[str] = None  # where it scores (auto | cpu | cuda | cuda:N; None: auto); not part of the cache key
    url: Optional[str] = None  # a served teacher's server (kind sglang); not part of the cache key
    model_vocab_size: Optional[int] = None  # the teacher's lm-head rows (padding included); None: vocab_size
    options: dict[str, Any] = field(default_factory=dict)  # the config's `options:`, the kind's `Options`

    @property
    def cache_meta(self) -> CacheMeta:
        return CacheMeta(teacher=self.name, checkpoint_hash=self.checkpoint_hash, vocab_size=self.vocab_size,
                         tokenizer_hash=self.tokenizer_hash, granularity=self.granularity,  # type: ignore[arg-type]
                         k=self.k, p=self.p, max_support=self.max_support,
                         model_vocab_size=self.rows if self.rows > self.vocab_size else None)

    @property
    def rows(self) -> int:
        """The teacher's lm-head rows; those from vocab_size up are embedding padding, masked when scoring."""
        return self.model_vocab_size or self.vocab_size


class Teacher(ABC):
    """One teacher model. `load` puts it in host memory from a local directory, `unload` frees it."""

    copies_checkpoint = True  # the prefetcher copies `spec.checkpoint` to the disk tier before `load`
    Options: ClassVar[type[BaseModel]] = NoOptions  # the kind's own settings (a teacher's `options:`), validated
    # before any work (`parse_options`) and read as `self.options`. An option that changes the scores belongs in
    # `identity` too, so the logit cache does not serve records scored under another value

    @classmethod
    def parse_options(cls, teacher) -> BaseModel:
        """The config entry's (`TeacherConfig`) `options:` validated by this kind's `Options` (UsageError naming a
        bad key)."""
        return parse_options(cls.Options, teacher.options, f"teacher {teacher.name!r} (kind {teacher.kind}): options")

    @classmethod
    def identity(cls, teacher, checkpoint: Path, granularity: str) -> str:
        """The teacher's identity in the logit cache (`TeacherSpec.checkpoint_hash`), from its config entry
        (`TeacherConfig`) and resolved checkpoint; ValueError for a setting this kind cannot score.
        Default: the hash of the checkpoint's weights."""
        return checkpoint_hash(checkpoint)

    def __init__(self, spec: TeacherSpec, *, score_batch_size: int = 32, vocab_chunk: int = 8192):
        self.spec = spec
        self.score_batch_size, self.vocab_chunk = score_batch_size, vocab_chunk
        self.options = self.Options.model_validate(spec.options)  # checked with its config before any work

    @property
    def name(self) -> str:
        return self.spec.name

    @abstractmethod
    def load(self, local_dir: Path) -> None:
        """Load the weights from `local_dir` (the local-tier copy of `spec.checkpoint`) onto `spec.device`."""

    @abstractmethod
    def unload(self) -> None: ...

    @property
    @abstractmethod
    def loaded(self) -> bool: ...

    @abstractmethod
    def score(self, trajectories: list[Trajectory]) -> list[TeacherRecord]:
        """One record per trajectory over its action tokens, at `spec.granularity` (what goes into the cache)."""
