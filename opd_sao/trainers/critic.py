"""The SAO critic: a copy of the policy's backbone with a scalar value head.

Frozen attention (SPEC 2.3): only MLP / expert projections and the value head train; full-parameter
critic training was unstable in the paper.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel

from opd_sao.checkpoints import DTYPES, MODEL_INIT_LOCK, check_attention

from ..modeling import position_ids_for

VALUE_HEAD_FILE = "value_head.safetensors"


def critic_attention(policy_attention: str) -> str:
    """The critic's attention: flash_attention_2 when the policy's is, else sdpa (fused; the critic is never
    compared with the engine, so it need not match the policy's eager)."""
    return "flash_attention_2" if policy_attention == "flash_attention_2" else "sdpa"


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1, dtype=backbone.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "float32", attn_implementation: str = "sdpa") -> "ValueModel":
        """From a policy checkpoint (zero value head) or a saved critic (`save_pretrained`: its trained head)."""
        check_attention(attn_implementation)
        with MODEL_INIT_LOCK:  # the head's nn.init must not run while another thread loads a model
            # fused attention: eager's separate passes over [B, heads, T, T] scores cost as much as its matmuls
            # (benchmarks/vocab_memory.py --kinds critic: 1.8x the step time)
            backbone = AutoModel.from_pretrained(str(path), dtype=DTYPES[dtype],
                                                 attn_implementation=critic_attention(attn_implementation))
            model = cls(backbone, backbone.config.hidden_size)
        head = Path(path) / VALUE_HEAD_FILE
        if head.is_file():
            model.value_head.load_state_dict(load_file(head))
        return model

    def save_pretrained(self, out_dir: Path) -> Path:
        """Backbone in HF format plus the value head, written to a temp dir, then renamed."""
        out_dir = Path(out_dir)
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.backbone.save_pretrained(tmp, safe_serialization=True)
        save_file({k: v.detach().float().cpu().contiguous() for k, v in self.value_head.state_dict().items()},
                  tmp / VALUE_HEAD_FILE)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
        return out_dir

    def activation_checkpointing_enable(self, **kwargs) -> None:
        """The backbone's (transformers') activation checkpointing, as a causal LM's."""
        self.backbone.activation_checkpointing_enable(**kwargs)

    def freeze_attention(self) -> None:
        for name, param in self.backbone.named_parameters():
            param.requires_grad_(".mlp." in name)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_for(attention_mask)
        ).last_hidden_state
        # the head's dtype (float32 master weights, DeepSpeed's bf16, float64); values at least float32
        state_values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)  # after reading token t
        state_values = state_values.to(torch.promote_types(state_values.dtype, torch.float32))
        values = torch.zeros_like(state_values)
        values[:, 1:] = state_values[:, :-1]  # V(s_t): state before token t
        return values * attention_mask
