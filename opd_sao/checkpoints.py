"""Loading policies and tokenizers from local HF directories, and building the embedded tiny model.

The tiny model is built once (random init from a Llama config, a byte-level BPE tokenizer trained
locally) and saved in HF format; from then on it loads through the same `from_pretrained` path a
real checkpoint takes. Nothing is ever downloaded.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path
from typing import Optional

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from opd_sao.config import TinyModelConfig

hf_logging.disable_progress_bar()  # one bar per stage is ours to draw; loading a tiny model needs none
hf_logging.set_verbosity_error()

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]

# transformers builds a model inside context managers that patch process-wide state (the default
# dtype, the meta device, no-op `nn.init` functions) and restore it on exit. Two threads loading at
# once (the teacher prefetcher and the trainer) interleave those saves and restores and can leave
# the patches in place: later models come out on the meta device or uninitialised. Every model
# construction in the project goes through `pretrained` or holds this lock.
MODEL_INIT_LOCK = threading.RLock()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text encodes) with digits kept apart, so numbers stay digit by digit."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    )


def build_tiny_model(out_dir: Path, texts: list[str], shape: TinyModelConfig, seed: int) -> Path:
    """Write a tokenizer and a randomly initialised Llama to `out_dir` (atomically)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = build_tokenizer(texts, shape.vocab_size)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    with MODEL_INIT_LOCK:
        model = LlamaForCausalLM(config)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def load_tokenizer(path: str | Path):
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def pretrained(auto_class, path: str | Path, **kwargs) -> torch.nn.Module:
    """`auto_class.from_pretrained`, serialised across threads (see MODEL_INIT_LOCK)."""
    with MODEL_INIT_LOCK:
        return auto_class.from_pretrained(str(path), **kwargs)


def load_causal_lm(path: str | Path, dtype: str = "float32", device: Optional[torch.device | str] = None
                   ) -> torch.nn.Module:
    """The model in `dtype` (float32 or bfloat16, on any device), moved to `device` (None: where it loads)."""
    model = pretrained(AutoModelForCausalLM, path, dtype=DTYPES[dtype], attn_implementation="eager")
    model.config.use_cache = False
    return model if device is None else model.to(device)


def save_checkpoint(model: torch.nn.Module, tokenizer, out_dir: Path) -> Path:
    """HF-format directory loadable by plain transformers; written to a temp dir, then renamed."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def file_hash(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def checkpoint_hash(path: str | Path) -> str:
    return file_hash(*sorted(Path(path).glob("*.safetensors")))


def tokenizer_hash(path: str | Path) -> str:
    return file_hash(Path(path) / "tokenizer.json")
