"""The trainer backend interface: forward passes and optimizer steps for policy and critic.

The learning rule lives in `opd_sao.learner` and is backend-agnostic; a backend only knows how to
run the models and apply a loss (plain torch here, DeepSpeed ZeRO in its own backend).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from ..config import TrainerConfig
from ..trajectory import Batch


def adamw(params, lr: float, cfg: TrainerConfig) -> torch.optim.AdamW:
    """The policy's and the critic's optimizer, with the config's betas and weight decay."""
    return torch.optim.AdamW(params, lr=lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay)


class TrainerBackend(ABC):
    policy_version: int = 0
    device: torch.device  # where the models run and where the returned logprobs / values live; the Learner
    # computes its losses there, so batches go there (`Batch.to`)

    @abstractmethod
    def policy_logprobs(self, batch: Batch, temperature: float, grad: bool) -> torch.Tensor:
        """[B, T] logprob of each token under the current policy (0 at t=0 and padding), at `temperature` and
        each trajectory's sampling top_p (`batch.top_p`): the distribution the engine sampled from."""

    @abstractmethod
    def critic_values(self, batch: Batch, grad: bool) -> torch.Tensor:
        """[B, T] V(s_t): the value of the prefix before token t."""

    @abstractmethod
    def step_policy(self, loss: torch.Tensor) -> float:
        """Backward, clip, optimizer step; increments policy_version; returns the grad norm."""

    @abstractmethod
    def step_critic(self, loss: torch.Tensor) -> float: ...

    @abstractmethod
    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights for the rollout engine (full, unsharded; the engine copies them onto its own device)."""

    @property
    @abstractmethod
    def policy_model(self) -> torch.nn.Module: ...

    @abstractmethod
    def export_policy(self, out_dir: Path, tokenizer) -> Path:
        """An HF-format checkpoint loadable by plain transformers."""

    @abstractmethod
    def export_critic(self, out_dir: Path) -> Path:
        """The critic (backbone in HF format + value head), for a later stage to start from (`critic_from`)."""

    @abstractmethod
    def save_state(self, out_dir: Path) -> None:
        """Everything needed to resume: weights, optimizer states, policy version."""

    @abstractmethod
    def load_state(self, in_dir: Path) -> None: ...
