"""configs/smollm2.yaml's pieces: the `constraints` reward against a hand-computed table, its data files
(examples/data/instructions.jsonl, functions.jsonl) passing the validity check (echo probe included) with held-out
splits of >= 200 tasks, and the whole config run end to end on the tiny model with one step per stage."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd_sao.config import load_config
from opd_sao.envs.dataset import DatasetEnv
from opd_sao.envs.rewards import build_reward
from opd_sao.envs.validity import check_environment
from opd_sao.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2.yaml"

LOWER_KEYWORD = [{"kind": "lowercase"}, {"kind": "include", "word": "lantern"}]
# (constraints, response, score): by hand, from the rules in envs/dataset/constraints.py
TABLE = [
    (LOWER_KEYWORD, "a lantern glows at night.", 1.0),
    (LOWER_KEYWORD, "A lantern glows at night.", 0.0),  # one upper-case letter
    (LOWER_KEYWORD, "lanterns glow at night.", 0.0),  # the word, not a longer one
    (LOWER_KEYWORD, "the LANTERN glows", 0.0),  # the word in any case, but not lowercase
    (LOWER_KEYWORD, "123 456", 0.0),  # no letter at all is not lowercase text
    ([{"kind": "max_words", "n": 3}], "one two three", 1.0),
    ([{"kind": "max_words", "n": 3}], "one two three four", 0.0),
    ([{"kind": "min_words", "n": 3}], "one two", 0.0),
    ([{"kind": "min_words", "n": 3}], " one  two\nthree ", 1.0),  # whitespace-separated words
    ([{"kind": "exclude", "word": "very"}], "it is everything", 1.0),  # "very" only inside another word
    ([{"kind": "exclude", "word": "very"}], "it is Very good", 0.0),
    ([{"kind": "no_commas"}, {"kind": "include", "word": "tea"}], "tea, please", 0.0),
    ([{"kind": "no_commas"}, {"kind": "include", "word": "tea"}], "tea please", 1.0),
    ([{"kind": "start_with", "phrase": "My answer:"}], "  My answer: yes", 1.0),  # the response is stripped
    ([{"kind": "start_with", "phrase": "My answer:"}], "my answer: yes", 0.0),  # verbatim
    ([{"kind": "end_with", "phrase": "That is all."}], "Tea is hot. That is all.\n", 1.0),
    ([{"kind": "end_with", "phrase": "That is all."}], "Tea is hot. That is all", 0.0),
    ([{"kind": "bullets", "n": 2}], "- one\n* two", 1.0),
    ([{"kind": "bullets", "n": 2}], "- one\n- two\n- three", 0.0),  # exactly n
    ([{"kind": "bullets", "n": 2}], "-one\n- two", 0.0),  # a bullet is `- ` or `* `
    ([{"kind": "quoted"}], '"tea is hot"', 1.0),
    ([{"kind": "quoted"}], '"tea is hot', 0.0),
    ([{"kind": "quoted"}], '"', 0.0),
]


@pytest.mark.parametrize("constraints, response, expected", TABLE)
def test_constraints_reward_is_one_only_when_every_constraint_holds(constraints, response, expected):
    task = {"id": "t", "prompt": "Write about tea.", "metadata": {"constraints": constraints}, "answer": "x"}
    assert build_reward("constraints").checked(task, response).score == expected


def test_constraints_reward_reads_after_the_echoed_prompt_and_refuses_malformed_rows_in_one_line():
    reward = build_reward("constraints")
    prompt = 'Tell me about tea. Include the word "lantern".'
    task = {"id": "t", "prompt": prompt, "metadata": {"constraints": [{"kind": "include", "word": "lantern"}]}}
    assert reward.score(task, prompt).score == 0.0  # the prompt names the word, but an echo answers nothing
    assert reward.score(task, prompt + " a lantern").score == 1.0
    for constraints, message in (([{"kind": "shout"}], "unknown constraint"), ([{"kind": "max_words"}], "needs 'n'"),
                                 ([], "non-empty list")):
        with pytest.raises(UsageError, match=message):
            reward.score({**task, "metadata": {"constraints": constraints}}, "x")
    with pytest.raises(UsageError, match="metadata_keys"):
        reward.score({"id": "t", "prompt": "p", "metadata": {}}, "x")


def _stage_options(name: str) -> dict:
    return next(s for s in load_config(CONFIG).stages if s.name == name).env_options


@pytest.mark.parametrize("stage, held_out", [("chat", 258), ("agent", 252)])
def test_the_configs_data_files_pass_the_validity_check_with_200_held_out(stage, held_out, monkeypatch):
    """Oracle 1, no-op, initial state and the echoed prompt 0 (every row of instructions.jsonl also fails its own
    request text: make_samples.py asserts it). Reference answers meet every constraint of their row."""
    monkeypatch.chdir(ROOT)
    options = _stage_options(stage)
    report = check_environment(f"dataset:{stage}", lambda: DatasetEnv(**options), n=8 if stage == "agent" else 64)
    assert report.ok and not report.skipped, report.describe()
    assert len(DatasetEnv(**options).make_tasks("eval", 10_000, seed=0)) == held_out
    if stage == "chat":
        env, reward = DatasetEnv(**options), build_reward("constraints")
        for task in env.scan(None):
            assert reward.score(task, task["answer"]).score == 1.0, task["id"]
            assert reward.score(task, "").score == 0.0, task["id"]


def test_the_config_runs_end_to_end_on_the_tiny_model(tmp_path, monkeypatch):
    """Every stage of the config, wired as written (envs, rewards, OPD teachers `best`), with the tiny model and one
    policy step each: what breaks here would break three hours into the real run."""
    from opd_sao.app.pipeline import run_pipeline

    monkeypatch.chdir(ROOT)
    overrides = ["model.path=tiny", "trainer.critic_warmup_steps=0", "trainer.train_batch_size=4",
                 "trainer.critic_trained_layers=1", "stages.reasoning.env_options.train_size=50"]
    for stage in ("reasoning", "agent", "chat", "opd"):  # gate probes and the warm start cut too: they were 1/3 of it
        overrides += [f"stages.{stage}.steps=1", f"stages.{stage}.eval.num_tasks=2", f"stages.{stage}.gate.probe_size=2"]
    overrides += ["stages.opd.trainer.train_batch_size=3", "stages.opd.checkpoint_every=1", "stages.reasoning.sft.steps=2"]
    summary = run_pipeline(load_config(CONFIG, overrides), tmp_path / "run", log=lambda _msg: None)
    assert [s["name"] for s in summary["stages"]] == ["reasoning", "agent", "chat", "opd"]
    domains = ["reasoning_gym:basic_arithmetic", "dataset:functions", "dataset:instructions"]
    for reached, stage in zip((1, 2, 3, 3), summary["stages"]):  # eval_scope: reached
        assert set(stage["eval_after"]) == set(domains[:reached])
        assert all(e["n"] == 2 for e in stage["eval_after_error"].values())
    teachers = json.dumps(summary["stages"][3])
    assert all(name in teachers for name in ("reasoning_teacher", "agent_teacher", "chat_teacher"))


def test_code_tests_strict_pays_only_a_program_that_passes_every_test():
    """The agent stage's reward_options: {strict: true}: a program passing one test of two scores 0, not 0.5."""
    task = {"id": "t", "tests": {"kind": "asserts", "asserts": ["assert f(0) == 0", "assert f(2) == 4"]}}
    half = "def f(x):\n    return x"  # passes f(0) == 0 only
    options = {"allow_rlimit_only": True}
    assert build_reward("code_tests", options).score(task, half).score == 0.5
    assert build_reward("code_tests", {**options, "strict": True}).score(task, half).score == 0.0
    assert build_reward("code_tests", {**options, "strict": True}).score(task, "def f(x):\n    return 2 * x").score == 1.0
