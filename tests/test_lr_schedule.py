"""Learning-rate schedules (transformers' schedulers): their lrs by hand, and the torch backend stepping and resuming
them.

(The DeepSpeed backend's schedule is checked in tests/test_deepspeed.py: it runs cosine there, step for step
with the torch backend, and a resumed DeepSpeed run must continue with the same weights as one never stopped.)
"""
from __future__ import annotations

import math

import pytest
import torch

from opd_sao.config import TrainerConfig
from opd_sao.trainers.base import lr_scheduler

# warm-up 2 of 6 steps, floor 0.1: 1/3, 2/3 (no step at lr 0), then a cosine from 1 (step 2) to the floor at the
# last step (5)
COSINE = [1 / 3, 2 / 3, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25, 0.1]


def _lrs(schedule: str, warmup: int, total, floor: float, n: int) -> list[float]:
    """The lr of each of n optimizer steps under `trainer.lr_schedule` at base lr 1."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = lr_scheduler(opt, TrainerConfig(lr_schedule=schedule, warmup_steps=warmup, min_lr_ratio=floor), total)
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_schedules_by_hand():
    assert _lrs("constant", 3, 10, 0.5, 6) == [1.0] * 6
    assert _lrs("linear_warmup", 3, None, 0.5, 6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert _lrs("cosine", 2, 6, 0.1, 6) == pytest.approx(COSINE)
    assert _lrs("cosine", 0, 7, 0.0, 7)[3] == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))
    assert _lrs("cosine", 0, 1, 0.3, 1) == [1.0]  # a one-step stage: its step at the full lr


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
    from opd_sao.trainers import TorchTrainer

    cfg = TrainerConfig(policy_lr=1e-3, critic_lr=2e-3, critic_steps=1, lr_schedule="cosine", warmup_steps=2,
                        min_lr_ratio=0.1)
    batch = _batch(tokenizer)
    trainer = TorchTrainer(tiny_model_dir, cfg, total_steps=6)
    used = _steps(trainer, batch, 3)
    trainer.save_state(tmp_path / "state")
    used += _steps(trainer, batch, 3)
    assert [p for p, _ in used] == pytest.approx([1e-3 * m for m in COSINE])
    assert [c for _, c in used] == pytest.approx([2e-3 * m for m in COSINE])  # critic_steps 1: the same horizon

    resumed = TorchTrainer(tiny_model_dir, cfg, total_steps=6)
    resumed.load_state(tmp_path / "state")
    assert _steps(resumed, batch, 3) == used[3:]  # the same lr, to the bit
    assert all(torch.equal(a, b) for a, b in zip(resumed.policy.parameters(), trainer.policy.parameters()))


def test_cosine_needs_a_horizon(tiny_model_dir):
    from opd_sao.trainers import TorchTrainer

    with pytest.raises(ValueError, match="cosine needs the number of optimizer steps"):
        TorchTrainer(tiny_model_dir, TrainerConfig(lr_schedule="cosine"), with_critic=False)
