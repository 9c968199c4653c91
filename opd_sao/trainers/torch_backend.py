"""Plain torch trainer backend: one process, AdamW for policy and critic."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from opd_sao.checkpoints import load_causal_lm, save_checkpoint
from opd_sao.io.files import atomic_path

from ..config import TrainerConfig
from ..devices import mixed_precision, resolve_device
from ..model import action_full_divergence, action_support_logprobs, sequence_logprobs
from ..trajectory import Batch
from .base import (
    SupportLogprobs,
    TrainerBackend,
    action_rows_of,
    adamw,
    lr_scheduler,
    prepare,
    require_finite,
    split,
    weights_dtype,
)
from .critic import ValueModel
from .micro_batches import Deferred, Outputs, Rows, micro_forward, widen


class TorchTrainer(TrainerBackend):
    def __init__(self, checkpoint: str | Path, cfg: TrainerConfig, *, with_critic: bool = True,
                 critic_from: str | Path | None = None, attn_implementation: str = "eager",
                 total_steps: Optional[int] = None):
        """`total_steps`: the stage's policy steps, where a cosine lr schedule ends (the critic's: x critic_steps)."""
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        # master weights: see precision()
        self.policy = prepare(load_causal_lm(checkpoint, weights_dtype(cfg), self.device, attn_implementation), cfg)
        self.policy_opt = adamw(self.policy.parameters(), cfg.policy_lr, cfg)
        self.policy_sched = lr_scheduler(self.policy_opt, cfg, total_steps)
        self.critic = None
        if with_critic:
            self.critic = ValueModel.from_pretrained(str(critic_from or checkpoint), weights_dtype(cfg),
                                                     attn_implementation)
            self.critic = prepare(self.critic.to(self.device), cfg)
            if cfg.freeze_critic_attention:
                self.critic.freeze_attention(cfg.critic_trained_layers)
            trainable = [p for p in self.critic.parameters() if p.requires_grad]
            self.critic_opt = adamw(trainable, cfg.critic_lr, cfg)
            self.critic_sched = lr_scheduler(self.critic_opt, cfg, total_steps and total_steps * cfg.critic_steps)
        self._deferred: dict[str, list[Deferred]] = {"policy": [], "critic": []}
        self.policy_version = 0

    @property
    def policy_model(self) -> torch.nn.Module:
        return self.policy

    def precision(self):
        """Mixed precision: the weights and AdamW stay float32 and `trainer.dtype` is the forward's compute
        dtype (as DeepSpeed's bf16 mode and FSDP's mixed precision do); checkpoints are written in float32."""
        return mixed_precision(self.device, self.cfg.dtype)

    def _run(self, kind: str, forward, rows: Rows, grad: bool, support: bool = False) -> Outputs:
        """`forward(rows of the batch, output rows)` over the batch's micro-batches (see micro_batches)."""
        parts = split(rows, self.cfg)
        out_rows = action_rows_of(rows, parts) if support else parts
        total = int(rows.action_rows()[-1]) if support else len(rows)
        outputs, deferred = micro_forward(forward, parts, out_rows, total, grad)
        if deferred is not None:
            self._deferred[kind].append(deferred)
        return outputs

    def policy_logprobs(self, batch: Batch, temperature: float, grad: bool) -> torch.Tensor:
        rows, width = Rows.of(batch, top_p=True, actions=True), batch.input_ids.shape[1]

        def forward(part, _):
            r = rows.take(part, self.device)
            with self.precision():
                return (widen(sequence_logprobs(self.policy, r.input_ids, r.attention_mask, temperature,
                                                   top_p=r.top_p, only=r.action_mask), width),)

        return self._run("policy", forward, rows, grad)[0]

    def policy_support_logprobs(self, batch: Batch, support_ids, support_mask, *, vocab_chunk: int,
                                top_k: int, vocab_size=None) -> SupportLogprobs:
        rows = Rows.of(batch, actions=True)

        def forward(part, where):
            r = rows.take(part, self.device)
            ids, mask = (None, None) if support_ids is None else (support_ids[where.to(support_ids.device)],
                                                                  support_mask[where.to(support_mask.device)])
            with self.precision():
                logp, tail, top = action_support_logprobs(self.policy, r.input_ids, r.attention_mask, r.action_mask,
                                                          ids, mask, vocab_chunk=vocab_chunk, top_k=top_k,
                                                          vocab_size=vocab_size)
            return (logp, tail) if top is None else (logp, tail, top)

        outputs = self._run("policy", forward, rows, True, support=True)
        return outputs[0], outputs[1], outputs[2] if len(outputs) > 2 else None

    def policy_full_divergence(self, batch: Batch, teacher, terms, *, report=None, vocab_chunk: int, top_k: int,
                               vocab_size=None):
        rows = Rows.of(batch, actions=True)

        def forward(part, where):
            r = rows.take(part, self.device)
            index = where.nonzero().squeeze(1) if where.dtype == torch.bool else where

            def local(block, start, end):  # the kernel's rows are this micro-batch's
                return teacher(index[block], start, end)

            with self.precision():
                return action_full_divergence(self.policy, r.input_ids, r.attention_mask, r.action_mask, local, terms,
                                              report=report, vocab_chunk=vocab_chunk, top_k=top_k,
                                              vocab_size=vocab_size)

        outputs = self._run("policy", forward, rows, True, support=True)
        return outputs[0], outputs[1].detach(), outputs[2] if len(outputs) > 2 else None

    def critic_step(self):
        return self.critic.reusing_frozen_start() if self.critic is not None else super().critic_step()

    def critic_values(self, batch: Batch, grad: bool) -> torch.Tensor:
        if self.critic is None:
            raise RuntimeError("this trainer was built without a critic (the algorithm needs none)")
        rows, width = Rows.of(batch, actions=True), batch.input_ids.shape[1]

        def forward(part, _):
            r = rows.take(part, self.device)
            with self.precision():
                return (widen(self.critic(r.input_ids, r.attention_mask, r.action_mask), width),)

        return self._run("critic", forward, rows, grad)[0]

    def _step(self, kind: str, loss, model, opt, sched) -> float:
        """The loss's backward; each micro-batched forward's share re-run and accumulated; clip; one step at the
        schedule's lr."""
        opt.zero_grad(set_to_none=True)
        deferred, self._deferred[kind] = self._deferred[kind], []
        require_finite(f"{kind} loss", loss)
        loss.backward()
        for forward in deferred:
            for surrogate in forward.surrogates([leaf.grad for leaf in forward.leaves]):
                surrogate.backward()
        # the optimizer's own list: a walk over the model's modules for its trainable parameters cost 0.5 ms a step
        params = [p for group in opt.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        if not torch.isfinite(norm):  # never applied: the weights stay as they were
            opt.zero_grad(set_to_none=True)
            require_finite(f"{kind} gradient norm", norm)
        opt.step()
        sched.step()
        return float(norm)

    def step_policy(self, loss: torch.Tensor) -> float:
        norm = self._step("policy", loss, self.policy, self.policy_opt, self.policy_sched)
        self.policy_version += 1
        return norm

    def step_critic(self, loss: torch.Tensor) -> float:
        return self._step("critic", loss, self.critic, self.critic_opt, self.critic_sched)

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.policy.state_dict().items()}

    def export_policy(self, out_dir: Path, tokenizer) -> Path:
        return save_checkpoint(self.policy, tokenizer, out_dir)

    def export_critic(self, out_dir: Path) -> Path:
        if self.critic is None:
            raise RuntimeError("this trainer was built without a critic (the algorithm needs none)")
        return self.critic.save_pretrained(out_dir)

    def save_state(self, out_dir: Path) -> None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        state = {"policy": self.policy.state_dict(), "policy_opt": self.policy_opt.state_dict(),
                 "policy_sched": self.policy_sched.state_dict()}
        if self.critic is not None:
            state.update(critic=self.critic.state_dict(), critic_opt=self.critic_opt.state_dict(),
                         critic_sched=self.critic_sched.state_dict())
        with atomic_path(out_dir / "trainer_state.pt") as tmp:
            torch.save(state, tmp)
        (out_dir / "trainer_meta.json").write_text(json.dumps({"policy_version": self.policy_version}))

    def load_state(self, in_dir: Path) -> None:
        state = torch.load(Path(in_dir) / "trainer_state.pt", weights_only=True, map_location=self.device)
        self.policy.load_state_dict(state["policy"])
        self.policy_opt.load_state_dict(state["policy_opt"])
        self.policy_sched.load_state_dict(state["policy_sched"])
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])
            self.critic_sched.load_state_dict(state["critic_sched"])
        self.policy_version = json.loads((Path(in_dir) / "trainer_meta.json").read_text())["policy_version"]
