"""The formulas: DIS, the SAO policy loss, skip-observation GAE, baselines, divergences.

Pure tensor functions (tensors in, tensors out): no I/O, no config objects, no
imports from the rest of the project but its name registry, so every trainer and
stage can share them and each formula can be checked by hand. At the bottom, the
registered advantage estimators and policy losses read the stage's settings object
and call these formulas. Notation follows docs/design.md sections 2
and 4.

Conventions
-----------
* Per-token tensors are ``[B, T]``. ``action_mask`` is 1/True on model-generated
  tokens and 0/False on prompt, observation and padding tokens; 0/1 float and
  bool are both accepted.
* "Token mean" = sum over the action tokens of the whole batch / number of action
  tokens in the whole batch (so long trajectories weigh more, as in the paper).
  With no action tokens it is 0, and still carries a grad_fn when the input
  requires grad, so a step on an empty batch is a no-op instead of a crash.
* A policy loss's normalisation is a ``[B, T]`` tensor of per-token weights
  (``token_mean_weights``, ``group_length_weights``), computed once for the whole
  batch: the loss is ``sum_t w_t * term_t``, so a batch split into micro-batches
  (rows sliced with their weights) accumulates exactly the full batch's gradient.
* Anything computed from the mask side of a ``torch.where`` is ignored, so
  garbage (inf/nan) in padding positions never leaks into a loss or a gradient.
* Metrics are plain python floats, ready for a metrics.jsonl line.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from opd_sao.registry import Registry

__all__ = [
    "masked_token_mean",
    "token_mean_weights",
    "group_length_weights",
    "dis_weights",
    "sao_policy_loss",
    "skip_observation_gae",
    "length_adaptive_lambda",
    "value_loss",
    "grpo_advantages",
    "ppo_clip_loss",
    "RunningMeanBaseline",
    "broadcast_sequence_advantage",
    "reverse_kl_advantage",
    "DIVERGENCES",
    "register_divergence",
    "truncated_divergence",
    "renormalize_support",
    "topk_overlap",
    "domain_shares",
    "AdvantageInputs",
    "Algorithm",
    "ADVANTAGES",
    "POLICY_LOSSES",
    "PRESETS",
    "register_advantage",
    "register_policy_loss",
    "register_preset",
    "resolve_algorithm",
]


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------

def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    """Accept 0/1 float or bool masks; everything downstream uses bool."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_token_mean(x: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over action tokens / number of action tokens in the batch.

    ``torch.where`` (not multiplication) so that inf/nan at non-action positions
    cannot turn into nan. Returns 0 (with a grad_fn if ``x`` has one) when there
    are no action tokens.
    """
    mask = _as_bool(action_mask)
    total = torch.where(mask, x, torch.zeros_like(x)).sum()
    return total / mask.sum().clamp(min=1)


def sft_loss(logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning: the token-mean negative log-likelihood of the answer tokens (`loss_mask`) over the
    whole batch, from the trainer's per-token logprobs [B, T]."""
    return -masked_token_mean(logp, loss_mask)


def token_mean_weights(action_mask: torch.Tensor, group_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, T]`` weights of the batch token mean: ``1 / N`` on each action token (N = action tokens in the
    batch), 0 elsewhere, so ``sum(w * x) == masked_token_mean(x)``. ``group_ids`` is ignored."""
    mask = _as_bool(action_mask)
    return mask.to(torch.get_default_dtype()) / mask.sum().clamp(min=1)


def group_length_weights(action_mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` weights of GRPO's normalisation as the SAO paper writes it: per group g of the batch
    (``group_ids [B]``), ``1 / (n_groups * sum_{i in g} |y_i|)`` on each action token of its members, so

        L = 1/n_groups * sum_g  1/(sum_{i in g} |y_i|) * sum_{i in g} sum_t term_{i,t}

    (the group's token sum over the group's total response length, averaged over the groups). A long
    response weighs more within its group, and every group weighs the same whatever its length. Groups
    without action tokens count in n_groups and contribute nothing."""
    mask = _as_bool(action_mask)
    dtype = torch.get_default_dtype()
    _, inverse = torch.unique(group_ids.to(mask.device), return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    lengths = mask.sum(-1).to(dtype)
    group_tokens = torch.zeros(n_groups, dtype=dtype, device=mask.device).index_add_(0, inverse, lengths)
    per_row = 1.0 / (max(n_groups, 1) * group_tokens.clamp(min=1.0))[inverse]
    return torch.where(mask, per_row.unsqueeze(-1).expand(mask.shape), torch.zeros((), dtype=dtype, device=mask.device))


def _weighted_sum(x: torch.Tensor, action_mask: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``sum_t w_t * x_t`` over action tokens (the token mean when ``weights`` is None)."""
    if weights is None:
        return masked_token_mean(x, action_mask)
    mask = _as_bool(action_mask)
    return torch.where(mask, x * weights.detach().to(x.dtype), torch.zeros_like(x)).sum()


def _masked_values(x: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """1-D detached tensor of ``x`` on action tokens (for metrics)."""
    return x.detach()[_as_bool(action_mask)]


def _zero_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` on action tokens, 0 elsewhere. Applied to inputs first so that
    padding garbage (-inf logprobs, nan) can reach neither values nor gradients:
    the gradient w.r.t. a non-action position is exactly 0."""
    return torch.where(mask, x, torch.zeros_like(x))


# ----------------------------------------------------------------------------
# SAO: DIS and the policy loss (docs/design.md §2.2)
# ----------------------------------------------------------------------------

def dis_weights(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct double-sided importance sampling weights ``f(r)``.

    The ratio is taken against the rollout engine's own logprobs (no pi_old is
    kept, because a single asynchronous rollout has no well-defined "old
    policy"). Tokens whose ratio leaves ``[1 - eps_low, 1 + eps_high]`` are
    MASKED (weight 0), not clipped: a token that drifted that far is not
    trustworthy in either direction. Both bounds are inclusive.

    Returns ``(weights, keep)``: weights = ``where(keep, r, 0)``, detached
    (it is ``sg(f(r))``); keep is bool.
    """
    ratio = torch.exp(logp.detach() - rollout_logp.detach())
    keep = (ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high)
    weights = torch.where(keep, ratio, torch.zeros_like(ratio))
    return weights, keep


def mask_fraction_by_age(keep: torch.Tensor, action_mask: torch.Tensor, age: torch.Tensor) -> dict[str, dict]:
    """DIS masking per token age (policy versions between the weights that sampled a token and the learner's),
    over action tokens: ``{"mask_fraction_by_age": {age: fraction masked}, "tokens_by_age": {age: tokens}}``.
    With partial rollouts one trajectory holds tokens of several ages; this shows whether the old ones drift."""
    mask = _as_bool(action_mask)
    ages, masked = age[mask], (~keep)[mask]
    by_age, tokens = {}, {}
    for a in sorted(set(ages.tolist())):
        at = ages == a
        tokens[str(a)] = int(at.sum())
        by_age[str(a)] = float(masked[at].float().mean())
    return {"mask_fraction_by_age": by_age, "tokens_by_age": tokens}


def sao_policy_loss(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAO policy loss ``-E_t[sg(f(r_t)) * A_t * logp_t]``, token mean over action tokens.

    Because ``f(r)`` is a detached weight, d loss / d logp_t = ``-f(r_t) * A_t / N``
    on kept action tokens and exactly 0 on DIS-masked and non-action tokens
    (N = number of action tokens in the batch, DIS-masked ones included, so
    masking a token does not rescale the others). ``weights`` ``[B, T]`` replaces
    ``1 / N`` by per-token weights (``group_length_weights`` for GRPO + DIS).

    Metrics: ``mask_fraction`` (the paper's "token clip rate": fraction of action
    tokens DIS masked), ``ratio_mean``/``ratio_max``/``ratio_min`` over action
    tokens, ``tokens``. All are 0.0 when there are no action tokens.
    """
    mask = _as_bool(action_mask)
    logp = _zero_outside(logp, mask)
    rollout_logp = _zero_outside(rollout_logp.detach(), mask)
    advantages = _zero_outside(advantages.detach(), mask)
    f_r, keep = dis_weights(logp, rollout_logp, eps_low, eps_high)
    loss = _weighted_sum(-(f_r * advantages * logp), mask, weights)

    r = torch.exp(logp.detach() - rollout_logp)[mask]
    n = int(mask.sum().item())
    if n == 0:
        metrics = dict(mask_fraction=0.0, ratio_mean=0.0, ratio_max=0.0, ratio_min=0.0, tokens=0.0)
    else:
        metrics = dict(
            mask_fraction=float((~keep[mask]).float().mean().item()),
            ratio_mean=float(r.mean().item()),
            ratio_max=float(r.max().item()),
            ratio_min=float(r.min().item()),
            tokens=float(n),
        )
    return loss, metrics


# ----------------------------------------------------------------------------
# Skip-observation GAE (docs/design.md §2.4)
# ----------------------------------------------------------------------------

def _credit_rewards_to_actions(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Move every reward onto an action token, so no reward is dropped.

    A reward at a non-action position (an observation, trailing padding, the
    final observation of a trajectory that ends with the environment) is added
    to the nearest PRECEDING action token. A reward before the first action
    token (i.e. in the prompt) has no preceding action; it is credited to the
    FIRST action token. Rows with no action token lose their rewards (there is
    nothing to credit; their advantages are all 0).
    """
    B, T = rewards.shape
    pos = torch.arange(T, device=rewards.device).expand(B, T)
    has_action = mask.any(dim=1, keepdim=True)
    first_action = mask.float().argmax(dim=1, keepdim=True).expand(B, T)
    # index of the last action token at or before t, -1 if none yet
    last_action = torch.where(mask, pos, torch.full_like(pos, -1)).cummax(dim=1).values
    target = torch.where(last_action >= 0, last_action, first_action)
    src = torch.where(has_action, rewards, torch.zeros_like(rewards))
    return torch.zeros_like(rewards).scatter_add_(1, target, src)


def skip_observation_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE over action tokens only, skipping observation tokens.

    Observation tokens were not generated by the policy, so they get no
    advantage and do not break the credit chain: the last token of action span
    i links directly to the first token of span i+1::

        delta_t = r_t + gamma * V(next action token) - V_t
        A_t     = delta_t + gamma * lam * A(next action token)

    with V = 0 and A = 0 after the last action token (terminal). Rewards on
    non-action positions are credited first (see ``_credit_rewards_to_actions``:
    nearest preceding action token; before any action -> first action token).

    ``lam`` is a float or a ``[B]`` tensor (per-trajectory length-adaptive
    lambda). Returns ``(advantages, returns)``, both ``[B, T]``, detached, 0 on
    non-action tokens; on action tokens ``returns = advantages + values``.
    Values at non-action positions are never read.
    """
    with torch.no_grad():
        mask = _as_bool(action_mask)
        values = values.detach()
        rewards = _credit_rewards_to_actions(rewards.detach().to(values.dtype), mask)
        B, T = values.shape
        if isinstance(lam, torch.Tensor):
            lam = lam.detach().to(device=values.device, dtype=values.dtype).reshape(B)
        else:
            lam = torch.full((B,), float(lam), device=values.device, dtype=values.dtype)

        # V(next action token after t), 0 past the last: the first action index > t, T (a zero column) if none
        pos = torch.arange(T, device=values.device).expand(B, T)
        at_or_after = torch.where(mask, pos, torch.full_like(pos, T)).flip(1).cummin(dim=1).values.flip(1)
        after = torch.cat([at_or_after[:, 1:], torch.full_like(at_or_after[:, :1], T)], dim=1)
        next_value = torch.cat([values, torch.zeros_like(values[:, :1])], dim=1).gather(1, after)
        deltas = rewards + gamma * next_value - values
        # the recursion alone runs over time; observation tokens pass the next action token's advantage through.
        # It spans the columns from the batch's first action token to its last: outside them no row has one, so
        # nothing there is kept or carried (a prompt's columns, the padding after the longest response)
        discount = gamma * lam
        adv = torch.zeros_like(values)
        next_adv = torch.zeros(B, device=values.device, dtype=values.dtype)
        acted = mask.any(0).nonzero().squeeze(1).tolist()
        for t in reversed(range(acted[0], acted[-1] + 1) if acted else ()):
            adv[:, t] = deltas[:, t] + discount * next_adv
            next_adv = torch.where(mask[:, t], adv[:, t], next_adv)

        zero = torch.zeros_like(values)
        advantages = torch.where(mask, adv, zero)
        returns = torch.where(mask, advantages + values, zero)
    return advantages, returns


def length_adaptive_lambda(action_lengths: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """``lambda_policy = 1 - 1/(alpha * l)``, l = number of action tokens (clamped >= 1).

    Long trajectories get lambda close to 1 so the terminal reward still
    reaches early tokens; short ones lean more on the critic (lower variance).
    """
    lengths = torch.as_tensor(action_lengths)
    lengths = lengths.to(torch.get_default_dtype() if not lengths.is_floating_point() else lengths.dtype)
    return 1.0 - 1.0 / (alpha * lengths.clamp(min=1.0))


# ----------------------------------------------------------------------------
# Critic (docs/design.md §2.3)
# ----------------------------------------------------------------------------

VAR_EPS = 1e-12  # returns are in reward units; a variance below this is round-off, not signal


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic loss ``E_t[(V_t - R_t)^2]``, token mean over action tokens.

    ``returns`` is a target (detached). Metrics: ``value_loss`` and
    ``explained_variance = 1 - Var(R - V) / Var(R)`` over action tokens
    (population variances). explained_variance is 0.0, not nan, when there are
    no action tokens or Var(R) is 0 up to float round-off (``VAR_EPS``: all-zero
    rewards leave ~1e-18 of residue in R = A + V, which would log as -1e14), so
    it can always be logged and compared.
    """
    mask = _as_bool(action_mask)
    values = _zero_outside(values, mask)
    returns = _zero_outside(returns.detach(), mask)
    loss = masked_token_mean((values - returns) ** 2, mask)

    v = _masked_values(values, mask)
    r = _masked_values(returns, mask)
    explained_variance = 0.0
    if r.numel() > 0:
        var_r = r.var(unbiased=False)
        if var_r.item() > VAR_EPS:
            explained_variance = float((1.0 - (r - v).var(unbiased=False) / var_r).item())
    return loss, {"value_loss": float(loss.detach().item()), "explained_variance": explained_variance}


# ----------------------------------------------------------------------------
# Baselines (docs/design.md §2.5)
# ----------------------------------------------------------------------------

def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: z-score of each trajectory's reward within its group.

    ``rewards [N]`` (one scalar per trajectory), ``group_ids [N]`` int (any
    values, need not be contiguous). Uses the POPULATION std (unbiased=False):
    it is defined for every group size and makes a group of 2 give +-1.
    ``A = (r - mean_g) / (std_g + eps)``; singleton and constant groups give 0.
    """
    rewards = rewards.detach()
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    rewards = rewards.to(dtype)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=dtype, device=rewards.device).index_add_(0, inverse, torch.ones_like(rewards))
    total = torch.zeros_like(count).index_add_(0, inverse, rewards)
    mean = (total / count)[inverse]
    sq = torch.zeros_like(count).index_add_(0, inverse, (rewards - mean) ** 2)
    std = (sq / count).sqrt()[inverse]
    return (rewards - mean) / (std + eps)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps: float = 0.2,
    weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Standard PPO clipped surrogate ``-min(r*A, clip(r, 1-eps, 1+eps)*A)``, token mean
    (or ``sum_t w_t * term_t`` with per-token ``weights`` ``[B, T]``: GRPO's ``group_length_weights``).

    The comparison baseline for DIS: clipping only removes the gradient on the
    side that would push the ratio further out (one side per advantage sign).
    Metrics: ``clip_fraction`` = fraction of action tokens where the clipped
    term is the active (strictly smaller) one, i.e. tokens with zero gradient;
    ``ratio_mean``; ``tokens``.
    """
    mask = _as_bool(action_mask)
    logp = _zero_outside(logp, mask)
    old_logp = _zero_outside(old_logp.detach(), mask)
    advantages = _zero_outside(advantages.detach(), mask)
    ratio = torch.exp(logp - old_logp)
    surr_unclipped = ratio * advantages
    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = _weighted_sum(-torch.minimum(surr_unclipped, surr_clipped), mask, weights)

    clipped = (surr_clipped < surr_unclipped)[mask]
    n = int(mask.sum().item())
    metrics = {
        "clip_fraction": float(clipped.float().mean().item()) if n else 0.0,
        "ratio_mean": float(ratio.detach()[mask].mean().item()) if n else 0.0,
        "tokens": float(n),
    }
    return loss, metrics


class RunningMeanBaseline:
    """Mean of the last ``window`` rewards (the paper's online-learning baseline).

    It lags a reward shift by about ``window`` samples, which is exactly what
    the SAO critic is compared against. ``value`` is 0.0 before any update.
    """

    def __init__(self, window: int = 128):
        self.rewards: deque[float] = deque(maxlen=window)

    def update(self, rewards) -> None:
        """Append one reward (float) or many (list / tensor, flattened)."""
        if isinstance(rewards, torch.Tensor):
            rewards = rewards.detach().flatten().tolist()
        elif isinstance(rewards, (int, float)):
            rewards = [rewards]
        self.rewards.extend(float(r) for r in rewards)

    @property
    def value(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0


def broadcast_sequence_advantage(adv: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Per-trajectory advantage ``[B]`` -> ``[B, T]``: the value on every action token, 0 elsewhere.

    Used by GRPO and the running-mean baseline, which score whole trajectories.
    """
    mask = _as_bool(action_mask)
    adv = adv.detach().reshape(-1, 1).expand(mask.shape)
    return torch.where(mask, adv, torch.zeros_like(adv))


# ----------------------------------------------------------------------------
# On-policy distillation (docs/design.md §4)
# ----------------------------------------------------------------------------

def reverse_kl_advantage(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    action_mask: torch.Tensor,
) -> torch.Tensor:
    """Sampled-token OPD advantage ``-(logp_student - logp_teacher)`` on action tokens, 0 elsewhere.

    Its expectation under the student's own samples is minus the reverse KL,
    so plugging it into the policy loss as an advantage minimises KL(student||teacher)
    with only the teacher's logprob of the sampled token. Detached.
    """
    mask = _as_bool(action_mask)
    adv = -(student_logp.detach() - teacher_logp.detach())
    return torch.where(mask, adv, torch.zeros_like(adv))


# An OPD divergence is a registered pure function of per-entry terms, `fn(p_s, log_s, p_t, log_t, beta)`: student
# and teacher probabilities and their log-probs (floored to finite values, so 0 * log 0 terms are 0 with finite
# gradients), the same shape ``[..., C]``; `beta` is ``opd.jsd_beta``. Summed over a row's entries (the support
# and its tail bucket, or the vocabulary chunk by chunk) it is the row's divergence. ``opd.divergence`` names one;
# adding one is one decorated function (a plugin's included).
DivergenceFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
DIVERGENCES: Registry[DivergenceFn] = Registry("divergence")
register_divergence = DIVERGENCES.register


@register_divergence("forward_kl")
def forward_kl(p_s, log_s, p_t, log_t, beta):
    """KL(teacher||student): mass-covering, the student spreads over every teacher mode."""
    return p_t * (log_t - log_s)


@register_divergence("reverse_kl")
def reverse_kl(p_s, log_s, p_t, log_t, beta):
    """KL(student||teacher): mode-seeking, what the sampled-token advantage estimates."""
    return p_s * (log_s - log_t)


@register_divergence("jsd")
def jsd(p_s, log_s, p_t, log_t, beta):
    """``beta KL(T||M) + (1 - beta) KL(S||M)``, ``M = beta T + (1 - beta) S``: bounded, between the two KLs."""
    p_m = beta * p_t + (1.0 - beta) * p_s
    log_m = p_m.clamp(min=torch.finfo(p_m.dtype).tiny).log()
    return beta * p_t * (log_t - log_m) + (1.0 - beta) * p_s * (log_s - log_m)


def truncated_divergence(
    student_logp_support: torch.Tensor,
    teacher_logp_support: torch.Tensor,
    support_mask: torch.Tensor,
    student_tail_logp: torch.Tensor | None = None,
    kind: str = "forward_kl",
    beta: float = 0.5,
) -> torch.Tensor:
    """Per-position divergence ``[N]`` between teacher and student on a truncated support.

    Inputs are log-probs ``[N, S]`` on S token ids per position (top-k, top-p
    nucleus padded to S, or the full vocabulary with S = V); ``support_mask``
    ``[N, S]`` bool marks real entries (padding values are ignored, even nan).
    The mass outside the support is kept as one explicit tail bucket, so the
    divergence is between two proper (S+1)-bucket distributions: >= 0 and 0 iff
    equal, instead of a truncated sum that can go negative.

    * teacher tail = ``max(1 - sum exp(teacher_logp_support), 0)``;
    * student tail = ``exp(student_tail_logp)`` when given (precise: e.g.
      logsumexp of the logits outside the support minus logsumexp of all
      logits), else ``max(1 - sum exp(student_logp_support), tiny)``.

    kind: a name in DIVERGENCES (``forward_kl`` = KL(teacher||student), ``reverse_kl`` =
    KL(student||teacher), ``jsd`` with ``beta``), summed over the buckets.

    The teacher is a constant target (detached). Differentiable w.r.t. the
    student log-probs (and ``student_tail_logp``). Numerically safe: log-probs
    are floored at ``log(finfo.tiny)`` inside logs, so teacher zeros (-inf
    logprobs) give finite values and gradients; a student mass where the
    teacher has none costs a large but finite reverse-KL. bf16/fp16 inputs are
    computed in float32. With S = V and a zero tail the tails are rounding-level
    and the result is the full-vocabulary divergence.
    """
    terms = DIVERGENCES.get(kind)  # an unknown name: UnknownName (a ValueError) listing the registered ones
    dtype = student_logp_support.dtype
    if dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    tiny = torch.finfo(dtype).tiny
    log_floor = math.log(tiny)

    mask = _as_bool(support_mask)
    zero = torch.zeros((), dtype=dtype, device=student_logp_support.device)
    # sanitise padding first so that neither values nor gradients see it
    s_lp = torch.where(mask, student_logp_support.to(dtype), zero)
    t_lp = torch.where(mask, teacher_logp_support.detach().to(dtype), zero)
    p_s = torch.where(mask, s_lp.exp(), zero)
    p_t = torch.where(mask, t_lp.exp(), zero)

    tail_t = (1.0 - p_t.sum(dim=-1)).clamp(min=0.0)
    if student_tail_logp is None:
        tail_s = (1.0 - p_s.sum(dim=-1)).clamp(min=tiny)
        log_tail_s = tail_s.log()
    else:
        log_tail_s = student_tail_logp.to(dtype)
        tail_s = log_tail_s.exp()

    def buckets(p, tail):
        return torch.cat([p, tail.unsqueeze(-1)], dim=-1)

    P_s = buckets(p_s, tail_s)
    P_t = buckets(p_t, tail_t)
    log_P_s = buckets(s_lp, log_tail_s).clamp(min=log_floor)
    log_P_t = buckets(t_lp, tail_t.clamp(min=tiny).log()).clamp(min=log_floor)
    bucket_mask = torch.cat([mask, torch.ones_like(mask[..., :1])], dim=-1)

    out = terms(P_s, log_P_s, P_t, log_P_t, beta)
    return torch.where(bucket_mask, out, torch.zeros_like(out)).sum(dim=-1)


def pointwise_divergence(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    kind: str = "forward_kl",
    beta: float = 0.5,
) -> torch.Tensor:
    """Per-entry terms ``[N, C]`` of a divergence over the whole vocabulary: their sum over all V columns is
    ``truncated_divergence`` of full rows without the (rounding-level) tail bucket, so a streamed kernel sums
    it one vocabulary chunk at a time (``modeling.streamed_divergence``). Same floors, same DIVERGENCES. Teacher
    detached."""
    terms = DIVERGENCES.get(kind)  # an unknown name: UnknownName (a ValueError) listing the registered ones
    dtype = torch.float64 if student_logp.dtype == torch.float64 else torch.float32
    tiny = torch.finfo(dtype).tiny
    log_floor = math.log(tiny)
    s_lp, t_lp = student_logp.to(dtype), teacher_logp.detach().to(dtype)
    p_s, p_t = s_lp.exp(), t_lp.exp()
    log_s, log_t = s_lp.clamp(min=log_floor), t_lp.clamp(min=log_floor)
    return terms(p_s, log_s, p_t, log_t, beta)


def renormalize_support(
    teacher_logp_support: torch.Tensor,
    support_mask: torch.Tensor,
    tail_mass: torch.Tensor,
) -> torch.Tensor:
    """Teacher log-probs ``[N, S]`` rescaled so the support holds exactly ``1 - tail_mass`` ``[N]``.

    Stored teacher log-probs are quantised (the logit cache keeps 256 levels), so
    ``sum exp(logp) + tail`` is close to but not exactly 1, and ``truncated_divergence``
    would infer a wrong tail bucket (``1 - sum``). This makes (support, tail) a proper
    distribution with the stored tail: ``logp_i - logsumexp_support(logp) + log(1 - tail)``.
    The tail is clamped to ``[0, 1 - tiny]``; padding entries come back as 0 (ignored by a mask).
    Float32 (or the input's wider dtype); detached: the teacher is a constant target.
    """
    mask = _as_bool(support_mask)
    dtype = teacher_logp_support.dtype if teacher_logp_support.dtype == torch.float64 else torch.float32
    tiny = torch.finfo(dtype).tiny
    logp = teacher_logp_support.detach().to(dtype)
    masked = torch.where(mask, logp, torch.full_like(logp, float("-inf")))
    norm = torch.logsumexp(masked, dim=-1, keepdim=True)
    norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
    kept = (1.0 - tail_mass.detach().to(dtype)).clamp(min=tiny, max=1.0).log().unsqueeze(-1)
    return torch.where(mask, logp - norm + kept, torch.zeros_like(logp))


def topk_overlap(
    student_topk_ids: torch.Tensor,
    teacher_logp_support: torch.Tensor,
    support_ids: torch.Tensor,
    support_mask: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Per position ``[N]``: the share of the student's top-m tokens that the teacher ranks in its top m.

    ``m = min(k, support size)``. ``student_topk_ids`` ``[N, >= k]`` are the student's most
    probable ids, most probable first; the teacher's ranking is taken inside its stored support
    (``support_ids``, ``teacher_logp_support``, ``support_mask``: ``[N, S]``), which is exactly its
    top-k for top-k supports and contains it for nuclei and full rows. A student token counts when
    its teacher log-prob is at least the teacher's m-th largest (ties count: stored log-probs are
    quantised, so equal values are common). 1 = the same m most likely tokens, 0 = disjoint.
    Positions with an empty support give 0.
    """
    mask = _as_bool(support_mask)
    m = mask.sum(dim=-1).clamp(max=k)  # [N]
    scores = teacher_logp_support.detach().float().masked_fill(~mask, float("-inf"))
    width = min(k, scores.shape[-1])
    ranked = scores.topk(width, dim=-1).values  # [N, width], descending
    threshold = ranked.gather(-1, (m - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)  # the m-th largest
    student = student_topk_ids[..., :width]
    match = (student.unsqueeze(-1) == support_ids.unsqueeze(-2)) & mask.unsqueeze(-2)  # [N, width, S]
    teacher_of_student = torch.where(match, scores.unsqueeze(-2), torch.full_like(scores.unsqueeze(-2), float("-inf")))
    teacher_of_student = teacher_of_student.max(dim=-1).values  # [N, width]: -inf when outside the support
    in_top = (teacher_of_student >= threshold.unsqueeze(-1)) & torch.isfinite(teacher_of_student)
    in_top &= torch.arange(width, device=m.device).unsqueeze(0) < m.unsqueeze(-1)  # only the student's top m
    hits = in_top.sum(dim=-1).float()
    return torch.where(m > 0, hits / m.clamp(min=1).float(), torch.zeros_like(hits))


def domain_shares(recovered: dict[str, float], target: float, floor: float = 0.0) -> dict[str, float]:
    """Each OPD domain's share of the student's rollouts from its measured recovery (student score / teacher score).

    A domain at or above ``target`` is done; the domains not done share the rollouts in proportion to their gap to
    the teacher, ``1 - recovered``: a domain at 50% of its teacher draws twice the rollouts of one at 75%. With
    ``floor`` > 0 every domain, done or not, first gets ``floor`` (rehearsal: a done domain that draws nothing
    slips while the others train), and the rest, ``1 - n floor``, goes by the gaps (all of it to the floors
    when only done domains are left). All zeros when every domain is done (the stage ends).
    """
    gaps = {d: (1.0 - r if r < target else 0.0) for d, r in recovered.items()}
    total = sum(gaps.values())
    if total <= 0:
        return dict.fromkeys(recovered, 0.0)
    free = 1.0 - floor * len(recovered)
    return {d: floor + free * g / total for d, g in gaps.items()}


# ----------------------------------------------------------------------------
# Advantage estimators and policy losses: two registries, and presets naming a pair
# ----------------------------------------------------------------------------
#
# verl's core_algos is the model. An advantage estimator turns a batch's rewards (and the critic's values, if it
# reads them) into per-token advantages (and the critic's targets); a policy loss turns the policy's logprobs and
# those advantages into a loss. Each is a function registered by name with what the learner must know about it,
# and each takes the stage's `rl:` settings (opd_sao.config.AlgoConfig) whole, so a new setting is one field there
# read here. A preset (the config's `algo:`) names one estimator and one loss; a stage's `rl.advantage` /
# `rl.policy_loss` replace either. The learner (opd_sao/rl/learner.py) and the config's checks read only these
# registries, so adding an algorithm is one decorated function (or two) and, if it deserves a name, one preset.

@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator reads besides the settings. Per-token tensors are ``[B, T]``."""

    rewards: torch.Tensor
    action_mask: torch.Tensor
    values: Optional[torch.Tensor] = None  # the critic's V(s_t) (estimators with critic=True)
    group_ids: Optional[torch.Tensor] = None  # [B] (grouped estimators)
    baseline: float = 0.0  # the running mean of recent rewards


AdvantageFn = Callable[[AdvantageInputs, Any], tuple[torch.Tensor, Optional[torch.Tensor]]]
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any, torch.Tensor],
                        tuple[torch.Tensor, dict[str, float]]]
TokenWeightsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (action_mask, group_ids) -> [B, T]


@dataclass(frozen=True)
class AdvantageEstimator:
    """``fn(inputs, rl) -> (advantages [B, T], critic targets [B, T] or None)``."""

    name: str
    fn: AdvantageFn
    critic: bool  # reads the critic's values and gives its targets: a value model trains, K updates per policy step
    grouped: bool  # needs rollouts in groups of rollout.group_size per prompt
    token_weights: TokenWeightsFn  # the policy loss's normalisation, per token (follows how advantages were formed)

    def __call__(self, x: AdvantageInputs, rl) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.fn(x, rl)


@dataclass(frozen=True)
class PolicyLoss:
    """``fn(logp, behaviour_logp, advantages, action_mask, rl, weights) -> (loss, metrics)``."""

    name: str
    fn: PolicyLossFn
    against_rollout: bool  # behaviour logprobs: the engine's (one pass) or pi_old recomputed (rl.update_epochs)

    def __call__(self, logp, behaviour_logp, advantages, action_mask, rl, weights=None):
        return self.fn(logp, behaviour_logp, advantages, action_mask, rl, weights)


@dataclass(frozen=True)
class Preset:
    name: str
    advantage: str
    policy_loss: str
    description: str = ""


ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator")
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
PRESETS: Registry[Preset] = Registry("algo")


def register_advantage(name: str, *, critic: bool = False, grouped: bool = False,
                       token_weights: TokenWeightsFn = token_mean_weights) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: ``fn(inputs: AdvantageInputs, rl)`` becomes the advantage estimator `name` (``rl.advantage``)."""
    def decorator(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGES.register(name)(AdvantageEstimator(name, fn, critic, grouped, token_weights))
        return fn

    return decorator


def register_policy_loss(name: str, *, against_rollout: bool = True) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: ``fn(logp, behaviour_logp, advantages, action_mask, rl, weights)`` becomes the policy loss `name`
    (``rl.policy_loss``)."""
    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.register(name)(PolicyLoss(name, fn, against_rollout))
        return fn

    return decorator


def register_preset(name: str, *, advantage: str, policy_loss: str, description: str = "") -> Preset:
    """`algo: name` in a config: the estimator and the loss, by their registered names."""
    ADVANTAGES.get(advantage)  # a typo fails here, at import
    POLICY_LOSSES.get(policy_loss)
    preset = Preset(name, advantage, policy_loss, description)
    PRESETS.register(name)(preset)
    return preset


@dataclass(frozen=True)
class Algorithm:
    """What a stage trains with: an estimator and a loss."""

    advantage: AdvantageEstimator
    policy_loss: PolicyLoss

    @property
    def critic(self) -> bool:
        return self.advantage.critic

    @property
    def grouped(self) -> bool:
        return self.advantage.grouped

    @property
    def against_rollout(self) -> bool:
        return self.policy_loss.against_rollout

    @property
    def token_weights(self) -> TokenWeightsFn:
        return self.advantage.token_weights


def resolve_algorithm(algo: str, rl=None) -> Algorithm:
    """The preset `algo`'s estimator and loss, either replaced by the one ``rl.advantage`` / ``rl.policy_loss``
    names (unknown names: KeyError listing the registered ones)."""
    preset = PRESETS.get(algo)
    return Algorithm(ADVANTAGES.get(getattr(rl, "advantage", None) or preset.advantage),
                     POLICY_LOSSES.get(getattr(rl, "policy_loss", None) or preset.policy_loss))


@register_advantage("adaptive_gae", critic=True)
def sao_advantages(x: AdvantageInputs, rl) -> tuple[torch.Tensor, torch.Tensor]:
    """Skip-observation GAE with the length-adaptive lambda (rl.alpha) for the policy; the critic's targets at
    lambda 1."""
    lam = length_adaptive_lambda(_as_bool(x.action_mask).sum(-1), rl.alpha)
    # one recursion over both lambdas, the batch stacked twice (rows are independent: the same numbers)
    B = len(lam)
    advantages, returns = skip_observation_gae(*(torch.cat([t, t]) for t in (x.rewards, x.values, x.action_mask)),
                                               rl.gamma, torch.cat([lam, torch.ones_like(lam)]))
    return advantages[:B], returns[B:]


@register_advantage("gae", critic=True)
def gae_advantages(x: AdvantageInputs, rl) -> tuple[torch.Tensor, torch.Tensor]:
    """Skip-observation GAE at a fixed lambda (rl.ppo_lambda), for the policy and the critic's targets alike."""
    return skip_observation_gae(x.rewards, x.values, x.action_mask, rl.gamma, rl.ppo_lambda)


@register_advantage("grpo", grouped=True, token_weights=group_length_weights)
def group_advantages(x: AdvantageInputs, rl) -> tuple[torch.Tensor, None]:
    """GRPO: each trajectory's reward z-scored within its group, on every action token; the loss divides each
    group's token sum by the group's total response length."""
    return broadcast_sequence_advantage(grpo_advantages(x.rewards.sum(-1), x.group_ids), x.action_mask), None


@register_advantage("running_mean")
def running_mean_advantages(x: AdvantageInputs, rl) -> tuple[torch.Tensor, None]:
    """The trajectory's reward minus the running mean of the last rl.baseline_window rewards, on every action
    token."""
    return broadcast_sequence_advantage(x.rewards.sum(-1) - x.baseline, x.action_mask), None


@register_policy_loss("dis")
def dis_policy_loss(logp, behaviour_logp, advantages, action_mask, rl, weights=None):
    """DIS against the rollout engine's logprobs in the band [1 - rl.eps_low, 1 + rl.eps_high] (`sao_policy_loss`);
    `weights`: the batch's token weights."""
    return sao_policy_loss(logp, behaviour_logp, advantages, action_mask, rl.eps_low, rl.eps_high, weights)


@register_policy_loss("ppo_clip", against_rollout=False)
def ppo_policy_loss(logp, behaviour_logp, advantages, action_mask, rl, weights=None):
    """PPO clip (rl.ppo_clip) against pi_old, the trainer's own logprobs before the update (`ppo_clip_loss`)."""
    return ppo_clip_loss(logp, behaviour_logp, advantages, action_mask, rl.ppo_clip, weights)


register_preset("sao", advantage="adaptive_gae", policy_loss="dis",
                description="single rollout, critic (frozen attention, K steps), skip-observation GAE, DIS")
register_preset("ppo", advantage="gae", policy_loss="ppo_clip",
                description="GAE (fixed lambda), PPO clip against pi_old")
register_preset("grpo", advantage="grpo", policy_loss="ppo_clip",
                description="group z-score, PPO clip against pi_old, each group over its total response length")
register_preset("grpo_dis", advantage="grpo", policy_loss="dis",
                description="group z-score, DIS, each group over its total response length")
register_preset("running_mean", advantage="running_mean", policy_loss="dis",
                description="reward minus the mean of the last baseline_window rewards, DIS")
