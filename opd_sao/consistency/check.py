"""Train/inference logprob consistency (docs/design.md §5): does the trainer agree with the engine that sampled?

For every sampled action token of a batch of rollouts, the trainer's model (at the rollouts' policy
version) recomputes the token's logprob under the distribution the engine sampled from (the rollout's
temperature, renormalised on the top-p nucleus when top_p < 1) and the result is compared with the
engine's `rollout_logp`. Versions come first: a rollout sampled by another policy version than the
trainer's is a version error, never counted as drift.

Two ways to recompute:
- chunked (default): one batched, right-padded forward to the final hidden states, then the lm head a
  block of rows and a chunk of the vocabulary at a time (`modeling.token_logprobs`, the trainer's own
  path), so a long sequence never materialises a [T, V] float32 tensor (benchmarks/consistency_memory.py);
- alone (deterministic mode): each action span scored with its prefix alone, unpadded, by
  `sequence_logprobs`: batch-invariant, the same function the deterministic embedded engine recomputes with.

The engine's side is always what it sampled with (`rollout_logp`, the behaviour policy's logprobs); a
deterministic engine's batch-invariant recomputation is kept beside it (`meta["recomputed_logp"]`) and only
reported, as `sampler_drift`: a sampler fault (padding ignored, a wrong temperature) is their difference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable, Optional

import numpy as np
import torch

from opd_sao.algorithms import dis_weights
from opd_sao.model.actions import action_hidden_states, model_device
from opd_sao.model.modeling import hidden_states, lm_head, sequence_logprobs, token_logprobs
from opd_sao.trajectory import Trajectory

# ----------------------------------------------------------------------------
# the estimators
# ----------------------------------------------------------------------------

def kl_estimators(delta: torch.Tensor) -> tuple[float, float]:
    """(k1, k3) estimates of KL(rollout || trainer) from tokens sampled by the rollout policy.

    delta = log pi_train - log pi_rollout, r = exp(delta). k1 = mean(-delta) is unbiased but noisy and
    can come out negative; k3 = mean((r - 1) - delta) is unbiased too, non-negative per token and of
    lower variance (Schulman, "Approximating KL divergence", 2020). Both are 0 when the two agree.
    """
    delta = delta.double()
    return float((-delta).mean()), float((torch.expm1(delta) - delta).mean())


def position_buckets(max_position: int) -> list[tuple[int, int]]:
    """[0,1), [1,2), [2,4), [4,8), ...: doubling buckets resolve the first tokens of a response and
    still summarise thousands of late ones in a few rows (drift that grows with position shows up as a
    rising tail: positional-encoding or KV-cache mismatches)."""
    edges, start, end = [], 0, 1
    while start <= max_position:
        edges.append((start, end))
        start, end = end, end * 2
    return edges


def drift_by_position(abs_diff: torch.Tensor, positions: torch.Tensor) -> list[dict]:
    """Mean and max |delta logp| per response-position bucket (position 0 is the first response token)."""
    rows = []
    for start, end in position_buckets(int(positions.max()) if len(positions) else -1):
        inside = (positions >= start) & (positions < end)
        if inside.any():
            rows.append({"start": start, "end": end, "tokens": int(inside.sum()),
                         "mean_abs_diff": float(abs_diff[inside].double().mean()),
                         "max_abs_diff": float(abs_diff[inside].max())})
    return rows


# ----------------------------------------------------------------------------
# the rows compared: one per sampled action token
# ----------------------------------------------------------------------------

@dataclass
class ActionTokens:
    """Every compared action token, flattened in trajectory order, then token order."""

    trajectory: torch.Tensor  # [N] index into the compared trajectories
    position: torch.Tensor  # [N] index within the response (0: first response token)
    target: torch.Tensor  # [N] the sampled token id
    rollout_logp: torch.Tensor  # [N] what the engine recorded
    temperature: torch.Tensor  # [N]
    top_p: torch.Tensor  # [N]

    @classmethod
    def of(cls, trajectories: list[Trajectory]) -> "ActionTokens":
        rows = [(i, j, traj.token_ids[j], traj.rollout_logp[j], traj.temperature, traj.top_p)
                for i, traj in enumerate(trajectories) for j, acted in enumerate(traj.action_mask) if acted]
        cols = list(zip(*rows)) if rows else [()] * 6
        return cls(*(torch.tensor(c, dtype=torch.long) for c in cols[:3]),
                   *(torch.tensor(c, dtype=torch.float32) for c in cols[3:]))

    def __len__(self) -> int:
        return len(self.target)

    def to(self, device) -> "ActionTokens":
        return ActionTokens(*(getattr(self, f.name).to(device) for f in fields(self)))


def chunked_logprobs(model, trajectories: list[Trajectory], tokens: ActionTokens, *, temperature_scale: float = 1.0,
                     padding: str = "right") -> torch.Tensor:
    """[N] the trainer's logprob of each action token, at `temperature_scale` x the rollout's temperature."""
    weight, bias = lm_head(model)
    hidden = action_hidden_states(model, trajectories, padding=padding)
    on = tokens.to(hidden.device)
    with torch.no_grad():
        return token_logprobs(hidden, weight, bias, on.target, on.temperature * temperature_scale, on.top_p).cpu()


@torch.no_grad()
def alone_logprobs(model, trajectories: list[Trajectory]) -> torch.Tensor:
    """[N] each action span scored with its prefix alone, unpadded, as the deterministic engine recomputes it.

    top_p = 1: `sequence_logprobs`, the very function the engine's deterministic mode calls, so equal
    weights give bitwise-equal numbers to its recomputation (not to its sampled logprobs). top_p < 1 (the engine keeps its sampled logprobs there): the
    nucleus-renormalised logprobs of the same unpadded hidden states. One forward per span, like the engine.
    """
    out, device = [], model_device(model)
    weight, bias = lm_head(model)
    for traj in trajectories:
        p = len(traj.prompt_ids)
        for start, end in action_spans(traj.action_mask):
            ids = torch.tensor([traj.prompt_ids + traj.token_ids[:end]], device=device)
            if traj.top_p >= 1.0:
                logp = sequence_logprobs(model, ids, torch.ones_like(ids), traj.temperature)[0, p + start:p + end]
            else:
                hidden = hidden_states(model, ids, torch.ones_like(ids))[0, p + start - 1:p + end - 1]
                n = end - start
                logp = token_logprobs(hidden, weight, bias, ids[0, p + start:p + end],
                                      torch.full((n,), traj.temperature), torch.full((n,), traj.top_p))
            out.append(logp.float().cpu())
    return torch.cat(out) if out else torch.empty(0)


def action_spans(action_mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of action tokens (one engine generation per run)."""
    spans, start = [], None
    for j, acted in enumerate(list(action_mask) + [0]):
        if acted and start is None:
            start = j
        elif not acted and start is not None:
            spans.append((start, j))
            start = None
    return spans


# ----------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------

@dataclass
class ConsistencyReport:
    trainer_version: int
    mode: str  # "trainer" (the trainer backend's batched forward), "chunked" or "alone"
    eps_low: float
    eps_high: float
    sequences: int  # compared (version errors excluded)
    tokens: int
    mean_abs_diff: Optional[float] = None  # None when no token was compared
    max_abs_diff: Optional[float] = None
    p50_abs_diff: Optional[float] = None
    p99_abs_diff: Optional[float] = None
    k1_kl: Optional[float] = None
    k3_kl: Optional[float] = None
    ratio_min: Optional[float] = None
    ratio_max: Optional[float] = None
    mask_fraction: Optional[float] = None  # of tokens DIS would mask at (eps_low, eps_high)
    drift_by_position: list[dict] = field(default_factory=list)
    version_errors: list[dict] = field(default_factory=list)
    trajectories: list[Trajectory] = field(default_factory=list, repr=False)  # the compared ones
    tokens_detail: Optional[ActionTokens] = field(default=None, repr=False)
    trainer_logp: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def abs_diff(self) -> torch.Tensor:
        return (self.trainer_logp - self.tokens_detail.rollout_logp).abs()

    def to_dict(self) -> dict:
        """JSON-ready numbers (non-finite values as strings: strict JSON has no Infinity)."""
        skip = {"trajectories", "tokens_detail", "trainer_logp"}
        return {k: _jsonable(v) for k, v in self.__dict__.items() if k not in skip}


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def version_errors(trajectories: list[Trajectory], version: int) -> list[dict]:
    """Rollouts with an action token sampled by another policy version than the trainer's."""
    errors = []
    for traj in trajectories:
        seen = sorted({v for v, m in zip(traj.versions, traj.action_mask) if m})
        if seen and seen != [version]:
            errors.append({"traj_id": traj.traj_id, "rollout_versions": seen, "trainer_version": version})
    return errors


def compare(trainer_logp: torch.Tensor, tokens: ActionTokens, *, eps_low: float, eps_high: float) -> dict:
    """The drift numbers of trainer vs rollout logprobs over the compared tokens."""
    delta = trainer_logp.double() - tokens.rollout_logp.double()
    abs_diff = delta.abs()
    p50, p99 = np.quantile(abs_diff.numpy(), [0.5, 0.99])
    k1, k3 = kl_estimators(delta)
    ratio = delta.exp()
    _, keep = dis_weights(trainer_logp, tokens.rollout_logp, eps_low, eps_high)
    return {
        "mean_abs_diff": float(abs_diff.mean()), "max_abs_diff": float(abs_diff.max()),
        "p50_abs_diff": float(p50), "p99_abs_diff": float(p99), "k1_kl": k1, "k3_kl": k3,
        "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max()),
        "mask_fraction": float((~keep).double().mean()),
        "drift_by_position": drift_by_position(abs_diff, tokens.position),
    }


def sampler_drift(trajectories: list[Trajectory]) -> Optional[dict]:
    """Mean and max |sampled - recomputed| logprob over the action tokens of the rollouts a deterministic engine
    rescored alone (`meta["recomputed_logp"]`); None when none was. The engine against itself: nonzero beyond
    float rounding means its sampler's logprobs are not what its own model gives the sequence unbatched."""
    sampled, recomputed = [], []
    for traj in trajectories:
        again = traj.meta.get("recomputed_logp")
        if again is not None:
            sampled += [lp for lp, m in zip(traj.rollout_logp, traj.action_mask) if m]
            recomputed += again
    if not sampled or len(sampled) != len(recomputed):
        return None
    diff = (torch.tensor(sampled, dtype=torch.float64) - torch.tensor(recomputed, dtype=torch.float64)).abs()
    return {"tokens": len(sampled), "mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max())}


def check(trajectories: list[Trajectory], model, *, version: int, eps_low: float = 0.3, eps_high: float = 5.0,
          alone: bool = False, trainer: Optional[Callable[[list[Trajectory]], torch.Tensor]] = None) -> ConsistencyReport:
    """Compare the rollouts' logprobs with `model`'s (the trainer's policy at policy version `version`; None with
    `trainer` where no rank holds the whole policy: ZeRO-3).

    `trainer(trajectories) -> [N]` scores with the trainer's own batched training forward (what the gate
    uses, in every mode: so a fault in the trainer's forward is never hidden by a checker that shares the
    engine's kernel). Otherwise alone=True is the deterministic-mode checker (`alone_logprobs`, batch-invariant:
    `opd-sao audit --deterministic`), and the default the chunked one. Either way the engine's side is its
    sampled logprobs.
    """
    errors = version_errors(trajectories, version)
    compared = [t for t in trajectories if t.num_action_tokens and not version_errors([t], version)]
    mode = "trainer" if trainer is not None else "alone" if alone else "chunked"
    report = ConsistencyReport(version, mode, eps_low, eps_high,
                               sequences=len(compared), tokens=0, version_errors=errors, trajectories=compared)
    if not compared:
        return report
    tokens = ActionTokens.of(compared)
    was_training = model is not None and model.training
    if model is not None:
        model.eval()
    try:
        with torch.no_grad():
            if trainer is not None:
                trainer_logp = trainer(compared).float().cpu()
            else:
                trainer_logp = alone_logprobs(model, compared) if alone else chunked_logprobs(model, compared, tokens)
    finally:
        if model is not None:
            model.train(was_training)
    report.tokens, report.tokens_detail, report.trainer_logp = len(tokens), tokens, trainer_logp
    for key, value in compare(trainer_logp, tokens, eps_low=eps_low, eps_high=eps_high).items():
        setattr(report, key, value)
    return report
