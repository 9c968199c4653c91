"""The teachers of an OPD stage, from its config: resolved checkpoints, domain routing, compatibility checks.

`TeacherSet.from_config` resolves each teacher's checkpoint (an earlier stage's name through the run
context, or a local HF directory), fixes its granularity (the teacher's own or the stage's) and its cache
identity, and checks up front, before any rollout, that it shares the student's tokenizer: OPD compares token
ids, so a teacher with another vocabulary would be silently wrong, not just worse.

Embeddings padded differently are fine (Qwen2.5-7B has 152,064 rows, 1.5B 151,936, one tokenizer of 151,665
tokens): rows past the tokenizer's size are padding no text ever produces, so both sides score the shared
tokenizer's ids only: the teacher's lm head and the student's divergence rows stop at `TeacherSet.vocab_size`
(masked before every softmax and top-k), and the cache's metadata names the teacher's rows it masked.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Optional

from transformers import AutoConfig

from opd_sao.checkpoints import file_hash, load_tokenizer
from opd_sao.config import BEST_CHECKPOINT, OPDConfig
from opd_sao.errors import UsageError
from opd_sao.model.decoders import check_plain_logits
from opd_sao.teachers.base import TEACHER_KINDS, Teacher, TeacherIncompatibleError, TeacherSpec


def vocab_fingerprint(tokenizer) -> str:
    """Hash of the token -> id map and the special token ids: equal iff the two tokenizers agree on ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()[:16]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def same_tokenizer_files(a: Path, b: Path) -> bool:
    """Both directories hold byte-identical tokenizer files (so the same token ids)."""
    if not (Path(a) / "tokenizer.json").is_file():
        return False
    return all((Path(a) / name).is_file() == (Path(b) / name).is_file()
               and (not (Path(a) / name).is_file() or file_hash(Path(a) / name) == file_hash(Path(b) / name))
               for name in TOKENIZER_FILES)


def model_vocab_size(checkpoint: Path) -> int:
    """The model's embedding rows (config.json's vocab_size), padding included."""
    config = Path(checkpoint) / "config.json"
    if not config.is_file():
        raise UsageError(f"{checkpoint} is not an HF-format model directory (no config.json)")
    return int(json.loads(config.read_text())["vocab_size"])


def _tokenizer_difference(student, teacher) -> str:
    """A short, specific description of how two tokenizers differ."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if len(s_vocab) != len(t_vocab):
        return f"tokenizer sizes differ: student {len(s_vocab)}, teacher {len(t_vocab)} tokens"
    s_by_id = {i: tok for tok, i in s_vocab.items()}
    t_by_id = {i: tok for tok, i in t_vocab.items()}
    differing = [i for i in sorted(s_by_id) if s_by_id.get(i) != t_by_id.get(i)]
    if differing:
        i = differing[0]
        return (f"{len(differing)} token ids map to different tokens "
                f"(e.g. id {i}: student {s_by_id.get(i)!r}, teacher {t_by_id.get(i)!r})")
    for what in ("bos", "eos", "pad"):
        s_id, t_id = getattr(student, f"{what}_token_id"), getattr(teacher, f"{what}_token_id")
        if s_id != t_id:
            return f"{what} token ids differ: student {s_id}, teacher {t_id}"
    return "tokenizers differ"


def check_student(checkpoint: Path, tokenizer) -> str:
    """The student's tokenizer fingerprint; TeacherIncompatibleError when its embedding cannot hold its tokens."""
    rows, tokens = model_vocab_size(checkpoint), len(tokenizer)
    if rows < tokens:
        raise TeacherIncompatibleError(f"student {checkpoint}: its embedding has {rows} rows, fewer than its "
                                       f"tokenizer's {tokens} tokens")
    return vocab_fingerprint(tokenizer)


def check_teacher(name: str, checkpoint: Path, student_checkpoint: Path, student_tokenizer,
                  student_print: Optional[str] = None) -> int:
    """The teacher's embedding rows, once checked against the student: the same tokenizer (token ids and special
    tokens), and at least a row per token; padding past the tokenizer may differ. TeacherIncompatibleError
    (one line, the first difference) otherwise."""
    student_print = student_print or vocab_fingerprint(student_tokenizer)
    vocab = model_vocab_size(checkpoint)
    where = f"teacher {name!r} ({checkpoint}) cannot teach student {student_checkpoint}"
    check_plain_logits(AutoConfig.from_pretrained(checkpoint), where)
    if not same_tokenizer_files(checkpoint, student_checkpoint):  # an earlier stage of the run shares the files:
        tokenizer = load_tokenizer(checkpoint)  # no need to load a 150k-token tokenizer again (seconds each)
        if vocab_fingerprint(tokenizer) != student_print:
            raise TeacherIncompatibleError(f"{where}: {_tokenizer_difference(student_tokenizer, tokenizer)} "
                                           f"(OPD needs a shared tokenizer)")
    if vocab < len(student_tokenizer):
        raise TeacherIncompatibleError(f"{where}: the teacher's embedding has {vocab} rows, fewer than the shared "
                                       f"tokenizer's {len(student_tokenizer)} tokens")
    return vocab


def best_stage(stage_scores: dict[str, dict[str, float]], domain: str) -> tuple[str, float]:
    """(stage, score): the completed stage whose checkpoint scored highest on `domain`'s held-out set.

    `stage_scores` is stage name -> eval_after in run order (the summary's stages). Ties go to the later
    stage, the one closer to the student the OPD stage starts from.
    """
    scored = [(scores[domain], i, name) for i, (name, scores) in enumerate(stage_scores.items()) if domain in scores]
    if not scored:
        raise UsageError(f"teacher checkpoint 'best' for domain {domain!r}: no completed stage has a held-out score "
                         f"on it (stages scored: {list(stage_scores)})")
    score, _, name = max(scored)
    return name, score


class TeacherSet:
    def __init__(self, specs: list[TeacherSpec], *, score_batch_size: int = 32, vocab_chunk: int = 8192,
                 chosen: Optional[dict[str, dict]] = None):
        self.specs = {spec.name: spec for spec in specs}
        # the scored vocabulary, shared by every teacher (one tokenizer): student rows past it are masked too
        self.vocab_size = min((spec.vocab_size for spec in specs), default=0)
        self.chosen = chosen or {}  # teacher name -> {stage, domain, score}, for `checkpoint: best` teachers
        self.score_batch_size, self.vocab_chunk = score_batch_size, vocab_chunk
        self._by_domain: dict[str, str] = {}
        for spec in specs:
            for domain in spec.domains:
                if domain in self._by_domain:
                    raise UsageError(f"domain {domain!r} has two teachers ({self._by_domain[domain]!r}, {spec.name!r})")
                self._by_domain[domain] = spec.name

    @classmethod
    def from_config(cls, opd: OPDConfig, *, domains: list[str], resolve: Callable[[str], Path],
                    student_checkpoint: Path, student_tokenizer, device: Optional[str] = None,
                    stage_scores: Optional[dict[str, dict[str, float]]] = None) -> "TeacherSet":
        """Resolve and check every teacher; ValueError (TeacherIncompatibleError) with the reason otherwise.

        `device`: the run's, for teachers that name none. `stage_scores` (completed stage -> held-out score per
        domain) picks the `checkpoint: best` teachers.
        """
        if not opd.teachers:
            raise UsageError("an OPD stage needs at least one teacher (opd.teachers)")
        student_print = check_student(student_checkpoint, student_tokenizer)
        specs, chosen = [], {}
        for teacher in opd.teachers:
            TEACHER_KINDS.get(teacher.kind).parse_options(teacher)  # an unknown kind or a bad option: one line
            unused = sorted(set(teacher.domains) - set(domains))
            if unused:
                raise UsageError(f"teacher {teacher.name!r} teaches {unused}, which are not among the stage's "
                                 f"domains {domains}")
            ref = teacher.checkpoint
            if ref == BEST_CHECKPOINT:
                (domain,) = teacher.domains
                ref, score = best_stage(stage_scores or {}, domain)
                chosen[teacher.name] = {"stage": ref, "domain": domain, "score": score}
            checkpoint = Path(resolve(ref))
            vocab = check_teacher(teacher.name, checkpoint, student_checkpoint, student_tokenizer, student_print)
            granularity = teacher.granularity or opd.granularity
            identity = TEACHER_KINDS.get(teacher.kind).identity(teacher, checkpoint, granularity)
            specs.append(TeacherSpec(
                name=teacher.name, kind=teacher.kind, checkpoint=checkpoint, domains=tuple(teacher.domains),
                granularity=granularity, k=opd.top_k if granularity == "top_k" else None,
                p=opd.top_p if granularity == "top_p" else None, checkpoint_hash=identity,
                vocab_size=len(student_tokenizer), model_vocab_size=vocab, tokenizer_hash=student_print,
                max_support=opd.max_support if granularity == "top_p" else None, device=teacher.device or device,
                url=teacher.url, options=teacher.options))
        return cls(specs, score_batch_size=opd.score_batch_size, vocab_chunk=opd.vocab_chunk, chosen=chosen)

    def teacher_for(self, domain: str) -> TeacherSpec:
        if domain not in self._by_domain:
            raise KeyError(f"no teacher for domain {domain!r}; teachers cover {sorted(self._by_domain)}")
        return self.specs[self._by_domain[domain]]

    @property
    def domains(self) -> list[str]:
        return list(self._by_domain)

    def build(self, name: str, **options) -> Teacher:
        spec = self.specs[name]
        return TEACHER_KINDS.get(spec.kind)(spec, score_batch_size=self.score_batch_size,
                                            vocab_chunk=self.vocab_chunk, **options)

    def build_all(self, **options) -> dict[str, Teacher]:
        return {name: self.build(name, **options) for name in self.specs}


def describe(registry: TeacherSet, order: Optional[list[str]] = None) -> dict:
    """The summary.json view of the teachers."""
    return {name: {"checkpoint": str(spec.checkpoint), "domains": list(spec.domains), "granularity": spec.granularity,
                   "k": spec.k, "p": spec.p, "max_support": spec.max_support, "device": spec.device,
                   "checkpoint_hash": spec.checkpoint_hash, "kind": spec.kind,
                   **({"url": spec.url} if spec.url else {}), **({"options": spec.options} if spec.options else {}),
                   **({"best": registry.chosen[name]} if name in registry.chosen else {})}
            for name, spec in registry.specs.items() if order is None or name in order}
