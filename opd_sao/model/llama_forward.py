"""opd-sao's own forward for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3): the embedded engine's, the
critic's and the trainer's policy's (`modeling.hidden_states`).

A serving engine runs its own model code (SGLang and vLLM do). On a small model a forward is mostly
per-operation overhead, not arithmetic: transformers' builds a 4D mask through its masking utilities, reads
the config through `__getattribute__` dozens of times and calls about 30 modules for 15 small matrix
products. This computes the same function of the same weights (the modules' own tensors, so weight syncs,
optimizers and checkpoints see nothing new) in fewer operations: one boolean mask for all layers,
`torch.rms_norm` where transformers' RMSNorm makes five operations, the attention the model is loaded with
(eager's products and float32 softmax in transformers' order, or sdpa's kernel with grouped-query attention
inside it; `_ShortRows` on CPU under 16 keys per query), and only the last layer's work that someone
reads: a prefill (the engine's joins) stops at the last layer's keys and values, which is all the cache
needs; the critic's last layer, and the policy's scoring its actions, run the output projection and
feed-forward block only where a position is read.

It serves only the decoder classes in `FAMILY`, whose layers are exactly norm -> attention (q, k, v, o
projections; Qwen3's per-head q/k norms) -> residual -> norm -> gated MLP -> residual, with sdpa or eager
attention over the whole sequence (a sliding window or an attention chunk, and flash-attention-2, keep
transformers' forward). It is differentiable (the policy and the critic train through it), with
activation checkpointing as transformers' layers do it when it is on (one checkpoint a layer, its input kept and
the layer recomputed in the backward; the critic's frozen-start layer is checkpointed by halves, and a frozen block
with no-grad inputs, which saves nothing, is not wrapped, so a critic's frozen prefix and its reuse work under
checkpointing too). It reads parameters directly, so it is not used where DeepSpeed ZeRO-3
gathers them in module hooks, for a model given to `keep_transformers` (`trainer.own_forward: false`), or for a model
off CPU not given to `use_own` (`own_forward: true`; `own_forward_on`), so teachers, evaluation and the gate's
scoring follow the same auto rule as the trainer and the engine. Results agree with transformers' to float
rounding, gradients included (tests/test_llama_forward.py); the consistency gate measures the engine's cached
decode against the trainer's whole-sequence pass, both this.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from .decoders import activation_checkpointing, attention_window, check_plain_logits, decoder_of, unwrap

FAMILY = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})  # transformers' decoder classes
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")
SHORT_ROWS = 16  # keys per query under which a forward on CPU attends through `_ShortRows` (the vector width)


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


_VERDICTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, Optional[str]]]" = weakref.WeakKeyDictionary()
_KEPT: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_OWN: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def own_forward_on(device: torch.device | str, setting: Optional[bool] = None) -> bool:
    """Whether this forward runs a model on `device` under `trainer.own_forward` / `engine.own_forward` =
    `setting`: an explicit true or false wins; unset (auto) it does on CPU only, where it is measured faster than
    transformers' (docs/benchmarks.md, benchmarks/policy_forwards.py). On CUDA or any other device transformers'
    forward runs until scripts/gpu_check.sh's `forwards` step has measured both there."""
    return setting if setting is not None else torch.device(device).type == "cpu"


def keep_transformers(model) -> None:
    """`model` (a causal LM or a decoder) runs transformers' forward from now on (`trainer.own_forward: false`)."""
    _KEPT.add(unwrap(model))


def use_own(model) -> None:
    """`model` (a causal LM or a decoder) runs this forward on any device from now on (`own_forward: true`), not
    only on CPU."""
    _OWN.add(unwrap(model))


def serves(model) -> bool:
    """Whether this forward runs `model` (a causal LM or a decoder) now: not `keep_transformers`, its parameters'
    device allowed by `own_forward_on` (unset, CPU only; `use_own`: any), `unsupported` (asked once per model and
    attention implementation: it walks the layers, 70 us on a 2-layer model) and `usable_now`."""
    model = unwrap(model)
    if model in _KEPT or not own_forward_on(next(model.parameters()).device, True if model in _OWN else None):
        return False
    implementation = decoder_of(model).config._attn_implementation
    if _VERDICTS.get(model, (None,))[0] != implementation:
        _VERDICTS[model] = (implementation, unsupported(model))
    return _VERDICTS[model][1] is None and usable_now(model)


def usable_now(model) -> bool:
    """Per call, beside `unsupported` (per model): no ZeRO-3 partitioned parameters (read directly, they are
    empty outside DeepSpeed's module hooks)."""
    return not hasattr(next(unwrap(model).parameters()), "ds_id")


def hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  read: Optional[torch.Tensor] = None, cache: Optional[DynamicCache] = None,
                  start: Optional[dict] = None) -> torch.Tensor:
    """The decoder's final hidden states for `input_ids` [B, T], the last T columns of `attention_mask` [B, L].

    `read` None: [B, T, H]; `read` [n] (indices into the B * T positions, row-major): [n, H] at those positions
    only, and with n == 0 the forward stops once the last layer's keys and values exist. `cache`: every layer's
    keys and values are appended to it (and read back, for the columns before these T). `start` (no cache): a
    dict {"layer": f} the caller keeps over forwards of the same rows and `read` while everything before layer f's
    feed-forward block is frozen (`frozen_prefix`): the first call stores what that block reads, later calls start
    from it, skipping layers 0 to f - 1 and f's attention (the same tensors, so the same result;
    `ValueModel.reusing_frozen_start`)."""
    decoder = decoder_of(model)
    resume_at = start["layer"] if start is not None and "state" in start else None
    if resume_at is not None:
        cos, sin, allowed, hidden, x = start["state"]
    else:
        hidden = decoder.embed_tokens(input_ids)
        cos, sin = decoder.rotary_emb(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        allowed = _allowed(attention_mask, input_ids.shape[1])
    eager = decoder.config._attn_implementation == "eager"
    if allowed.device.type == "cpu" and allowed.shape[-1] < SHORT_ROWS:
        attend = _short_rows(allowed, eager)
    else:
        attend = _eager if eager else _sdpa
    last = len(decoder.layers) - 1
    # transformers' activation checkpointing, as its layers do it (training, no cache), where a block has anything
    # to differentiate: a frozen prefix under no-grad inputs builds no graph, so it saves nothing anyway
    checkpointed = (cache is None and torch.is_grad_enabled() and decoder.training
                    and activation_checkpointing(model))

    def run(block, modules, layer, hidden, *rest):
        if checkpointed and (hidden.requires_grad or any(p.requires_grad for m in modules for p in m.parameters())):
            return checkpoint(block, layer, hidden, *rest, use_reentrant=False)
        return block(layer, hidden, *rest)

    for index, layer in enumerate(decoder.layers):
        if resume_at is not None and index < resume_at:
            continue
        if checkpointed and index != resume_at and (start is None or index != start["layer"]) \
                and (index != last or read is None or len(read)):
            # one checkpoint for the whole layer, as transformers' (its input kept, both halves recomputed)
            hidden = run(_decoder_layer, (layer,), layer, hidden, index, cos, sin, allowed, attend,
                         read if index == last else None)
            continue
        if index != resume_at:
            halves = run(_attention_block, (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm),
                         layer, hidden, index, cos, sin, allowed, attend, cache, read if index == last else None)
            if halves is None:  # a prefill: the last layer's keys and values are in the cache, nothing is read
                return hidden.new_zeros(0, hidden.shape[-1])
            hidden, x = halves
            if start is not None and index == start["layer"]:  # detached: a later forward's backward must not
                # reach this one's graph, which an input made to require grad (transformers' checkpointing hook
                # on the embeddings) would build through the frozen prefix
                start["state"] = (cos, sin, allowed, hidden.detach(), x.detach())
        hidden = run(_feed_forward_block, (layer.mlp,), layer, hidden, x)
    return _rms_norm(hidden, decoder.norm)


def _attention_block(layer, hidden: torch.Tensor, index: int, cos, sin, allowed, attend,
                     cache: Optional[DynamicCache], read: Optional[torch.Tensor]):
    """A decoder layer's first half: (the residual stream after its attention, the feed-forward block's normed
    input), at the `read` positions only where given ([n, H]); None where `read` is empty (a prefill's last
    layer: its keys and values are in `cache`, nothing more is needed)."""
    attention = layer.self_attn
    x = _rms_norm(hidden, layer.input_layernorm)
    keys = _rotate(_heads(x, attention.k_proj, attention.head_dim, getattr(attention, "k_norm", None)), cos, sin)
    values = _heads(x, attention.v_proj, attention.head_dim)
    if cache is not None:
        keys, values = cache.layers[index].update(keys, values)
    if read is not None and not len(read):
        return None
    queries = _rotate(_heads(x, attention.q_proj, attention.head_dim, getattr(attention, "q_norm", None)), cos, sin)
    mixed = attend(queries, keys, values, allowed, attention.scaling).transpose(1, 2).flatten(2)
    if read is not None:  # the rest works on each position alone: only the read ones
        mixed, hidden = mixed.flatten(0, 1)[read], hidden.flatten(0, 1)[read]
    hidden = hidden + _linear(mixed, attention.o_proj)
    return hidden, _rms_norm(hidden, layer.post_attention_layernorm)


def _decoder_layer(layer, hidden: torch.Tensor, index: int, cos, sin, allowed, attend,
                   read: Optional[torch.Tensor]) -> torch.Tensor:
    """A whole decoder layer without a cache (a checkpointed training forward): both halves."""
    return _feed_forward_block(layer, *_attention_block(layer, hidden, index, cos, sin, allowed, attend, None, read))


def _feed_forward_block(layer, hidden: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A decoder layer's second half: the gated MLP of `x` added to the residual stream."""
    mlp = layer.mlp
    return hidden + _linear(mlp.act_fn(_linear(x, mlp.gate_proj)) * _linear(x, mlp.up_proj), mlp.down_proj)


def hidden_states_at(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                     read: Optional[torch.Tensor] = None, start: Optional[dict] = None) -> torch.Tensor:
    """[B, T, H] `hidden_states` where `read` [B, T] marks a position (zeros elsewhere), every position with `read`
    None: the trainer's shape, for the policy's logprobs and the critic's values."""
    if read is None:
        return hidden_states(model, input_ids, attention_mask, position_ids, start=start)
    where = read.bool().flatten().nonzero().squeeze(1)
    hidden = hidden_states(model, input_ids, attention_mask, position_ids, read=where, start=start)
    return hidden.new_zeros(read.numel(), hidden.shape[-1]).index_copy(0, where, hidden).view(*read.shape, -1)


def frozen_prefix(model) -> Optional[int]:
    """The deepest layer f with everything before its feed-forward block frozen (the embeddings, layers 0 to f - 1
    whole, layer f's norms and attention), None when even layer 0's attention trains: `hidden_states`' `start` at
    layer f may then be reused while only later weights change. Frozen attention alone gives 0; a critic that
    trains only its last N layers (`trainer.critic_trained_layers`) gives L - N, and each later forward of a step
    runs N layers, not L."""
    def frozen(*modules) -> bool:
        return not any(p.requires_grad for module in modules for p in module.parameters())

    decoder, deepest = decoder_of(model), None
    if not frozen(decoder.embed_tokens):
        return None
    for index, layer in enumerate(decoder.layers):
        if not frozen(layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm):
            break
        deepest = index
        if not frozen(layer.mlp):
            break
    return deepest


class FrozenStarts:
    """`hidden_states`' starts kept over forwards of the same rows and read positions (a critic step's K updates and
    its values after them: `ValueModel.reusing_frozen_start`), at most `budget` bytes of them; none where this
    forward does not serve the model or nothing before layer 0's feed-forward block is frozen (`frozen_prefix`,
    asked at the first forward)."""

    def __init__(self, budget: int):
        self.budget, self.used, self.usable, self.layer = budget, 0, None, None
        self.kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]] = []  # (ids, mask, read, start)

    def start_for(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, read: torch.Tensor,
                  element_size: int) -> Optional[dict]:
        """The kept start of these rows and read positions (`read` [B, T]), a new one to fill where the budget
        allows (the state is [B, T, H] twice, in `element_size`-byte elements), or None."""
        if self.usable is None:
            self.layer = frozen_prefix(model) if serves(model) else None
            self.usable = self.layer is not None
        if not self.usable:
            return None
        for ids, mask, marks, start in self.kept:
            if (ids.shape == input_ids.shape and torch.equal(ids, input_ids) and torch.equal(mask, attention_mask)
                    and marks.shape == read.shape and torch.equal(marks, read)):
                return start
        size = 2 * input_ids.numel() * unwrap(model).config.hidden_size * element_size
        if self.used + size > self.budget:
            return None
        self.used += size
        self.kept.append((input_ids, attention_mask, read, {"layer": self.layer}))
        return self.kept[-1][3]


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


def _short_rows(allowed: torch.Tensor, eager: bool):
    """Attention over fewer than SHORT_ROWS keys per query on CPU (`_ShortRows`), for a model loaded with `eager`
    (the softmax in float32, as transformers' eager) or sdpa attention (in the queries' precision, at least
    float32). The mask's additive form and its zeros are built once per forward, for every layer."""
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(torch.float32).min)
    keep = (allowed | ~allowed.any(-1, keepdim=True)).float()  # a row with nothing to attend to: uniform, as eager

    def attend(queries, keys, values, _, scale) -> torch.Tensor:
        dtype = torch.float32 if eager else torch.promote_types(queries.dtype, torch.float32)
        return _ShortRows.apply(queries, keys, values, bias.to(dtype), keep.to(dtype), scale)

    return attend


class _ShortRows(torch.autograd.Function):
    """Attention over short rows, its softmax and backward written out. Two slow paths of torch 2.13's CPU
    kernels sit exactly there: softmax (eager's, and inside sdpa's fused kernel) loops scalar over rows shorter
    than the vector width (2,560 rows of 10: 0.50 ms; of 16: 0.05 ms), and exp of a masked score (-inf,
    finfo.min, anything with a subnormal result) costs 10-100x a finite one's. Here a masked score is the float
    type's lowest, as in eager, every score minus its row's maximum is clamped to -80 before exp (which then
    never goes subnormal), and the masked keys' weights are set to exactly 0 after it (`keep`), so no gradient
    reaches a padding key: the same function and gradients as eager or sdpa to float rounding
    (tests/test_llama_forward.py). [64 rows, 4 heads, 11 queries x 11 keys, 2 key/value heads], one thread:
    forward 0.19 ms (sdpa 0.59, eager 0.69), forward and backward 0.61 ms (sdpa 1.18, eager 1.49); from 16
    keys on, sdpa's fused kernel is faster and takes over. Grouped-query heads attend as one [G x queries]
    block per key/value head, without copying the keys and values G times."""

    @staticmethod
    def forward(ctx, queries, keys, values, bias, keep, scale):
        rows, kv_heads, columns, dim = keys.shape
        heads, width = queries.shape[1], queries.shape[2]
        grouped = queries.reshape(rows, kv_heads, heads // kv_heads * width, dim)
        scores = torch.matmul(grouped, keys.transpose(2, 3)).view(rows, heads, width, columns).to(bias.dtype)
        scores = scores * scale + bias
        probs = (scores - scores.amax(-1, keepdim=True)).clamp_min_(-80).exp_().mul_(keep)
        probs = probs.div_(probs.sum(-1, keepdim=True))
        flat = probs.to(queries.dtype).view(rows, kv_heads, -1, columns)
        ctx.save_for_backward(grouped, keys, values, probs)
        ctx.scale = scale
        return torch.matmul(flat, values).view(rows, heads, width, dim)

    @staticmethod
    def backward(ctx, grad):
        grouped, keys, values, probs = ctx.saved_tensors
        rows, kv_heads, columns, dim = keys.shape
        flat = probs.view(rows, kv_heads, -1, columns)
        grad = grad.reshape(rows, kv_heads, -1, dim).to(values.dtype)  # no autocast here: every product's types
        grad_values = torch.matmul(flat.to(values.dtype).transpose(2, 3), grad)
        grad_probs = torch.matmul(grad, values.transpose(2, 3)).to(probs.dtype)
        grad_scores = (flat * (grad_probs - (grad_probs * flat).sum(-1, keepdim=True)) * ctx.scale).to(keys.dtype)
        grad_queries = torch.matmul(grad_scores, keys).view(rows, -1, probs.shape[2], dim).to(grouped.dtype)
        grad_keys = torch.matmul(grad_scores.transpose(2, 3), grouped.to(keys.dtype))
        return grad_queries, grad_keys, grad_values, None, None, None


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
