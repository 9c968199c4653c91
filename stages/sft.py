"""The SFT stage: one supervised warm start on the reference solutions of several domains at once.

A real post-training run starts its RL stages from a model that already has some skill in every domain;
this stage gives the tiny model that start. Domains are environment names (`domains:`), mixed in equal
shares; each uses the environment options of the stage that trains on it (opd_sao.stages.domains.Domain).
Settings are the `sft:` block (steps, lr, batch_size). An interrupted SFT stage continues from its last saved
state (every `checkpoint_every` steps, Stage.sft); its checkpoint is written atomically, so a completed one is
never half there.
"""
from __future__ import annotations

import random

from opd_sao.checkpoints import PromptFormat
from opd_sao.envs import ENVIRONMENTS
from opd_sao.errors import UsageError
from opd_sao.supervised import sft_examples

from .base import SFT_SECTIONS, TRAIN_TASK_POOL, Stage, StageResult, register_stage
from .domains import Domain


@register_stage("sft")
class SFTStage(Stage):
    sections = SFT_SECTIONS | {"domains", "rollout"}  # rollout: the prompt format of a domain no other stage trains on

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        if not cfg.domains:
            raise UsageError(f"stage {cfg.name!r} (sft) needs `domains:` (environment names to learn)")
        if not cfg.sft.steps:
            raise UsageError(f"stage {cfg.name!r} (sft) needs `sft: {{steps: N}}` with N > 0")
        for name in cfg.domains:
            ENVIRONMENTS.get(name)

    def run(self) -> StageResult:
        cfg, run, tok = self.cfg, self.ctx.cfg, self.ctx.tokenizer
        domains = [Domain(name, cfg, run.stages, run.device) for name in cfg.domains]
        pools = [sft_examples(d.factory, tok, n=TRAIN_TASK_POOL, seed=run.seed,
                              prompt_format=PromptFormat.from_rollout(tok, d.rollout)) for d in domains]
        rng, share = random.Random(run.seed), max(len(pool) for pool in pools)
        mixture = [example for pool in pools for example in rng.choices(pool, k=share)]
        start = self.ctx.resolve_checkpoint(cfg.init_from)
        checkpoint, resumed = self.sft(start, mixture, self.dir / "checkpoint")
        summary = {"algo": "sft", "steps": cfg.sft.steps, "domains": list(cfg.domains),
                   "examples_per_domain": share, "start_checkpoint": str(start)}
        if resumed:
            summary["resume"] = resumed
        return StageResult(checkpoint, summary, start_checkpoint=start)
