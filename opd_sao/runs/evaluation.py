"""Held-out evaluation: a domain's score is the mean episode reward on its eval split, with its standard error
over the tasks (`Score`)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from opd_sao.checkpoints import load_causal_lm
from opd_sao.config import EvalConfig, RolloutConfig
from opd_sao.devices import resolve_device
from opd_sao.engines.embedded import EmbeddedEngine
from opd_sao.errors import UsageError
from opd_sao.rl.rollout import Episode, episodes_for, run_episodes


@dataclass(frozen=True)
class Score:
    """A held-out score: the mean reward, its standard error over tasks (None with one task) and the task count."""

    mean: float
    stderr: Optional[float]
    n: int

    def error(self) -> dict:
        """For summary.json, beside the score: {"stderr", "n"} (`<score field>_error` per domain)."""
        return {"stderr": None if self.stderr is None else round(self.stderr, 4), "n": self.n}


def task_score(rewards: dict[str, list[float]]) -> Score:
    """The mean and standard error over tasks, each task's samples averaged first: the samples of one task are not
    independent draws of the score (they share the task), so the error is that of the mean of n task means,
    sd(task means) / sqrt(n), with sd the sample standard deviation. With as many samples per every task, the mean
    is the mean of all episodes."""
    means = [statistics.fmean(r) for r in rewards.values() if r]
    if not means:
        raise ValueError("no episode rewards to score")
    stderr = statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else None
    return Score(statistics.fmean(means), stderr, len(means))


def make_episodes(env_factory, tasks, tokenizer, rollout: RolloutConfig, *, domain: str, temperature: float,
                  repeats: int = 1, sampling_seed: Optional[int] = None, greedy: bool = False,
                  max_positions: Optional[int] = None) -> list[Episode]:
    """Episodes played as in training, compaction and prompt truncation included, so a held-out score measures the
    trained behaviour; `sampling_seed` keys every draw (see episodes_for); `greedy`: argmax decoding (top_k 1);
    `max_positions`: the model's."""
    return [episode for task in tasks
            for episode in episodes_for(env_factory, task, tokenizer, rollout, domain=domain, count=repeats,
                                        temperature=temperature, sampling_seed=sampling_seed,
                                        top_k=1 if greedy else None, max_positions=max_positions,
                                        traj_ids=[f"eval-{domain}-{task['id']}-{r}" for r in range(repeats)])]


def evaluate(checkpoint: Path, env_factory, tokenizer, *, domain: str, rollout: RolloutConfig, eval_cfg: EvalConfig,
             seed: int, device: Optional[str] = None, attn_implementation: str = "eager") -> float:
    """The mean reward (`evaluate_score` gives its standard error too). Sampled at eval_cfg.temperature (argmax
    with eval_cfg.greedy), every draw keyed by (seed, task, sample, turn, position), so a
    checkpoint scores the same whatever the batching or the load, and two checkpoints are compared on common random
    numbers: where their policies agree they draw the same tokens, and the difference of their scores is the
    difference of the policies, not of the draws (docs/benchmarks.md, "Evaluation on common random numbers").

    `device`: where the model generates (the run's engine device; None: auto); `attn_implementation`: the
    engine's (model.attn_implementation).
    """
    return evaluate_score(checkpoint, env_factory, tokenizer, domain=domain, rollout=rollout, eval_cfg=eval_cfg,
                          seed=seed, device=device, attn_implementation=attn_implementation).mean


def evaluate_score(checkpoint: Path, env_factory, tokenizer, *, domain: str, rollout: RolloutConfig,
                   eval_cfg: EvalConfig, seed: int, device: Optional[str] = None,
                   attn_implementation: str = "eager") -> Score:
    """`evaluate`'s score with its standard error over the tasks and their number."""
    return task_score(episode_rewards(checkpoint, env_factory, tokenizer, domain=domain, rollout=rollout,
                                      eval_cfg=eval_cfg, seed=seed, device=device,
                                      attn_implementation=attn_implementation))


def episode_rewards(checkpoint: Path, env_factory, tokenizer, *, domain: str, rollout: RolloutConfig,
                    eval_cfg: EvalConfig, seed: int, device: Optional[str] = None,
                    attn_implementation: str = "eager") -> dict[str, list[float]]:
    """Every eval episode's reward, per task (eval_cfg.samples_per_task each): the score and its sampling noise."""
    tasks, episodes, trajs = played(checkpoint, env_factory, tokenizer, domain=domain, rollout=rollout,
                                    eval_cfg=eval_cfg, seed=seed, device=device,
                                    attn_implementation=attn_implementation)
    rewards: dict[str, list[float]] = {str(task["id"]): [] for task in tasks}
    for episode, traj in zip(episodes, trajs):
        rewards[str(episode.task["id"])].append(traj.total_reward)
    return rewards


def played(checkpoint: Path, env_factory, tokenizer, *, domain: str, rollout: RolloutConfig, eval_cfg: EvalConfig,
           seed: int, device: Optional[str] = None, attn_implementation: str = "eager") -> tuple[list, list, list]:
    """The eval split's first eval_cfg.num_tasks tasks played by `checkpoint` as the evaluation plays them: (tasks,
    episodes, trajectories). What `episode_rewards` scores and `opd-sao samples` shows."""
    tasks = env_factory().make_tasks("eval", eval_cfg.num_tasks, seed=seed)
    if not tasks:
        raise UsageError(f"environment {domain!r} has no eval tasks")
    model = load_causal_lm(checkpoint, device=resolve_device(device), attn_implementation=attn_implementation)
    engine = EmbeddedEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, max_batch=64,
                            seed=seed)
    episodes = make_episodes(env_factory, tasks, tokenizer, rollout, domain=domain, temperature=eval_cfg.temperature,
                             repeats=eval_cfg.samples_per_task, sampling_seed=seed, greedy=eval_cfg.greedy,
                             max_positions=getattr(model.config, "max_position_embeddings", None))
    with torch.no_grad():
        trajs = run_episodes(engine, episodes)
    return tasks, episodes, trajs
