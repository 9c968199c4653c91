"""One learning step per algorithm: turns a batch of trajectories into policy and critic updates.

The formulas come from `opd_sao.algorithms`; the forward passes and optimizer steps from a
`TrainerBackend`. This module only composes them, the same way for every backend.
"""
from __future__ import annotations

import torch

from opd_sao import algorithms as A
from opd_sao.config import SAOConfig
from opd_sao.trainers.base import TrainerBackend
from opd_sao.trajectory import Batch

ALGOS_WITH_CRITIC = {"sao", "ppo"}


def needs_critic(algo: str) -> bool:
    return algo in ALGOS_WITH_CRITIC


class ResumableLearner:
    """The step count and running-mean window: what a resumed stage needs beyond the backend's weights and
    optimizers (the RL learner and the OPD learner both keep them)."""

    def __init__(self, baseline_window: int):
        self.baseline = A.RunningMeanBaseline(baseline_window)
        self.steps_done = 0

    def state(self) -> dict:
        return {"steps_done": self.steps_done, "baseline": list(self.baseline.rewards)}

    def restore(self, state: dict) -> None:
        self.steps_done = state["steps_done"]
        self.baseline.update(state["baseline"])


class Learner(ResumableLearner):
    def __init__(self, backend: TrainerBackend, algo: str, cfg: SAOConfig, *, critic_steps: int,
                 critic_warmup_steps: int):
        super().__init__(cfg.baseline_window)
        self.backend, self.algo, self.cfg = backend, algo, cfg
        self.critic_steps = critic_steps
        self.critic_warmup_steps = critic_warmup_steps if needs_critic(algo) else 0

    @property
    def warming_up(self) -> bool:
        return self.steps_done < self.critic_warmup_steps

    def step(self, batch: Batch, temperature: float) -> dict[str, float]:
        """One trainer step: K critic updates, then (after warm-up) one policy update."""
        mask = batch.action_mask
        seq_rewards = batch.rewards.sum(-1)
        metrics: dict[str, float] = {"reward_mean": float(seq_rewards.mean()), "batch_size": float(len(seq_rewards))}
        if needs_critic(self.algo):
            advantages = self._critic_update(batch, metrics)
        elif self.algo == "running_mean":
            advantages = A.broadcast_sequence_advantage(seq_rewards - self.baseline.value, mask)
            self.baseline.update(seq_rewards)
        else:  # grpo, grpo_dis
            group_ids = torch.tensor([t.meta.get("group", i) for i, t in enumerate(batch.trajectories)])
            advantages = A.broadcast_sequence_advantage(A.grpo_advantages(seq_rewards, group_ids), mask)
        acted = mask.bool()
        metrics["adv_mean"] = float(advantages[acted].mean()) if acted.any() else 0.0
        metrics["adv_std"] = float(advantages[acted].std()) if acted.sum() > 1 else 0.0
        if not self.warming_up:
            metrics.update(self._policy_update(batch, advantages, temperature))
        metrics["critic_warmup"] = float(self.warming_up)
        self.steps_done += 1
        return metrics

    def _critic_update(self, batch: Batch, metrics: dict) -> torch.Tensor:
        """K value-loss steps (TTUR); GAE uses the values of the first forward, before any update."""
        mask = batch.action_mask
        for k in range(self.critic_steps):
            values = self.backend.critic_values(batch, grad=True)
            if k == 0:
                advantages, returns = self._advantages_and_returns(batch, values.detach())
            loss, value_metrics = A.value_loss(values, returns, mask)
            metrics["critic_grad_norm"] = self.backend.step_critic(loss)
            if k == 0:
                metrics.update(value_metrics)  # measured before the update: an honest explained variance
        return advantages

    def _advantages_and_returns(self, batch: Batch, values: torch.Tensor):
        mask, cfg = batch.action_mask, self.cfg
        if self.algo == "sao":  # length-adaptive lambda for the policy, lambda = 1 for the critic's targets
            lam = A.length_adaptive_lambda(mask.sum(-1), cfg.alpha)
            advantages, _ = A.skip_observation_gae(batch.rewards, values, mask, cfg.gamma, lam)
            _, returns = A.skip_observation_gae(batch.rewards, values, mask, cfg.gamma, 1.0)
            return advantages, returns
        return A.skip_observation_gae(batch.rewards, values, mask, cfg.gamma, cfg.ppo_lambda)

    def _policy_update(self, batch: Batch, advantages: torch.Tensor, temperature: float) -> dict[str, float]:
        mask, cfg = batch.action_mask, self.cfg
        if self.algo in ("sao", "grpo_dis", "running_mean"):
            logp = self.backend.policy_logprobs(batch, temperature, grad=True)
            loss, metrics = A.sao_policy_loss(logp, batch.rollout_logp, advantages, mask, cfg.eps_low, cfg.eps_high)
            metrics["policy_grad_norm"] = self.backend.step_policy(loss)
        else:  # grpo, ppo: clip against pi_old, recomputed by the trainer before the update
            old_logp = self.backend.policy_logprobs(batch, temperature, grad=False)
            for _ in range(cfg.update_epochs):
                logp = self.backend.policy_logprobs(batch, temperature, grad=True)
                loss, metrics = A.ppo_clip_loss(logp, old_logp, advantages, mask, cfg.ppo_clip)
                metrics["policy_grad_norm"] = self.backend.step_policy(loss)
            _, dis = A.dis_weights(old_logp, batch.rollout_logp, cfg.eps_low, cfg.eps_high)
            metrics["mask_fraction"] = float(1 - dis[mask.bool()].float().mean()) if mask.any() else 0.0
        metrics["policy_loss"] = float(loss.detach())
        return metrics
