"""Learning-rate schedules: the multiplier by hand, and the torch backend stepping and resuming it.

(The DeepSpeed backend's schedule is checked in tests/test_deepspeed.py: it runs cosine there, step for step
with the torch backend, and a resumed DeepSpeed run must continue with the same weights as one never stopped.)
"""
from __future__ import annotations

import math

import pytest
import torch

from opd_sao.algorithms import lr_multiplier


def test_lr_multiplier_by_hand():
    assert [lr_multiplier(s, "constant", 3, 10, 0.5) for s in (0, 5, 50)] == [1.0, 1.0, 1.0]
    assert [lr_multiplier(s, "linear_warmup", 3, 10, 0.5) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    # warm-up 2, 6 steps, floor 0.1: 1/3, 2/3, then cos from p = 0 (step 2) to p = 1 (step 5, the last)
    cosine = [lr_multiplier(s, "cosine", 2, 6, 0.1) for s in range(8)]
    assert cosine == pytest.approx([1 / 3, 2 / 3, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25, 0.1, 0.1, 0.1])
    assert lr_multiplier(3, "cosine", 0, 7, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_multiplier(0, "step", 0, 1, 0.0)


def _batch(tokenizer):
    from opd_sao.trajectory import Trajectory, collate

    trajs = [Trajectory(traj_id=f"t{i}", domain="d", prompt_ids=[tokenizer.bos_token_id, 7 + i, 9],
                        token_ids=[11, 12 + i, 13][: 2 + i % 2], action_mask=[1] * (2 + i % 2),
                        rollout_logp=[-1.0] * (2 + i % 2), versions=[0] * (2 + i % 2), rewards=[0.0] * (2 + i % 2))
             for i in range(4)]
    return collate(trajs, tokenizer.pad_token_id)


def _steps(trainer, batch, n: int) -> list[tuple[float, float]]:
    """n policy and critic steps on a fixed loss; the (policy, critic) lr each step ran at."""
    used = []
    for _ in range(n):
        used.append((trainer.policy_opt.param_groups[0]["lr"], trainer.critic_opt.param_groups[0]["lr"]))
        logp = trainer.policy_logprobs(batch, 1.0, grad=True)
        trainer.step_policy(-(logp * batch.action_mask).sum())
        values = trainer.critic_values(batch, grad=True)
        trainer.step_critic(((values - 1) ** 2 * batch.action_mask).sum())
    return used


def test_torch_backend_follows_the_schedule_and_resumes_it(tmp_path, tiny_model_dir, tokenizer):
    from opd_sao.config import TrainerConfig
    from opd_sao.trainers import TorchTrainer

    cfg = TrainerConfig(policy_lr=1e-3, critic_lr=2e-3, critic_steps=1, lr_schedule="cosine", warmup_steps=2,
                        min_lr_ratio=0.1)
    batch = _batch(tokenizer)
    trainer = TorchTrainer(tiny_model_dir, cfg, total_steps=6)
    used = _steps(trainer, batch, 3)
    trainer.save_state(tmp_path / "state")
    used += _steps(trainer, batch, 4)
    want = [lr_multiplier(s, "cosine", 2, 6, 0.1) for s in range(7)]
    assert [p for p, _ in used] == pytest.approx([1e-3 * m for m in want])
    assert [c for _, c in used] == pytest.approx([2e-3 * m for m in want])  # critic_steps 1: the same horizon

    resumed = TorchTrainer(tiny_model_dir, cfg, total_steps=6)
    resumed.load_state(tmp_path / "state")
    assert _steps(resumed, batch, 4) == used[3:]  # the same lr, to the bit
    assert all(torch.equal(a, b) for a, b in zip(resumed.policy.parameters(), trainer.policy.parameters()))


def test_cosine_needs_a_horizon(tiny_model_dir):
    from opd_sao.config import TrainerConfig
    from opd_sao.trainers import TorchTrainer

    with pytest.raises(ValueError, match="cosine needs the number of optimizer steps"):
        TorchTrainer(tiny_model_dir, TrainerConfig(lr_schedule="cosine"), with_critic=False)
