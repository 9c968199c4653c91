"""The stage interface, its registry, and what a stage gets from the pipeline (the run context)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from opd_sao.buffer import recover
from opd_sao.checkpointing import StageState, truncate_step_log
from opd_sao.config import RunConfig, StageConfig
from opd_sao.registry import Registry

STAGES: Registry[type["Stage"]] = Registry("stage kind")
register_stage = STAGES.register


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
    wandb_run: Any = None
    resume: bool = False

    def stage_dir(self, name: str) -> Path:
        path = self.run_dir / "stages" / name
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
        raise ValueError(f"checkpoint {ref!r} is not a completed stage ({list(self.checkpoints)}) or a directory")


class Stage(ABC):
    """One step of the pipeline: starts from a checkpoint, ends with a promoted checkpoint."""

    def __init__(self, cfg: StageConfig, ctx: RunContext):
        self.cfg, self.ctx = cfg, ctx
        self.dir = ctx.stage_dir(cfg.name)

    @abstractmethod
    def run(self) -> StageResult: ...

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
        waiting, dropped = recover(self.dir / "buffer", trained_ids, backend.policy_version, rollout.max_staleness)
        return step, waiting, {"from_step": step, "buffer_reused": len(waiting), "buffer_dropped_stale": dropped}
