"""The SAO critic: a copy of the policy's backbone with a scalar value head.

Frozen attention: only the feed-forward blocks (MLP, MoE experts, shared experts) and the value head
train; full-parameter critic training was unstable in the paper (-6.7 AIME points in its ablation).

The trainable set is chosen by each module's role in its decoder layer, not by its name (experts are
`mlp`, `block_sparse_moe`, `feed_forward` or `ffn` depending on the architecture):

* a child of a decoder layer whose forward takes the attention mask, position embeddings or a cache mixes
  positions (attention, Mamba mixers, DBRX's norm-attention-norm): frozen;
* a child with weight matrices whose forward sees only the hidden states is the feed-forward block: it trains,
  except its routers;
* routers (in an MoE block, a module whose weight maps the hidden state to one score per expert, or to one
  gate value: Qwen2-MoE's shared-expert gate) stay frozen: the critic's value loss has no load-balancing
  term, so a router trained by it alone can route every token to a few experts; frozen, the critic keeps the
  policy's token -> expert assignment and adapts what the experts compute;
* norms, embeddings and everything outside the decoder layers stay frozen.

An architecture where the rule finds no feed-forward parameter is refused (`freeze_attention`).
"""
from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel

from opd_sao.checkpoints import DTYPES, MODEL_INIT_LOCK, check_attention

from ..model import FrozenStarts, action_values, decoder_layers, expert_counts, feed_forward_blocks, mixes_positions

VALUE_HEAD_FILE = "value_head.safetensors"
FROZEN_START_BYTES = 256 << 20  # the most `reusing_frozen_start` keeps: it pays on small models (see there)
ROLES = ("feed_forward", "router", "token_mixer", "other")


def _routers(block: nn.Module) -> set[str]:
    """Names (relative to an MoE block) of its routers' parameters; empty for a dense MLP."""
    experts = expert_counts(block)
    if not experts:
        return set()
    names = set()
    for prefix, module in block.named_modules():
        weight = getattr(module, "weight", None)
        if prefix and isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[0] in experts | {1}:
            names |= {f"{prefix}.{name}" for name, _ in module.named_parameters()}
    return names


def parameter_roles(backbone: nn.Module) -> dict[str, str]:
    """Every backbone parameter's role (one of ROLES), by the rule in the module docstring."""
    roles = dict.fromkeys((name for name, _ in backbone.named_parameters()), "other")
    where = {id(m): name for name, m in backbone.named_modules()}
    for layer in decoder_layers(backbone):
        feed_forward = feed_forward_blocks(layer)
        for child in layer.children():
            params = [name for name, _ in child.named_parameters()]
            if mixes_positions(child):
                role, routers = "token_mixer", set()
            elif any(child is block for block in feed_forward):
                role, routers = "feed_forward", _routers(child)
            else:
                continue
            for name in params:
                roles[f"{where[id(child)]}.{name}"] = "router" if name in routers else role
    return roles


def critic_trainable(backbone: nn.Module, top_layers: Optional[int] = None) -> list[str]:
    """The backbone parameters the critic trains (the value head trains too): every feed-forward block, or with
    `top_layers` those of the last N decoder layers only, so the critic's backward stops at the first of them (each
    critic pass costs about a policy step otherwise: docs/benchmarks.md, "A real model"); ValueError when there are
    none."""
    names = [name for name, role in parameter_roles(backbone).items() if role == "feed_forward"]
    if top_layers is not None:
        layers = decoder_layers(backbone)
        if not 1 <= top_layers <= len(layers):
            raise ValueError(f"trainer.critic_trained_layers is {top_layers}; {type(backbone).__name__} has "
                             f"{len(layers)} decoder layers")
        kept = {id(p) for layer in layers[len(layers) - top_layers:] for p in layer.parameters()}
        params = dict(backbone.named_parameters())
        names = [name for name in names if id(params[name]) in kept]
    if not names:
        raise ValueError(f"the critic's frozen-attention rule finds no feed-forward (MLP or MoE expert) parameters "
                         f"in {type(backbone).__name__}; set trainer.freeze_critic_attention: false to train the "
                         "whole critic")
    return names


def describe_critic(path: str | Path) -> dict:
    """What the critic of a model directory trains (`opd-sao models check`): parameter names by role with layer
    indices folded (`layers.*.mlp.up_proj.weight`), the trainable share, or why the rule refuses the model.
    The backbone is built on the meta device from the config: no weights are read."""
    from transformers import AutoConfig

    with torch.device("meta"):
        backbone = AutoModel.from_config(AutoConfig.from_pretrained(str(path)))
    roles = parameter_roles(backbone)
    sizes = dict((name, p.numel()) for name, p in backbone.named_parameters())
    folded: dict[str, list[str]] = {role: [] for role in ROLES}
    for name, role in roles.items():
        short = re.sub(r"\.\d+\.", ".*.", name)
        if short not in folded[role]:
            folded[role].append(short)
    trained = sum(sizes[name] for name, role in roles.items() if role == "feed_forward")
    out = {"trains": folded["feed_forward"], "frozen_routers": folded["router"],
           "frozen_token_mixers": folded["token_mixer"], "trainable_parameters": trained,
           "backbone_parameters": sum(sizes.values())}
    try:
        critic_trainable(backbone)
    except ValueError as err:
        out["refused"] = str(err)
    return out


def critic_attention(policy_attention: str) -> str:
    """The critic's attention: flash_attention_2 when the policy's is, else sdpa (fused; the critic is never
    compared with the engine, so it need not match the policy's eager)."""
    return "flash_attention_2" if policy_attention == "flash_attention_2" else "sdpa"


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self._starts: Optional[FrozenStarts] = None  # within reusing_frozen_start
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
            # no KV cache: a training forward never continues, and a no-grad one (the values after the K updates)
            # would otherwise hold every layer's keys and values to its end (~0.5 GB per 8k-token row at 7B)
            backbone.config.use_cache = False
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

    def freeze_attention(self, top_layers: Optional[int] = None) -> None:
        """Train only the feed-forward blocks (of the last `top_layers` decoder layers; None: all) and the value head:
        see the module docstring."""
        trainable = set(critic_trainable(self.backbone, top_layers))
        for name, param in self.backbone.named_parameters():
            param.requires_grad_(name in trainable)

    @contextmanager
    def reusing_frozen_start(self):
        """Within it, forwards over rows seen before (the same ids, mask and actions: a step's K updates and its
        values after them) start from the first one's state before the feed-forward block of the deepest layer
        that everything frozen precedes (`llama_forward.frozen_prefix`): layer 0 under frozen attention alone (the
        embeddings, layer 0's norms and attention stay untrained), layer L - N with `critic_trained_layers` N.
        Exact: the same tensors as computing them again. With all L layers' feed-forward blocks training it saves
        about 1/(2L) of each later forward (a quarter on the vs-TRL model's 2 layers); training the last N, each
        later forward runs N layers, not L. It holds the state, [B, T, H] twice, so it keeps at most
        FROZEN_START_BYTES and computes the rest as usual."""
        self._starts = FrozenStarts(FROZEN_START_BYTES)
        try:
            yield
        finally:
            self._starts = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                actions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[B, T] V(s_t) on real tokens; `actions` [B, T]: only at these tokens (`model.action_values`)."""
        return action_values(self.backbone, self.value_head, input_ids, attention_mask, actions, self._starts)
