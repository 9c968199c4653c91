"""Hostile data and rewards (issue 25): NaN and out-of-range rewards, the trainer's refusal of non-finite updates,
gameable code tests, broken dataset files and rewards that hang or misread. Each case failed on the code before
the fix (docs/reliability.md, "Hostile data and rewards")."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from opd_sao.config import TrainerConfig, parse_config
from opd_sao.pipeline import run_pipeline
from opd_sao.runs.checkpointing import StageState
from opd_sao.trainers.base import NonFiniteError
from opd_sao.trainers.torch_backend import TorchTrainer
from stages.envs.dataset import DatasetEnv
from stages.envs.validity import check_environment

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
ROWS = [{"id": f"q{i}", "prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]


def rows_file(tmp_path: Path, rows: list[dict] = ROWS, name: str = "rows.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def python_reward(tmp_path: Path, otherwise: str, *, oracle: str = "1.0", empty: str = "0.0") -> str:
    """A `python:` reward function: `oracle` for the answer, `empty` for "" or a no-op, `otherwise` else."""
    path = tmp_path / "my_reward.py"
    path.write_text("import math, time\n"
                    "def score(task, response):\n"
                    f"    if response.strip() == task['answer']:\n        return {oracle}\n"
                    f"    if response.strip() in ('', 'pass'):\n        return {empty}\n"
                    f"    return {otherwise}\n")
    return f"{path}:score"


@pytest.mark.parametrize("value", ["math.nan", "math.inf", "-1e308", "1.5"])
def test_a_reward_outside_its_range_fails_the_validity_check_naming_the_tasks(tmp_path, value):
    """Before: NaN (and -1e308 from a no-op) passed the check, since every comparison with NaN is false."""
    function = python_reward(tmp_path, "0.0", oracle=value)
    env = lambda: DatasetEnv(path=str(rows_file(tmp_path)), reward="python", reward_options={"function": function})  # noqa: E731
    report = check_environment("dataset", env)
    assert not report.ok and len(report.failures["reward"]) == len(report.tasks) == 16
    assert "finite number in reward_range [0.0, 1.0]" in report.describe() and "q" in report.describe()


def test_a_declared_reward_range_is_honoured(tmp_path):
    function = python_reward(tmp_path, "-1.0", oracle="1.0", empty="-1.0")
    options = {"function": function, "reward_range": [-1, 1]}
    env = DatasetEnv(path=str(rows_file(tmp_path)), reward="python", reward_options=options)
    env.reset(ROWS[0])
    assert env.step("nonsense")[1] == -1.0
    with pytest.raises(ValueError, match="reward_range must be"):
        DatasetEnv(path=str(rows_file(tmp_path)), reward="python",
                   reward_options={"function": function, "reward_range": [1, "nan"]}).reward  # noqa: B018


def _run_config(tmp_path: Path, env_options: dict, **stage) -> dict:
    return {"seed": 0, "model": {"tiny": TINY}, "logging": {"wandb": False, "progress": False},
            "trainer": {"train_batch_size": 4},
            "stages": [{"name": "r", "kind": "reasoning", "env": "dataset", "env_options": env_options, "steps": 3,
                        "checkpoint_every": 1, "rollout": {"max_new_tokens": 4}, "eval": {"num_tasks": 2},
                        "gate": {"enabled": False}, **stage}]}


def test_a_nan_reward_during_rollouts_stops_the_run_naming_the_task_and_nothing_is_saved(tmp_path):
    """Before: the NaN trained, the checkpoint and the resumable state were written as NaN, and evaluation
    crashed with a multinomial traceback. The oracle and the no-op score 1 and 0, so the validity check passes."""
    function = python_reward(tmp_path, "math.nan")
    cfg = parse_config(_run_config(tmp_path, {"path": str(rows_file(tmp_path)), "reward": "python",
                                              "reward_options": {"function": function}}))
    with pytest.raises(ValueError, match=r"PythonReward scored task 'q\d+' nan: a score must be a finite number"):
        run_pipeline(cfg, tmp_path / "run", log=lambda m: None)
    stage = tmp_path / "run" / "stages" / "r"
    assert not (stage / "state").exists() and not (stage / "checkpoint").exists()


def test_the_trainer_refuses_a_non_finite_loss_or_gradient_before_applying_it(tiny_model_dir, tmp_path):
    """Before: a NaN loss stepped AdamW, and every weight became NaN."""
    backend = TorchTrainer(tiny_model_dir, TrainerConfig(), with_critic=False)
    before = {k: v.clone() for k, v in backend.policy.state_dict().items()}
    weight = next(p for p in backend.policy.parameters() if p.dim() == 2)
    with pytest.raises(NonFiniteError, match="the policy loss is nan"):
        backend.step_policy(weight.sum() * math.nan)
    with pytest.raises(NonFiniteError, match="the policy gradient norm is (nan|inf)"):
        backend.step_policy(torch.sqrt(weight - weight.detach()).sum())  # 0, but d sqrt(x)/dx at 0 is inf
    assert all(torch.equal(v, backend.policy.state_dict()[k]) for k, v in before.items())
    assert backend.policy_version == 0
    with torch.no_grad():
        weight[0, 0] = math.inf
    with pytest.raises(NonFiniteError, match="non-finite weights in"):
        StageState(tmp_path).save(backend, 3, {})
    assert not (tmp_path / "state").exists()
