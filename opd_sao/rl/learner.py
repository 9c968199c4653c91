"""One learning step per algorithm: turns a batch of trajectories into policy and critic updates.

The algorithm is an advantage estimator and a policy loss from `opd_sao.algorithms` (a preset, either part
replaced by the stage's `rl:` settings, which both read whole); the forward passes and optimizer steps come from
a `TrainerBackend`. This module only composes them, the same way for every algorithm and every backend.
"""
from __future__ import annotations

import torch

from opd_sao import algorithms as A
from opd_sao.config import AlgoConfig
from opd_sao.io.timing import PhaseTimer
from opd_sao.trainers.base import TrainerBackend
from opd_sao.trajectory import Batch


def needs_critic(algo: str, rl: AlgoConfig | None = None) -> bool:
    return A.resolve_algorithm(algo, rl).critic


class ResumableLearner:
    """The step count and running-mean window: what a resumed stage needs beyond the backend's weights and
    optimizers (the RL learner and the OPD learner both keep them)."""

    def __init__(self, baseline_window: int, timer: PhaseTimer | None = None):
        self.baseline = A.RunningMeanBaseline(baseline_window)
        self.steps_done = 0
        self.timer = timer if timer is not None else PhaseTimer()  # the stage's (RLLoop times with it too)

    def state(self) -> dict:
        return {"steps_done": self.steps_done, "baseline": list(self.baseline.rewards)}

    def restore(self, state: dict) -> None:
        self.steps_done = state["steps_done"]
        self.baseline.update(state["baseline"])


class Learner(ResumableLearner):
    def __init__(self, backend: TrainerBackend, algo: str, cfg: AlgoConfig, *, critic_steps: int,
                 critic_warmup_steps: int, critic_minibatches: bool = False, timer: PhaseTimer | None = None):
        super().__init__(cfg.baseline_window, timer)
        self.backend, self.algo, self.cfg = backend, algo, cfg
        self.algorithm = A.resolve_algorithm(algo, cfg)
        self.critic_steps = critic_steps
        self.critic_minibatches = critic_minibatches
        self.critic_warmup_steps = critic_warmup_steps if self.algorithm.critic else 0

    @property
    def warming_up(self) -> bool:
        return self.steps_done < self.critic_warmup_steps

    def step(self, batch: Batch, temperature: float) -> dict[str, float]:
        """One trainer step: K critic updates, then (after warm-up) one policy update from the updated critic."""
        mask = batch.action_mask
        seq_rewards = batch.rewards.sum(-1)
        metrics: dict[str, float] = {"reward_mean": float(seq_rewards.mean()), "batch_size": float(len(seq_rewards))}
        values = None
        if self.algorithm.critic:
            with self.timer.phase("critic"):
                values = self._critic_update(batch, metrics)
        advantages, _ = self.algorithm.advantage(self._inputs(batch, values), self.cfg)
        self.baseline.update(seq_rewards)
        acted = mask.bool()
        metrics["adv_mean"] = float(advantages[acted].mean()) if acted.any() else 0.0
        metrics["adv_std"] = float(advantages[acted].std()) if acted.sum() > 1 else 0.0
        if not self.warming_up:
            with self.timer.phase("policy"):
                metrics.update(self._policy_update(batch, advantages, temperature))
        metrics["critic_warmup"] = float(self.warming_up)
        self.steps_done += 1
        return metrics

    @staticmethod
    def _group_ids(batch: Batch) -> torch.Tensor:
        return torch.tensor([t.meta.get("group", i) for i, t in enumerate(batch.trajectories)],
                            device=batch.rewards.device)

    def _inputs(self, batch: Batch, values) -> A.AdvantageInputs:
        return A.AdvantageInputs(rewards=batch.rewards, action_mask=batch.action_mask, values=values,
                                 group_ids=self._group_ids(batch), baseline=self.baseline.value)

    def _critic_update(self, batch: Batch, metrics: dict) -> torch.Tensor:
        """K value-loss steps (TTUR), then the values the policy's advantages are computed from.

        The paper's K updates let the value "adapt to the current policy before being used for advantage
        computation": each update's targets come from its own forward before it steps (at lambda_critic =
        gamma = 1 they are the Monte-Carlo returns, independent of the critic; K passes over the whole batch
        take them from the first), and GAE reads the values after the K updates, at the cost of one more
        critic forward. The explained variance is measured before any update."""
        returns = None
        with self.backend.critic_step():
            for k, part in enumerate(self._critic_parts(batch)):
                values = self.backend.critic_values(part, grad=True)
                if returns is None or part is not batch:
                    _, returns = self.algorithm.advantage(self._inputs(part, values.detach()), self.cfg)
                loss, value_metrics = A.value_loss(values, returns, part.action_mask)
                metrics["critic_grad_norm"] = self.backend.step_critic(loss)
                if k == 0:
                    metrics.update(value_metrics)  # measured before the update: an honest explained variance
            return self.backend.critic_values(batch, grad=False).detach()

    def _critic_parts(self, batch: Batch) -> list[Batch]:
        """What each of the K updates reads: the whole batch, or (critic_minibatches) every K-th trajectory from
        the k-th on (a batch of fewer than K trajectories: the whole batch each time)."""
        K = self.critic_steps
        if not self.critic_minibatches or len(batch.trajectories) < K:
            return [batch] * K
        row = torch.arange(len(batch.trajectories), device=batch.input_ids.device)
        return [batch.select(row % K == k) for k in range(K)]

    def _policy_update(self, batch: Batch, advantages: torch.Tensor, temperature: float) -> dict[str, float]:
        """The algorithm's policy loss against the rollout logprobs (one pass), or against pi_old recomputed by
        the trainer before the update (`update_epochs` passes, as PPO needs for its clip to matter).

        With one pass, pi_old is the policy of that very pass: its logprobs, detached, are pi_old's, so no
        separate no-grad forward is run (the same forward on the same weights gives the same numbers)."""
        mask, cfg, algorithm = batch.action_mask, self.cfg, self.algorithm
        weights = algorithm.token_weights(mask, self._group_ids(batch))  # the whole batch's normalisation, per token
        epochs = 1 if algorithm.against_rollout else cfg.update_epochs
        behaviour = batch.rollout_logp if algorithm.against_rollout else None
        if behaviour is None and epochs > 1:
            behaviour = self.backend.policy_logprobs(batch, temperature, grad=False)
        age = self.backend.policy_version - batch.versions  # of each token, before this update
        for _ in range(epochs):
            logp = self.backend.policy_logprobs(batch, temperature, grad=True)
            if behaviour is None:
                behaviour = logp.detach()
            loss, metrics = algorithm.policy_loss(logp, behaviour, advantages, mask, cfg, weights)
            metrics["policy_grad_norm"] = self.backend.step_policy(loss)
        # what DIS masked (against the rollout) or would have masked (for comparison), overall and per token age
        _, keep = A.dis_weights(logp.detach() if algorithm.against_rollout else behaviour, batch.rollout_logp,
                                cfg.eps_low, cfg.eps_high)
        if not algorithm.against_rollout:
            metrics["mask_fraction"] = float(1 - keep[mask.bool()].float().mean()) if mask.any() else 0.0
        metrics.update(A.mask_fraction_by_age(keep, mask, age))
        metrics["policy_loss"] = float(loss.detach())
        return metrics
