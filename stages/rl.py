"""RL stages (reasoning, agent, chat): one environment, trained with SAO or a baseline algorithm.

The three kinds share this code and differ only in their environment and defaults; the
environment decides single- or multi-turn, the reward, and the reference solutions for SFT.
"""
from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

from opd_sao.checkpoints import PromptFormat
from opd_sao.consistency.gate import probe_episodes
from opd_sao.engines import build_engine
from opd_sao.envs import ENVIRONMENTS, sample_tasks
from opd_sao.envs.validity import require_valid
from opd_sao.errors import UsageError
from opd_sao.io.files import write_json
from opd_sao.io.tracking import read_jsonl
from opd_sao.rl.learner import Learner, needs_critic
from opd_sao.rl.rollout import Episode, episodes_for
from opd_sao.rl.value_pretrain import pretrain_critic
from opd_sao.runs.evaluation import evaluate_score
from opd_sao.supervised import sft_examples
from opd_sao.trainers import build_backend

from .base import (
    ENV_SECTIONS,
    LOOP_SECTIONS,
    SFT_SECTIONS,
    TRAIN_TASK_POOL,
    Stage,
    StageResult,
    check_domain_prompts,
    max_positions,
    register_stage,
)

CRITIC_DIR = "critic"  # next to checkpoint/: the critic a later stage of the same env carries over
VALIDITY_TASKS = 16  # tasks the oracle / no-op / initial-state check samples at stage start


class RLStage(Stage):
    """The RL kinds' shared code. A kind subclassing it declares its own DIS band in `defaults` (or, declaring none,
    gets the schema's DEFAULT_DIS_BOUNDS: never another kind's)."""

    sections = ENV_SECTIONS | LOOP_SECTIONS | SFT_SECTIONS | {"algo", "critic_pretrain"}  # SFT: the warm start

    @classmethod
    def validate_in_run(cls, cfg, run) -> None:
        super().validate_in_run(cfg, run)
        earlier = run.stages[:run.stages.index(cfg)]
        if cfg.critic_pretrain.carry_over and not any(s.env == cfg.env for s in earlier):
            raise ValueError(f"stage {cfg.name!r}: critic_pretrain.carry_over needs an earlier stage with env "
                             f"{cfg.env!r} to take the critic from")

    @classmethod
    def check(cls, cfg) -> None:
        super().check(cfg)
        if not cfg.env:
            raise UsageError(f"stage {cfg.name!r} ({cfg.kind}) needs `env:` (one of {ENVIRONMENTS.names()})")
        ENVIRONMENTS.get(cfg.env)

    @classmethod
    def check_base_model(cls, cfg, run, base, tokenizer) -> None:
        """Its environment's prompts leave room to answer (a 50 MB row or one past the model's positions), and a
        critic's `critic_trained_layers` is at most the model's layers: refused before the first stage, not
        mid-run."""
        super().check_base_model(cfg, run, base, tokenizer)
        env_cls = ENVIRONMENTS.get(cfg.env)
        check_domain_prompts(env_cls, cfg.env_options, cfg.rollout, tokenizer, domain=cfg.env, base=base, seed=run.seed)
        top = run.stage_trainer(cfg).critic_trained_layers
        if top is not None and needs_critic(run.stage_algo(cfg), cfg.rl):
            layers = json.loads((Path(base) / "config.json").read_text()).get("num_hidden_layers")
            if layers is not None and top > layers:
                raise UsageError(f"stages.{cfg.name}: trainer.critic_trained_layers is {top}, but the model has "
                                 f"{layers} decoder layers")

    def env_factory(self, train_step=None):
        """`train_step()` (the trainer's step count) goes to environments whose reward follows training."""
        env_cls = ENVIRONMENTS.get(self.cfg.env)
        options = dict(self.cfg.env_options)
        if train_step is not None and env_cls.reads_train_step:
            options["train_step"] = train_step
        if env_cls.reads_device:
            options.setdefault("device", self.ctx.cfg.device)
        return lambda: env_cls(**options)

    def warm_start(self, start, env_factory) -> tuple:
        """SFT on reference solutions when configured (resumable, Stage.sft); returns (checkpoint, eval before SFT
        ({"eval_init": score, "error": its standard error and n}) or None, resume report)."""
        cfg, run = self.cfg, self.ctx.cfg
        if not cfg.sft.steps:
            return start, None, {}
        tok, done = self.ctx.tokenizer, self.dir / "sft_checkpoint"
        record = self.dir / "sft_eval.json"
        if self.ctx.resume and record.is_file():
            before = json.loads(record.read_text())
            if (done / "config.json").is_file():
                return done, before, {"sft_from_step": cfg.sft.steps}
        else:
            with self.timed("evaluation"):
                score = evaluate_score(start, env_factory, tok, domain=cfg.env, rollout=cfg.rollout,
                                       eval_cfg=cfg.eval, seed=run.seed, device=run.engine_device,
                                       attn_implementation=run.model.attn_implementation)
            before = {"eval_init": score.mean, "error": score.error()}
            record.write_text(json.dumps(before))
        examples = sft_examples(env_factory, tok, n=TRAIN_TASK_POOL, seed=run.seed,
                                prompt_format=PromptFormat.from_rollout(tok, cfg.rollout))
        sft_ckpt, resumed = self.sft(start, examples, done)
        return sft_ckpt, before, resumed

    def carried_critic(self) -> Path:
        """The critic saved by the latest earlier stage with this stage's env (`critic_pretrain.carry_over`)."""
        earlier = [s for s in self.ctx.cfg.stages[:self.ctx.cfg.stages.index(self.cfg)] if s.env == self.cfg.env]
        path = self.ctx.stage_dir(earlier[-1].name) / CRITIC_DIR if earlier else None
        if path is None or not (path / "config.json").is_file():
            raise UsageError(f"stage {self.cfg.name!r}: critic_pretrain.carry_over: no critic saved by an earlier "
                             f"stage with env {self.cfg.env!r} ({path or 'no such stage'}; a stage saves its "
                             f"critic only if it trains one)")
        return path

    def critic_carried_later(self) -> bool:
        """Whether a later stage of the same env starts from this stage's critic (then it is saved)."""
        stages = self.ctx.cfg.stages
        following = next((s for s in stages[stages.index(self.cfg) + 1:] if s.env == self.cfg.env), None)
        return following is not None and following.critic_pretrain.carry_over

    def run(self) -> StageResult:
        cfg, run, tok = self.cfg, self.ctx.cfg, self.ctx.tokenizer
        env_factory = self.env_factory()
        require_valid(cfg.env, env_factory, n=VALIDITY_TASKS, seed=run.seed)  # before any work
        pool = env_factory().make_tasks("train", TRAIN_TASK_POOL, run.seed)
        positions = max_positions(self.ctx.base_checkpoint)  # prompts were checked before the first stage
        start, eval_init, sft_resumed = self.warm_start(self.ctx.resolve_checkpoint(cfg.init_from), env_factory)
        algo, trainer_cfg = run.stage_algo(cfg), run.stage_trainer(cfg)
        critic = needs_critic(algo, cfg.rl)
        critic_from = self.carried_critic() if critic and cfg.critic_pretrain.carry_over else None
        attention = run.model.attn_implementation  # trainer and engine alike: the gate compares them
        backend = build_backend(trainer_cfg, start, with_critic=critic, critic_from=critic_from,
                                attn_implementation=attention, total_steps=cfg.steps)
        engine = build_engine(run.engine, start, tok, seed=run.seed, device=run.device,
                              attn_implementation=attention)
        learner = Learner(backend, algo, cfg.rl, critic_steps=trainer_cfg.critic_steps,
                          critic_warmup_steps=trainer_cfg.critic_warmup_steps,
                          critic_minibatches=trainer_cfg.critic_minibatches, timer=self.ctx.timer)
        train_env = self.env_factory(train_step=lambda: learner.steps_done)
        tasks = sample_tasks(pool, run.seed)
        groups = itertools.count()

        def make_episodes() -> list[Episode]:
            return episodes_for(train_env, next(tasks), tok, cfg.rollout, domain=cfg.env, count=cfg.rollout.group_size,
                                group=next(groups), max_positions=positions)

        pretrain = cfg.critic_pretrain
        pretrain_record = self.dir / "critic_pretrain.json"

        def pretrain_critic_first() -> None:
            with self.progress(pretrain.steps, "critic pre-training") as bar, self.ctx.timer.phase("critic_pretrain"):
                report = pretrain_critic(backend, engine, make_episodes, rollouts=pretrain.rollouts,
                                         steps=pretrain.steps,
                                         batch_size=pretrain.batch_size or trainer_cfg.train_batch_size,
                                         gamma=cfg.rl.gamma, pad_id=tok.pad_token_id, seed=run.seed, progress=bar)
            write_json(pretrain_record, report)

        gate, resumed = self.train(engine=engine, backend=backend, learner=learner, make_episodes=make_episodes,
                                   make_probe=lambda: probe_episodes(env_factory, tok, cfg.rollout, domain=cfg.env,
                                                                     n=cfg.gate.probe_size, seed=run.seed,
                                                                     max_positions=positions),
                                   trainer_cfg=trainer_cfg, what=algo,
                                   before_loop=pretrain_critic_first if critic and pretrain.rollouts else None)
        with self.timed("checkpoint"):
            checkpoint = backend.export_policy(self.dir / "checkpoint", tok)
            if critic and self.critic_carried_later():
                backend.export_critic(self.dir / CRITIC_DIR)
        engine.close()
        history = read_jsonl(self.dir / "metrics.jsonl")  # the whole stage, resumed or not
        summary = {"algo": algo, "steps": len(history), "start_checkpoint": str(start), "train": _train_summary(history),
                   "gate": gate.summary()}
        settle = cfg.rollout.max_staleness if cfg.rollout.asynchronous else 0  # batches scored under an older reward
        summary.update(env_factory().training_summary([row["reward_mean"] for row in history], settle=settle))
        if resumed or sft_resumed:
            summary["resume"] = {**sft_resumed, **resumed}
        if critic_from:
            summary["critic_from"] = str(critic_from)
        if pretrain_record.is_file():
            summary["critic_pretrain"] = json.loads(pretrain_record.read_text())
        if eval_init is not None:
            summary["eval_init"] = {cfg.env: eval_init["eval_init"]}
            if "error" in eval_init:  # not in the record of a run started before scores had one
                summary["eval_init_error"] = {cfg.env: eval_init["error"]}
        return StageResult(checkpoint, summary, start_checkpoint=start)


def _train_summary(history: list[dict]) -> dict:
    if not history:
        return {}
    tail = history[-max(1, len(history) // 4):]
    mean = lambda key, rows: statistics.fmean(r.get(key, 0.0) for r in rows)
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

    defaults = {"rl": {"eps_low": 0.3, "eps_high": 5.0}}  # SAO section 4.1's DIS band for math / reasoning


@register_stage("agent")
class AgentStage(RLStage):
    """Multi-turn tool use in the sandbox."""

    defaults = {"rl": {"eps_low": 0.8, "eps_high": 3.0}}  # SAO section 4.1's DIS band for code / agent


@register_stage("chat")
class ChatStage(RLStage):
    """Open dialogue scored by a judge."""

    defaults = {"rl": {"eps_low": 0.3, "eps_high": 5.0}}  # the paper gives no dialogue band: its math one
