"""Held-out evaluation: a domain's score is the mean episode reward on its eval split."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from opd_sao.checkpoints import load_causal_lm
from opd_sao.config import EvalConfig, RolloutConfig
from opd_sao.devices import resolve_device
from opd_sao.engines.embedded import EmbeddedEngine
from opd_sao.errors import UsageError
from opd_sao.rl.rollout import Episode, episodes_for, run_episodes


def make_episodes(env_factory, tasks, tokenizer, rollout: RolloutConfig, *, domain: str, temperature: float,
                  repeats: int = 1, sampling_seed: Optional[int] = None) -> list[Episode]:
    """Episodes played as in training, compaction included, so a held-out score measures the trained behaviour;
    `sampling_seed` keys every draw (see episodes_for)."""
    return [episode for task in tasks
            for episode in episodes_for(env_factory, task, tokenizer, rollout, domain=domain, count=repeats,
                                        temperature=temperature, sampling_seed=sampling_seed,
                                        traj_ids=[f"eval-{domain}-{task['id']}-{r}" for r in range(repeats)])]


def evaluate(checkpoint: Path, env_factory, tokenizer, *, domain: str, rollout: RolloutConfig, eval_cfg: EvalConfig,
             seed: int, device: Optional[str] = None, attn_implementation: str = "eager") -> float:
    """Sampled (not greedy) at eval_cfg.temperature, every draw keyed by (seed, task, sample, turn, position), so a
    checkpoint scores the same whatever the batching or the load, and two checkpoints are compared on common random
    numbers: where their policies agree they draw the same tokens, and the difference of their scores is the
    difference of the policies, not of the draws (docs/benchmarks.md, "Evaluation on common random numbers").

    `device`: where the model generates (the run's engine device; None: auto); `attn_implementation`: the
    engine's (model.attn_implementation).
    """
    rewards = episode_rewards(checkpoint, env_factory, tokenizer, domain=domain, rollout=rollout, eval_cfg=eval_cfg,
                              seed=seed, device=device, attn_implementation=attn_implementation)
    return sum(r for per_task in rewards.values() for r in per_task) / sum(len(r) for r in rewards.values())


def episode_rewards(checkpoint: Path, env_factory, tokenizer, *, domain: str, rollout: RolloutConfig,
                    eval_cfg: EvalConfig, seed: int, device: Optional[str] = None,
                    attn_implementation: str = "eager") -> dict[str, list[float]]:
    """Every eval episode's reward, per task (eval_cfg.samples_per_task each): the score and its sampling noise."""
    tasks = env_factory().make_tasks("eval", eval_cfg.num_tasks, seed=seed)
    if not tasks:
        raise UsageError(f"environment {domain!r} has no eval tasks")
    model = load_causal_lm(checkpoint, device=resolve_device(device), attn_implementation=attn_implementation)
    engine = EmbeddedEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, max_batch=64,
                            seed=seed)
    episodes = make_episodes(env_factory, tasks, tokenizer, rollout, domain=domain, temperature=eval_cfg.temperature,
                             repeats=eval_cfg.samples_per_task, sampling_seed=seed)
    with torch.no_grad():
        trajs = run_episodes(engine, episodes)
    rewards: dict[str, list[float]] = {str(task["id"]): [] for task in tasks}
    for episode, traj in zip(episodes, trajs):
        rewards[str(episode.task["id"])].append(traj.total_reward)
    return rewards
