"""opd-sao's own forward for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3): the embedded engine's and the
critic's.

A serving engine runs its own model code (SGLang and vLLM do). On a small model a forward is mostly
per-operation overhead, not arithmetic: transformers' builds a 4D mask through its masking utilities, reads
the config through `__getattribute__` dozens of times and calls about 30 modules for 15 small matrix
products. This computes the same function of the same weights (the modules' own tensors, so weight syncs,
optimizers and checkpoints see nothing new) in fewer operations: one boolean mask for all layers,
`torch.rms_norm` where transformers' RMSNorm makes five operations, the attention the model is loaded with
(eager's products and float32 softmax in transformers' order, or sdpa's kernel with grouped-query attention
inside it), and only the last layer's work that someone reads: a prefill (the engine's
joins) stops at the last layer's keys and values, which is all the cache needs; the critic's last layer
runs its output projection and feed-forward block only where a value is read.

It serves only the decoder classes in `FAMILY`, whose layers are exactly norm -> attention (q, k, v, o
projections; Qwen3's per-head q/k norms) -> residual -> norm -> gated MLP -> residual, with sdpa or eager
attention over the whole sequence (a sliding window or an attention chunk, and flash-attention-2, keep
transformers' forward). It is differentiable (the critic trains through it), but reads parameters directly,
so it is not used where DeepSpeed ZeRO-3 gathers them in module hooks or where activation checkpointing is on.
Results agree with transformers' to float rounding (tests/test_llama_forward.py); the consistency gate
measures the engine against the trainer, whose policy forward is always transformers'.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .modeling import activation_checkpointing, attention_window, check_plain_logits, decoder_of, unwrap

FAMILY = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})  # transformers' decoder classes
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")
SHORT_ROWS = 16  # keys per query under which the engine's forward on CPU attends through `_short_rows`


def unsupported(model) -> Optional[str]:
    """Why `model` (a causal LM or its decoder) cannot run through this forward (None: it can)."""
    model = unwrap(model)
    decoder = decoder_of(model)
    name = type(decoder).__name__
    if name not in FAMILY or not type(decoder).__module__.startswith("transformers.models."):
        return f"its decoder {name} is not one of {', '.join(sorted(FAMILY))}"
    if attention_window(model) is not None:
        return "its attention is windowed"
    if decoder.config._attn_implementation not in ("eager", "sdpa"):
        return f"it runs {decoder.config._attn_implementation}"
    check_plain_logits(model.config, type(model).__name__)
    for layer in decoder.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (attention is None or mlp is None or not all(hasattr(attention, p) for p in _ATTENTION)
                or not all(hasattr(mlp, p) for p in _MLP)
                or not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm"))):
            return f"its layer {type(layer).__name__} is not norm / self_attn / norm / gated mlp"
    return None


def usable_now(model) -> bool:
    """Per call, beside `unsupported` (per model): no activation checkpointing, no ZeRO-3 partitioned parameters."""
    return not activation_checkpointing(model) and not hasattr(next(unwrap(model).parameters()), "ds_id")


def hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  read: Optional[torch.Tensor] = None, cache: Optional[DynamicCache] = None,
                  start: Optional[dict] = None) -> torch.Tensor:
    """The decoder's final hidden states for `input_ids` [B, T], the last T columns of `attention_mask` [B, L].

    `read` None: [B, T, H]; `read` [n] (indices into the B * T positions, row-major): [n, H] at those positions
    only, and with n == 0 the forward stops once the last layer's keys and values exist. `cache`: every layer's
    keys and values are appended to it (and read back, for the columns before these T). `start` (no cache): a
    dict the caller keeps over forwards of the same rows and `read` while the embeddings and the first layer's
    norms and attention are frozen: the first call stores what layer 0's feed-forward block reads, later calls
    start from it (the same tensors, so the same result; `ValueModel.reusing_frozen_start`)."""
    decoder = decoder_of(model)
    if start:
        cos, sin, allowed, hidden, x = start["layer0"]
    else:
        hidden = decoder.embed_tokens(input_ids)
        cos, sin = decoder.rotary_emb(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        allowed = _allowed(attention_mask, input_ids.shape[1])
    if cache is not None and allowed.device.type == "cpu" and allowed.shape[-1] < SHORT_ROWS \
            and not torch.is_grad_enabled():
        attend = _short_rows(allowed)
    else:
        attend = _eager if decoder.config._attn_implementation == "eager" else _sdpa
    last = len(decoder.layers) - 1
    for index, layer in enumerate(decoder.layers):
        if index or not start:
            attention = layer.self_attn
            x = _rms_norm(hidden, layer.input_layernorm)
            keys = _rotate(_heads(x, attention.k_proj, attention.head_dim, getattr(attention, "k_norm", None)),
                           cos, sin)
            values = _heads(x, attention.v_proj, attention.head_dim)
            if cache is not None:
                keys, values = cache.layers[index].update(keys, values)
            if index == last and read is not None and not len(read):
                return hidden.new_zeros(0, hidden.shape[-1])
            queries = _rotate(_heads(x, attention.q_proj, attention.head_dim, getattr(attention, "q_norm", None)),
                              cos, sin)
            mixed = attend(queries, keys, values, allowed, attention.scaling).transpose(1, 2).flatten(2)
            if index == last and read is not None:  # the rest works on each position alone: only the read ones
                mixed, hidden = mixed.flatten(0, 1)[read], hidden.flatten(0, 1)[read]
            hidden = hidden + _linear(mixed, attention.o_proj)
            x = _rms_norm(hidden, layer.post_attention_layernorm)
            if index == 0 and start is not None:
                start["layer0"] = (cos, sin, allowed, hidden, x)
        mlp = layer.mlp
        hidden = hidden + _linear(mlp.act_fn(_linear(x, mlp.gate_proj)) * _linear(x, mlp.up_proj), mlp.down_proj)
    return _rms_norm(hidden, decoder.norm)


def frozen_start(model) -> bool:
    """Whether everything before layer 0's feed-forward block is frozen (embeddings, the layer's norms and
    attention): `hidden_states`' `start` may then be reused while only later weights change."""
    decoder = decoder_of(model)
    layer = decoder.layers[0]
    before = (decoder.embed_tokens, layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm)
    return not any(p.requires_grad for module in before for p in module.parameters())


def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            cache: DynamicCache) -> None:
    """The engine's join: every layer's keys and values of `input_ids` appended to `cache`, nothing more."""
    hidden_states(model, input_ids, attention_mask, position_ids, read=input_ids.new_zeros(0), cache=cache)


def next_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: DynamicCache) -> torch.Tensor:
    """The engine's decode step: [B, V] logits after the last of `input_ids`' columns (keys and values to `cache`)."""
    rows, width = input_ids.shape
    last = torch.arange(rows, device=input_ids.device) * width + width - 1
    head = unwrap(model).get_output_embeddings()
    return F.linear(hidden_states(model, input_ids, attention_mask, position_ids, read=last, cache=cache),
                    head.weight, head.bias)


def _allowed(attention_mask: torch.Tensor, width: int) -> torch.Tensor:
    """[B, 1, T, L] bool: query i (column L - T + i) sees the real columns up to its own, and always itself, so a
    padding query attends to something (its output is never read, but a row with nothing to attend to is NaN in
    some attention kernels, and a NaN key or value at a padding column would reach real rows as 0 * NaN)."""
    columns = attention_mask.shape[1]
    allowed = attention_mask.bool()[:, None, None, :]
    if width == 1:
        return allowed
    causal = torch.ones(width, columns, dtype=torch.bool, device=attention_mask.device).tril(columns - width)
    own = torch.zeros_like(causal)
    own[:, columns - width:] = torch.eye(width, dtype=torch.bool, device=attention_mask.device)
    return (allowed & causal) | own


def _eager(queries, keys, values, allowed, scale) -> torch.Tensor:
    """transformers' eager attention: the same products and a float32 softmax, in the same order."""
    groups = queries.shape[1] // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = (torch.matmul(queries, keys.transpose(2, 3)) * scale).masked_fill(~allowed, torch.finfo(queries.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype), values)


def _sdpa(queries, keys, values, allowed, scale) -> torch.Tensor:
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, scale=scale,
                                          enable_gqa=keys.shape[1] != queries.shape[1])


def _short_rows(allowed: torch.Tensor):
    """Attention over fewer than SHORT_ROWS keys per query on CPU, without gradients: eager's products and float32
    softmax, the softmax written out. Two slow paths of torch 2.13's CPU kernels sit exactly there: its softmax
    loops scalar over rows shorter than the vector width (2,560 rows of 10: 0.50 ms; of 16: 0.05 ms), and exp of a
    masked score (-inf, finfo.min, anything with a subnormal result) costs 10-100x a finite one's. Here a masked
    score is float32's lowest, as in eager (a row with nothing to attend to, a padding-only prompt's, is then
    uniform like eager's, not NaN), and every score minus its row's maximum is clamped to -80 before exp: a
    masked key weighs under 2e-35 of the row's largest, far below float32's resolution of the row's sum. Equal
    to eager to float rounding. The engine's decode steps and joins take it on small models: [64, 4 heads, 10
    queries, 10 keys] in 0.22 ms against eager's 0.66 and sdpa's 0.57. Not the critic: its values must not depend
    on how a batch is cut into micro-batches (a narrower one would change kernel), and its gradients need the
    fused kernel."""
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(torch.float32).min)

    def attend(queries, keys, values, _, scale) -> torch.Tensor:
        groups = queries.shape[1] // keys.shape[1]
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        scores = torch.matmul(queries, keys.transpose(2, 3)).float() * scale + bias
        weights = (scores - scores.amax(-1, keepdim=True)).clamp_min_(-80).exp_()
        return torch.matmul(weights.div_(weights.sum(-1, keepdim=True)).to(queries.dtype), values)

    return attend


def _linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """transformers' Llama RMSNorm: normalised in float32, cast back, then scaled by the weight."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


def _heads(x: torch.Tensor, projection: torch.nn.Linear, head_dim: int,
           norm: Optional[torch.nn.Module] = None) -> torch.Tensor:
    """[B, T, H] -> [B, heads, T, head_dim], each head normalised first where the model has a per-head norm."""
    heads = _linear(x, projection).unflatten(-1, (-1, head_dim))
    return (heads if norm is None else _rms_norm(heads, norm)).transpose(1, 2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, the half-split convention transformers' Llama family uses."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
