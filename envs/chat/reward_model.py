"""A reward model: a transformers sequence-classification model (one score) trained on preference pairs.

Bradley-Terry loss, -log sigmoid(score(chosen) - score(rejected)), on (prompt, chosen, rejected)
pairs. The backbone is any local HF causal-LM directory (the tiny model the project builds, or a
real one); the result is a plain HF directory that `AutoModelForSequenceClassification` loads, with
the good/bad decision threshold and the held-out pair accuracy in its config (`reward_model`).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from opd_sao.checkpoints import encode_text, load_tokenizer, pretrained, save_checkpoint
from opd_sao.devices import resolve_device
from opd_sao.errors import UsageError

Pair = tuple[str, str, str]  # (prompt, chosen response, rejected response)


def encode(tokenizer, prompts: list[str], responses: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(bos +) prompt + response + eos, right-padded: the classifier reads the eos, so a cut-off response differs."""
    seqs = [encode_text(tokenizer, p + r) + [tokenizer.eos_token_id] for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, seq in enumerate(seqs):
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
    return ids, attention


def _scores(model, tokenizer, prompts: list[str], responses: list[str]) -> torch.Tensor:
    ids, attention = encode(tokenizer, prompts, responses)
    device = model.device
    return model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits.squeeze(-1).float().cpu()


def _pair_scores(model, tokenizer, pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores, rejected scores), from one forward over both."""
    prompts = [p for p, _, _ in pairs]
    scores = _scores(model, tokenizer, prompts * 2, [c for _, c, _ in pairs] + [r for _, _, r in pairs])
    return scores[: len(pairs)], scores[len(pairs):]


def best_threshold(good: torch.Tensor, bad: torch.Tensor) -> float:
    """The cut that best separates good from bad scores (midway between the neighbouring scores)."""
    scores, order = torch.cat([good, bad]).sort()
    is_good = torch.cat([torch.ones_like(good), torch.zeros_like(bad)])[order]
    correct = (1 - is_good).cumsum(0) + (is_good.sum() - is_good.cumsum(0))  # cut just above position i
    i = int(correct.argmax())
    return float((scores[i] + scores[i + 1]) / 2) if i + 1 < len(scores) else float(scores[i]) + 1.0


class RewardModel:
    def __init__(self, path: str | Path, device: Optional[str] = None):
        """`device`: where it scores (auto | cpu | cuda | cuda:N; None: auto)."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no reward model at {str(path)!r} (no config.json)")
        self.device = resolve_device(device)
        self.model = pretrained(AutoModelForSequenceClassification, path).to(self.device).eval()
        self.tokenizer = load_tokenizer(path)
        self.info = getattr(self.model.config, "reward_model", None) or {}
        self.threshold = float(self.info.get("threshold", 0.0))

    @torch.no_grad()
    def score(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        return _scores(self.model, self.tokenizer, prompts, responses)

    @torch.no_grad()
    def accuracy(self, pairs: list[Pair]) -> float:
        chosen, rejected = _pair_scores(self.model, self.tokenizer, pairs)
        return float((chosen > rejected).float().mean())


def train_reward_model(init: str | Path, out: str | Path, pairs: list[Pair], heldout: list[Pair], *,
                       steps: int = 300, lr: float = 2e-3, batch_size: int = 32, seed: int = 0,
                       device: Optional[str] = None, trained_from: Optional[dict] = None) -> dict:
    """Train from `init` (an HF causal-LM directory) on `device`, save to `out`; returns the held-out pair
    accuracy etc. (also saved in the model's config as `reward_model`, with `trained_from`: what the pairs
    came from, so a later run can tell whether the model is still current)."""
    if not pairs or not heldout:
        raise UsageError("training a reward model needs training and held-out preference pairs")
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(init)
    model = pretrained(AutoModelForSequenceClassification, init, num_labels=1,
                       pad_token_id=tokenizer.pad_token_id).to(resolve_device(device)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    for _ in range(steps):
        chosen, rejected = _pair_scores(model, tokenizer, [rng.choice(pairs) for _ in range(batch_size)])
        loss = -F.logsigmoid(chosen - rejected).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    with torch.no_grad():
        threshold = best_threshold(*_pair_scores(model, tokenizer, rng.sample(pairs, min(len(pairs), 512))))
        chosen, rejected = _pair_scores(model, tokenizer, heldout)
    info = {"threshold": threshold, "heldout_accuracy": float((chosen > rejected).float().mean()),
            "heldout_good_rate": float((chosen > threshold).float().mean()),
            "heldout_bad_rate": float((rejected > threshold).float().mean()),
            "train_pairs": len(pairs), "heldout_pairs": len(heldout), "steps": steps, "final_loss": float(loss.detach())}
    if trained_from is not None:
        info["trained_from"] = trained_from
    model.config.reward_model = info
    save_checkpoint(model, tokenizer, Path(out))
    return info
