"""What a transformers causal LM is made of, read off its modules and config: the decoder under the head, its
layers, each layer's children by role (token mixers, feed-forward blocks, experts), activation checkpointing,
attention windows, and whether its logits are a plain linear map of the hidden states.

The forwards (`modeling`, `llama_forward`) and the critic's trainable set (`trainers.critic`) all ask these
questions; they sit here, below all of them, so each may ask without importing the others.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Optional

from torch import nn

from opd_sao.errors import UsageError

# A forward argument that only a module mixing positions needs (attention, state-space mixers).
MIXER_ARGS = frozenset({"attention_mask", "position_embeddings", "position_ids", "cache", "past_key_value",
                        "past_key_values", "cache_params", "layer_past", "cache_position"})


def unwrap(model) -> nn.Module:
    """The transformers model inside a wrapper that keeps it as `.module` (a DeepSpeed engine)."""
    return getattr(model, "module", model)


def decoder_of(model) -> nn.Module:
    """The decoder stack under a causal LM's head: transformers' `get_decoder`, which returns the LM itself for a few
    (Llama 4's text model), then its `.model`."""
    model = unwrap(model)
    decoder = model.get_decoder()
    return getattr(model, "model", decoder) if decoder is model else decoder


def decoder_layers(backbone: nn.Module) -> list[nn.Module]:
    """The decoder layers: the module list with one entry per hidden layer of the model's config."""
    config = backbone.config.get_text_config() if hasattr(backbone.config, "get_text_config") else backbone.config
    n = getattr(config, "num_hidden_layers", None)
    return next((list(m) for m in backbone.modules() if isinstance(m, nn.ModuleList) and n and len(m) == n), [])


def mixes_positions(module: nn.Module) -> bool:
    """Whether a decoder layer's child mixes positions (its forward takes a mask, positions or a cache)."""
    return _takes_mixer_args(module.forward.__func__ if hasattr(module.forward, "__func__") else module.forward)


@functools.lru_cache(maxsize=None)
def _takes_mixer_args(forward) -> bool:  # per class's forward: read_only_at asks on every forward pass
    return bool(MIXER_ARGS & set(inspect.signature(forward).parameters))


def feed_forward_blocks(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's feed-forward blocks: the children with weight matrices that see only the hidden states."""
    return [child for child in layer.children()
            if not mixes_positions(child) and any(p.dim() >= 2 for p in child.parameters())]


def expert_counts(block: nn.Module) -> set[int]:
    """How many experts a feed-forward block holds (fused [n_experts, ...] weights, or one module per expert in a
    module list); empty for a dense MLP."""
    counts = {p.shape[0] for p in block.parameters() if p.dim() == 3}
    return counts | {len(m) for m in block.modules() if isinstance(m, nn.ModuleList)}


def moe_blocks(backbone: nn.Module) -> list[nn.Module]:
    """The decoder layers' mixture-of-experts blocks (none in a dense model)."""
    return [block for layer in decoder_layers(backbone) for block in feed_forward_blocks(layer) if expert_counts(block)]


_LAST_FEED_FORWARD: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def last_feed_forward(model: nn.Module) -> tuple[Optional[nn.Module], Optional[nn.Module]]:
    """(the last decoder layer, its one feed-forward block or None), found once per model: a walk over every module
    on each forward pass costs a 28-layer model milliseconds."""
    if model not in _LAST_FEED_FORWARD:
        layers = decoder_layers(model)
        blocks = feed_forward_blocks(layers[-1]) if layers else []
        _LAST_FEED_FORWARD[model] = (layers[-1] if layers else None, blocks[0] if len(blocks) == 1 else None)
    return _LAST_FEED_FORWARD[model]


def activation_checkpointing(model) -> bool:
    """Whether transformers' activation checkpointing is on: the decoder layers' flag, read off the last one
    (`is_activation_checkpointing` walks every module, milliseconds per forward on a large model)."""
    layer, _ = last_feed_forward(unwrap(model))
    if layer is None:
        return bool(getattr(unwrap(model), "is_activation_checkpointing", False))
    return bool(getattr(layer, "gradient_checkpointing", False))


def attention_window(model) -> Optional[int]:
    """The narrowest span a layer's attention is limited to (a sliding window, or Llama 4's attention chunk);
    None where every layer sees the whole sequence. Read from the config as transformers reads it."""
    config = _text_config(model)
    kinds = getattr(config, "layer_types", None)
    spans = [getattr(config, field, None) for field, kind in (("sliding_window", "sliding_attention"),
                                                              ("attention_chunk_size", "chunked_attention"))
             if kinds is None or kind in kinds]
    return min((span for span in spans if span is not None), default=None)


def _text_config(model):
    """The decoder's config: a multimodal model's `text_config` (transformers' get_text_config costs ~75 us)."""
    config = unwrap(model).config
    return getattr(config, "text_config", None) or config


# config fields by which a causal LM's forward changes its logits after the lm head: Gemma 2's and others' tanh
# soft-capping, Cohere's scale, Granite's and MiniCPM 3's divisor, and multipliers (1 or None: unchanged)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                    "output_multiplier_scale")


def check_plain_logits(config, what: str = "the model") -> None:
    """UsageError where the config's model changes its logits after the lm head: opd-sao's vocabulary-chunked
    logprobs compute hidden @ lm_head.weight.T (+ bias), and the engine samples from the model's own logits."""
    text = getattr(config, "text_config", None)  # a multimodal model's decoder
    for part in (config,) if text is None else (config, text):
        for attr in LOGIT_TRANSFORMS:
            if getattr(part, attr, None) not in (None, 1, 1.0):
                raise UsageError(f"{what} ({part.model_type}) transforms its logits after the lm head ({attr} = "
                                 f"{getattr(part, attr)}); opd-sao's logprobs need logits = hidden @ lm_head.weight.T "
                                 "(+ bias)")
