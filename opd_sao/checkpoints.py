"""Loading policies and tokenizers from local HF directories, prompt encoding, and the embedded tiny model.

The tiny model is built once (random init from a Llama config, a byte-level BPE tokenizer trained
locally, a small chat template) and saved in HF format; from then on it loads through the same
`from_pretrained` path a real checkpoint takes. Nothing is ever downloaded. Any local HF causal LM
loads the same way; `PromptFormat` encodes prompts the way its tokenizer expects (BOS only when it has
one; its chat template for `prompt_format: chat`).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import threading
import time
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
from opd_sao.errors import UsageError
from opd_sao.gguf_header import is_gguf_path

hf_logging.disable_progress_bar()  # one bar per stage is ours to draw; loading a tiny model needs none
hf_logging.set_verbosity_error()

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
# The tiny model's chat template: "role: content" lines, the assistant's closed by eos (what stops generation).
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
PROMPT_FORMATS = ("raw", "chat")

# transformers builds a model inside context managers that patch process-wide state (the default
# dtype, the meta device, no-op `nn.init` functions) and restore it on exit. Two threads loading at
# once (the teacher prefetcher and the trainer) interleave those saves and restores and can leave
# the patches in place: later models come out on the meta device or uninitialised. Every model
# construction in the project goes through `pretrained` or holds this lock.
MODEL_INIT_LOCK = threading.RLock()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


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
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False,
        chat_template=TINY_CHAT_TEMPLATE,
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
    """The checkpoint's tokenizer; without a pad token, eos pads (every padded position is masked out)."""
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise UsageError(f"the tokenizer of {path} has neither a pad nor an eos token: set one of them in its "
                             "tokenizer_config.json")
        tok.pad_token = tok.eos_token
    return tok


def encode_text(tokenizer, text: str) -> list[int]:
    """Plain text as a model sees it at the start of a sequence: BOS first only when the tokenizer has one."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids if tokenizer.bos_token_id is None else [tokenizer.bos_token_id] + ids


@functools.lru_cache(maxsize=8192)
def _raw_prompt(tokenizer, text: str) -> tuple[int, ...]:
    """Raw prompts, encoded once: a training pool's prompts come back every epoch and a group's G times."""
    return tuple(encode_text(tokenizer, text))


_ACTION, _OBSERVATION = "\x00opd-sao-action\x00", "\x00opd-sao-observation\x00"


class PromptFormat:
    """How environment text becomes the token ids a model expects (a stage's `rollout.prompt_format`).

    raw: the prompt as plain text (`encode_text`), observations as plain text after the action. chat: the
    tokenizer's chat template: the prompt is a user turn (after the optional system prompt) followed by the
    generation prompt; each observation closes the assistant's turn (unless the action already ended on the
    stop token that closes it), is a user turn, and opens the next assistant turn. Actions are the engine's
    token ids, never re-tokenised: only the text around them is encoded.
    """

    def __init__(self, tokenizer, kind: str = "raw", system_prompt: Optional[str] = None):
        if kind not in PROMPT_FORMATS:
            raise UsageError(f"prompt_format must be one of {list(PROMPT_FORMATS)} (got {kind!r})")
        if kind == "chat" and not tokenizer.chat_template:
            raise UsageError(f"prompt_format chat: the tokenizer {tokenizer.name_or_path!r} has no chat template "
                             "(use prompt_format raw, or add a chat_template to its tokenizer_config.json)")
        self.tokenizer, self.kind = tokenizer, kind
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        if kind == "chat":
            # The template's text between an assistant message and the next assistant message's content,
            # around the user's content: rendered once with placeholders, so any template works.
            text = self._render([{"role": "user", "content": "?"}, {"role": "assistant", "content": _ACTION},
                                 {"role": "user", "content": _OBSERVATION}])
            self._turn = tuple(text.split(_ACTION, 1)[1].split(_OBSERVATION, 1))

    @classmethod
    def from_rollout(cls, tokenizer, rollout) -> "PromptFormat":
        return cls(tokenizer, rollout.prompt_format, rollout.system_prompt)

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(self.system + messages, tokenize=False, add_generation_prompt=True)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, text: str) -> list[int]:
        if self.kind == "raw":
            return list(_raw_prompt(self.tokenizer, text))
        return self._encode(self._render([{"role": "user", "content": text}]))

    def observation(self, text: str, stopped_on: Optional[int] = None, instruction: str = "") -> list[int]:
        """An observation after an action (`stopped_on`: the stop token the action ended with, if any),
        followed by `instruction` (compaction's request for a summary) in the same turn."""
        if self.kind == "raw":
            return self._encode(text) + (self._encode(instruction) if instruction else [])
        head, tail = self._turn
        if stopped_on is not None:
            closing = self.tokenizer.decode([stopped_on])
            if closing and head.startswith(closing):
                head = head[len(closing):]
        return self._encode(head + text + instruction + tail)

    def answer(self, text: str) -> list[int]:
        """A reference response as the model should write it (SFT): the text, then eos, which ends the turn."""
        return self._encode(text) + [self.tokenizer.eos_token_id]


def pretrained(auto_class, path: str | Path, **kwargs) -> torch.nn.Module:
    """`auto_class.from_pretrained`, serialised across threads (see MODEL_INIT_LOCK)."""
    with MODEL_INIT_LOCK:
        return auto_class.from_pretrained(str(path), **kwargs)


def check_attention(attn_implementation: str) -> None:
    """flash_attention_2 needs CUDA and the flash_attn package: refused in one line without them."""
    if attn_implementation != "flash_attention_2":
        return
    import importlib.util

    if not torch.cuda.is_available():
        raise UsageError("model.attn_implementation flash_attention_2 needs a CUDA GPU, and this machine has none "
                         "(use sdpa)")
    if importlib.util.find_spec("flash_attn") is None:
        raise UsageError("model.attn_implementation flash_attention_2 needs the flash_attn package (pip install "
                         "flash-attn), which is not installed (or use sdpa)")


def load_causal_lm(path: str | Path, dtype: str = "float32", device: Optional[torch.device | str] = None,
                   attn_implementation: str = "eager") -> torch.nn.Module:
    """The model in `dtype` (float32, bfloat16 or float64, on any device), moved to `device` (None: where it
    loads), with transformers' `attn_implementation` (`model.attn_implementation`)."""
    check_attention(attn_implementation)
    model = pretrained(AutoModelForCausalLM, path, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    model.config.use_cache = False
    return model if device is None else model.to(device)


def stop_ids(model: torch.nn.Module, eos_id: Optional[int]) -> frozenset[int]:
    """The tokenizer's eos and every eos id of the model's generation config: any of them ends a response
    (Qwen-style chat models stop on `<|im_end|>` or `<|endoftext|>`)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    ids = frozenset(configured + ([eos_id] if eos_id is not None else []))
    if not ids:
        raise UsageError("the model has no eos token (neither its tokenizer nor its generation config names one), "
                         "so generation could never stop")
    return ids


def describe_model(path: str | Path) -> dict:
    """What opd-sao will use from a model directory (`opd-sao models check`); ValueError naming what is wrong."""
    path = Path(path)
    if is_gguf_path(path) and path.is_file():
        raise UsageError(f"{path} is a GGUF file: convert it first (opd-sao models import {path} OUT), then check OUT")
    if not (path / "config.json").is_file():
        raise UsageError(f"{path} is not an HF-format model directory (no config.json)")
    try:
        tokenizer = load_tokenizer(path)
        model = pretrained(AutoModelForCausalLM, path, dtype="auto")
    except Exception as err:  # any loading failure is the one-line answer
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UsageError(f"{path} cannot be loaded as a causal LM: {type(err).__name__}: {reason}") from None
    vocab = model.get_input_embeddings().num_embeddings
    output = model.get_output_embeddings()

    def token(i):
        return None if i is None else {"id": i, "token": tokenizer.convert_ids_to_tokens(i)}

    return {
        "path": str(path), "architecture": (model.config.architectures or [type(model).__name__])[0],
        "model_type": model.config.model_type, "vocab_size": vocab, "tokenizer_size": len(tokenizer),
        "padded_rows": vocab - len(tokenizer),
        "tied_embeddings": output is not None and output.weight is model.get_input_embeddings().weight,
        "bos": token(tokenizer.bos_token_id), "eos": token(tokenizer.eos_token_id), "pad": token(tokenizer.pad_token_id),
        "pad_is_eos": tokenizer.pad_token_id == tokenizer.eos_token_id,
        "stop_ids": sorted(stop_ids(model, tokenizer.eos_token_id)),
        "chat_template": bool(tokenizer.chat_template), "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "parameters": model.num_parameters(),
        "weights": sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin")
                          or p.name.endswith(".index.json")),
    }


def save_checkpoint(model: torch.nn.Module, tokenizer, out_dir: Path) -> Path:
    """HF-format directory loadable by plain transformers; written to a temp dir, then renamed."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    training, model.config.use_cache = model.config.use_cache, True  # a user's generate() keeps its KV cache
    try:  # (training loads turn it off, load_causal_lm)
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        model.config.use_cache = training
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


HASH_BLOCK = 1 << 24
# Every file a loader may read weights from: (sharded) safetensors and their index, PyTorch .bin / .pt
# shards and their index, under any sub-folder (some exports put weights in a sub-directory).
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth")


def file_hash(*paths: Path, root: Path | None = None) -> str:
    """sha256 of the files' bytes, streamed (a shard can be larger than memory); with `root`, of their
    paths relative to it too, so a renamed shard changes the hash."""
    digest = hashlib.sha256()
    for path in paths:
        if root is not None:
            digest.update(str(Path(path).relative_to(root)).encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(HASH_BLOCK):
                digest.update(block)
    return digest.hexdigest()[:16]


def weight_files(path: str | Path) -> list[Path]:
    path = Path(path)
    return sorted({f for pattern in WEIGHT_PATTERNS for f in path.rglob(pattern) if f.is_file()})


_CHECKPOINT_HASHES: dict[tuple, str] = {}  # checkpoint_hash's memo, keyed by the weight files' stat signatures
RACY_NS = 2_000_000_000  # files changed this recently are hashed every time (their stat may not show a rewrite yet)


def checkpoint_hash(path: str | Path) -> str:
    """The identity of a checkpoint's weights (the logit cache keys on it): every weight file, any format.
    Memoised per process on each file's (device, inode, size, mtime, ctime), as make and git's index do, so the
    evaluator, the OPD stage and the teacher registry asking about one finished checkpoint read its weights once,
    while a checkpoint written again is hashed again. Files changed in the last 2 s are not memoised (git's "racy"
    rule: a rewrite within the file system's timestamp tick, same size, would keep the signature)."""
    files = weight_files(path)
    if not files:
        raise UsageError(f"checkpoint {str(path)!r} has no weight files to hash ({', '.join(WEIGHT_PATTERNS)})")
    root, now = Path(path), time.time_ns()
    stats = [(f, f.stat()) for f in files]
    key = tuple((str(f.relative_to(root)), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                for f, st in stats)
    if key in _CHECKPOINT_HASHES:
        return _CHECKPOINT_HASHES[key]
    digest = file_hash(*files, root=root)
    if all(now - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS for _, st in stats):
        _CHECKPOINT_HASHES[key] = digest
    return digest


def tokenizer_hash(path: str | Path) -> str:
    return file_hash(Path(path) / "tokenizer.json")
