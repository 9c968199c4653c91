"""The in-process teacher: a transformers causal LM on its device, scoring with chunked lm-head passes."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from opd_sao.cache import TeacherRecord
from opd_sao.checkpoints import load_causal_lm
from opd_sao.devices import resolve_device
from opd_sao.errors import UsageError
from opd_sao.model.actions import action_hidden_states
from opd_sao.model.modeling import lm_head, vocab_rows
from opd_sao.trajectory import Trajectory

from .base import Teacher, register_teacher
from .scoring import score_rows


@register_teacher("in_process")
class InProcessTeacher(Teacher):
    def __init__(self, spec, *, score_batch_size: int = 32, vocab_chunk: int = 8192, dtype: str = "float32"):
        super().__init__(spec, score_batch_size=score_batch_size, vocab_chunk=vocab_chunk)
        self.dtype = dtype
        self.model: Optional[torch.nn.Module] = None

    def load(self, local_dir: Path) -> None:
        model = load_causal_lm(local_dir, self.dtype, resolve_device(self.spec.device)).eval()
        for param in model.parameters():
            param.requires_grad_(False)
        if model.config.vocab_size != self.spec.rows:
            raise UsageError(f"teacher {self.name!r}: {local_dir} has vocab size {model.config.vocab_size}, "
                             f"expected {self.spec.rows}")
        self.model = model

    def unload(self) -> None:
        self.model = None

    @property
    def loaded(self) -> bool:
        return self.model is not None

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) if self.model is not None else 0

    @torch.no_grad()
    def score(self, trajectories: list[Trajectory]) -> list[TeacherRecord]:
        """One decoder forward per `score_batch_size` trajectories, then the lm head on action rows in chunks."""
        if self.model is None:
            raise RuntimeError(f"teacher {self.name!r} is not loaded")
        if not trajectories:
            return []
        spec = self.spec
        hidden = action_hidden_states(self.model, trajectories, batch_size=self.score_batch_size)
        targets = torch.tensor([tok for t in trajectories for tok, m in zip(t.token_ids, t.action_mask) if m],
                               dtype=torch.long, device=hidden.device)
        weight, bias = lm_head(self.model)
        weight, bias = vocab_rows(weight, bias, spec.vocab_size)  # padded rows carry no probability
        rows = score_rows(hidden, weight, bias, targets, granularity=spec.granularity, k=spec.k, p=spec.p,
                          max_support=spec.max_support,
                          vocab_chunk=self.vocab_chunk)
        return rows.split([t.num_action_tokens for t in trajectories])
