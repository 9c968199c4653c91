"""Teachers for on-policy distillation: registry from config, in-process scoring, prefetch, cache-backed targets.

    registry = TeacherSet.from_config(stage.opd, domains=..., resolve=ctx.resolve_checkpoint,
                                           student_checkpoint=..., student_tokenizer=...)  # checks vocabularies
    prefetcher = Prefetcher(registry.build_all(), local_dir=..., max_resident=2)
    targets = TeacherTargets(registry, prefetcher, cache_dir)
    batch_targets = targets.fetch(trajectories)   # scored if missing, written to and read back from the cache

A new way to score is one file in teachers/ with a class registered by `@register_teacher("kind")`
(see `opd_sao.teachers.base.Teacher`); every module here is imported.
"""
import importlib
import pkgutil

from .base import (
    TEACHER_KINDS,
    Teacher,
    TeacherIncompatibleError,
    TeacherSpec,
    register_teacher,
)

for _module in pkgutil.iter_modules(__path__):  # every module here is imported, so a new teacher kind is one file
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
from opd_sao.teachers.routing import TeacherSet, vocab_fingerprint

from .in_process import InProcessTeacher
from .prefetch import Prefetcher, copy_checkpoint
from .scoring import ScoredRows, score_rows
from .targets import Targets, TeacherTargets, cache_key

__all__ = ["TEACHER_KINDS", "Teacher", "TeacherIncompatibleError", "TeacherSpec", "register_teacher",
           "InProcessTeacher", "Prefetcher", "copy_checkpoint", "TeacherSet", "vocab_fingerprint",
           "ScoredRows", "score_rows", "Targets", "TeacherTargets", "cache_key"]
