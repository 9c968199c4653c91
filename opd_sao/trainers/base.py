"""The trainer backend interface: forward passes and optimizer steps for policy and critic.

The learning rule lives in `opd_sao.rl.learner` and is backend-agnostic; a backend only knows how to
run the models and apply a loss (plain torch here, DeepSpeed ZeRO in its own backend).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import torch
import transformers

from ..config import TrainerConfig
from ..model import SupportLogprobs, keep_transformers, use_own
from ..trajectory import Batch
from .micro_batches import Rows, micro_batches


class NonFiniteError(ValueError):
    """A loss, gradient or weight that is NaN or infinite, refused before the optimizer applies it (and so before
    any state or checkpoint holds it); the loop adds the step and the batch that produced it."""


def require_finite(what: str, value: torch.Tensor) -> None:
    """Raise NonFiniteError unless every element of `value` (a loss, a gradient norm) is finite."""
    if not bool(torch.isfinite(value.detach()).all()):
        raise NonFiniteError(f"the {what} is {float(value.detach().float().flatten()[0])}")


def nonfinite_parameters(*models: Optional[torch.nn.Module]) -> list[str]:
    """Names of the parameters holding a NaN or an infinity (checked before a state or checkpoint is written)."""
    return [name for model in models if model is not None for name, p in model.named_parameters()
            if not bool(torch.isfinite(p.detach()).all())]


def adamw(params, lr: float, cfg: TrainerConfig) -> torch.optim.AdamW:
    """The policy's and the critic's optimizer, with the config's betas and weight decay.

    Fused (one kernel over every tensor, on CPU as on CUDA) where every parameter allows it: the same update as
    torch's default per-tensor loop, which costs 1.1 ms a step on the tiny model against the fused 0.2 ms."""
    params = list(params)
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay,
                             fused=fused or None)


def lr_scheduler(optimizer, cfg: TrainerConfig, total_steps: Optional[int]) -> torch.optim.lr_scheduler.LambdaLR:
    """`trainer.lr_schedule` on an optimizer that takes `total_steps` steps in the stage: transformers' schedulers.

    linear_warmup and cosine are transformers' cosine to a floor, whose warm-up of n steps starts at 1/n of the lr
    (no step at lr 0): n = warmup_steps + 1 puts step k of the warm-up at (k + 1) / (warmup_steps + 1) and the
    floor at the stage's last step, total_steps - 1 (a stage takes no step past it). linear_warmup is that with
    the floor at 1."""
    if cfg.lr_schedule == "constant":
        return transformers.get_constant_schedule(optimizer)
    if cfg.lr_schedule == "cosine" and not total_steps:
        raise ValueError("trainer.lr_schedule cosine needs the number of optimizer steps it decays over")
    return transformers.get_cosine_with_min_lr_schedule_with_warmup_lr_rate(
        optimizer, num_warmup_steps=cfg.warmup_steps + 1, num_training_steps=total_steps or cfg.warmup_steps + 1,
        min_lr_rate=cfg.min_lr_ratio if cfg.lr_schedule == "cosine" else 1.0)


def weights_dtype(cfg: TrainerConfig) -> str:
    """The dtype the trained weights are kept in: float32 master weights (bfloat16 only computes), or float64."""
    return "float64" if cfg.dtype == "float64" else "float32"


def prepare(model: torch.nn.Module, cfg: TrainerConfig) -> torch.nn.Module:
    """Train mode, an explicit `trainer.own_forward` (unset, `llama_forward.serves` decides by where the parameters
    are at each call: after DeepSpeed has moved them too), and `trainer.gradient_checkpointing` (transformers'
    activation checkpointing, formerly gradient_checkpointing_enable: each decoder layer, in train mode only;
    non-reentrant, so the chunked lm head and DeepSpeed's hooks see ordinary autograd)."""
    model.train()
    if cfg.own_forward:
        use_own(getattr(model, "backbone", model))  # the critic's backbone
    elif cfg.own_forward is False:
        keep_transformers(getattr(model, "backbone", model))
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        # transformers then makes the embeddings' output require grad (for adapters under reentrant checkpointing,
        # which needs a differentiable input): non-reentrant checkpointing does not, and with it a frozen prefix
        # (the critic's attention, or all but its last critic_trained_layers) would be differentiated for nothing
        getattr(model, "backbone", model).disable_input_require_grads()
    return model


def split(rows: Rows, cfg: TrainerConfig) -> list[torch.Tensor]:
    """The micro-batches of these rows under `trainer.micro_batch_size` / `max_tokens_per_micro_batch`."""
    return micro_batches(rows.lengths(), cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)


def action_rows_of(rows: Rows, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each micro-batch's rows of a support output (one row per action token, trajectory order)."""
    starts = rows.action_rows()
    out = []
    for part in parts:
        first, count = starts[part], starts[part + 1] - starts[part]
        # each row's range first .. first + count, concatenated: an arange shifted by each range's offset
        shift = torch.repeat_interleave(first - (count.cumsum(0) - count), count)
        out.append(torch.arange(int(count.sum()), dtype=torch.long) + shift)
    return out


class TrainerBackend(ABC):
    policy_version: int = 0
    device: torch.device  # where the models run and where the returned logprobs / values live; the Learner
    # computes its losses there, so batches go there (`Batch.to`)

    @abstractmethod
    def policy_logprobs(self, batch: Batch, temperature: float, grad: bool) -> torch.Tensor:
        """[B, T] logprob of each action token under the current policy, at `temperature` and each trajectory's
        sampling top_p (`batch.top_p`): the distribution the engine sampled from. Every caller reads action
        positions only, so a backend may leave the others 0 (the torch backend does: no lm head for prompts
        and observations; the DeepSpeed backend scores every real position)."""

    @abstractmethod
    def policy_support_logprobs(self, batch: Batch, support_ids: Optional[torch.Tensor],
                                support_mask: Optional[torch.Tensor], *, vocab_chunk: int,
                                top_k: int, vocab_size: Optional[int] = None) -> SupportLogprobs:
        """The policy's temperature-1 distribution at every action token of `batch` (rows: trajectory order,
        then position) on a support (OPD's divergences): (log-probs on `support_ids` [N, S] (0 where
        `support_mask` is False), log of the exact mass outside the support [N], the top_k most probable ids
        [N, top_k] (no grad; None when top_k is 0)), differentiable for the next `step_policy`.
        `support_ids` None is the whole vocabulary: the [N, V] log-softmax and a tail of log(tiny).
        `vocab_size`: the distribution over the first vocab_size ids only (rows past the tokenizer's ids are
        embedding padding, masked as the teacher's are)."""

    def policy_full_divergence(self, batch: Batch, teacher, terms, *, report=None, vocab_chunk: int, top_k: int,
                               vocab_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                          Optional[torch.Tensor]]:
        """OPD's `full` granularity: per action row of `batch` (trajectory order, then position), the sum over the
        whole vocabulary of `terms(student logp, teacher logp)` (elementwise; differentiable for the next
        `step_policy`), the same sum of `report`'s terms (no grad; zeros without one) and the student's top_k
        most probable ids (None when top_k is 0). `teacher(rows, start, end)` gives the teacher's logprobs of
        action rows `rows` (an index tensor) on vocabulary columns [start, end).

        This default reads the policy's whole [N, V] log-softmax (`policy_support_logprobs`), for a backend whose
        lm head cannot be streamed (ZeRO-3: its weight exists only inside the model's forward); the torch
        backend streams it, chunk by chunk, never [N, V] (`modeling.streamed_divergence`)."""
        logp, _, top = self.policy_support_logprobs(batch, None, None, vocab_chunk=vocab_chunk, top_k=top_k,
                                                    vocab_size=vocab_size)
        target = teacher(torch.arange(len(logp), device=logp.device), 0, logp.shape[1]).to(logp)
        extra = report(logp.detach(), target).sum(1) if report is not None else torch.zeros(len(logp))
        return terms(logp, target).sum(1), extra.to(logp.device), top

    def critic_step(self):
        """The scope of one step's critic forwards over one batch (its K updates and the values after them), where
        a backend may reuse what depends on frozen weights alone (TorchTrainer: `ValueModel.reusing_frozen_start`)."""
        return nullcontext()

    @abstractmethod
    def critic_values(self, batch: Batch, grad: bool) -> torch.Tensor:
        """[B, T] V(s_t): the value of the prefix before token t, at the batch's action tokens (0 elsewhere: GAE and
        the value loss read no other)."""

    @abstractmethod
    def step_policy(self, loss: torch.Tensor) -> float:
        """Backward, clip, optimizer step; increments policy_version; returns the grad norm. `loss` may read
        every grad=True policy forward since the last step (e.g. OPD's sampled and divergence terms)."""

    @abstractmethod
    def step_critic(self, loss: torch.Tensor) -> float: ...

    @abstractmethod
    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights for the rollout engine (full, unsharded; the engine copies them onto its own device)."""

    @property
    @abstractmethod
    def policy_model(self) -> torch.nn.Module: ...

    def nonfinite_weights(self) -> list[str]:
        """Names of the policy's and critic's parameters holding a NaN or an infinity (checked before a state is
        written). A backend whose weights are partitioned checks every rank's shard."""
        return nonfinite_parameters(self.policy_model, getattr(self, "critic", None))

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
