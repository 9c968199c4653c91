"""Supervised warm start on an environment's reference solutions, so a tiny model starts above zero."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import torch

from opd_sao.checkpoints import PromptFormat, load_causal_lm, save_checkpoint
from opd_sao.config import SFTConfig
from opd_sao.devices import mixed_precision, resolve_device
from opd_sao.modeling import sft_loss
from opd_sao.runs.checkpointing import truncate_step_log
from opd_sao.runs.files import atomic_path
from opd_sao.runs.tracking import MetricsLogger

STATE, LOG = "sft_state.pt", "sft.jsonl"  # in run_sft's work_dir


def sft_examples(env_factory, tokenizer, n: int, seed: int,
                 prompt_format: Optional[PromptFormat] = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + eos) from the train split's reference actions, in the stage's prompt format."""
    env = env_factory()
    fmt = prompt_format or PromptFormat(tokenizer)
    examples = []
    for task in env.make_tasks("train", n, seed):
        actions = env.reference_actions(task)
        if not actions:
            continue
        examples.append((fmt.prompt(env.reset(task)), fmt.answer(actions[0])))
    if not examples:
        raise ValueError("the environment gives no reference actions, so SFT warm start has nothing to learn from")
    return examples


def load_sft_state(work_dir: Path) -> Optional[dict]:
    """The state an interrupted run_sft saved in `work_dir` (None when there is none): pass it to run_sft."""
    path = Path(work_dir) / STATE
    return torch.load(path, weights_only=True) if path.is_file() else None


def discard_sft_state(work_dir: Path) -> None:
    """Before a fresh start: an earlier run's state and step log must not be continued."""
    for name in (STATE, LOG):
        (Path(work_dir) / name).unlink(missing_ok=True)


def run_sft(checkpoint: Path, out_dir: Path, examples, tokenizer, cfg: SFTConfig, seed: int, progress=None, *,
            work_dir: Optional[Path] = None, save_every: int = 0, state: Optional[dict] = None,
            device: Optional[str] = None, dtype: str = "float32") -> Path:
    """SFT from `checkpoint`; returns the HF-format `out_dir`, written atomically.

    With `work_dir` it is resumable, like an RL stage: work_dir/sft.jsonl gets one line per step (loss and the
    indices of the examples trained on), and every `save_every` steps the weights, optimizer and sampler go to
    work_dir/sft_state.pt (atomically). Given that `state` (load_sft_state), it continues from the saved step with
    the log cut back to it: a step counts as trained only if the weights that learnt from it were saved, and the
    examples drawn are the ones an uninterrupted run draws. The state is removed once `out_dir` is written.
    Runs on `device` in the trainer's precision (`dtype`: float32 weights, bfloat16 compute under autocast).
    """
    device = resolve_device(device)
    model = load_causal_lm(checkpoint, device=device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng, start = random.Random(seed), 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        rng.setstate((state["rng"][0], tuple(state["rng"][1]), state["rng"][2]))
        start = state["step"]
    logger = None
    if work_dir is not None:
        truncate_step_log(Path(work_dir) / LOG, start)
        logger = MetricsLogger(Path(work_dir) / LOG, stage="sft")
    if progress is not None:
        progress.update(start)
    for step in range(start, cfg.steps):
        picks = [rng.randrange(len(examples)) for _ in range(cfg.batch_size)]
        chosen = [examples[i] for i in picks]
        width = max(len(p) + len(a) for p, a in chosen)
        ids = torch.full((len(chosen), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        loss_mask = torch.zeros(ids.shape)
        for i, (prompt, answer) in enumerate(chosen):
            seq = prompt + answer
            ids[i, : len(seq)] = torch.tensor(seq)
            attention[i, : len(seq)] = 1
            loss_mask[i, len(prompt): len(seq)] = 1
        with mixed_precision(device, dtype):
            loss = sft_loss(model, ids.to(device), attention.to(device), loss_mask.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{loss.item():.3f}")
        if logger is not None:
            logger.log({"loss": round(loss.item(), 5), "examples": picks}, step)
            if save_every and (step + 1) % save_every == 0 and step + 1 < cfg.steps:
                with atomic_path(Path(work_dir) / STATE) as tmp:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng.getstate(),
                                "step": step + 1}, tmp)
    checkpoint = save_checkpoint(model, tokenizer, out_dir)
    if work_dir is not None:
        (Path(work_dir) / STATE).unlink(missing_ok=True)
    return checkpoint
