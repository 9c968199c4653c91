"""The OPD stage: several teachers distilled into one student on the student's own rollouts (docs/design.md §4).

The student samples on prompts from every listed domain (`domains:`, environment names; default: the
teachers' domains), one rollout per prompt, through the same asynchronous machinery as the RL stages (`RLLoop`: a rollout worker thread keeps the engine generating while the trainer trains,
staleness bound, weight sync). Each trajectory goes to its domain's teacher; teacher outputs go through
the logit cache (`teachers.TeacherTargets`); `opd_sao.rl.distill.OPDLearner` trains on what the cache holds.

The stage finishes the job rather than a step count: every `opd.probe_every` policy steps (and at the start)
the student is exported and each domain's held-out split scored (as the pipeline scores it, with another
sampling seed, so the final evaluation's draws stay unseen), against its teacher's score with that same seed: both
on the same keyed draws (common random numbers, opd_sao.runs.evaluation), so the gap is the policies', not the
sampling's. Each domain's share of the next rollouts follows its gap to its teacher (`rl.distill.DomainSchedule`);
a domain within `opd.target` of its teacher draws only `opd.min_share` (every domain gets that floor), and the stage ends when every domain is there, or
after `steps` (the budget). The probes, shares and rollouts per domain go to summary.json (`schedule`) and
the report.

Per domain, episodes use the environment options and rollout lengths of the stage of the run that trained
on that environment, or those the domain's teacher gives (its `env_options`, `rollout`, `eval`: OPD on datasets no
earlier stage trains on; opd_sao.stages.domains.Domain); temperature and top_p are this stage's (one policy
temperature per batch). Every domain is checked for train and eval tasks before the run's first stage.

Teachers are scored in the trainer thread, one after another, with the next teacher prefetched (copied
to the local disk tier and loaded into host memory) in the background while the current one scores.
Why not a separate scoring thread: on one device scoring and training contend for the same compute, so a
third thread buys no throughput; the cache already decouples scoring from training (a separate process
can fill it ahead, and a resumed stage reuses it), and the rollout worker keeps generating meanwhile.

`summary.json` gets, per domain: the teacher's score, the student's score before and after, and the
fraction of the teacher's score the student reached (all with the same evaluation settings the pipeline
uses for its per-stage evaluation).
"""
from __future__ import annotations

import itertools
import json
import statistics
import threading
from pathlib import Path

from opd_sao.checkpoints import checkpoint_hash, weight_files
from opd_sao.config import BEST_CHECKPOINT, require_device
from opd_sao.consistency.gate import probe_episodes
from opd_sao.engines import build_engine
from opd_sao.envs import ENVIRONMENTS, sample_tasks
from opd_sao.errors import UsageError
from opd_sao.io.tracking import read_jsonl
from opd_sao.rl.distill import DISTILL_TEMPERATURE, DomainSchedule, OPDLearner
from opd_sao.rl.rollout import Episode, episodes_for
from opd_sao.runs.evaluation import evaluate_score
from opd_sao.teachers import TEACHER_KINDS, Prefetcher, TeacherSet, TeacherTargets
from opd_sao.teachers.routing import check_student, check_teacher, describe
from opd_sao.trainers import build_backend

from .base import (
    LOOP_SECTIONS,
    TRAIN_TASK_POOL,
    Stage,
    StageResult,
    check_domain_prompts,
    max_positions,
    register_stage,
)
from .domains import Domain

PROBE_SEED_OFFSET = 1  # probes sample the held-out split with seed + this: the final evaluation's samples stay unseen


@register_stage("opd")
class OPDStage(Stage):
    # rl: the learner's DIS band and reward baseline; eval: that of a domain no other stage trains on
    sections = LOOP_SECTIONS | {"domains", "opd", "eval"}
    defaults = {"rl": {"eps_low": 0.3, "eps_high": 5.0}}  # the DIS band on the student's own rollouts: the math one

    @classmethod
    def validate_in_run(cls, cfg, run) -> None:
        """Every teacher's checkpoint exists or is an earlier stage (`best`: of one domain), its device exists on
        this machine, and every domain has a teacher."""
        super().validate_in_run(cfg, run)
        seen = [s.name for s in run.stages[:run.stages.index(cfg)]]
        for teacher in cfg.opd.teachers:
            if teacher.checkpoint == BEST_CHECKPOINT:
                if not seen or len(teacher.domains) != 1:
                    raise ValueError(f"stage {cfg.name!r}: teacher {teacher.name!r} checkpoint 'best' needs an "
                                     f"earlier stage and exactly one domain (got {teacher.domains}); the best "
                                     f"checkpoint is chosen per domain")
            elif not Path(teacher.checkpoint).is_dir() and teacher.checkpoint not in seen:
                raise ValueError(f"stage {cfg.name!r}: teacher {teacher.name!r} checkpoint {teacher.checkpoint!r} "
                                 f"is neither a local directory nor an earlier stage ({seen})")
            require_device(f"stage {cfg.name!r}: teacher {teacher.name!r} device", teacher.device or run.device)
        taught = {d for teacher in cfg.opd.teachers for d in teacher.domains}
        if cfg.opd.teachers and not set(cfg.domains) <= taught:
            raise ValueError(f"stage {cfg.name!r}: domains {sorted(set(cfg.domains) - taught)} have no teacher "
                             f"(teachers cover {sorted(taught)})")

    @classmethod
    def environments(cls, cfg) -> list[tuple[str, dict]]:
        """Also each domain of a teacher with its own `env_options`."""
        return super().environments(cfg) + [(domain, teacher.env_options) for teacher in cfg.opd.teachers
                                            if teacher.env_options is not None for domain in teacher.domains]

    @classmethod
    def check_base_model(cls, cfg, run, base, tokenizer) -> None:
        """A top_k within the base model's vocabulary (every stage's model and teacher shares it); every teacher
        given as a directory shares the base model's tokenizer (so every stage's: they all start from it)."""
        vocab = json.loads((base / "config.json").read_text()).get("vocab_size")
        top_k = any((teacher.granularity or cfg.opd.granularity) == "top_k" for teacher in cfg.opd.teachers)
        if top_k and vocab and cfg.opd.top_k > vocab:
            raise UsageError(f"stage {cfg.name!r}: opd.top_k {cfg.opd.top_k} is more than the base model's "
                             f"vocabulary ({vocab} tokens)")
        external = [t for t in cfg.opd.teachers
                    if t.checkpoint != BEST_CHECKPOINT and t.checkpoint not in {s.name for s in run.stages}]
        fingerprint = check_student(base, tokenizer) if external else None
        for teacher in external:
            try:
                check_teacher(teacher.name, Path(teacher.checkpoint), base, tokenizer, fingerprint)
            except ValueError as err:
                raise UsageError(f"stage {cfg.name!r}: {err}") from None
        for name in cls.domain_names(cfg):  # each domain's prompts, with its episode settings (its teacher's first)
            domain = Domain(name, cfg, run.stages)
            check_domain_prompts(domain.env_cls, domain.options, domain.rollout, tokenizer, domain=name, base=base,
                                 seed=run.seed)

    @staticmethod
    def domain_names(cfg) -> list[str]:
        if cfg.domains:
            return list(cfg.domains)
        return list(dict.fromkeys(d for t in cfg.opd.teachers for d in t.domains))

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        names = cls.domain_names(cfg)
        if not names:
            raise UsageError(f"stage {cfg.name!r} (opd) needs `domains:` or teachers with domains")
        for name in names:  # that every domain has a teacher is checked by the config schema
            ENVIRONMENTS.get(name)
        if cfg.opd.min_share * len(names) > 1:
            raise UsageError(f"stage {cfg.name!r}: opd.min_share {cfg.opd.min_share} x {len(names)} domains is over 1")
        for teacher in cfg.opd.teachers:  # a teacher kind (a plugin's) named wrongly fails now, not after earlier stages
            if teacher.kind not in TEACHER_KINDS:
                raise UsageError(f"stage {cfg.name!r}: teacher {teacher.name!r}: {TEACHER_KINDS.unknown(teacher.kind)}")

    def run(self) -> StageResult:
        cfg, run, tok, opd = self.cfg, self.ctx.cfg, self.ctx.tokenizer, self.cfg.opd
        names = self.domain_names(cfg)
        domains = {name: Domain(name, cfg, run.stages, run.device) for name in names}
        start = self.ctx.resolve_checkpoint(cfg.init_from)
        registry = TeacherSet.from_config(opd, domains=names, resolve=self.ctx.resolve_checkpoint,
                                          student_checkpoint=start, student_tokenizer=tok, device=run.device,
                                          stage_scores=self.ctx.scores)
        trainer_cfg = run.stage_trainer(cfg)
        bandwidth = opd.copy_bandwidth_mb_s * 1e6 if opd.copy_bandwidth_mb_s else None
        prefetcher = Prefetcher(registry.build_all(), local_dir=Path(opd.local_dir or self.dir / "teacher_tier"),
                                max_resident=opd.max_resident, enabled=opd.prefetch, copy_bandwidth=bandwidth)
        engine = targets = None
        # scores keyed by the checkpoint's weights (a teacher is often the student's start: scored once), seeded
        # with the pipeline's scores of the completed stages: the same evaluation (settings, seed)
        self._evaluations = {"run": 0, "reused": 0}  # (checkpoint, domain) scores measured here, and found kept
        finished = {stage: checkpoint_hash(ckpt) for stage, ckpt in self.ctx.checkpoints.items() if weight_files(ckpt)}
        self._scores: dict[tuple[str, str, int], float] = {
            (weights, name, 0): score for stage, weights in finished.items()
            for name, score in self.ctx.scores.get(stage, {}).items() if name in domains}
        self._errors: dict[tuple[str, str, int], dict] = {  # and their standard errors ({stderr, n})
            (weights, name, 0): error for stage, weights in finished.items()
            for name, error in self.ctx.score_errors.get(stage, {}).items() if name in domains}
        try:
            targets = TeacherTargets(registry, prefetcher, Path(opd.cache_dir or self.dir / "logit_cache"))
            targets.warm_up()  # teachers copy and load in the background from here on: trainer and engine
            # loading, the consistency probe and the first rollouts all overlap with it
            attention = run.model.attn_implementation  # trainer and engine alike: the gate compares them
            backend = build_backend(trainer_cfg, start, with_critic=False, attn_implementation=attention,
                                    total_steps=cfg.steps)
            engine = build_engine(run.engine, start, tok, seed=run.seed, device=run.device,
                                  attn_implementation=attention)
            learner = OPDLearner(backend, opd, cfg.rl, targets, timer=self.ctx.timer)
            schedule = DomainSchedule(names, opd.target, opd.min_share)
            gate, resumed = self._train(domains, backend, engine, learner, trainer_cfg, schedule, registry)
            with self.timed("checkpoint"):
                checkpoint = backend.export_policy(self.dir / "checkpoint", tok)
        finally:
            if engine is not None:
                engine.close()
            prefetcher.close(remove_copies=True)  # the tier is a per-stage cache of the sources
            if targets is not None:
                targets.close()  # every record trained on is committed before the stage is recorded
        history = read_jsonl(self.dir / "metrics.jsonl")
        with self.timed("evaluation"):
            distillation = self._distillation(domains, registry, start, checkpoint)
        summary = {
            "algo": "opd", "steps": len(history), "start_checkpoint": str(start),
            "granularity": opd.granularity, "divergence": opd.divergence, "teachers": describe(registry),
            "temperatures": {"sampling": cfg.rollout.temperature, "distillation": DISTILL_TEMPERATURE},
            "train": _train_summary(history), "prefetch": {**{k: round(v, 4) if isinstance(v, float) else v
                                                              for k, v in prefetcher.stats.items()},
                                                           "enabled": opd.prefetch, "max_resident": opd.max_resident},
            "distillation": distillation, "evaluations": dict(self._evaluations), "gate": gate.summary(),
            "schedule": {**schedule.summary(), "probe_every": opd.probe_every, "budget_steps": cfg.steps},
        }
        if resumed:
            summary["resume"] = resumed
        return StageResult(checkpoint, summary, start_checkpoint=start)

    def _train(self, domains: dict[str, Domain], backend, engine, learner, trainer_cfg, schedule: DomainSchedule,
               registry):
        cfg, run, tok = self.cfg, self.ctx.cfg, self.ctx.tokenizer
        streams = {name: sample_tasks(d.factory().make_tasks("train", TRAIN_TASK_POOL, run.seed), run.seed + i)
                   for i, (name, d) in enumerate(domains.items())}
        groups = itertools.count()
        lock = threading.Lock()
        positions = max_positions(self.ctx.base_checkpoint)

        def make_episodes() -> list[Episode]:
            with lock:
                name = schedule.next_domain()
                task, group = next(streams[name]), next(groups)
            return episodes_for(domains[name].factory, task, tok, domains[name].rollout, domain=name,
                                count=cfg.rollout.group_size, group=group, max_positions=positions)

        def probe() -> list[Episode]:
            per = -(-cfg.gate.probe_size // len(domains))
            return [ep for name, d in domains.items()
                    for ep in probe_episodes(d.factory, tok, d.rollout, domain=name, n=per, seed=run.seed,
                                             max_positions=positions)]

        def stop_when(steps_done: int) -> bool:
            """Probe every domain when due (and first thing, fresh or resumed); True once every domain is done."""
            every = self.cfg.opd.probe_every
            if every and (steps_done % every == 0 or not schedule.probes):
                with self.timed("evaluation"):
                    student = backend.export_policy(self.dir / "probe_checkpoint", tok)
                    scores = {name: self._score(student, d, PROBE_SEED_OFFSET)
                              for name, d in domains.items()}
                    teachers = {name: self._score(registry.teacher_for(name).checkpoint, d, PROBE_SEED_OFFSET)
                                for name, d in domains.items()}
                schedule.update(steps_done, scores, teachers)
            return schedule.done

        return self.train(engine=engine, backend=backend, learner=learner, make_episodes=make_episodes,
                          make_probe=probe, trainer_cfg=trainer_cfg, what="opd", stop_when=stop_when)

    def _score(self, ckpt: Path, d: Domain, seed_offset: int = 0) -> float:
        """A checkpoint's held-out score on a domain, with the pipeline's evaluation settings (seed + seed_offset);
        cached per (weights, domain, seed offset): equal weights under two paths are scored once."""
        key = (checkpoint_hash(ckpt), d.name, seed_offset)
        self._evaluations["reused" if key in self._scores else "run"] += 1
        if key not in self._scores:
            score = evaluate_score(ckpt, d.factory, self.ctx.tokenizer, domain=d.name, rollout=d.eval_rollout,
                                   eval_cfg=d.eval_cfg, seed=self.ctx.cfg.seed + seed_offset,
                                   device=self.ctx.cfg.engine_device,
                                   attn_implementation=self.ctx.cfg.model.attn_implementation)
            self._scores[key], self._errors[key] = round(score.mean, 4), score.error()
        return self._scores[key]

    def _error(self, ckpt: Path, d: Domain) -> dict | None:
        """The standard error of `_score(ckpt, d)` (None for a score from a run recorded before scores had one)."""
        return self._errors.get((checkpoint_hash(ckpt), d.name, 0))

    def _distillation(self, domains: dict[str, Domain], registry, start: Path, checkpoint: Path) -> dict:
        """Per domain: teacher score, student before / after, and the share of the teacher's score reached."""
        out = {}
        for name, d in domains.items():
            spec = registry.teacher_for(name)
            teacher, before, after = self._score(spec.checkpoint, d), self._score(start, d), self._score(checkpoint, d)
            out[name] = {"teacher": spec.name, "teacher_score": teacher, "student_before": before,
                         "student_after": after,
                         "recovered": round(after / teacher, 4) if teacher > 0 else None,
                         "teacher_score_error": self._error(spec.checkpoint, d),
                         "student_before_error": self._error(start, d),
                         "student_after_error": self._error(checkpoint, d)}
        return out


def _train_summary(history: list[dict]) -> dict:
    if not history:
        return {}
    quarter = max(1, len(history) // 4)
    first, last = history[:quarter], history[-quarter:]

    def mean(key, rows):
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return round(statistics.fmean(values), 5) if values else None

    out = {"kl_first_quarter": mean("kl", first), "kl_last_quarter": mean("kl", last),
           "reward_first_quarter": mean("reward_mean", first), "reward_last_quarter": mean("reward_mean", last),
           "support_mass_mean": mean("support_mass", history),
           "nucleus_cap_hit_rate_mean": mean("nucleus_cap_hit_rate", history),
           "topk_overlap_first_quarter": mean("topk_overlap", first),
           "topk_overlap_last_quarter": mean("topk_overlap", last),
           "cache_hit_rate_mean": mean("cache_hit_rate", history),
           "prefetch_stall_s_total": round(sum(r.get("prefetch_stall_s", 0.0) for r in history), 4),
           "corrupt_rescored": sum(r.get("corrupt_rescored", 0) for r in history),
           "trainer_idle_fraction": history[-1].get("trainer_idle_fraction"),
           "samples_per_s": history[-1].get("samples_per_s")}
    for key in sorted({k for r in history for k in r if k.startswith(("kl_teacher/", "kl_domain/"))}):
        out[f"{key}_first_quarter"], out[f"{key}_last_quarter"] = mean(key, first), mean(key, last)
    return out
