"""Value pre-training (SAO section 3.3): fit the critic to the start policy's Monte-Carlo returns before RL.

A fresh critic has a zero value head, so the first policy steps of a single-rollout stage get advantages
that are the raw returns (no baseline); the paper names this cold start the main bottleneck and fixes it
by pre-training the value model on rollouts of the initial policy. Here: play `rollouts` episodes with
the stage's start policy (the engine before any weight sync), compute every action token's Monte-Carlo
return (GAE with lambda 1 and the stage's gamma: independent of the critic), and take `steps` critic
steps with the learner's value loss on random minibatches of them. The policy is not touched.
"""
from __future__ import annotations

import random
import time
from typing import Callable

import torch

from opd_sao import algorithms as A
from opd_sao.engines.base import RolloutEngine
from opd_sao.rl.rollout import Episode, run_episodes
from opd_sao.trainers.base import TrainerBackend
from opd_sao.trajectory import Batch, Trajectory, collate


def monte_carlo_returns(batch: Batch, gamma: float) -> torch.Tensor:
    """[B, T] reward-to-go on action tokens (0 elsewhere); lambda 1 makes GAE's returns ignore the values."""
    _, returns = A.skip_observation_gae(batch.rewards, torch.zeros_like(batch.rewards), batch.action_mask, gamma, 1.0)
    return returns


def critic_error(backend: TrainerBackend, trajectories: list[Trajectory], *, gamma: float, pad_id: int) -> dict:
    """The critic's value loss and explained variance against the MC returns of `trajectories` (no update)."""
    batch = collate(trajectories, pad_id).to(backend.device)
    with torch.no_grad():
        _, metrics = A.value_loss(backend.critic_values(batch, grad=False), monte_carlo_returns(batch, gamma),
                                  batch.action_mask)
    return metrics


def rollout_corpus(engine: RolloutEngine, make_episodes: Callable[[], list[Episode]], n: int) -> list[Trajectory]:
    """At least `n` finished trajectories of the engine's current policy (every segment of a compacted episode)."""
    episodes: list[Episode] = []
    while len(episodes) < n:
        episodes.extend(make_episodes())
    with torch.no_grad():
        run_episodes(engine, episodes)
    return [segment for episode in episodes for segment in episode.segments]


def pretrain_critic(backend: TrainerBackend, engine: RolloutEngine, make_episodes: Callable[[], list[Episode]], *,
                    rollouts: int, steps: int, batch_size: int, gamma: float, pad_id: int, seed: int,
                    progress=None) -> dict:
    """Roll out, then fit; returns what it did and the critic's fit on its own corpus before and after."""
    t0 = time.perf_counter()
    corpus = rollout_corpus(engine, make_episodes, rollouts)
    rollout_s = time.perf_counter() - t0
    rng, order = random.Random(seed), []
    first = last = None
    for _ in range(steps):
        while len(order) < batch_size:  # epochs over the corpus, reshuffled
            order += rng.sample(range(len(corpus)), len(corpus))
        batch = collate([corpus[i] for i in order[:batch_size]], pad_id).to(backend.device)
        del order[:batch_size]
        values = backend.critic_values(batch, grad=True)
        loss, metrics = A.value_loss(values, monte_carlo_returns(batch, gamma), batch.action_mask)
        backend.step_critic(loss)
        first, last = first or metrics, metrics
        if progress is not None:
            progress.update(1)
    returns = [t.total_reward for t in corpus]
    return {"rollouts": len(corpus), "steps": steps, "batch_size": batch_size,
            "return_mean": round(sum(returns) / len(returns), 4),
            "value_loss_first": round(first["value_loss"], 5), "value_loss_last": round(last["value_loss"], 5),
            "explained_variance_first": round(first["explained_variance"], 4),
            "explained_variance_last": round(last["explained_variance"], 4),
            "rollout_s": round(rollout_s, 2), "fit_s": round(time.perf_counter() - t0 - rollout_s, 2)}
