"""Runs a config's stages in order and writes the run directory (see README, "Run directory")."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import yaml

from opd_sao.checkpoints import build_tiny_model, check_attention, checkpoint_hash, load_tokenizer
from opd_sao.config import BEST_CHECKPOINT, RunConfig
from opd_sao.engines import check_engine
from opd_sao.errors import UsageError
from opd_sao.gguf_header import is_gguf_path
from opd_sao.io.data_fingerprint import check_data_record, write_data_record
from opd_sao.io.files import atomic_write, inside, write_json
from opd_sao.io.fingerprint import check_resume, started_stages, write_record
from opd_sao.io.lock import locked_run_dir
from opd_sao.io.model_fingerprint import check_model_record, write_model_record
from opd_sao.io.progress import StageProgress
from opd_sao.io.timing import PhaseTimer, StageCost, reset_peak_memory
from opd_sao.io.tracking import start_wandb
from opd_sao.model.decoders import check_plain_logits
from opd_sao.model_import import import_gguf, model_config
from opd_sao.runs.checkpointing import BUFFER_DIR, STATE_DIRS, discard_state, disk_use
from opd_sao.runs.evaluation import Score, evaluate_score
from opd_sao.runs.report import checkpoint_scores, forgetting, write_report


def eval_domains(cfg: RunConfig) -> dict[str, object]:
    """Every environment an RL stage trains on is a domain evaluated after every stage."""
    domains = {}
    for stage in cfg.stages:
        if stage.env and stage.env not in domains:
            domains[stage.env] = stage
    if cfg.eval_domains:  # the config schema has checked that each is some stage's env
        domains = {d: domains[d] for d in cfg.eval_domains}
    return domains


def listed_domains(stage) -> list[str]:
    """The domains a multi-domain stage (OPD, SFT) lists in its `domains` section; none for a kind without one."""
    from opd_sao.stages import STAGES

    kind = STAGES.get(stage.kind)
    return kind.domain_names(stage) if "domains" in kind.sections else []


def stage_domains(stage) -> list[str]:
    """The domains a stage trains: its `env`, or its kind's `domains` (an OPD stage's)."""
    return ([stage.env] if stage.env else []) + listed_domains(stage)


def configured_environments(cfg: RunConfig) -> list[tuple[str, str, dict]]:
    """(stage name, environment name, env_options) of every environment the config gives options for, as each
    stage's kind names them (`Stage.environments`: its `env`; an OPD stage's teachers' own `env_options` too)."""
    from opd_sao.stages import STAGES

    return [(stage.name, env, options) for stage in cfg.stages
            for env, options in STAGES.get(stage.kind).environments(stage)]


def check_before_work(cfg: RunConfig) -> None:
    """What the schema cannot check alone (it needs the registries or the disk), checked before anything is written:
    what each stage's kind needs (Stage.check; the schema checks the sections it reads), every environment's options and
    the files they name (a dataset path of the last stage fails before the first stage), that every domain of a
    multi-domain stage (OPD, SFT) resolves to an environment with train and eval tasks (stages.domains.Domain), that
    a stage with a critic trains its policy at all (steps > critic_warmup_steps), the model path, and an http
    engine's fleet (every URL answers, every router has workers). Teachers are checked once the base model exists
    (`Stage.check_base_model`); their kinds and `options:` now."""
    from opd_sao.envs import ENVIRONMENTS
    from opd_sao.stages import STAGES
    from opd_sao.stages.domains import Domain
    from opd_sao.teachers import TEACHER_KINDS

    for stage in cfg.stages:
        STAGES.get(stage.kind).check(stage)
    for teacher in (teacher for stage in cfg.stages for teacher in stage.opd.teachers):
        TEACHER_KINDS.get(teacher.kind).parse_options(teacher)
    for stage_name, env, options in configured_environments(cfg):
        try:
            ENVIRONMENTS.get(env).check_options(options)
        except (KeyError, ValueError) as err:
            raise UsageError(f"stage {stage_name!r}: env_options of {env!r}: {err.args[0]}") from None
    for stage in cfg.stages:
        for name in listed_domains(stage):
            try:
                Domain(name, stage, cfg.stages).check(cfg.seed)
            except (KeyError, ValueError) as err:
                raise UsageError(f"stage {stage.name!r}: domain {name!r}: {err.args[0]}") from None
    if cfg.model.path != "tiny" and not is_gguf_path(cfg.model.path) \
            and not (Path(cfg.model.path) / "config.json").is_file():
        raise UsageError(f"model.path {cfg.model.path!r} is not an HF-format model directory (no config.json) "
                         "nor a .gguf file")
    if cfg.model.path != "tiny":  # a GGUF file's config is read from its metadata (a file that is not GGUF stops here)
        check_plain_logits(model_config(cfg.model.path), f"model.path {cfg.model.path!r}")
    check_attention(cfg.model.attn_implementation)  # flash_attention_2 without CUDA or flash_attn
    check_critic_warmup(cfg)
    # a rollout fleet that cannot take weights (or sample at a stage's top_p) fails now, not after an SFT warm start
    check_engine(cfg.engine, nucleus=any(stage.rollout.top_p < 1 for stage in cfg.stages), model_path=cfg.model.path)


def check_critic_warmup(cfg: RunConfig) -> None:
    """A stage that trains with a critic (a kind reading `algo`, an algorithm whose estimator reads values) and whose
    `steps` are all critic warm-up would end with its start policy unchanged: refused, not run."""
    from opd_sao.algorithms import resolve_algorithm
    from opd_sao.stages import STAGES

    for stage in cfg.stages:
        warmup = cfg.stage_trainer(stage).critic_warmup_steps
        if "algo" in STAGES.get(stage.kind).sections and 0 < stage.steps <= warmup \
                and resolve_algorithm(cfg.stage_algo(stage), stage.rl).critic:
            raise UsageError(f"stage {stage.name!r}: steps {stage.steps} <= trainer.critic_warmup_steps {warmup}: "
                             f"the policy would never be trained (only the critic warms up); raise steps or lower "
                             f"critic_warmup_steps")


def stage_data_files(cfg: RunConfig) -> dict[str, list[str]]:
    """Stage name -> the data files its environment reads (`Environment.data_files`), for the data record."""
    from opd_sao.envs import ENVIRONMENTS

    found: dict[str, list[str]] = {}
    for stage_name, env, options in configured_environments(cfg):
        files = ENVIRONMENTS.get(env).data_files(options)
        if files:
            found[stage_name] = sorted({*found.get(stage_name, []), *files})
    return found


def create_run_dir(run_dir: Path) -> set[str] | None:
    """Make the run directory; returns the names it already held (None when it is new), so that a run that fails
    before any stage output can remove exactly what it made."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"run directory {str(run_dir)!r} is a file, not a directory")
    existing = set(os.listdir(run_dir)) if run_dir.is_dir() else None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create run directory {str(run_dir)!r}: {err.strerror}") from None
    return existing


def remove_if_no_stage_output(run_dir: Path, existing: set[str] | None) -> None:
    """After a failed fresh run: remove what it created, unless a stage has already written a file."""
    stages = run_dir / "stages"
    if stages.is_dir() and any(path.is_file() for path in stages.rglob("*")):
        return
    if existing is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for name in set(os.listdir(run_dir)) - existing:
        path = run_dir / name
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def given_model(cfg: RunConfig) -> Path | None:
    """model.path when it is a model directory the run reads as is; None when the run builds its base model (tiny)
    or converts it (a .gguf file) once into its own base_model/."""
    return None if cfg.model.path == "tiny" or is_gguf_path(cfg.model.path) else Path(cfg.model.path)


def given_teachers(cfg: RunConfig) -> dict[str, Path]:
    """Every OPD teacher given as a checkpoint directory (not an earlier stage's checkpoint), by its name in an
    error: what the model record holds beside the base model."""
    stages = {stage.name for stage in cfg.stages}
    return {f"stage {stage.name!r}: teacher {teacher.name!r}": Path(teacher.checkpoint) for stage in cfg.stages
            for teacher in stage.opd.teachers if teacher.checkpoint != BEST_CHECKPOINT and teacher.checkpoint not in stages}


def ensure_base_model(cfg: RunConfig, run_dir: Path) -> Path:
    """The model directory every stage starts from: model.path itself, or built (tiny) or converted (a .gguf file)
    once into the run's base_model/, which a resumed run reuses."""
    if is_gguf_path(cfg.model.path):
        base = run_dir / "base_model"
        return base if (base / "config.json").is_file() else import_gguf(cfg.model.path, base)
    if cfg.model.path != "tiny":  # check_before_work has checked it is a model directory
        return Path(cfg.model.path)
    from opd_sao.envs import ENVIRONMENTS

    texts = []
    for name in ENVIRONMENTS.names():  # every domain, so later stages' text tokenizes well too
        texts.extend(ENVIRONMENTS.get(name)().corpus())
    for _, env, options in configured_environments(cfg):  # and every configured domain whose texts come from its
        env_cls = ENVIRONMENTS.get(env)  # options (a data file)
        if env_cls.corpus_from_options:
            texts.extend(env_cls(**options).corpus())
    return build_tiny_model(run_dir / "base_model", texts, cfg.model.tiny, cfg.seed)


class Evaluator:
    """Scores checkpoints on every domain, remembering results so a checkpoint is scored once.

    With `run_dir`, each (checkpoint, domain) score is also kept in its `evaluations.json` as soon as it is
    measured, keyed by the checkpoint's weights (`checkpoint_hash`), the domain and every setting that decides the
    score (seed, eval and rollout settings, environment options): a run stopped during a stage's evaluation
    (evaluation dominates a real model's run: docs/benchmarks.md) resumes with the domains already scored."""

    RECORD = "evaluations.json"

    def __init__(self, cfg: RunConfig, tokenizer, base: Path | None = None, run_dir: Path | None = None):
        """`base`: the run's base model, left unscored (no domain) unless `cfg.eval_start`."""
        from opd_sao.stages.domains import Domain

        self.cfg, self.tokenizer = cfg, tokenizer
        self.domains = {name: Domain(name, None, cfg.stages, cfg.device) for name in eval_domains(cfg)}
        self._seen: dict[str, dict[str, Score]] = {}
        self._record = Path(run_dir) / self.RECORD if run_dir is not None else None
        self._kept: dict[str, dict] = json.loads(self._record.read_text()) if self._record and \
            self._record.is_file() else {}
        # the base model is left unscored unless eval_start
        self._unscored = {str(Path(base).resolve())} if base is not None and not cfg.eval_start else set()

    def _settings(self, name: str) -> str:
        """What decides a domain's score besides the weights, as a short digest."""
        d = self.domains[name]
        settings = {"seed": self.cfg.seed, "eval": d.eval_cfg.model_dump(mode="json"),
                    "rollout": d.eval_rollout.model_dump(mode="json"), "env_options": d.options}
        return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def _score(self, checkpoint: Path, weights: str | None, name: str) -> Score:
        key = f"{weights}/{name}/{self._settings(name)}" if weights else None
        if key in self._kept:
            return Score(**self._kept[key])
        d = self.domains[name]
        score = evaluate_score(checkpoint, d.factory, self.tokenizer, domain=name, rollout=d.eval_rollout,
                               eval_cfg=d.eval_cfg, seed=self.cfg.seed, device=self.cfg.engine_device,
                               attn_implementation=self.cfg.model.attn_implementation)
        if key is not None:
            self._kept[key] = {"mean": score.mean, "stderr": score.stderr, "n": score.n}
            write_json(self._record, self._kept)
        return score

    def scores(self, checkpoint: Path, names: Iterable[str] | None = None) -> dict[str, Score]:
        """The checkpoint's score on each of `names` (default: every eval domain; names that are no eval domain are
        left out), each measured once."""
        key = str(Path(checkpoint).resolve())
        if key in self._unscored:
            return {}
        asked = None if names is None else set(names)
        wanted = [name for name in self.domains if asked is None or name in asked]
        seen = self._seen.setdefault(key, {})
        missing = [name for name in wanted if name not in seen]
        if missing:
            weights = checkpoint_hash(checkpoint) if self._record is not None else None
            seen.update({name: self._score(checkpoint, weights, name) for name in missing})
        return {name: seen[name] for name in wanted}

    def __call__(self, checkpoint: Path, names: Iterable[str] | None = None) -> dict[str, float]:
        """Every domain's score (of `names`, as scores()), rounded to 4 places."""
        return {name: round(score.mean, 4) for name, score in self.scores(checkpoint, names).items()}

    def errors(self, checkpoint: Path, names: Iterable[str] | None = None) -> dict[str, dict]:
        """Every domain's standard error and task count ({"stderr", "n"})."""
        return {name: score.error() for name, score in self.scores(checkpoint, names).items()}


def run_pipeline(cfg: RunConfig, run_dir: Path, *, log=print, resume: bool = False,
                 allow_config_change: bool = False) -> dict:
    """Run every stage in order; with `resume`, skip completed stages and continue the interrupted one.

    Everything checkable is checked before the run directory is written; a fresh run that fails before any stage
    has written a file leaves nothing behind. A resume refuses a config that differs from the one the run started
    with (io/fingerprint.py); `allow_config_change` lets through changes that cannot change what is trained.
    """
    from opd_sao.stages import discover

    discover()
    run_dir = Path(run_dir)
    config = cfg.model_dump(mode="json")
    if resume:  # an edited config is named as such, before what the edit may have broken
        with locked_run_dir(run_dir):
            allowed = check_resume(config, run_dir, allow_change=allow_config_change)
            check_before_work(cfg)
            files = stage_data_files(cfg)  # a stage not started yet may read other data, as its settings may change
            check_data_record({s: f for s, f in files.items() if s in started_stages(run_dir)}, run_dir)
            write_data_record(files, run_dir)
            check_model_record(given_model(cfg), run_dir, given_teachers(cfg))
            if allowed:
                log(f"resuming with changed {', '.join(allowed)} (settings of stages not started yet, or allowed "
                    f"by --allow-config-change)")
            return _run_stages(cfg, run_dir, log, resume=True)
    check_before_work(cfg)
    for line in cfg.tiny_defaults_left():
        log(f"warning: {line}")
    existing = create_run_dir(run_dir)
    with locked_run_dir(run_dir):  # refused: nothing is removed, the directory is the other run's
        try:
            atomic_write(run_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))
            write_record(config, run_dir)
            write_data_record(stage_data_files(cfg), run_dir)
            write_model_record(given_model(cfg), run_dir, given_teachers(cfg))
            return _run_stages(cfg, run_dir, log, resume=False)
        except BaseException:
            remove_if_no_stage_output(run_dir, existing)
            raise


def _keep_scores(ctx, stages: list[dict]) -> None:
    """Each finished stage's checkpoint's scores for later stages (an OPD teacher's `best`): its own, and where it
    left a domain unscored (eval_scope: reached), the next stage's `before` on it."""
    for i, entry in enumerate(stages):
        ctx.scores[entry["name"]] = checkpoint_scores(stages, i)
        ctx.score_errors[entry["name"]] = checkpoint_scores(stages, i, "eval_after_error")


def _run_stages(cfg: RunConfig, run_dir: Path, log, *, resume: bool) -> dict:
    from opd_sao.stages import STAGES, RunContext

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    base = ensure_base_model(cfg, run_dir)
    tokenizer = load_tokenizer(base)
    for stage_cfg in cfg.stages:  # what a stage cannot do with this base model (an OPD top_k, a teacher's tokenizer)
        STAGES.get(stage_cfg.kind).check_base_model(stage_cfg, cfg, base, tokenizer)
    wandb_run = start_wandb(cfg.logging.wandb_project, run_dir, cfg.model_dump(mode="json"), cfg.logging.wandb)
    ctx = RunContext(cfg=cfg, run_dir=run_dir, base_checkpoint=base, tokenizer=tokenizer, wandb_run=wandb_run,
                     resume=resume)
    evaluator = Evaluator(cfg, tokenizer, base, run_dir)
    summary = {"run_dir": str(run_dir), "base_model": str(base), "stages": []}
    if resume and (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
        for entry in summary["stages"]:
            ctx.checkpoints[entry["name"]] = Path(entry["checkpoint"])
        _keep_scores(ctx, summary["stages"])
    done = set(ctx.checkpoints)
    reached: set[str] = set()  # the domains of the stages so far (eval_scope: reached)
    try:
        for stage_cfg in cfg.stages:
            if stage_cfg.name in done:
                reached.update(stage_domains(stage_cfg))
                log(f"[{stage_cfg.name}] already complete, skipped")
                continue
            log(f"[{stage_cfg.name}] {stage_cfg.kind} stage starting")
            if cfg.checkpointing.keep_state == "last":  # a stage starts: every finished stage's state goes
                for finished in ctx.checkpoints:
                    discard_state(inside(run_dir / "stages", finished), STATE_DIRS)
            ctx.timer = PhaseTimer()
            ctx.progress = StageProgress(stage_cfg.name, enabled=cfg.logging.progress,
                                         every=cfg.logging.progress_every, interval_s=cfg.logging.progress_interval_s)
            reset_peak_memory()
            cost = StageCost(inside(run_dir / "costs", f"{stage_cfg.name}.json"), ctx.timer)
            try:
                with ctx.progress.activity(f"{stage_cfg.kind} stage"):  # the heartbeat's line while nothing
                    # finer runs (loading models, building the engine, a teacher's first load)
                    result = STAGES.get(stage_cfg.kind)(stage_cfg, ctx).run()
                start = result.start_checkpoint or ctx.resolve_checkpoint(stage_cfg.init_from)
                reached.update(stage_domains(stage_cfg))
                names = None if cfg.eval_scope == "all" else reached
                with ctx.timer.phase("evaluation"), ctx.progress.activity("evaluation"):
                    scored = {"eval_before": evaluator(start, names), "eval_after": evaluator(result.checkpoint, names),
                              "eval_before_error": evaluator.errors(start, names),
                              "eval_after_error": evaluator.errors(result.checkpoint, names)}
            finally:
                ctx.progress.close()
                spent = cost.close()
            entry = {
                "name": stage_cfg.name,
                "kind": stage_cfg.kind,
                **scored,
                "checkpoint": str(result.checkpoint),
                **result.summary,
                **spent,  # every process's that worked on the stage (a resumed stage's earlier ones too)
            }
            ctx.checkpoints[stage_cfg.name] = result.checkpoint
            write_json(ctx.stage_dir(stage_cfg.name) / "summary.json", entry)
            summary["stages"].append(entry)
            _keep_scores(ctx, summary["stages"])
            write_json(run_dir / "summary.json", summary)
            keep = cfg.checkpointing.keep_state
            if keep != "all":  # finished and recorded: no resume reads it again (last: state/ goes later)
                discard_state(ctx.stage_dir(stage_cfg.name), (BUFFER_DIR,) if keep == "last" else STATE_DIRS)
            log(f"[{stage_cfg.name}] done in {entry['wall_s']}s: eval before {entry['eval_before']} "
                f"after {entry['eval_after']}")
    finally:
        if wandb_run is not None:
            wandb_run.finish()
    summary["forgetting"] = forgetting(summary)
    summary["disk_bytes"] = {"total": disk_use(run_dir), "base_model": disk_use(run_dir / "base_model"),
                             **{s.name: disk_use(run_dir / "stages" / s.name) for s in cfg.stages}}
    write_json(run_dir / "summary.json", summary)
    summary["report"] = str(write_report(run_dir))
    return summary
