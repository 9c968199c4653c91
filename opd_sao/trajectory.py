"""The one record every component exchanges: a trajectory, and its padded tensor view."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

import orjson
import torch


@dataclass
class Trajectory:
    """prompt, then response tokens: model actions (mask 1) interleaved with observations (mask 0).

    Per-response-token lists all have len(token_ids). `rollout_logp` is what the engine that sampled
    the token assigned to it (0 on observations); `versions` is the policy version that sampled it
    (-1 on observations); `rewards` may sit on any position (GAE credits non-action rewards back).
    """

    traj_id: str
    domain: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    rollout_logp: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    finish_reason: str = ""
    temperature: float = 1.0
    top_p: float = 1.0
    meta: dict[str, Any] = field(default_factory=dict)

    def append(self, ids, *, action: bool, logp=None, versions=None) -> None:
        """Actions come with the engine's logprobs and versions; observations with neither."""
        ids = list(ids)
        if action and (logp is None or versions is None or not len(logp) == len(versions) == len(ids)):
            raise ValueError("an action span needs one logprob and one version per token")
        self.token_ids += ids
        self.action_mask += [int(action)] * len(ids)
        self.rollout_logp += list(logp) if action else [0.0] * len(ids)
        self.versions += list(versions) if action else [-1] * len(ids)
        self.rewards += [0.0] * len(ids)

    def add_reward(self, reward: float) -> None:
        """A reward arrives after the latest token (GAE credits it to the preceding action)."""
        if not self.rewards:
            raise ValueError(f"trajectory {self.traj_id} has no tokens to attach a reward to")
        self.rewards[-1] += float(reward)

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def num_action_tokens(self) -> int:
        return int(sum(self.action_mask))

    @property
    def min_version(self) -> int:
        acted = [v for v, m in zip(self.versions, self.action_mask) if m]
        return min(acted) if acted else -1

    def to_json(self) -> str:
        """The write-ahead record: the fields as they are (dataclasses.asdict's deep copy cost more than the rest of
        the record). orjson (a tenth of json's time on the float lists) where its line parses back to the same
        values: it writes a non-finite float as null, so a line with a null (a None, a NaN, or a string holding
        "null") and anything orjson refuses (a non-string key) are json's, which writes NaN and Infinity."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        try:
            line = orjson.dumps(record)
        except TypeError:
            return json.dumps(record)
        return line.decode() if b"null" not in line else json.dumps(record)

    @classmethod
    def from_json(cls, line: str) -> "Trajectory":
        return cls(**json.loads(line))


@dataclass
class Batch:
    """Right-padded tensors over full sequences (prompt + response); position t is token t."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    action_mask: torch.Tensor  # [B, T] float
    rollout_logp: torch.Tensor  # [B, T] float
    rewards: torch.Tensor  # [B, T] float
    versions: torch.Tensor  # [B, T] long
    trajectories: list[Trajectory]

    @property
    def top_p(self) -> torch.Tensor:
        """[B] the nucleus each trajectory was sampled with: the trainer scores under the same distribution."""
        return torch.tensor([t.top_p for t in self.trajectories], dtype=torch.float32)

    @property
    def traj_ids(self) -> list[str]:
        return [t.traj_id for t in self.trajectories]

    def to(self, device: torch.device) -> "Batch":
        """The same batch with every tensor on `device` (the trainer's: its losses are computed there)."""
        return Batch(*(getattr(self, name).to(device) for name in _BATCH_TENSORS), self.trajectories)

    def select(self, keep: torch.Tensor) -> "Batch":
        """The trajectories where `keep` [B] bool is set, in order, as a batch of the same width."""
        index = keep.nonzero().squeeze(1)
        return Batch(*(getattr(self, name)[index.to(self.input_ids.device)] for name in _BATCH_TENSORS),
                     [self.trajectories[i] for i in index.tolist()])


_BATCH_TENSORS = ("input_ids", "attention_mask", "action_mask", "rollout_logp", "rewards", "versions")


def collate(trajectories: list[Trajectory], pad_id: int) -> Batch:
    """Right-padded [B, T] tensors, each built in one call from padded rows (a tensor copy per row and field cost
    more than the rest of a small model's learner step)."""
    if not trajectories:
        raise ValueError("cannot collate an empty list of trajectories")
    width = max(len(t.prompt_ids) + len(t.token_ids) for t in trajectories)

    def rows(full_row, fill, dtype):
        """`full_row(t)`: the row over prompt + response, right-padded with `fill` to the batch's width."""
        out = []
        for t in trajectories:
            row = full_row(t)
            out.append(row + [fill] * (width - len(row)))
        return torch.tensor(out, dtype=dtype)

    def response(name, outside, dtype):  # a per-response-token field; `outside` on the prompt and the padding
        return rows(lambda t: [outside] * len(t.prompt_ids) + getattr(t, name), outside, dtype)

    real = torch.get_default_dtype()
    input_ids = rows(lambda t: t.prompt_ids + t.token_ids, pad_id, torch.long)
    attention = rows(lambda t: [1] * (len(t.prompt_ids) + len(t.token_ids)), 0, torch.long)
    action = response("action_mask", 0, real)
    rollout_logp = response("rollout_logp", 0.0, real)
    rewards = response("rewards", 0.0, real)
    versions = response("versions", -1, torch.long)
    return Batch(input_ids, attention, action, rollout_logp, rewards, versions, list(trajectories))
