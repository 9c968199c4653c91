"""Context compaction for long agent episodes ("SAO with compaction", docs/design.md §3, the GLM-5.3 notes).

When an episode's context passes `rollout.compaction_budget` tokens, the episode appends a fixed
instruction to the latest observation and the model writes a summary. That summary is an action
(mask 1, sampled logprobs, trained like any other). The episode then continues from
`first prompt + summary + latest observation` instead of the whole history.

Why segments: after compaction the engine conditions on a shorter context than the history so far, so
one trajectory holding everything would make the trainer recompute later actions' logprobs over a
prefix the engine never saw (DIS ratios and the consistency gate would both be wrong). So the current
trajectory ends at the summary (finish_reason "compacted") and the episode goes on as a NEW trajectory
segment whose prompt is the compacted context: every segment's `prompt_ids + token_ids` is exactly what
the engine saw, and the trainer scores each with its own prefix. `meta` carries `episode` (the first
segment's id) and `segment` (0, 1, ...).

Credit: a segment ends before the episode does, so when the episode ends the rewards of all later
segments are added to each earlier segment's last token (its summary). With gamma = 1, every token's
return is then the episode's reward-to-go, as if the episode had never been cut; the first segment's
total reward is the episode's.
"""
from __future__ import annotations

from dataclasses import dataclass

from opd_sao.trajectory import Trajectory


@dataclass(frozen=True)
class Compaction:
    budget: int  # context tokens (prompt + history + latest observation) past which the episode compacts
    instruction: str  # the fixed observation that asks for the summary

    @classmethod
    def from_rollout(cls, rollout) -> "Compaction | None":
        """The stage's compaction settings, or None when `rollout.compaction` is off."""
        return cls(rollout.compaction_budget, rollout.compaction_instruction) if rollout.compaction else None


def next_segment(segments: list[Trajectory], summary_ids: list[int], observation_ids: list[int]) -> Trajectory:
    """The trajectory an episode continues in after a summary: prompt = first prompt + summary + observation."""
    first, last = segments[0], segments[-1]
    index = len(segments)
    return Trajectory(
        traj_id=f"{first.traj_id}-s{index}", domain=first.domain,
        prompt_ids=first.prompt_ids + list(summary_ids) + list(observation_ids),
        temperature=first.temperature, top_p=first.top_p,
        meta={**last.meta, "episode": first.traj_id, "segment": index, "turns": 0},
    )


def propagate_returns(segments: list[Trajectory]) -> None:
    """Add every later segment's rewards to each earlier segment's last token (reward-to-go, gamma = 1)."""
    later = 0.0
    for segment in reversed(segments):
        own = segment.total_reward
        if later:
            segment.add_reward(later)
        later += own
