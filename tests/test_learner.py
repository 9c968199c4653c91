"""What makes SAO SAO, pinned through the learner's public behaviour on a real tiny model and trainer:
K critic updates per step, the critic warm-up, Monte-Carlo critic targets, DIS against the engine's
logprobs, and the running-mean baseline read before it is updated. Each test names the mutation it catches
(docs/consistency.md, "Mutations the suite catches")."""
from __future__ import annotations

import math

import pytest
import torch

from opd_sao import algorithms as A
from opd_sao.config import AlgoConfig, TrainerConfig
from opd_sao.rl.learner import Learner
from opd_sao.trainers import TorchTrainer
from opd_sao.trajectory import Trajectory, collate


class CountingTrainer(TorchTrainer):
    """The real torch trainer, counting its optimizer steps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.critic_steps = self.policy_steps = 0

    def step_critic(self, loss):
        self.critic_steps += 1
        return super().step_critic(loss)

    def step_policy(self, loss):
        self.policy_steps += 1
        return super().step_policy(loss)


def _batch(tokenizer, rewards=(1.0, 0.0, 1.0, 0.0), seed=0):
    """Trajectories of different lengths (3, 4, 5, ...), one with an observation span between two actions."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i, reward in enumerate(rewards):
        traj = Trajectory(f"t{i}", "arithmetic", [1] + torch.randint(3, 50, (4,), generator=g).tolist())
        n = 3 + i
        traj.append(torch.randint(3, 50, (n,), generator=g).tolist(), action=True, logp=[-1.0] * n, versions=[0] * n)
        if i == 1:
            traj.append([7, 8], action=False)
            traj.append([9, 10], action=True, logp=[-1.0, -1.0], versions=[0, 0])
        traj.add_reward(reward)
        trajs.append(traj)
    return collate(trajs, tokenizer.pad_token_id)


def _with_ratios(batch, backend, ratios: torch.Tensor):
    """The batch with rollout logprobs that put the trainer's DIS ratio at `ratios` ([B, T]) on action tokens."""
    logp = backend.policy_logprobs(batch, 1.0, grad=False)
    batch.rollout_logp = torch.where(batch.action_mask.bool(), logp - ratios.log().expand_as(logp), batch.rollout_logp)
    return batch


def test_sao_takes_k_critic_updates_per_step_and_no_policy_update_during_warm_up(tiny_model_dir, tokenizer):
    """Mutations caught: one critic update instead of K; no critic warm-up."""
    backend = CountingTrainer(tiny_model_dir, TrainerConfig(train_batch_size=4), with_critic=True)
    learner = Learner(backend, "sao", AlgoConfig(), critic_steps=3, critic_warmup_steps=2)
    batch = _with_ratios(_batch(tokenizer), backend, torch.ones(1))  # on-policy rollouts: nothing masked
    policy_before = {k: v.clone() for k, v in backend.policy.state_dict().items()}
    history = []
    for step in range(2):
        history.append(learner.step(batch, 1.0))
        assert backend.critic_steps == 3 * (step + 1) and backend.policy_steps == 0
    assert all(torch.equal(v, backend.policy.state_dict()[k]) for k, v in policy_before.items())
    assert [h["critic_warmup"] for h in history] == [1.0, 1.0] and "policy_loss" not in history[0]
    m = learner.step(batch, 1.0)
    assert backend.critic_steps == 9 and backend.policy_steps == 1 and m["critic_warmup"] == 0.0
    assert any(not torch.equal(v, backend.policy.state_dict()[k]) for k, v in policy_before.items())


class ReadingTrainer(CountingTrainer):
    """The real torch trainer, recording which trajectories each critic forward read and whether with a graph."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.critic_reads = []

    def critic_values(self, batch, grad):
        self.critic_reads.append((batch.traj_ids, grad))
        return super().critic_values(batch, grad)


def test_critic_minibatches_take_k_updates_in_one_pass_and_gae_reads_the_values_after_them(tiny_model_dir, tokenizer):
    """trainer.critic_minibatches: update k reads every K-th trajectory from the k-th on, each once; the policy's
    values come from one forward over the whole batch after the K steps. Mutations caught: the whole batch in
    each update; a trajectory read twice or never; GAE on the values before the last update."""
    backend = ReadingTrainer(tiny_model_dir, TrainerConfig(train_batch_size=6), with_critic=True)
    learner = Learner(backend, "sao", AlgoConfig(), critic_steps=2, critic_warmup_steps=0, critic_minibatches=True)
    batch = _batch(tokenizer, rewards=(1.0, 0.0, 1.0, 0.0, 1.0, 0.0))
    metrics = learner.step(batch, 1.0)
    ids = batch.traj_ids
    assert backend.critic_reads == [(ids[0::2], True), (ids[1::2], True), (ids, False)]
    assert backend.critic_steps == 2 and backend.policy_steps == 1
    with torch.no_grad():  # the values GAE read are the critic's after both steps
        after = backend.critic_values(batch, grad=False)
    lam = A.length_adaptive_lambda(batch.action_mask.sum(-1), AlgoConfig().alpha)
    advantages, _ = A.skip_observation_gae(batch.rewards, after, batch.action_mask, 1.0, lam)
    assert metrics["adv_mean"] == pytest.approx(float(advantages[batch.action_mask.bool()].mean()), rel=1e-5)


@pytest.mark.parametrize("minibatches", [False, True])
def test_critic_value_loss_before_the_first_update_is_against_monte_carlo_returns(tiny_model_dir, tokenizer,
                                                                                  minibatches):
    """lambda_critic = gamma = 1: the first value loss is (V - reward-to-go)^2 whatever V is, logged before the
    first update steps: over the whole batch, or over the first mini-batch (trajectories 0 and 2 of 4).
    Mutations caught: critic targets at lambda < 1 (they would lean on V); a mini-batch's targets from other
    rows."""
    # a critic far from its targets, so lambda < 1 targets (R = A + V) would differ from the returns
    backend = TorchTrainer(tiny_model_dir, TrainerConfig(train_batch_size=4, critic_lr=0.05), with_critic=True)
    learner = Learner(backend, "sao", AlgoConfig(), critic_steps=2, critic_warmup_steps=0,
                      critic_minibatches=minibatches)
    batch = _batch(tokenizer, rewards=(1.0, 0.0, 3.0, -2.0))
    with torch.no_grad():
        backend.critic.value_head.bias.fill_(5.0)
        values = backend.critic_values(batch, grad=False)
    rows = [0, 2] if minibatches else [0, 1, 2, 3]
    mask = batch.action_mask.bool()[rows]
    returns = batch.rewards.sum(-1, keepdim=True).expand_as(values)[rows]  # one terminal reward: the total
    expected = float(((values[rows] - returns)[mask] ** 2).mean())
    assert learner.step(batch, 1.0)["value_loss"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("algo", ["sao", "running_mean", "grpo_dis"])
def test_dis_ratio_is_taken_against_the_rollout_engines_logprobs(tiny_model_dir, tokenizer, algo):
    """The behaviour logprobs are the engine's (batch.rollout_logp), not a recomputation by the trainer.
    Mutation caught: the DIS ratio against the trainer's recomputed logprobs (every ratio 1, nothing masked)."""
    backend = TorchTrainer(tiny_model_dir, TrainerConfig(train_batch_size=4), with_critic=A.resolve_algorithm(algo).critic)
    learner = Learner(backend, algo, AlgoConfig(eps_low=0.3, eps_high=5.0), critic_steps=1, critic_warmup_steps=0)
    batch = _batch(tokenizer)
    mask = batch.action_mask.bool()
    pattern = torch.tensor([1.0, 0.5, 2.0, 7.0, 1.2])  # kept, masked (< 0.7), kept, masked (> 6), kept
    ratios = pattern.repeat(1 + batch.action_mask.shape[1] // len(pattern))[: batch.action_mask.shape[1]]
    batch = _with_ratios(batch, backend, ratios.expand_as(batch.rollout_logp).clone())
    expected_masked = float(((ratios.expand_as(mask) < 0.7) | (ratios.expand_as(mask) > 6.0))[mask].float().mean())
    m = learner.step(batch, 1.0)
    assert m["mask_fraction"] == pytest.approx(expected_masked, abs=1e-6) and expected_masked > 0.2
    assert m["ratio_mean"] == pytest.approx(float(ratios.expand_as(mask)[mask].mean()), rel=1e-4)


def test_running_mean_baseline_is_read_before_it_is_updated(tiny_model_dir, tokenizer):
    """Step 1's advantages are the rewards minus the empty window's 0, step 2's minus step 1's mean.
    Mutation caught: the baseline updated with the batch's own rewards before the advantages."""
    backend = TorchTrainer(tiny_model_dir, TrainerConfig(train_batch_size=4), with_critic=False)
    learner = Learner(backend, "running_mean", AlgoConfig(baseline_window=128), critic_steps=1, critic_warmup_steps=0)
    first, second = _batch(tokenizer, rewards=(1.0, 1.0, 1.0, 0.0)), _batch(tokenizer, rewards=(0.0, 1.0, 0.0, 0.0))

    def token_mean_advantage(batch, baseline):
        mask = batch.action_mask.bool()
        adv = (batch.rewards.sum(-1, keepdim=True) - baseline).expand_as(mask)
        return float(adv[mask].mean())

    m1 = learner.step(first, 1.0)
    assert m1["adv_mean"] == pytest.approx(token_mean_advantage(first, 0.0), abs=1e-6)
    m2 = learner.step(second, 1.0)
    assert m2["adv_mean"] == pytest.approx(token_mean_advantage(second, 0.75), abs=1e-6)
    assert not math.isclose(m2["adv_mean"], token_mean_advantage(second, (3 + 1) / 8), abs_tol=1e-3)
