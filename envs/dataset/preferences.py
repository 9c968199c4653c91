"""A reward model trained from a preference file (rows of prompt, chosen response, rejected response).

The training itself is the chat environment's (`envs/chat/reward_model.py`, Bradley-Terry on a
sequence-classification head); this module only reads the pairs from a file and builds the tiny backbone
on the file's own texts, so its tokenizer covers them.
"""
from __future__ import annotations

import json
import logging
import tempfile
import threading
from pathlib import Path

from .files import BadRow, DatasetError, field, iter_rows, stable_fraction

HELDOUT_FRACTION = 0.2
_lock = threading.Lock()
log = logging.getLogger(__name__)


def read_pairs(path: Path, prompt_key: str, chosen_key: str, rejected_key: str) -> list[tuple[str, str, str]]:
    """Every (prompt, chosen, rejected) of the file; any malformed row refuses the file (one line)."""
    pairs = []
    for number, row in iter_rows(path):
        if isinstance(row, BadRow):
            raise DatasetError(str(row))
        if not isinstance(row, dict):
            raise DatasetError(f"{path}: row {number}: not an object")
        try:
            pairs.append(tuple(field(path, number, row, key, str) for key in (prompt_key, chosen_key, rejected_key)))
        except BadRow as err:
            raise DatasetError(str(err)) from None
    return pairs


def train_from_file(path: Path, out: Path, *, prompt_key: str = "prompt", chosen_key: str = "chosen",
                    rejected_key: str = "rejected", steps: int = 200, seed: int = 0) -> dict:
    """Train a reward model at `out` from the pairs in `path`; a stable hash of the prompt holds out ~20%.

    A model already at `out` is kept when it was trained from the same file contents with the same keys,
    steps and seed (its config records them); one trained from anything else is trained again, so editing
    the preference file never leaves a stale reward model in use. A model at `out` that this function did
    not train is refused, not overwritten."""
    import torch

    from opd_sao.checkpoints import build_tiny_model, file_hash
    from opd_sao.config import TinyModelConfig
    from opd_sao.envs.chat.reward_model import train_reward_model

    source = {"sha256": file_hash(path), "keys": [prompt_key, chosen_key, rejected_key], "steps": steps,
              "seed": seed}
    with _lock:
        if (out / "config.json").is_file():
            recorded = json.loads((out / "config.json").read_text()).get("reward_model", {}).get("trained_from")
            if recorded == source:
                return {}
            if recorded is None:
                raise DatasetError(f"{out} holds a reward model that was not trained from {path}: point the reward's "
                                   "`path` elsewhere, delete it, or drop `train_from` to use it as it is")
            log.warning("retraining the reward model at %s: %s changed since it was trained", out, path)
        pairs = read_pairs(path, prompt_key, chosen_key, rejected_key)
        heldout = [p for p in pairs if stable_fraction(p[0]) < HELDOUT_FRACTION]
        train = [p for p in pairs if stable_fraction(p[0]) >= HELDOUT_FRACTION]
        if not train or not heldout:
            raise DatasetError(f"{path}: {len(pairs)} preference pairs are too few to train and hold out a reward model")
        texts = [p + c for p, c, _ in pairs] + [p + r for p, _, r in pairs]
        with tempfile.TemporaryDirectory() as tmp, torch.enable_grad():  # first use may come inside an evaluation
            init = build_tiny_model(Path(tmp) / "init", texts, TinyModelConfig(), seed)
            return train_reward_model(init, out, train, heldout, steps=steps, seed=seed, trained_from=source)
