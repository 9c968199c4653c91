"""RL stages (reasoning, agent, chat): one environment, trained with SAO or a baseline algorithm.

The three kinds share this code and differ only in their environment and defaults; the
environment decides single- or multi-turn, the reward, and the reference solutions for SFT.
"""
from __future__ import annotations

import itertools
import statistics

from tqdm import tqdm

from opd_sao.engines import build_engine
from opd_sao.engines.base import SamplingParams
from opd_sao.evaluation import evaluate
from opd_sao.gate import ConsistencyGate, probe_episodes
from opd_sao.learner import Learner, needs_critic
from opd_sao.rl_loop import RLLoop
from opd_sao.rollout import Episode
from opd_sao.sft import run_sft, sft_examples
from opd_sao.tracking import MetricsLogger
from opd_sao.trainers import build_backend

from .base import Stage, StageResult, register_stage
from .envs import ENVIRONMENTS, sample_tasks

TRAIN_TASK_POOL = 100_000


class RLStage(Stage):
    def env_factory(self):
        if not self.cfg.env:
            raise ValueError(f"stage {self.cfg.name!r} ({self.cfg.kind}) needs `env:` (one of {ENVIRONMENTS.names()})")
        env_cls = ENVIRONMENTS.get(self.cfg.env)
        options = dict(self.cfg.env_options)
        return lambda: env_cls(**options)

    def _progress(self, total: int, what: str):
        enabled = self.ctx.cfg.logging.progress
        return tqdm(total=total, desc=f"{self.cfg.name}: {what}", disable=not enabled, leave=False, dynamic_ncols=True)

    def warm_start(self, start, env_factory) -> tuple:
        """SFT on reference solutions when configured; returns (checkpoint, eval before SFT or None)."""
        cfg, run = self.cfg, self.ctx.cfg
        if not cfg.sft.steps:
            return start, None
        tok = self.ctx.tokenizer
        before = evaluate(start, env_factory, tok, domain=cfg.env, rollout=cfg.rollout, eval_cfg=cfg.eval, seed=run.seed)
        examples = sft_examples(env_factory, tok, n=TRAIN_TASK_POOL, seed=run.seed)
        with self._progress(cfg.sft.steps, "sft") as bar:
            sft_ckpt = run_sft(start, self.dir / "sft_checkpoint", examples, tok, cfg.sft, run.seed, bar)
        return sft_ckpt, before

    def run(self) -> StageResult:
        cfg, run, tok = self.cfg, self.ctx.cfg, self.ctx.tokenizer
        env_factory = self.env_factory()
        start, eval_init = self.warm_start(self.ctx.resolve_checkpoint(cfg.init_from), env_factory)
        algo, trainer_cfg = run.stage_algo(cfg), run.stage_trainer(cfg)
        backend = build_backend(trainer_cfg, start, with_critic=needs_critic(algo))
        engine = build_engine(run.engine, start, tok, seed=run.seed)
        learner = Learner(backend, algo, cfg.sao, critic_steps=trainer_cfg.critic_steps,
                          critic_warmup_steps=trainer_cfg.critic_warmup_steps)
        tasks = sample_tasks(env_factory().make_tasks("train", TRAIN_TASK_POOL, run.seed), run.seed)
        groups = itertools.count()
        params = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens)

        def make_episodes() -> list[Episode]:
            task, group = next(tasks), next(groups)
            return [Episode(env_factory(), task, tok, params, domain=cfg.env, max_turns=cfg.rollout.max_turns,
                            max_context_tokens=cfg.rollout.max_context_tokens, group=group)
                    for _ in range(cfg.rollout.group_size)]

        gate = ConsistencyGate(cfg.gate, stage=cfg.name, out_dir=self.dir, engine=engine, backend=backend,
                               make_probe=lambda: probe_episodes(env_factory, tok, cfg.rollout, domain=cfg.env,
                                                                 n=cfg.gate.probe_size, seed=run.seed),
                               eps_low=cfg.sao.eps_low, eps_high=cfg.sao.eps_high,
                               deterministic=run.engine.deterministic)
        with self._progress(cfg.steps, algo) as bar:
            loop = RLLoop(engine=engine, learner=learner, make_episodes=make_episodes, rollout=cfg.rollout,
                          train_batch_size=trainer_cfg.train_batch_size, pad_id=tok.pad_token_id,
                          logger=MetricsLogger(self.dir / "metrics.jsonl", stage=cfg.name, wandb_run=self.ctx.wandb_run),
                          trained_log=self.dir / "trained.jsonl", slowdown_s=trainer_cfg.slowdown_s, progress=bar,
                          after_step=gate.after_step)
            gate.run("start", sync=loop.sync_weights)
            history = loop.run(cfg.steps)
            gate.run("final", sync=loop.sync_weights)  # before the checkpoint is promoted
        checkpoint = backend.export_policy(self.dir / "checkpoint", tok)
        engine.close()
        summary = {"algo": algo, "steps": len(history), "start_checkpoint": str(start), "train": _train_summary(history),
                   "gate": gate.summary()}
        if eval_init is not None:
            summary["eval_init"] = {cfg.env: eval_init}
        return StageResult(checkpoint, summary, start_checkpoint=start)


def _train_summary(history: list[dict]) -> dict:
    if not history:
        return {}
    tail = history[-max(1, len(history) // 4):]
    mean = lambda key, rows: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
    return {
        "reward_first_quarter": mean("reward_mean", history[: max(1, len(history) // 4)]),
        "reward_last_quarter": mean("reward_mean", tail),
        "mask_fraction_mean": mean("mask_fraction", history),
        "staleness_mean": mean("staleness_mean", history),
        "dropped_stale": history[-1].get("dropped_stale", 0),
        "trainer_idle_fraction": history[-1].get("trainer_idle_fraction", 0.0),
        "samples_per_s": history[-1].get("samples_per_s", 0.0),
    }


@register_stage("reasoning")
class ReasoningStage(RLStage):
    """Math / algorithmic problems with a verifier."""


@register_stage("agent")
class AgentStage(RLStage):
    """Multi-turn tool use in the sandbox."""


@register_stage("chat")
class ChatStage(RLStage):
    """Open dialogue scored by a judge."""
