"""The SAO critic: a copy of the policy's backbone with a scalar value head.

Frozen attention (SPEC 2.3): only MLP / expert projections and the value head train; full-parameter
critic training was unstable in the paper.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModel

from opd_sao.checkpoints import DTYPES, MODEL_INIT_LOCK

from ..modeling import position_ids_for


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32") -> "ValueModel":
        with MODEL_INIT_LOCK:  # the head's nn.init must not run while another thread loads a model
            backbone = AutoModel.from_pretrained(str(path), dtype=DTYPES[dtype], attn_implementation="eager")
            return cls(backbone, backbone.config.hidden_size)

    def freeze_attention(self) -> None:
        for name, param in self.backbone.named_parameters():
            param.requires_grad_(".mlp." in name)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_for(attention_mask)
        ).last_hidden_state
        state_values = self.value_head(hidden.float()).squeeze(-1)  # value after reading token t
        values = torch.zeros_like(state_values)
        values[:, 1:] = state_values[:, :-1]  # V(s_t): state before token t
        return values * attention_mask
