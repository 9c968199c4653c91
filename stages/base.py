"""The stage interface, its registry, and what a stage gets from the pipeline (the run context)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

from pydantic import BaseModel

from opd_sao.config import COMMON_STAGE_FIELDS, STAGES, RunConfig, StageConfig, TrainerConfig
from opd_sao.consistency.gate import ConsistencyGate
from opd_sao.errors import UsageError
from opd_sao.io.files import inside
from opd_sao.io.progress import StageProgress
from opd_sao.io.timing import PhaseTimer
from opd_sao.io.tracking import MetricsLogger
from opd_sao.model_import import model_config
from opd_sao.registry import NoOptions, parse_options
from opd_sao.rl.buffer import TrajectoryBuffer, recover
from opd_sao.rl.loop import RLLoop
from opd_sao.rl.rollout import check_prompts
from opd_sao.runs.checkpointing import StageState, truncate_step_log
from opd_sao.supervised import discard_sft_state, run_sft, sft_resume_step

register_stage = STAGES.register  # the registry is the config's, which validates each stage through its kind

TRAIN_TASK_POOL = 100_000  # training tasks a stage draws per domain (environments sample up to this many)

# What the shared machinery reads of a stage's config beyond COMMON_STAGE_FIELDS; a kind's `sections` is the union
# of what it uses. A kind that reads `env` declares all of ENV_SECTIONS: the pipeline evaluates that domain after
# every stage with the stage's environment options, episode settings and eval settings (stages/domains.py).
ENV_SECTIONS = frozenset({"env", "env_options", "rollout", "eval"})
SFT_SECTIONS = frozenset({"sft", "checkpoint_every"})  # Stage.sft
# Stage.train (rl: the gate's DIS band)
LOOP_SECTIONS = frozenset({"steps", "checkpoint_every", "buffer_memory", "rollout", "gate", "rl"})


def max_positions(checkpoint: Path) -> Optional[int]:
    """The model's max_position_embeddings (None when its config has none): a prompt and its answer fit in it."""
    return getattr(model_config(checkpoint), "max_position_embeddings", None)


def check_domain_prompts(env_cls, options: dict, rollout, tokenizer, *, domain: str, base: Path, seed: int) -> None:
    """Before the first stage: every prompt of the domain's train pool and eval split leaves room to answer
    (rl.rollout.check_prompts, with rollout.truncation), on the environment built for its prompts alone
    (`Environment.for_prompts`: the chat env's reward model is not loaded)."""
    factory = lambda: env_cls.for_prompts(options)
    for split in ("train", "eval"):
        check_prompts(factory, factory().make_tasks(split, TRAIN_TASK_POOL, seed), tokenizer, rollout, domain=domain,
                      max_positions=max_positions(base))


@dataclass
class StageResult:
    checkpoint: Path  # the promoted HF-format checkpoint
    summary: dict[str, Any] = field(default_factory=dict)  # merged into summary.json's entry for the stage
    start_checkpoint: Optional[Path] = None  # where training began (after any warm start): eval_before's model


@dataclass
class RunContext:
    cfg: RunConfig
    run_dir: Path
    base_checkpoint: Path
    tokenizer: Any
    checkpoints: dict[str, Path] = field(default_factory=dict)  # completed stage name -> checkpoint
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # completed stage -> held-out score per domain
    score_errors: dict[str, dict[str, dict]] = field(default_factory=dict)  # and its {stderr, n} per domain
    wandb_run: Any = None
    resume: bool = False
    # the running stage's: seconds per phase (metrics.jsonl, summary.json) and its progress lines on stdout; the
    # pipeline gives every stage fresh ones
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    progress: StageProgress = field(default_factory=lambda: StageProgress("stage", enabled=False))

    def stage_dir(self, name: str) -> Path:
        path = inside(self.run_dir / "stages", name)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def resolve_checkpoint(self, ref: str, *, before: Optional[str] = None) -> Path:
        """'base', 'previous' (the last completed stage), a stage name, or a local directory."""
        if ref == "base":
            return self.base_checkpoint
        if ref == "previous":
            return list(self.checkpoints.values())[-1] if self.checkpoints else self.base_checkpoint
        if ref in self.checkpoints:
            return self.checkpoints[ref]
        if Path(ref).is_dir():
            return Path(ref)
        raise UsageError(f"checkpoint {ref!r} is not a completed stage ({list(self.checkpoints)}) or a directory")


class Stage(ABC):
    """One step of the pipeline: starts from a checkpoint, ends with a promoted checkpoint.

    What a kind knows about its config, it declares here, and the config schema asks it through the registry
    while it validates (config.py names no kind): its own settings are a pydantic model assigned to `Options` (the
    stage config's `options:`, validated with the config and read as `self.options`); `defaults` gives the settings
    of the shared sections its stages get when their config leaves them unset ({section: {field: value}}; a kind
    that declares none gets the schema's own defaults); `validate_in_run` checks its stage against the rest of the
    run. `sections` names the stage config's other fields it reads beyond COMMON_STAGE_FIELDS (`rollout`, `sft`,
    `env`, ...); one a config sets for a kind that does not read it is refused while the config validates
    (`check_sections`), not ignored, and a stage written out (a run's config.yaml) holds only these.
    """

    Options: type[BaseModel] = NoOptions
    sections: ClassVar[frozenset[str]] = frozenset()
    defaults: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, cfg: StageConfig, ctx: RunContext):
        self.cfg, self.ctx = cfg, ctx
        self.options = self.parse_options(cfg)
        self.dir = ctx.stage_dir(cfg.name)

    @abstractmethod
    def run(self) -> StageResult: ...

    @classmethod
    def parse_options(cls, cfg: StageConfig) -> BaseModel:
        return parse_options(cls.Options, cfg.options, f"stage {cfg.name!r} ({cfg.kind}): options")

    @classmethod
    def check_sections(cls, cfg: StageConfig) -> None:
        """Raise ValueError for a field outside COMMON_STAGE_FIELDS that the config sets and this kind does not read:
        it would be ignored. Called by the config schema for every stage, before it fills any default. A default value
        passes: the config.yaml of a run started before stages were written out with their own sections only holds
        every field."""
        for name in StageConfig.model_fields:
            if name in COMMON_STAGE_FIELDS or name in cls.sections or name not in cfg.model_fields_set:
                continue
            if getattr(cfg, name) != StageConfig.model_fields[name].get_default(call_default_factory=True):
                reads = ", ".join(sorted(cls.sections)) or "none beyond the common ones"
                raise ValueError(f"stage {cfg.name!r} ({cfg.kind}): `{name}:` is not read by {cfg.kind} stages "
                                 f"(their sections: {reads})")

    @staticmethod
    def domain_names(cfg: StageConfig) -> list[str]:
        """A kind that reads `domains` (a multi-domain stage): the domains it uses, each checked before any work for
        an environment with train and eval tasks (stages/domains.py)."""
        return list(cfg.domains)

    @classmethod
    def fill_defaults(cls, cfg: StageConfig) -> None:
        """The settings of `defaults` this stage's config leaves unset, set (before the schema's other checks)."""
        for section, values in cls.defaults.items():
            given = getattr(cfg, section)
            for key, value in values.items():
                if key not in given.model_fields_set:
                    setattr(given, key, value)

    @classmethod
    def validate_in_run(cls, cfg: StageConfig, run: RunConfig) -> None:
        """Raise ValueError for what this stage's config cannot be in `run` (its options; earlier stages, devices);
        called by the config schema while it validates, so a mistake is one config error line. Kinds that override
        it call super().validate_in_run(cfg, run), which validates `options:`."""
        cls.parse_options(cfg)

    @classmethod
    def environments(cls, cfg: StageConfig) -> list[tuple[str, dict]]:
        """(environment, env_options) of every environment this stage gives options for, each checked before any
        work, its data files recorded and (a tiny base model) its corpus in the tokenizer: its `env`."""
        return [(cfg.env, cfg.env_options)] if cfg.env else []

    @classmethod
    def check_base_model(cls, cfg: StageConfig, run: RunConfig, base: Path, tokenizer) -> None:
        """Raise UsageError for what this stage cannot do with the run's base model (its vocabulary, its tokenizer):
        called once the base model exists, before the first stage, rather than when this stage starts."""

    @classmethod
    def generates(cls) -> bool:
        """Whether its stages sample with their `rollout:` settings: the kinds that run the loop (Stage.train)."""
        return LOOP_SECTIONS <= cls.sections

    @classmethod
    def check(cls, cfg: StageConfig) -> None:
        """Raise ValueError for a stage config this kind cannot run with the registries as they are (environments,
        teacher kinds); called for every stage before any work. Kinds that override it call super().check(cfg)."""

    def progress(self, total: int, what: str):
        """A stepped task's progress lines (io/progress.py; `logging.progress: false` turns them off)."""
        return self.ctx.progress.task(what, total)

    def timed(self, phase: str):
        """Work counted as `phase` in the stage's timing, and named by the progress heartbeat while it runs."""
        stack = ExitStack()
        stack.enter_context(self.ctx.timer.phase(phase))
        stack.enter_context(self.ctx.progress.activity(phase))
        return stack

    def sft(self, start: Path, examples, out: Path) -> tuple[Path, dict]:
        """Supervised training on `examples` into `out`, resumable like the RL loop (opd_sao.supervised.run_sft,
        state saved every `checkpoint_every` steps). Returns (checkpoint, resume report: {} on a fresh start)."""
        from_step = sft_resume_step(self.dir) if self.ctx.resume else 0
        if not self.ctx.resume:
            discard_sft_state(self.dir)
        with self.progress(self.cfg.sft.steps, "sft") as bar, self.ctx.timer.phase("sft"):
            checkpoint = run_sft(start, out, examples, self.ctx.tokenizer, self.cfg.sft, self.ctx.cfg.seed, bar,
                                 trainer=self.ctx.cfg.stage_trainer(self.cfg), work_dir=self.dir,
                                 save_every=self.cfg.checkpoint_every, resume=self.ctx.resume,
                                 attn_implementation=self.ctx.cfg.model.attn_implementation)
        return checkpoint, ({"sft_from_step": from_step} if self.ctx.resume else {})

    def train(self, *, engine, backend, learner, make_episodes, make_probe, trainer_cfg: TrainerConfig,
              what: str, before_loop: Optional[Callable[[], None]] = None,
              stop_when: Optional[Callable[[int], bool]] = None) -> tuple[ConsistencyGate, dict]:
        """The asynchronous loop (RLLoop) for `steps` (or until `stop_when(steps done)`), resumable, gated at the
        start and before promotion.

        `before_loop` runs once on a fresh start (step 0), before the first rollout of the loop; a stage
        resumed from saved state skips it (its effect is in that state). Returns (gate, resume report). The
        step history is in metrics.jsonl, trained ids in trained.jsonl.
        """
        cfg, run, tok = self.cfg, self.ctx.cfg, self.ctx.tokenizer
        gate = ConsistencyGate(cfg.gate, stage=cfg.name, out_dir=self.dir, engine=engine, backend=backend,
                               make_probe=make_probe, eps_low=cfg.rl.eps_low, eps_high=cfg.rl.eps_high,
                               deterministic=run.engine.deterministic, pad_id=tok.pad_token_id)
        start_step, waiting, resumed = self.resume_point(backend, learner)
        if before_loop is not None and start_step == 0:
            before_loop()
        state = StageState(self.dir)

        def after_step(step: int) -> None:
            with self.timed("gate"):
                gate.after_step(step)
            if (step + 1) % cfg.checkpoint_every == 0:
                with self.timed("checkpoint"):
                    state.save(backend, step + 1, {"learner": learner.state()})

        buffer = TrajectoryBuffer(cfg.rollout.group_size, spill_dir=self.dir / "buffer", memory_budget=cfg.buffer_memory)
        with self.progress(cfg.steps, what) as bar:
            bar.update(start_step)
            loop = RLLoop(engine=engine, learner=learner, make_episodes=make_episodes, rollout=cfg.rollout,
                          train_batch_size=trainer_cfg.train_batch_size, pad_id=tok.pad_token_id,
                          logger=MetricsLogger(self.dir / "metrics.jsonl", stage=cfg.name, wandb_run=self.ctx.wandb_run),
                          trained_log=self.dir / "trained.jsonl", slowdown_s=trainer_cfg.slowdown_s, progress=bar,
                          after_step=after_step, buffer=buffer, stop_when=stop_when)
            with self.timed("gate"):
                gate.run("start", sync=loop.sync_weights)
            loop.run(cfg.steps, start_step, waiting)
            with self.timed("gate"):
                gate.run("final", sync=loop.sync_weights)  # before the checkpoint is promoted
        return gate, resumed

    def resume_point(self, backend, learner) -> tuple[int, list, dict]:
        """(start step, recovered waiting trajectories, resume report); a fresh start is step 0."""
        state, rollout = StageState(self.dir), self.cfg.rollout
        if not self.ctx.resume:
            for leftover in ("trained.jsonl", "metrics.jsonl", "buffer/buffer.jsonl", "gate.json"):
                (self.dir / leftover).unlink(missing_ok=True)
            return 0, [], {}
        step = 0
        if state.exists() or (state.path.with_name("state.old") / "loop.json").is_file():
            meta = state.load(backend)
            step = meta["step"]
            learner.restore(meta["learner"])
        trained = truncate_step_log(self.dir / "trained.jsonl", step)
        truncate_step_log(self.dir / "metrics.jsonl", step)
        trained_ids = {traj_id for record in trained for traj_id in record["traj_ids"]}
        waiting, dropped = recover(self.dir / "buffer", trained_ids, backend.policy_version, rollout.max_staleness,
                                  rollout.group_size)
        return step, waiting, {"from_step": step, "buffer_reused": len(waiting), "buffer_dropped_stale": dropped}
