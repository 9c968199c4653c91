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


# ------------------------------------------------------------------------------------------------ code tests
ASSERTS = {"id": "t", "tests": {"kind": "asserts", "asserts": ["assert f(1) == 2", "assert f(2) == 3", "assert f(5) == 6"]}}
RIGHT = "def f(x):\n    return x + 1\n"
GAMES = {  # each a wrong program (f(x) = 0) that scored 1.0 before (issue 25)
    "mutate the tests": "import sys\nsys.modules['__main__'].tests[:] = ['pass'] * 3\ndef f(x):\n    return 0\n",
    "fake the result line": "import os, json\nos.write(1, ('\\n' + json.dumps([['', None]] * 3) + '\\n').encode())\n"
                            "os._exit(0)\n",
    "patch json.dumps": "import json\njson.dumps = lambda *a, **k: '[[\"\", null], [\"\", null], [\"\", null]]'\n"
                        "def f(x):\n    return 0\n",
    "an object equal to anything": "class A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return A()\n",
    "write to the sandbox's stdout through /proc": "import json, os\nfor pid in (1, os.getppid()):\n    try:\n"
        "        with open(f'/proc/{pid}/fd/1', 'w') as out:\n"
        "            out.write('\\n' + json.dumps([['', None]] * 3) + '\\n')\n    except OSError:\n        pass\n"
        "os._exit(0)\n",
}


@pytest.mark.parametrize("game", sorted(GAMES))
def test_code_tests_cannot_be_gamed(game):
    from stages.envs.dataset.rewards import build_reward

    reward = build_reward("code_tests", {})
    assert reward.score(ASSERTS, GAMES[game]).score == 0.0
    assert reward.score(ASSERTS, RIGHT).score == 1.0


def test_code_tests_output_and_test_count_are_not_the_programs_limit():
    """Before: a correct program printing 100 KB, or passing 50,000 asserts, scored 0 (the tests' results were
    echoed on the program's output, past its 64 KiB)."""
    from stages.envs.dataset.rewards import build_reward

    reward = build_reward("code_tests", {})
    assert reward.score(ASSERTS, RIGHT + "print('x' * 100_000)\n").score == 1.0
    many = {"id": "many", "tests": {"kind": "asserts", "asserts": [f"assert f({i}) == {i + 1}" for i in range(50_000)]}}
    assert reward.score(many, RIGHT).score == 1.0
    stdin = {"id": "io", "tests": {"kind": "io", "inputs": ["1", "2"], "outputs": ["2", "3"]}}
    assert reward.score(stdin, "x = int(input())\nprint('noise ' * 20_000)\nprint(x + 1)\n").score == 0.0
    assert reward.score(stdin, "x = int(input())\nimport sys\nprint('noise ' * 20_000, file=sys.stderr)\n"
                               "print(x + 1)\n").score == 1.0


@pytest.mark.parametrize("tests", ["", "   ", ["pass"], ["assert True", "# nothing"], ["'''doc'''"], ["assert f(1) =="]])
def test_empty_or_vacuous_tests_are_refused_at_load(tmp_path, tests):
    """Before: `tests: ""` was one empty assert that any program passed."""
    rows = [{"id": "a", "prompt": "p", "answer": RIGHT, "tests": tests}, *[
        {"id": f"ok{i}", "prompt": "p", "answer": RIGHT, "tests": ["assert f(1) == 2"]} for i in range(3)]]
    env = DatasetEnv(path=str(rows_file(tmp_path, rows)), reward="code_tests", max_bad_rows=1)
    counts: dict = {}
    assert [t["id"] for t in env.scan(None, counts)] == ["ok0", "ok1", "ok2"]
    assert counts["bad_rows"] == 1 and "row 1: field 'tests'" in counts["examples"][0]


def test_an_empty_reference_answer_is_refused_at_load(tmp_path):
    """Before: an empty answer made an empty \\boxed{} score 1.0."""
    rows = [{"id": "a", "prompt": "p", "answer": " "}, *ROWS[:3]]
    env = DatasetEnv(path=str(rows_file(tmp_path, rows)), reward="math", max_bad_rows=1)
    counts: dict = {}
    assert len(list(env.scan(None, counts))) == 3 and "field 'answer' is empty" in counts["examples"][0]
