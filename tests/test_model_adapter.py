"""The model adapter (opd_sao/model/) is one boundary: a trainer step calls into it once per forward (the policy's
logprobs, the critic's values, OPD's student support), through the names the package exports, and the adapter picks
opd-sao's forward or transformers' inside. Checked by tracing every Python call of one real step on the tiny model."""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

import opd_sao.model as adapter
from opd_sao.config import AlgoConfig, TrainerConfig
from opd_sao.rl.learner import Learner
from opd_sao.trainers import TorchTrainer
from opd_sao.trajectory import Trajectory, collate

PACKAGE = str(Path(adapter.__file__).parent)


def _inside(code) -> bool:
    return code.co_filename.startswith(PACKAGE)


def entries(fn) -> collections.Counter:
    """(caller file, function entered) of every call into the package from outside it (no package frame on the
    stack), but autograd running a backward the package defined."""
    seen = collections.Counter()

    def profile(frame, event, arg):
        if event != "call" or not _inside(frame.f_code):
            return
        caller, outer = frame.f_back, []
        while caller is not None and not _inside(caller.f_code):
            outer.append(caller.f_code.co_filename)
            caller = caller.f_back
        if caller is None and not any("torch/autograd" in name for name in outer):
            project = next(name for name in outer if "/opd_sao/" in name or "/tests/" in name)
            seen[(Path(project).name, frame.f_code.co_qualname)] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def _batch(tokenizer):
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i, reward in enumerate((1.0, 0.0, 1.0, 0.0)):
        traj = Trajectory(f"t{i}", "arithmetic", [1] + torch.randint(3, 50, (4,), generator=g).tolist())
        traj.append(torch.randint(3, 50, (3 + i,), generator=g).tolist(), action=True, logp=[-1.0] * (3 + i),
                    versions=[0] * (3 + i))
        traj.add_reward(reward)
        trajs.append(traj)
    return collate(trajs, tokenizer.pad_token_id)


def test_a_trainer_step_enters_the_model_adapter_once_per_forward(tiny_model_dir, tokenizer):
    backend = TorchTrainer(tiny_model_dir, TrainerConfig(train_batch_size=4), with_critic=True)
    learner = Learner(backend, "sao", AlgoConfig(), critic_steps=2, critic_warmup_steps=0)
    batch = _batch(tokenizer)
    assert adapter.action_values.__module__ == "opd_sao.model.actions"

    step = entries(lambda: learner.step(batch, 1.0))
    # one policy forward; K = 2 critic updates and the values after them; the critic step's frozen-start store
    assert step == {("torch_backend.py", "sequence_logprobs"): 1, ("critic.py", "action_values"): 3,
                    ("critic.py", "FrozenStarts.__init__"): 1}, step

    def opd():
        logp, _, _ = backend.policy_support_logprobs(batch, None, None, vocab_chunk=64, top_k=4)
        backend.step_policy(-(logp.exp() * logp).sum())

    assert entries(opd) == {("torch_backend.py", "action_support_logprobs"): 1}
