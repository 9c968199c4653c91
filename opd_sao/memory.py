"""The memory model of a training step, on paper: bytes per parameter and per token of each component.

docs/scale_out.md derives it and applies it to 1.5B-32B students with 7B-70B teachers on 8 x 80 GB;
benchmarks/memory_scaling.py prints it beside measured peaks. Pure arithmetic on a model's shape, no torch.

Per parameter (P policy parameters, world size N, ZeRO stage z): weights in the compute dtype, gradients, and
AdamW's float32 master copy and two moments (mixed precision; in float32 the master copy is the weights).
ZeRO-1 shards the optimizer state, ZeRO-2 the gradients too, ZeRO-3 the weights as well. The critic is a
copy of the backbone whose MLPs alone train (attention and embedding frozen, SAO), so it pays weights on
every parameter and gradients and moments on its MLPs only. A teacher is weights only (inference), sharded
over the N ranks under ZeRO-3 inference.

Per token of a micro-batch, per decoder layer (one autograd-saved tensor each, fused sdpa attention: no
T x T scores): the two RMSNorms' inputs and outputs (4H), q k v projections (H + 2 KV), their rotary copies
(H + KV), the grouped k and v expanded to every head (2H), the attention output and its contiguous copy for
o_proj (2H), the MLP's gate, up, activation and product (4I): 10H + 3KV + 4I values. Gradient checkpointing
keeps each layer's input (H) and recomputes one layer at a time in the backward. The lm head never
materialises [tokens, V]: one row block x vocabulary chunk of logits and their gradient at a time
(opd_sao.model.modeling). The peak of a step is the static part plus the larger of the backward's working set
(saved activations, all gradients, the lm-head chunk, and with tied embeddings the lookup's dense gradient
before it is added to the lm head's) and AdamW's foreach temporary (one more copy of the trainable parameters,
while the moments update).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from opd_sao.model.modeling import ROW_BLOCK, VOCAB_CHUNK


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2/Llama-style decoder: what its memory depends on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = True
    qkv_bias: bool = True  # Qwen2's q, k, v projections have biases

    @classmethod
    def of(cls, config) -> "ModelShape":
        """From a transformers config (Qwen2Config, LlamaConfig, ...)."""
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                   config.num_attention_heads, config.num_key_value_heads, config.vocab_size,
                   bool(getattr(config, "tie_word_embeddings", False)),
                   config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)))

    @property
    def kv(self) -> int:
        """Width of the keys (and of the values): kv heads x head dim."""
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def mlp_params(self) -> int:
        return self.layers * 3 * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv
        attention = 2 * h * h + 2 * h * kv + ((h + 2 * kv) if self.qkv_bias else 0)
        return attention + 3 * h * self.intermediate + 2 * h

    @property
    def backbone_params(self) -> int:
        """Embedding, decoder layers and the final norm: what the critic copies."""
        return self.vocab * self.hidden + self.layers * self.layer_params + self.hidden

    @property
    def params(self) -> int:
        return self.backbone_params + (0 if self.tied else self.vocab * self.hidden)

    def saved_per_token(self, checkpointing: bool) -> int:
        """Values the forward keeps for the backward, per token, over the whole stack (the embedding's output and
        the final norm's input and output included)."""
        per_layer = self.hidden if checkpointing else self.layer_activations
        return self.layers * per_layer + 3 * self.hidden

    @property
    def layer_activations(self) -> int:
        """Values one decoder layer saves per token (module docstring): 10H + 3KV + 4I."""
        return 10 * self.hidden + 3 * self.kv + 4 * self.intermediate


def sharded(count: float, world: int, shard: bool) -> float:
    return count / world if shard else count


def step_memory(student: ModelShape, tokens: int, *, checkpointing: bool = False, critic: bool = False,
                teacher: Optional[ModelShape] = None, world: int = 1, zero: int = 0,
                precision: str = "float32", teacher_bytes: int = 2) -> dict[str, float]:
    """Bytes per rank of one training step, by component, and `peak`.

    `tokens`: tokens of one micro-batch on this rank (rows x padded length). `precision`: float32 (weights,
    gradients, activations 4 bytes) or bfloat16 (mixed: bf16 weights, gradients and activations, float32
    master weights and moments). `teacher_bytes`: bytes per teacher weight (2: bf16 inference).
    """
    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision must be float32 or bfloat16, got {precision!r}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0-3, got {zero}")
    w = 4 if precision == "float32" else 2  # weights, gradients, activations
    master = 0 if precision == "float32" else 4  # a float32 copy next to bf16 weights
    P, Pc, Pm = student.params, student.backbone_params, student.mlp_params
    out = {
        "policy_weights": sharded(w * P, world, zero >= 3),
        "policy_grads": sharded(w * P, world, zero >= 2),
        "policy_optimizer": sharded((master + 8) * P, world, zero >= 1),
        "critic_weights": sharded(w * Pc, world, zero >= 3) if critic else 0.0,
        "critic_grads": sharded(w * Pm, world, zero >= 2) if critic else 0.0,
        "critic_optimizer": sharded((master + 8) * Pm, world, zero >= 1) if critic else 0.0,
        "teacher_weights": sharded(teacher_bytes * teacher.params, world, zero >= 3) if teacher else 0.0,
        "activations": w * tokens * student.saved_per_token(checkpointing),
        "recompute": w * tokens * student.layer_activations if checkpointing else 0.0,
        "lm_head_chunk": 4 * 2 * min(ROW_BLOCK, tokens) * min(VOCAB_CHUNK, student.vocab),
        # tied embeddings: the lookup's backward makes a dense [V, H] gradient that is then added to the lm head's
        "embedding_grad": w * student.vocab * student.hidden if student.tied else 0.0,
        "optimizer_temporary": sharded(4 * P, world, zero >= 1),
    }
    static = sum(out[k] for k in ("policy_weights", "policy_grads", "policy_optimizer", "critic_weights",
                                  "critic_grads", "critic_optimizer", "teacher_weights"))
    backward = out["activations"] + out["recompute"] + out["lm_head_chunk"] + out["embedding_grad"]
    out["peak"] = static + max(backward, out["optimizer_temporary"])
    return out
