"""`env: reasoning_gym` on real reasoning-gym generators: disjoint splits (seeds and question text), strict final
answers (the oracle scores 1, an echoed prompt or the restated expression 0), one-line option errors, and a short RL
run of the tiny model on `reasoning_gym:basic_arithmetic`."""
from __future__ import annotations

import pytest

from opd_sao.app.pipeline import run_pipeline
from opd_sao.config import parse_config
from opd_sao.envs import ENVIRONMENTS
from opd_sao.envs.answers import prompt_expression
from opd_sao.envs.reasoning_gym_env import ReasoningGymEnv
from opd_sao.envs.validity import check_environment, probes

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # at most 2 x 10 x 10 questions


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum"])
def test_splits_never_share_a_question(task):
    env = ReasoningGymEnv(task=task, task_options=SMALL, train_size=150, eval_size=100)
    train, held_out = env.make_tasks("train", 10_000, 0), env.make_tasks("eval", 10_000, 0)
    assert len(train) == 150 and 0 < len(held_out) < 100  # the small space repeats: repeated questions dropped
    assert not {t["prompt"] for t in train} & {t["prompt"] for t in held_out}
    assert not {t["id"] for t in train} & {t["id"] for t in held_out}
    assert env.generated.counts["eval_dropped"] == 100 - len(held_out)
    assert ENVIRONMENTS.get(f"reasoning_gym:{task}") is ReasoningGymEnv


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum"])
def test_oracle_scores_one_and_echo_or_restated_expression_zero(task):
    env = ReasoningGymEnv(task=task, train_size=40, eval_size=20)
    for item in env.make_tasks("train", 5, 0) + env.make_tasks("eval", 5, 0):
        prompt, answer = env.reset(item), item["answer"]
        expression = prompt_expression(prompt)
        assert expression and probes(prompt, env.reference_actions(item))["restate"]  # the probe does run
        score = lambda response: (env.reset(item), env.step(response)[1])[1]
        assert [score(r) for r in (f"<answer>{answer}</answer>", f"so\n<answer> {answer} </answer>",
                                    rf"\boxed{{{answer}}}", answer)] == [1.0] * 4
        assert [score(r) for r in (prompt, expression, f"<answer>{expression}</answer>", rf"\boxed{{{expression}}}",
                                   f"The answer is {answer}.", f"<answer>{answer} {answer}1</answer>", "",
                                   f"<answer>{answer}</answer><answer>0{answer}1</answer>")] == [0.0] * 8
    report = check_environment(f"reasoning_gym:{task}", lambda: ReasoningGymEnv(task=task, train_size=40, eval_size=20))
    assert report.ok and not report.skipped and len(report.tasks) == 16


def test_leg_counting_references_and_corpus():
    env = ReasoningGymEnv(task="leg_counting", train_size=20, eval_size=10)
    (item,) = env.make_tasks("train", 1, 3)
    assert item["prompt"].endswith("as <answer>...</answer>.") and env.reference_actions(item)[0].startswith("<answer>")
    assert check_environment("reasoning_gym:leg_counting", lambda: env, n=6).ok
    assert len(env.corpus(10)) == 20 and ReasoningGymEnv().corpus() == []  # the bare default has no tasks


@pytest.mark.parametrize("options, needle", [
    ({"task": "nope"}, "no generator 'nope'"),
    ({"task": "basic"}, "close: basic_arithmetic"),
    ({"task": "chain_sum", "task_options": {"size": 5}}, "may not set ['size']"),
    ({"task": "chain_sum", "task_options": {"min_terms": 0}}, "min_terms must be positive"),
    ({"task": "chain_sum", "prompt_template": "{q}"}, "must name {question}"),
    ({"eval_size": 3}, "give `task`"),
])
def test_bad_options_are_one_line(options, needle):
    with pytest.raises(ValueError, match=None) as err:
        ReasoningGymEnv.check_options(options)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_short_rl_run_on_basic_arithmetic(tmp_path):
    options = {"task": "basic_arithmetic", "task_options": SMALL, "train_size": 64, "eval_size": 16}
    stage = {"name": "reasoning", "kind": "reasoning", "env": "reasoning_gym:basic_arithmetic", "env_options": options,
             "steps": 2, "sft": {"steps": 2, "batch_size": 4}, "rollout": {"max_new_tokens": 8},
             "eval": {"num_tasks": 4}, "gate": {"enabled": False}}
    cfg = parse_config({"seed": 0, "logging": {"wandb": False, "progress": False},
                        "model": {"path": "tiny", "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
                                                           "num_heads": 2, "num_kv_heads": 1}},
                        "trainer": {"train_batch_size": 4, "critic_warmup_steps": 0}, "stages": [stage]})
    summary = run_pipeline(cfg, tmp_path, log=lambda m: None)
    (done,) = summary["stages"]
    assert set(done["eval_after"]) == {"reasoning_gym:basic_arithmetic"}
    assert done["reasoning_gym"]["task"] == "basic_arithmetic" and done["reasoning_gym"]["train"] == 64
    assert len((tmp_path / "stages" / "reasoning" / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_documented_stage_is_valid():
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    (stage,) = [block for block in re.findall(r"```yaml\n(.*?)```", text, re.S) if "reasoning_gym:" in block]
    (stage,) = yaml.safe_load(stage)
    assert stage["env"] == "reasoning_gym:basic_arithmetic" and ReasoningGymEnv.check_options(stage["env_options"])
