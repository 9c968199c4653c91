"""Supervised warm start on an environment's reference solutions, so a tiny model starts above zero."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import torch

from opd_sao.checkpoints import load_causal_lm, save_checkpoint
from opd_sao.config import SFTConfig
from opd_sao.devices import resolve_device
from opd_sao.modeling import sft_loss


def sft_examples(env_factory, tokenizer, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + eos) from the train split's reference actions."""
    env = env_factory()
    examples = []
    for task in env.make_tasks("train", n, seed):
        actions = env.reference_actions(task)
        if not actions:
            continue
        prompt = [tokenizer.bos_token_id] + tokenizer.encode(env.reset(task), add_special_tokens=False)
        answer = tokenizer.encode(actions[0], add_special_tokens=False) + [tokenizer.eos_token_id]
        examples.append((prompt, answer))
    if not examples:
        raise ValueError("the environment gives no reference actions, so SFT warm start has nothing to learn from")
    return examples


def run_sft(checkpoint: Path, out_dir: Path, examples, tokenizer, cfg: SFTConfig, seed: int, progress=None,
            device: Optional[str] = None) -> Path:
    """`steps` AdamW steps on random batches of `examples`, on `device` (the trainer's; None: auto)."""
    device = resolve_device(device)
    model = load_causal_lm(checkpoint, device=device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(seed)
    for _ in range(cfg.steps):
        chosen = [examples[rng.randrange(len(examples))] for _ in range(cfg.batch_size)]
        width = max(len(p) + len(a) for p, a in chosen)
        ids = torch.full((len(chosen), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        loss_mask = torch.zeros(ids.shape)
        for i, (prompt, answer) in enumerate(chosen):
            seq = prompt + answer
            ids[i, : len(seq)] = torch.tensor(seq)
            attention[i, : len(seq)] = 1
            loss_mask[i, len(prompt): len(seq)] = 1
        loss = sft_loss(model, ids.to(device), attention.to(device), loss_mask.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{loss.item():.3f}")
    return save_checkpoint(model, tokenizer, out_dir)
