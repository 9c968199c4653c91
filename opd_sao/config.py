"""The one config schema: it mirrors the YAML, holds every default, and validates before any work starts."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Algo = Literal["sao", "grpo", "grpo_dis", "ppo", "running_mean"]
Granularity = Literal["sampled", "top_k", "top_p", "full"]
Divergence = Literal["forward_kl", "reverse_kl", "jsd"]


class ConfigError(ValueError):
    """A user mistake in a config file or override, reported as one line."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(Strict):
    """Shape of the model the project builds itself when `model.path` is `tiny`."""

    vocab_size: int = Field(384, ge=64)
    hidden_size: int = Field(64, ge=8)
    intermediate_size: int = Field(192, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    max_positions: int = Field(1024, ge=64)


class ModelConfig(Strict):
    path: str = "tiny"  # "tiny": build the embedded tiny model; otherwise a local HF-format directory
    tiny: TinyModelConfig = TinyModelConfig()


class EngineConfig(Strict):
    kind: Literal["embedded", "http"] = "embedded"
    urls: list[str] = []  # rollout servers for kind=http (SGLang native API or `opd-sao serve`)
    weights_dir: Optional[str] = None  # kind=http: where weight syncs are written; every server must read it
    max_batch: int = Field(32, ge=1)  # concurrent sequences in the continuous batch
    dtype: Literal["float32", "bfloat16"] = "float32"
    deterministic: bool = False  # score every sequence alone with the trainer's kernels (see docs)


class TrainerConfig(Strict):
    backend: Literal["torch", "deepspeed"] = "torch"
    policy_lr: float = Field(1e-4, gt=0)
    critic_lr: float = Field(5e-4, gt=0)
    critic_steps: int = Field(2, ge=1)  # K critic updates per policy update (TTUR, SPEC 2.3)
    critic_warmup_steps: int = Field(10, ge=0)
    freeze_critic_attention: bool = True
    grad_clip: float = Field(1.0, gt=0)
    adam_betas: tuple[float, float] = (0.9, 0.999)  # policy and critic AdamW (torch; DeepSpeed unless its config has an optimizer)
    weight_decay: float = Field(0.0, ge=0)
    train_batch_size: int = Field(16, ge=1)
    dtype: Literal["float32", "bfloat16"] = "float32"
    deepspeed_config: Optional[dict[str, Any]] = None
    slowdown_s: float = Field(0.0, ge=0)  # artificial delay per step, to force staleness in experiments


    @model_validator(mode="after")
    def _betas_in_range(self) -> "TrainerConfig":
        if not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"adam_betas must both be in [0, 1) (got {list(self.adam_betas)})")
        return self


class RolloutConfig(Strict):
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(16, ge=1)
    asynchronous: bool = True  # False: synchronous group batching (a step waits for the whole batch)
    group_size: Optional[int] = Field(None, ge=1)  # rollouts per prompt; default 1 (SAO) or 8 (grpo, grpo_dis)
    max_staleness: int = Field(4, ge=0)  # policy versions a trajectory may lag; older ones are dropped
    sync_every: int = Field(1, ge=1)  # policy steps between weight syncs to the engine
    max_turns: int = Field(1, ge=1)
    max_context_tokens: int = Field(512, ge=16)
    compaction: bool = False  # summarise long agent episodes and continue from the summary (opd_sao/compaction.py)
    compaction_budget: int = Field(256, ge=16)  # context tokens past which an episode compacts
    compaction_instruction: str = "\n# summary of the task and attempts so far:\n"

    @model_validator(mode="after")
    def _room_for_a_summary(self) -> "RolloutConfig":
        if self.compaction and self.compaction_budget + self.max_new_tokens >= self.max_context_tokens:
            raise ValueError(f"compaction_budget {self.compaction_budget} + max_new_tokens {self.max_new_tokens} "
                             f"must stay below max_context_tokens {self.max_context_tokens}")
        return self


class SAOConfig(Strict):
    eps_low: float = Field(0.3, ge=0, le=1)
    eps_high: float = Field(5.0, ge=0)
    alpha: float = Field(1.5, gt=0)  # length-adaptive policy lambda = 1 - 1/(alpha*l)
    gamma: float = Field(1.0, ge=0, le=1)
    ppo_clip: float = Field(0.2, gt=0)  # grpo / ppo baselines
    ppo_lambda: float = Field(0.95, ge=0, le=1)
    update_epochs: int = Field(1, ge=1)  # grpo / ppo: passes over each batch (the clip needs > 1)
    baseline_window: int = Field(128, ge=1)  # running_mean baseline


class SFTConfig(Strict):
    steps: int = Field(0, ge=0)
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(32, ge=1)


class EvalConfig(Strict):
    num_tasks: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    samples_per_task: int = Field(1, ge=1)


class GateConfig(Strict):
    enabled: bool = True
    mean_abs_diff: float = Field(1e-3, gt=0)
    p99_abs_diff: float = Field(1e-2, gt=0)
    every: int = Field(0, ge=0)  # also gate every N policy steps (0: only at start and before promotion)
    probe_size: int = Field(8, ge=1)


class TeacherConfig(Strict):
    name: str
    checkpoint: str  # a local HF directory, or the name of an earlier stage of this run
    domains: list[str] = Field(min_length=1)
    granularity: Optional[Granularity] = None  # default: the OPD stage's
    kind: str = "in_process"  # a Teacher implementation registered in teachers/ (TEACHER_KINDS)


class OPDConfig(Strict):
    teachers: list[TeacherConfig] = []
    granularity: Granularity = "top_k"
    top_k: int = Field(16, ge=1)
    top_p: float = Field(0.95, gt=0, le=1)
    divergence: Divergence = "reverse_kl"
    jsd_beta: float = Field(0.5, gt=0, lt=1)
    reward_weight: float = Field(0.0, ge=0)  # sampled mode: mix the task reward into the advantage
    max_resident: int = Field(2, ge=1)
    prefetch: bool = True
    cache_dir: Optional[str] = None  # default: <stage dir>/logit_cache
    local_dir: Optional[str] = None  # disk tier teachers are copied to before loading; default: <stage dir>/teacher_tier
    copy_bandwidth_mb_s: Optional[float] = Field(None, gt=0)  # throttle the copy (simulates slow storage; benchmarks)
    score_batch_size: int = Field(32, ge=1)  # trajectories per teacher forward pass
    vocab_chunk: int = Field(8192, ge=1)  # vocabulary columns per lm-head chunk (teacher scoring, student support)

    @model_validator(mode="after")
    def _one_teacher_per_domain(self) -> "OPDConfig":
        names, owner = set(), {}
        for teacher in self.teachers:
            if teacher.name in names:
                raise ValueError(f"teacher name {teacher.name!r} is used twice")
            names.add(teacher.name)
            for domain in teacher.domains:
                if domain in owner:
                    raise ValueError(f"domain {domain!r} has two teachers ({owner[domain]!r} and {teacher.name!r})")
                owner[domain] = teacher.name
        return self


class StageConfig(Strict):
    name: str
    kind: str  # a name registered in stages/ (reasoning, agent, chat, opd, ...)
    env: Optional[str] = None  # a name registered in stages/envs
    env_options: dict[str, Any] = {}
    domains: list[str] = []  # OPD: the domains (environments) whose prompts the student answers
    algo: Optional[Algo] = None  # default: the run's `algo`
    steps: int = Field(20, ge=0)
    init_from: str = "previous"  # "base", "previous", or an earlier stage's name
    checkpoint_every: int = Field(25, ge=1)  # policy steps between resumable state saves
    buffer_memory: int = Field(4096, ge=1)  # waiting trajectories kept in host memory; the rest spill to disk
    trainer: dict[str, Any] = {}  # overrides of the run's trainer settings for this stage
    rollout: RolloutConfig = RolloutConfig()
    sao: SAOConfig = SAOConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    gate: GateConfig = GateConfig()
    opd: OPDConfig = OPDConfig()
    options: dict[str, Any] = {}  # stage-kind specific settings, validated by the stage class


class LoggingConfig(Strict):
    wandb: bool = True  # offline unless WANDB_MODE says otherwise
    wandb_project: str = "opd-sao"
    progress: bool = True


class RunConfig(Strict):
    seed: int = 0
    torch_threads: Optional[int] = Field(1, ge=1)  # per process; tiny models run fastest single-threaded, and the
    # rollout and trainer threads each get a core. None: torch's default
    algo: Algo = "sao"
    run_dir: Optional[str] = None
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    trainer: TrainerConfig = TrainerConfig()
    logging: LoggingConfig = LoggingConfig()
    eval_domains: list[str] = []  # environments evaluated after every stage (default: every stage's env)
    stages: list[StageConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_stages(self) -> "RunConfig":
        seen: list[str] = []
        for stage in self.stages:
            if stage.name in seen:
                raise ValueError(f"stage name {stage.name!r} is used twice; stage names must be unique")
            if stage.init_from not in ("base", "previous") and stage.init_from not in seen:
                raise ValueError(
                    f"stage {stage.name!r}: init_from {stage.init_from!r} is not an earlier stage "
                    f"(use 'base', 'previous' or one of {seen})"
                )
            for teacher in stage.opd.teachers:
                if not Path(teacher.checkpoint).is_dir() and teacher.checkpoint not in seen:
                    raise ValueError(
                        f"stage {stage.name!r}: teacher {teacher.name!r} checkpoint {teacher.checkpoint!r} "
                        f"is neither a local directory nor an earlier stage ({seen})"
                    )
            taught = {d for teacher in stage.opd.teachers for d in teacher.domains}
            if stage.opd.teachers and not set(stage.domains) <= taught:
                raise ValueError(f"stage {stage.name!r}: domains {sorted(set(stage.domains) - taught)} have no teacher "
                                 f"(teachers cover {sorted(taught)})")
            trainer = TrainerConfig(**{**self.trainer.model_dump(), **stage.trainer})
            grouped = self.stage_algo(stage) in ("grpo", "grpo_dis")
            if stage.rollout.group_size is None:
                stage.rollout.group_size = 8 if grouped else 1
            if grouped and stage.rollout.group_size < 2:
                raise ValueError(f"stage {stage.name!r}: {self.stage_algo(stage)} needs rollout.group_size >= 2")
            if stage.rollout.compaction and stage.rollout.group_size > 1:
                raise ValueError(f"stage {stage.name!r}: rollout.compaction needs group_size 1 (a compacted episode "
                                 f"is several trajectories, which a group cannot compare)")
            if trainer.train_batch_size % stage.rollout.group_size:
                raise ValueError(f"stage {stage.name!r}: trainer.train_batch_size {trainer.train_batch_size} must be "
                                 f"a multiple of rollout.group_size {stage.rollout.group_size}")
            seen.append(stage.name)
        return self

    def stage_algo(self, stage: StageConfig) -> str:
        return stage.algo or self.algo

    def stage_trainer(self, stage: StageConfig) -> TrainerConfig:
        return TrainerConfig(**{**self.trainer.model_dump(), **stage.trainer})


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    got = first.get("input")
    shown = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    more = f"; and {err.error_count() - 1} more" if err.error_count() > 1 else ""
    return f"{where}: {first['msg']}{shown}{more}"


def _apply_override(data: dict, dotted: str) -> None:
    """`a.b.c=value`; list items by index or, for stages, by stage name."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} must look like key.path=value")
    key, raw = dotted.split("=", 1)
    value = yaml.safe_load(raw) if raw else ""
    node: Any = data
    parts = key.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            index = next((j for j, item in enumerate(node) if isinstance(item, dict) and item.get("name") == part), None)
            if index is None and part.lstrip("-").isdigit():
                index = int(part)
            if index is None or not -len(node) <= index < len(node):
                raise ConfigError(f"override {key!r}: no list item {part!r}")
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ConfigError(f"override {key!r}: {'.'.join(parts[:i])} is not a mapping")


def parse_config(data: dict, overrides: list[str] = ()) -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError("config must be a YAML mapping at the top level")
    for item in overrides:
        _apply_override(data, item)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {str(err).splitlines()[0]}") from None
    return parse_config(data or {}, overrides)
