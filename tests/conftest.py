"""Shared fixtures: a real tiny transformers model and tokenizer, built once per test session."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)  # tiny models: one thread is fastest, and the rollout and trainer threads get a core each


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from opd_sao.checkpoints import build_tiny_model
    from opd_sao.config import TinyModelConfig
    from stages.envs import ENVIRONMENTS

    texts = []
    for name in ENVIRONMENTS.names():
        texts.extend(ENVIRONMENTS.get(name)().corpus(300))
    shape = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", texts, shape, seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from opd_sao.checkpoints import load_tokenizer

    return load_tokenizer(tiny_model_dir)
