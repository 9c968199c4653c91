"""The model adapter: what a transformers decoder is (`decoders`), how to run it (`modeling`: hidden states, the
lm head one vocabulary chunk at a time; `llama_forward`: opd-sao's own forward for the Llama family, which
`modeling.hidden_states` picks where it serves the model, transformers' elsewhere), its caches and its heads.

A trainer step enters it once per forward: the policy's logprobs (`sequence_logprobs`), OPD's support logprobs
and full divergence (`action_support_logprobs`, `action_full_divergence`), the critic's values (`action_values`);
teachers and the consistency gate read `action_hidden_states`. Below are the names callers outside the package use.
"""
from .actions import (
    SupportLogprobs,
    action_full_divergence,
    action_hidden_states,
    action_support_logprobs,
    action_values,
    model_device,
)
from .decoders import (
    check_plain_logits,
    decoder_layers,
    expert_counts,
    feed_forward_blocks,
    mixes_positions,
    moe_blocks,
)
from .llama_forward import FrozenStarts, keep_transformers, own_forward_on, use_own
from .modeling import sequence_logprobs

__all__ = ["FrozenStarts", "SupportLogprobs", "action_full_divergence", "action_hidden_states",
           "action_support_logprobs", "action_values", "check_plain_logits", "decoder_layers", "expert_counts",
           "feed_forward_blocks", "keep_transformers", "mixes_positions", "model_device", "moe_blocks",
           "own_forward_on", "sequence_logprobs", "use_own"]
