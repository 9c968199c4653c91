"""The validity check's gaming probes: a verifier that pays for echoing the prompt, or for restating its expression,
is refused (a reward crediting the operands, and math-verify on the whole response: the old `math` behaviour), while
the built-in environments and honest rewards on the same data pass."""
from __future__ import annotations

import json

import pytest

from opd_sao.envs import ENVIRONMENTS
from opd_sao.envs.dataset import DatasetEnv
from opd_sao.envs.validity import check_environment, probes, require_valid
from opd_sao.errors import UsageError

ROWS = [{"id": f"c{i}", "prompt": f"Calculate {60 + i} - {i % 9 + 1}.", "answer": str(60 + i - (i % 9 + 1))}
        for i in range(30)]
GAMEABLE = '''import re


def operands(task, response):
    """Credits any response holding every number of the prompt (or the exact answer)."""
    numbers = re.findall(r"\\d+", task["prompt"])
    return float(response.strip() == task["answer"] or all(n in response for n in numbers))


def whole_response(task, response):
    """The old math reward: math-verify on the whole response, which evaluates the question's own expression. By the
    math checker's `equivalent`, without math-verify's wall-clock timers: a parse they cut short on a busy machine
    reads as "not equal", and this verifier would then look less gameable than it is."""
    from opd_sao.envs.dataset.math_worker import equivalent

    return float(equivalent(response, "$" + task["answer"] + "$"))
'''


@pytest.fixture
def data(tmp_path):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (tmp_path / "gameable.py").write_text(GAMEABLE)
    return tmp_path


@pytest.mark.parametrize("function", ["operands", "whole_response"])
def test_a_gameable_verifier_is_refused(data, function):
    options = {"path": str(data / "rows.jsonl"), "eval_fraction": 0.3, "reward": "python",
               "reward_options": {"function": f"{data / 'gameable.py'}:{function}"}}
    report = check_environment("dataset:calc", lambda: DatasetEnv(**options), n=8)
    assert not report.failures["oracle"] and not report.failures["noop"]  # the three old checks pass it
    assert len(report.failures["restate"]) == 8  # `66 - 8` (or `\boxed{66 - 8}`) is paid
    assert len(report.failures["echo"]) == 8
    with pytest.raises(UsageError, match=r"echoing the prompt scores above 0 on 8/8 tasks .*restating the "
                                         r"prompt's expression scores above 0 on 8/8 tasks"):
        require_valid("dataset:calc", lambda: DatasetEnv(**options), n=8)


@pytest.mark.parametrize("reward", ["math", "exact"])
def test_honest_rewards_on_the_same_data_pass(data, reward):
    options = {"path": str(data / "rows.jsonl"), "eval_fraction": 0.3, "reward": reward}
    report = check_environment("dataset:calc", lambda: DatasetEnv(**options), n=8)
    assert report.ok and not report.skipped


@pytest.mark.parametrize("env, options", [("arithmetic", {"ops": "+-*"}), ("digits_reverse", {}), ("digits_sort", {}),
                                          ("digits_copy", {})])
def test_built_in_environments_pass_the_probes(env, options):
    assert check_environment(env, lambda: ENVIRONMENTS.get(env)(**options), n=8).ok


def test_which_probes_run():
    assert probes("Calculate 66 - 8.", ["58"]) == {"echo": [["Calculate 66 - 8."]],
                                                    "restate": [["66 - 8"], [r"\boxed{66 - 8}"]]}
    assert list(probes("copy 4821=", ["4821"])) == ["echo"]  # no expression in the prompt
    assert list(probes("Make 14 from 3, 4 and 2: 3 * 4 + 2?", ["3*4+2"])) == ["echo"]  # the answer is an expression
