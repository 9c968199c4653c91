"""Hand-checked tests for opd_sao.algorithms.

Expected numbers are worked out by hand in the comments, not recomputed with
the code under test.
"""

import math

import pytest
import torch

from opd_sao.algorithms import (
    RunningMeanBaseline,
    broadcast_sequence_advantage,
    dis_weights,
    group_length_weights,
    grpo_advantages,
    length_adaptive_lambda,
    masked_token_mean,
    ppo_clip_loss,
    resolve_algorithm,
    reverse_kl_advantage,
    sao_policy_loss,
    skip_observation_gae,
    token_mean_weights,
    truncated_divergence,
    value_loss,
)
from opd_sao.config import AlgoConfig

D = torch.float64
LOSS = AlgoConfig(eps_low=0.3, eps_high=5.0, ppo_clip=0.2)


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


# ----------------------------------------------------------------------------
# skip-observation GAE
# ----------------------------------------------------------------------------


def support_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs of the full softmax on support ids: what the chunked path computes, written the naive way."""
    return torch.log_softmax(logits, dim=-1).gather(-1, ids)

def test_gae_two_action_spans_with_observation_reward():
    #            prompt  a    a   obs  obs   a    a   pad
    mask = t([[0, 1, 1, 0, 0, 1, 1, 0]])
    # values at non-action positions are garbage and must never be read
    values = t([[9.0, 0.5, 0.6, 9.0, 9.0, 0.7, 0.8, 9.0]])
    # 0.2 arrives with the observation at t=3 -> credited to the action token t=2
    rewards = t([[0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 1.0, 0.0]])
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # gamma=1, lam=0.5; action tokens 1,2,5,6; effective rewards 0,0.2,0,1
    # t=6: delta = 1 + 0 - 0.8 = 0.2                      A6 = 0.2
    # t=5: delta = 0 + 0.8 - 0.7 = 0.1                    A5 = 0.1 + 0.5*0.2 = 0.2
    # t=2: delta = 0.2 + V5(0.7) - 0.6 = 0.3 (skips 3,4)  A2 = 0.3 + 0.5*0.2 = 0.4
    # t=1: delta = 0 + 0.6 - 0.5 = 0.1                    A1 = 0.1 + 0.5*0.4 = 0.3
    # returns = A + V: 0.8, 1.0, 0.9, 1.0
    torch.testing.assert_close(adv, t([[0, 0.3, 0.4, 0, 0, 0.2, 0.2, 0]]))
    torch.testing.assert_close(ret, t([[0, 0.8, 1.0, 0, 0, 0.9, 1.0, 0]]))
    assert not adv.requires_grad and not ret.requires_grad


def test_gae_trajectory_ending_in_observation_credits_last_action():
    mask = t([[1, 1, 0, 0]])
    values = t([[0.5, 0.25, 3.0, 3.0]])
    rewards = t([[0.0, 0.0, 0.0, 1.0]])  # reward on the final observation token
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # reward 1 credited to t=1: A1 = 1 - 0.25 = 0.75; A0 = 0 + 0.25 - 0.5 + 0.75 = 0.5
    torch.testing.assert_close(adv, t([[0.5, 0.75, 0, 0]]))
    torch.testing.assert_close(ret, t([[1.0, 1.0, 0, 0]]))


def test_gae_reward_before_first_action_goes_to_first_action():
    mask = t([[0, 1, 1]])
    values = t([[0.0, 0.0, 0.0]])
    rewards = t([[0.5, 0.0, 1.0]])
    adv, _ = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # 0.5 (prompt) -> t=1. A2 = 1, A1 = 0.5 + 0 - 0 + 1 = 1.5
    torch.testing.assert_close(adv, t([[0, 1.5, 1.0]]))


def test_gae_gamma_below_one():
    mask = t([[1, 1, 0, 1]])
    values = t([[1.0, 2.0, 5.0, 4.0]])
    rewards = t([[0.0, 0.0, 0.0, 2.0]])
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=0.5, lam=1.0)
    # t=3: delta = 2 - 4 = -2;                   A3 = -2
    # t=1: delta = 0 + 0.5*4 - 2 = 0;            A1 = 0 + 0.5*1*(-2) = -1
    # t=0: delta = 0 + 0.5*2 - 1 = 0;            A0 = 0 + 0.5*(-1) = -0.5
    # (lam=1 check: discounted returns 0.5, 1, 2 minus values 1, 2, 4)
    torch.testing.assert_close(adv, t([[-0.5, -1.0, 0, -2.0]]))
    torch.testing.assert_close(ret, t([[0.5, 1.0, 0, 2.0]]))


def test_gae_lambda_per_row_and_all_masked_row():
    mask = t([[1, 1, 1], [1, 1, 1], [0, 0, 0]])
    values = t([[0.5, 0.5, 0.5]] * 3)
    rewards = t([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 0.0, 1.0]])
    lam = t([0.0, 0.5, 0.9])
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=lam)
    # row 0, lam=0: A = delta: t2 = 1-0.5 = 0.5, t1 = 0+0.5-0.5 = 0, t0 = 0
    # row 1, lam=0.5: t2 = 0.5, t1 = 0 + 0.5*0.5 = 0.25, t0 = 0 + 0.5*0.25 = 0.125
    # row 2: no action tokens -> zeros, rewards have nowhere to go
    torch.testing.assert_close(adv, t([[0, 0, 0.5], [0.125, 0.25, 0.5], [0, 0, 0]]))
    torch.testing.assert_close(ret, t([[0.5, 0.5, 1.0], [0.625, 0.75, 1.0], [0, 0, 0]]))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


def test_gae_accepts_bool_mask_and_float32():
    mask = torch.tensor([[False, True, True]])
    adv, _ = skip_observation_gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.zeros(1, 3), mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 1.0, 1.0]]))


def _plain_gae(rewards, values, gamma, lam):
    """Textbook GAE on a 1-D sequence of action tokens only."""
    n = len(rewards)
    adv = [0.0] * n
    next_v, next_a = 0.0, 0.0
    for i in reversed(range(n)):
        delta = rewards[i] + gamma * next_v - values[i]
        next_a = delta + gamma * lam * next_a
        adv[i] = next_a
        next_v = values[i]
    return adv


def test_gae_equals_plain_gae_on_compressed_action_sequence():
    g = torch.Generator().manual_seed(0)
    B, T = 4, 23
    mask = (torch.rand(B, T, generator=g) < 0.6).to(D)
    mask[:, 0] = 0.0  # a prompt token
    mask[:, 1] = 1.0
    rewards = torch.randn(B, T, generator=g, dtype=D)
    values = torch.randn(B, T, generator=g, dtype=D)
    lam = t([0.3, 0.7, 0.95, 1.0])
    gamma = 0.9
    adv, ret = skip_observation_gae(rewards, values, mask, gamma, lam)
    for b in range(B):
        idx = [i for i in range(T) if mask[b, i] == 1]
        # credit each reward to the nearest preceding action token (first one for the prompt)
        r = [0.0] * len(idx)
        for i in range(T):
            before = [k for k, j in enumerate(idx) if j <= i]
            r[before[-1] if before else 0] += rewards[b, i].item()
        expected = _plain_gae(r, [values[b, j].item() for j in idx], gamma, lam[b].item())
        torch.testing.assert_close(adv[b, idx], t(expected))
        torch.testing.assert_close(ret[b, idx], t(expected) + values[b, idx])
        others = [i for i in range(T) if i not in idx]
        assert (adv[b, others] == 0).all() and (ret[b, others] == 0).all()


def test_length_adaptive_lambda():
    lam = length_adaptive_lambda(torch.tensor([1, 10, 0]))
    # l=1: 1 - 1/1.5 = 1/3; l=10: 1 - 1/15; l=0 is clamped to 1
    torch.testing.assert_close(lam, torch.tensor([1 / 3, 1 - 1 / 15, 1 / 3]))
    torch.testing.assert_close(length_adaptive_lambda(t([4.0]), alpha=2.0), t([1 - 1 / 8]))


# ----------------------------------------------------------------------------
# DIS and the SAO policy loss
# ----------------------------------------------------------------------------

def test_dis_weights_boundaries_inclusive():
    # eps_low=0.5 -> lower bound 0.5; eps_high=3 -> upper bound 4 (exp(log x) == x in float64 here)
    ratios = t([0.5, 0.5 - 1e-9, 4.0, 4.0 + 1e-9, 1.0])
    rollout = torch.zeros(5, dtype=D)  # so that logp - rollout is exactly log(ratio)
    logp = torch.log(ratios)
    assert torch.exp(logp - rollout)[0] == 0.5 and torch.exp(logp - rollout)[2] == 4.0  # precondition
    w, keep = dis_weights(logp, rollout, eps_low=0.5, eps_high=3.0)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, False, True, False, True]
    torch.testing.assert_close(w, t([0.5, 0.0, 4.0, 0.0, 1.0]))


def test_dis_weights_are_detached():
    logp = t([-1.0, -2.0]).requires_grad_()
    w, _ = dis_weights(logp, t([-1.0, -2.0]), 0.2, 0.2)
    assert not w.requires_grad


def test_sao_policy_loss_value_gradient_and_metrics():
    # 5 positions: t=0 non-action, t=1..4 action
    mask = t([[0, 1, 1, 1, 1]])
    rollout = t([[-1.0, -1.0, -2.0, -0.5, -1.5]])
    ratios = t([[1.0, 2.0, 0.1, 1.0, 0.5]])  # eps_low=0.3, eps_high=3: 0.1 and 0.5 masked (<0.7)
    logp = (rollout + torch.log(ratios)).requires_grad_()
    adv = t([[7.0, 1.5, 2.0, -1.0, 3.0]])
    loss, m = sao_policy_loss(logp, rollout, adv, mask, eps_low=0.3, eps_high=3.0)
    loss.backward()
    # N = 4 action tokens (masked ones still count). kept: t=1 (r=2, A=1.5), t=3 (r=1, A=-1)
    # grad = -f(r) * A / N: t=1: -2*1.5/4 = -0.75; t=3: -1*(-1)/4 = 0.25; others exactly 0
    torch.testing.assert_close(logp.grad, t([[0.0, -0.75, 0.0, 0.25, 0.0]]))
    assert logp.grad[0, 0] == 0 and logp.grad[0, 2] == 0 and logp.grad[0, 4] == 0
    # loss = -(2*1.5*logp1 + 1*(-1)*logp3)/4, logp1 = -1 + ln2, logp3 = -0.5
    expected = -(3.0 * (-1.0 + math.log(2.0)) + (-1.0) * (-0.5)) / 4
    assert loss.item() == pytest.approx(expected)
    assert m["mask_fraction"] == pytest.approx(0.5)
    assert m["ratio_mean"] == pytest.approx((2.0 + 0.1 + 1.0 + 0.5) / 4)
    assert m["ratio_max"] == pytest.approx(2.0)
    assert m["ratio_min"] == pytest.approx(0.1)
    assert m["tokens"] == 4.0
    assert all(isinstance(v, float) for v in m.values())


def test_sao_policy_loss_ignores_padding_garbage():
    mask = torch.tensor([[True, False]])
    logp = t([[-1.0, -math.inf]]).requires_grad_()
    rollout = t([[-1.0, math.nan]])
    adv = t([[2.0, math.nan]])
    loss, _ = sao_policy_loss(logp, rollout, adv, mask, 0.2, 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(2.0)  # -(1 * 2 * -1) / 1
    torch.testing.assert_close(logp.grad, t([[-2.0, 0.0]]))


def test_empty_batch_loss_is_zero_with_grad():
    logp = torch.zeros(2, 3, dtype=D, requires_grad=True)
    mask = torch.zeros(2, 3)
    loss, m = sao_policy_loss(logp, torch.zeros(2, 3, dtype=D), torch.ones(2, 3, dtype=D), mask, 0.2, 0.2)
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert (logp.grad == 0).all()
    assert m["tokens"] == 0.0 and m["mask_fraction"] == 0.0
    assert masked_token_mean(logp, mask).grad_fn is not None


# ----------------------------------------------------------------------------
# critic
# ----------------------------------------------------------------------------

def test_value_loss_and_explained_variance():
    values = t([[1.0, 2.0, 3.0, 100.0]]).requires_grad_()
    returns = t([[1.0, 3.0, 5.0, -100.0]])
    mask = t([[1, 1, 1, 0]])
    loss, m = value_loss(values, returns, mask)
    # errors 0,1,2 -> (0+1+4)/3 = 5/3
    assert loss.item() == pytest.approx(5 / 3)
    assert m["value_loss"] == pytest.approx(5 / 3)
    # Var(R)=Var(1,3,5)=8/3; Var(R-V)=Var(0,1,2)=2/3; EV = 1 - 0.25 = 0.75
    assert m["explained_variance"] == pytest.approx(0.75)
    loss.backward()
    # d/dV (V-R)^2/3 = 2(V-R)/3: 0, -2/3, -4/3, 0
    torch.testing.assert_close(values.grad, t([[0.0, -2 / 3, -4 / 3, 0.0]]))


def test_explained_variance_constant_returns_is_zero_not_nan():
    _, m = value_loss(t([[1.0, 2.0]]), t([[1.0, 1.0]]), t([[1, 1]]))
    assert m["explained_variance"] == 0.0
    _, m = value_loss(t([[1.0, 2.0]]), t([[1.0, 1.0]]), t([[0, 0]]))
    assert m["explained_variance"] == 0.0 and m["value_loss"] == 0.0
    # all-zero rewards: R = A + V leaves float round-off, which must not log as -1e14
    _, m = value_loss(t([[0.3, 0.5, 0.2]]), t([[0.0, 1e-9, -1e-9]]), t([[1, 1, 1]]))
    assert m["explained_variance"] == 0.0


# ----------------------------------------------------------------------------
# baselines
# ----------------------------------------------------------------------------

def test_grpo_advantages():
    rewards = t([1.0, 0.0, 1.0, 1.0, 5.0, 2.0, 2.0, 0.0, 1.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 9, 9, 4, 4])
    adv = grpo_advantages(rewards, groups)
    # group 7: mean 0.75, population var (3*0.0625 + 0.5625)/4 = 0.1875, std = sqrt(3)/4
    #   1 -> 0.25/(sqrt3/4) = 1/sqrt3 ; 0 -> -0.75/(sqrt3/4) = -sqrt3
    # group 3 singleton -> 0; group 9 constant -> 0; group 4 (size 2) -> -1, +1
    s3 = math.sqrt(3)
    expected = t([1 / s3, -s3, 1 / s3, 1 / s3, 0.0, 0.0, 0.0, -1.0, 1.0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


def test_ppo_clip_loss_hand_case():
    # ratios 1.5 (A=+1): min(1.5, 1.2) = 1.2 clipped
    #        0.5 (A=+1): min(0.5, 0.8) = 0.5 not clipped
    #        0.5 (A=-1): min(-0.5, -0.8) = -0.8 clipped
    #        1.0 (A=+2): 2 not clipped; last position is not an action
    old = t([[-1.0, -1.0, -2.0, -0.3, -1.0]])
    ratios = t([[1.5, 0.5, 0.5, 1.0, 9.0]])
    logp = (old + torch.log(ratios)).requires_grad_()
    adv = t([[1.0, 1.0, -1.0, 2.0, 5.0]])
    mask = t([[1, 1, 1, 1, 0]])
    loss, m = ppo_clip_loss(logp, old, adv, mask, clip_eps=0.2)
    # loss = -(1.2 + 0.5 - 0.8 + 2)/4 = -0.725
    assert loss.item() == pytest.approx(-0.725)
    assert m["clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    # clipped tokens get 0 grad; others -r*A/N: 0.5*1/4 -> -0.125; 1*2/4 -> -0.5
    torch.testing.assert_close(logp.grad, t([[0.0, -0.125, 0.0, -0.5, 0.0]]))


def test_grpo_loss_divides_each_group_by_its_total_response_length():
    """The paper's GRPO: mean over groups of (group's token sum / group's total response length)."""
    # group 5: responses of 1 and 3 action tokens (4 in all); group 2: one response of 2 tokens (a row with a
    # prompt position and padding: not actions)
    mask = t([[1, 0, 0, 0], [1, 1, 1, 0], [0, 1, 1, 0]])
    groups = torch.tensor([5, 5, 2])
    w = group_length_weights(mask, groups)
    expected = t([[1 / 8, 0, 0, 0], [1 / 8, 1 / 8, 1 / 8, 0], [0, 1 / 4, 1 / 4, 0]])  # 1/(2 groups * 4), 1/(2 * 2)
    torch.testing.assert_close(w.double(), expected)
    torch.testing.assert_close(token_mean_weights(mask).double(), mask / 6)
    # PPO clip at ratio 1 (no clipping): loss = -sum_t w_t A_t; the batch token mean would be -(1 + 3*2 + 2*4)/6
    logp = torch.zeros(3, 4, dtype=D, requires_grad=True)
    adv = t([[1.0, 0, 0, 0], [2.0, 2.0, 2.0, 0], [0, 4.0, 4.0, 0]])
    loss, _ = resolve_algorithm("grpo").policy_loss(logp, logp.detach(), adv, mask, LOSS, w)
    assert loss.item() == pytest.approx(-((1 + 3 * 2) / 4 + (2 * 4) / 2) / 2)  # -4.875, not -2.5
    loss.backward()
    torch.testing.assert_close(logp.grad, -(adv * expected))
    logp.grad = None
    loss_dis, _ = resolve_algorithm("grpo_dis").policy_loss(logp, logp.detach(), adv, mask, LOSS, w)
    loss_dis.backward()  # DIS at ratio 1: d loss / d logp_t = -w_t A_t as well
    torch.testing.assert_close(logp.grad, -(adv * expected))
    # the algorithms carry their normalisation: GRPO's per group, SAO's the batch token mean
    grpo, grpo_dis = resolve_algorithm("grpo"), resolve_algorithm("grpo_dis")
    assert grpo.token_weights is group_length_weights is grpo_dis.token_weights
    assert resolve_algorithm("sao").token_weights is token_mean_weights


def test_token_weights_split_into_micro_batches_give_the_full_batch_gradient():
    """Weights are computed once for the whole batch, so summing per-row-slice losses is the full loss."""
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 1, 1]])
    w = group_length_weights(mask, torch.tensor([0, 0, 1, 1]))
    logp = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(0)).requires_grad_()
    adv = t([[1.0] * 3, [-1.0] * 3, [0.5] * 3, [2.0] * 3])
    full, _ = sao_policy_loss(logp, logp.detach(), adv, mask, 0.3, 5.0, w)
    parts = [sao_policy_loss(logp[s], logp[s].detach(), adv[s], mask[s], 0.3, 5.0, w[s])[0]
             for s in (slice(0, 1), slice(1, 3), slice(3, 4))]
    assert sum(p.item() for p in parts) == pytest.approx(full.item())


def test_running_mean_baseline_window():
    b = RunningMeanBaseline(window=128)
    assert b.value == 0.0
    for r in range(129):  # 0..128; 0 falls out of the window
        b.update(float(r))
    assert b.value == pytest.approx(64.5)  # mean of 1..128
    b.update(torch.tensor([1000.0, 1000.0]))
    assert len(b.rewards) == 128
    assert b.value == pytest.approx((sum(range(3, 129)) + 2000.0) / 128)


def test_broadcast_sequence_advantage():
    out = broadcast_sequence_advantage(t([2.0, -1.0]), torch.tensor([[0, 1, 1], [1, 0, 1]]))
    torch.testing.assert_close(out, t([[0.0, 2.0, 2.0], [-1.0, 0.0, -1.0]]))


# ----------------------------------------------------------------------------
# distillation
# ----------------------------------------------------------------------------

def test_reverse_kl_advantage():
    s = t([[-1.0, -2.0, -0.5]]).requires_grad_()
    adv = reverse_kl_advantage(s, t([[-1.5, -1.0, -0.1]]), t([[1, 1, 0]]))
    # -(s - teacher): -(−1+1.5) = -0.5; -(−2+1) = 1; non-action -> 0
    torch.testing.assert_close(adv, t([[-0.5, 1.0, 0.0]]))
    assert not adv.requires_grad


KINDS = ["forward_kl", "reverse_kl", "jsd"]


@pytest.mark.parametrize("kind", KINDS)
def test_divergence_zero_for_identical(kind):
    lp = torch.log(t([[0.5, 0.3], [0.6, 0.4]]))
    d = truncated_divergence(lp, lp, torch.ones(2, 2, dtype=torch.bool), kind=kind)
    torch.testing.assert_close(d, t([0.0, 0.0]))


@pytest.mark.parametrize("kind", KINDS)
def test_divergence_full_vocab_equals_exact(kind):
    g = torch.Generator().manual_seed(1)
    N, V = 5, 11
    s = torch.log_softmax(torch.randn(N, V, generator=g, dtype=D), -1)
    te = torch.log_softmax(2 * torch.randn(N, V, generator=g, dtype=D), -1)
    ps, pt = s.exp(), te.exp()
    if kind == "forward_kl":
        exact = (pt * (te - s)).sum(-1)
    elif kind == "reverse_kl":
        exact = (ps * (s - te)).sum(-1)
    else:
        pm = 0.3 * pt + 0.7 * ps
        exact = 0.3 * (pt * (te - pm.log())).sum(-1) + 0.7 * (ps * (s - pm.log())).sum(-1)
    # the support is the whole vocabulary, in a shuffled order
    ids = torch.stack([torch.randperm(V, generator=g) for _ in range(N)])
    d = truncated_divergence(
        support_logp(s, ids), te.gather(-1, ids), torch.ones(N, V, dtype=torch.bool), kind=kind, beta=0.3
    )
    torch.testing.assert_close(d, exact, atol=1e-10, rtol=1e-8)
    assert (d > 0).all()


def test_divergence_hand_case_with_tail():
    # teacher support probs 0.5, 0.3 -> tail 0.2; student 0.4, 0.3 -> tail 0.3
    te = torch.log(t([[0.5, 0.3]]))
    s = torch.log(t([[0.4, 0.3]]))
    m = torch.ones(1, 2, dtype=torch.bool)
    # KL(T||S) = 0.5 ln(0.5/0.4) + 0.3 ln 1 + 0.2 ln(0.2/0.3)
    #          = 0.5*0.22314355131 + 0.2*(-0.40546510811) = 0.030478754035
    fwd = truncated_divergence(s, te, m, kind="forward_kl")
    assert fwd.item() == pytest.approx(0.030478754035, abs=1e-10)
    # KL(S||T) = 0.4 ln(0.4/0.5) + 0.3 ln(0.3/0.2) = 0.4*(-0.22314355131) + 0.3*0.40546510811
    #          = 0.032382111907
    rev = truncated_divergence(s, te, m, kind="reverse_kl")
    assert rev.item() == pytest.approx(0.032382111907, abs=1e-10)
    # JSD(beta=.5): M = (0.45, 0.3, 0.25)
    # 0.5*[0.5 ln(0.5/0.45) + 0.2 ln(0.2/0.25)] + 0.5*[0.4 ln(0.4/0.45) + 0.3 ln(0.3/0.25)]
    # = 0.5*[0.052680257 - 0.044628710] + 0.5*[-0.047112214 + 0.054696467] = 0.007817400
    jsd = truncated_divergence(s, te, m, kind="jsd", beta=0.5)
    assert jsd.item() == pytest.approx(0.0078174002, abs=1e-9)
    # an explicit student tail logprob gives the same result
    fwd2 = truncated_divergence(s, te, m, student_tail_logp=torch.log(t([0.3])), kind="forward_kl")
    assert fwd2.item() == pytest.approx(0.030478754035, abs=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_divergence_ragged_support(kind):
    # row 0 has 2 real entries + 1 padding (garbage, even nan); row 1 has 3 entries
    te = torch.log(t([[0.5, 0.3, 0.1], [0.5, 0.3, 0.1]]))
    te[0, 2] = math.nan
    s = torch.log(t([[0.4, 0.3, 0.9], [0.4, 0.3, 0.1]])).requires_grad_()
    mask = torch.tensor([[True, True, False], [True, True, True]])
    d = truncated_divergence(s, te, mask, kind=kind)
    ref = truncated_divergence(torch.log(t([[0.4, 0.3]])), torch.log(t([[0.5, 0.3]])), mask[:1, :2], kind=kind)
    torch.testing.assert_close(d[0], ref[0])
    assert d[1] != d[0]  # the third entry changes the buckets of row 1
    d.sum().backward()
    assert torch.isfinite(s.grad).all() and s.grad[0, 2] == 0
    if kind == "forward_kl":
        torch.testing.assert_close(d[0], t(0.030478754035))


@pytest.mark.parametrize("kind", KINDS)
def test_divergence_teacher_zero_probability(kind):
    te = torch.log(t([[0.6, 0.0, 0.4], [0.0, 0.0, 1.0]]))  # -inf entries, zero tail
    logits = torch.tensor([[0.0, 0.5, -1.0], [1.0, 0.0, 2.0]], dtype=D, requires_grad=True)
    s = support_logp(logits, torch.tensor([[0, 1, 2], [0, 1, 2]]))
    d = truncated_divergence(s, te, torch.ones(2, 3, dtype=torch.bool), kind=kind)
    assert torch.isfinite(d).all() and (d > 0).all()
    d.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0
    if kind == "forward_kl":
        # student probs row 0: softmax(0, .5, -1) = (0.3315, 0.5466, 0.1220); teacher 0 on id 1 contributes 0:
        # KL = 0.6 ln(0.6/0.3315) + 0.4 ln(0.4/0.1220) = 0.3560 + 0.4750 = 0.8310
        ps = torch.softmax(logits.detach(), -1)[0]
        expected = 0.6 * math.log(0.6 / ps[0].item()) + 0.4 * math.log(0.4 / ps[2].item())
        assert d[0].item() == pytest.approx(expected)
        assert d[0].item() == pytest.approx(0.8310, abs=1e-3)


def test_divergence_float32_and_bf16_inputs():
    te = torch.log(torch.tensor([[0.5, 0.3]]))
    s = torch.log(torch.tensor([[0.4, 0.3]])).requires_grad_()
    d = truncated_divergence(s, te, torch.ones(1, 2, dtype=torch.bool))
    assert d.item() == pytest.approx(0.030478754, abs=1e-6)
    d.backward()
    assert torch.isfinite(s.grad).all()
    d16 = truncated_divergence(s.detach().bfloat16(), te.bfloat16(), torch.ones(1, 2, dtype=torch.bool))
    assert d16.dtype == torch.float32 and d16.item() == pytest.approx(0.0305, abs=5e-3)


def test_divergence_unknown_kind():
    with pytest.raises(ValueError):
        truncated_divergence(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), kind="kl")


# ----------------------------------------------------------------------------
# OPD helpers: renormalize_support, topk_overlap
# ----------------------------------------------------------------------------

def test_renormalize_support_keeps_the_stored_tail():
    from opd_sao.algorithms import renormalize_support

    # row 0: stored (quantised) probs 0.5, 0.3 (sum 0.8) with stored tail 0.1 -> support must hold 0.9:
    # 0.5 * 0.9 / 0.8 = 0.5625, 0.3 * 0.9 / 0.8 = 0.3375. Row 1: one real entry 0.7, tail 0.3 -> 0.7; padding -> 0.
    logp = torch.log(torch.tensor([[0.5, 0.3], [0.7, 0.123]], dtype=D))
    mask = torch.tensor([[True, True], [True, False]])
    out = renormalize_support(logp, mask, torch.tensor([0.1, 0.3], dtype=D))
    assert out[0].exp().tolist() == pytest.approx([0.5625, 0.3375])
    assert out[1, 0].exp().item() == pytest.approx(0.7)
    assert out[1, 1].item() == 0.0
    # the (support, tail) pair is a proper distribution, so truncated_divergence infers the stored tail:
    # identical student -> divergence 0
    d = truncated_divergence(out, out, mask)
    assert d.tolist() == pytest.approx([0.0, 0.0], abs=1e-12)


def test_topk_overlap_by_hand():
    from opd_sao.algorithms import topk_overlap

    # row 0: teacher support {1: .5, 2: .3, 3: .1}, k = 2 -> teacher top-2 = {1, 2};
    #        student top-2 = (3, 1) -> shares {1} -> 1/2.
    # row 1: teacher support {4} only (size 1) -> m = 1; student top-1 = 4 -> 1/1.
    # row 2: teacher top-2 {5, 6}; student (7, 8) -> 0.
    support_ids = torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 9]])
    teacher = torch.log(torch.tensor([[0.5, 0.3, 0.1], [0.9, 1.0, 1.0], [0.4, 0.35, 0.05]]))
    mask = torch.tensor([[True, True, True], [True, False, False], [True, True, True]])
    student = torch.tensor([[3, 1], [4, 0], [7, 8]])
    assert topk_overlap(student, teacher, support_ids, mask, k=2).tolist() == pytest.approx([0.5, 1.0, 0.0])
    # ties: teacher {1: .4, 2: .2, 3: .2}, k = 2 -> the 2nd largest is .2, so ids 2 and 3 both rank in its top 2;
    # student (3, 1) -> 2/2. Student (2, 5): 5 is outside the support -> 1/2.
    tie_ids = torch.tensor([[1, 2, 3], [1, 2, 3]])
    tie_lp = torch.log(torch.tensor([[0.4, 0.2, 0.2], [0.4, 0.2, 0.2]]))
    both = torch.ones(2, 3, dtype=torch.bool)
    assert topk_overlap(torch.tensor([[3, 1], [2, 5]]), tie_lp, tie_ids, both, k=2).tolist() == pytest.approx([1.0, 0.5])


def test_mask_fraction_by_age_counts_each_token_age_apart():
    """Partial rollouts (#42): one row holds tokens of two versions; DIS masking is reported per token age, over
    action tokens only."""
    keep = torch.tensor([[True, False, True, True, False]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    age = torch.tensor([[1, 1, 0, 0, 0]])
    from opd_sao.algorithms import mask_fraction_by_age

    assert mask_fraction_by_age(keep, mask, age) == {"mask_fraction_by_age": {"0": 0.0, "1": 0.5},
                                                     "tokens_by_age": {"0": 2, "1": 2}}
