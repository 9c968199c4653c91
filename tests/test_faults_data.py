"""Hostile data and rewards (issue 25): NaN and out-of-range rewards, the trainer's refusal of non-finite updates,
gameable code tests, broken dataset files and rewards that hang or misread. Each case failed on the code before
the fix (docs/reliability.md, "Hostile data and rewards")."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from opd_sao.app.pipeline import run_pipeline
from opd_sao.config import TrainerConfig, parse_config
from opd_sao.envs.dataset import DatasetEnv
from opd_sao.envs.rewards import RewardFailure
from opd_sao.envs.validity import check_environment
from opd_sao.runs.checkpointing import StageState
from opd_sao.trainers.base import NonFiniteError
from opd_sao.trainers.torch_backend import TorchTrainer

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
    """Before: NaN (and -1e308 from a no-op) passed the check, since every comparison with NaN is false. A python
    reward's NaN or infinity is a reward error since issue 43: scored 0, and the check stops past `max_errors`."""
    function = python_reward(tmp_path, "0.0", oracle=value)
    env = lambda: DatasetEnv(path=str(rows_file(tmp_path)), reward="python", reward_options={"function": function})
    if value in ("math.nan", "math.inf"):
        with pytest.raises(RewardFailure, match=r"failed on task 'q\d+': ValueError: returned (nan|inf), not a finite"):
            check_environment("dataset", env)
        return
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
                   reward_options={"function": function, "reward_range": [1, "nan"]}).reward


def _run_config(tmp_path: Path, env_options: dict, **stage) -> dict:
    return {"seed": 0, "model": {"tiny": TINY}, "logging": {"wandb": False, "progress": False},
            "trainer": {"train_batch_size": 4, "critic_warmup_steps": 0},
            "stages": [{"name": "r", "kind": "reasoning", "env": "dataset", "env_options": env_options, "steps": 3,
                        "checkpoint_every": 1, "rollout": {"max_new_tokens": 4}, "eval": {"num_tasks": 2},
                        "gate": {"enabled": False}, **stage}]}


def test_a_nan_reward_during_rollouts_stops_the_run_naming_the_task_and_nothing_is_saved(tmp_path):
    """Before: the NaN trained, the checkpoint and the resumable state were written as NaN, and evaluation
    crashed with a multinomial traceback. The oracle and the no-op score 1 and 0, so the validity check passes."""
    function = python_reward(tmp_path, "math.nan")  # a reward error since issue 43: here, no error is tolerated
    options = {"function": function, "max_errors": 0, "max_error_rate": 0}
    cfg = parse_config(_run_config(tmp_path, {"path": str(rows_file(tmp_path)), "reward": "python",
                                              "reward_options": options}))
    with pytest.raises(RewardFailure, match=r"failed on task 'q\d+': ValueError: returned nan, not a finite number"):
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
    from opd_sao.envs.rewards import build_reward

    reward = build_reward("code_tests", {})
    assert reward.score(ASSERTS, GAMES[game]).score == 0.0
    assert reward.score(ASSERTS, RIGHT).score == 1.0


def test_code_tests_output_and_test_count_are_not_the_programs_limit():
    """Before: a correct program printing 100 KB, or passing 50,000 asserts, scored 0 (the tests' results were
    echoed on the program's output, past its 64 KiB). The 50,000 asserts run with wall and CPU limits of 300 s
    (issue 43): at the default 5 s + 0.2 ms per test they hit the wall limit on a loaded machine (one pipe round
    trip per call, 2-14 s measured at load 7-20), and what this checks is the output, not the time allowance."""
    from opd_sao.envs.rewards import build_reward

    reward = build_reward("code_tests", {})
    assert reward.score(ASSERTS, RIGHT + "print('x' * 100_000)\n").score == 1.0
    many = {"id": "many", "tests": {"kind": "asserts", "asserts": [f"assert f({i}) == {i + 1}" for i in range(50_000)]}}
    verdict = build_reward("code_tests", {"wall_s": 300.0, "cpu_s": 300}).score(many, RIGHT)
    assert verdict.score == 1.0, verdict
    stdin = {"id": "io", "tests": {"kind": "io", "inputs": ["1", "2"], "outputs": ["2", "3"]}}
    assert reward.score(stdin, "x = int(input())\nprint('noise ' * 20_000)\nprint(x + 1)\n").score == 0.0
    assert reward.score(stdin, "x = int(input())\nimport sys\nprint('noise ' * 20_000, file=sys.stderr)\n"
                               "print(x + 1)\n").score == 1.0


def test_each_io_input_runs_in_a_fresh_process_that_shares_only_the_work_dir():
    """The runner forks the program per input from an interpreter that never ran it: state in memory (here a
    builtin) and the process are new each time, as with an interpreter per input before; files written to the work
    dir are seen by the next input, as before (one sandbox per graded program)."""
    from opd_sao.envs.rewards import build_reward

    program = ("import builtins, os\nbuiltins.runs = getattr(builtins, 'runs', 0) + 1\n"
               "pids = open('pids').read().split() if os.path.exists('pids') else []\n"
               "open('pids', 'a').write(f'{os.getpid()}\\n')\n"
               "print(input(), builtins.runs, len(pids), str(os.getpid()) not in pids)\n")
    io = {"id": "io", "tests": {"kind": "io", "inputs": ["a", "b", "c"], "outputs": ["a 1 0 True", "b 1 1 True",
                                                                                   "c 1 2 True"]}}
    verdict = build_reward("code_tests", {}).score(io, program)
    assert verdict.score == 1.0, verdict


def test_limits_hold_per_io_input_and_a_killed_run_or_runner_fails_only_what_it_ran():
    """Each forked run has the program's own CPU limit (a run spinning past it is killed, the next input runs
    with a fresh one); a program that kills its runner fails the inputs left. Wall limit 300 s: a CPU limit is
    what this checks, not the machine's load."""
    from opd_sao.envs.rewards import build_reward

    reward = build_reward("code_tests", {"wall_s": 300.0, "cpu_s": 1})
    io = {"id": "io", "tests": {"kind": "io", "inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]}}
    spin = reward.score(io, "import time\nx = input()\nwhile x == '1' or time.process_time() < 0.6:\n    pass\n"
                            "print(x)\n")
    assert spin.score == pytest.approx(2 / 3) and "exit status -24" in spin.feedback, spin  # SIGXCPU
    killer = reward.score(io, "import os\nx = input()\nif x == '2':\n    os.kill(os.getppid(), 9)\nprint(x)\n")
    assert killer.score == pytest.approx(1 / 3) and "runner died" in killer.feedback, killer


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


# --------------------------------------------------------------------------------------------- data files
HOSTILE_ROWS = {  # (the bytes of one line, what the one-line error names)
    "invalid UTF-8": (b'{"id": "x", "prompt": "caf\xff", "answer": "1"}', "not valid UTF-8 (byte 0xff at column 27)"),
    "100k-deep JSON": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "5,000-digit int": (b'{"id": "x", "prompt": "p", "answer": ' + b"9" * 5000 + b"}", "Exceeds the limit"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_ROWS))
def test_a_hostile_row_is_named_by_file_and_row_and_skippable(tmp_path, case):
    """Before: a UnicodeDecodeError naming no file or row (and not skippable), a RecursionError, Python's int-limit
    message."""
    raw, named = HOSTILE_ROWS[case]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in ROWS[:2]) + raw + b"\n" +
                     json.dumps(ROWS[2]).encode() + b"\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: row 3: .*{re.escape(named)}") as refused:
        list(DatasetEnv(path=str(path)).scan(None))
    assert "\n" not in str(refused.value)
    counts: dict = {}
    assert len(list(DatasetEnv(path=str(path), max_bad_rows=1).scan(None, counts))) == 3 and counts["bad_rows"] == 1


def test_a_bom_is_accepted_and_skipped_rows_are_counted_in_the_summary(tmp_path):
    """Before: a UTF-8 BOM refused row 1, and rows dropped under max_bad_rows left no trace in summary.json."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in ROWS).encode() + b"{oops\n")
    env = DatasetEnv(path=str(path), max_bad_rows=1)
    assert len(list(env.scan(None))) == len(ROWS)
    data = env.training_summary([])["data"]
    assert data["train_bad_rows"] == 1 and data["train_file_rows"] == len(ROWS)
    json_file = tmp_path / "rows.json"
    json_file.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS).encode())
    assert len(list(DatasetEnv(path=str(json_file)).scan(None))) == len(ROWS)


def test_bad_files_and_templates_are_one_line_errors(tmp_path):
    """Before: a list-shaped dataset_dict.json raised AttributeError; prompt_template "{0}" raised IndexError."""
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="dataset_dict.json: not a DatasetDict's description"):
        list(DatasetEnv(path=str(saved)).scan(None))
    bad_json = tmp_path / "rows.json"
    bad_json.write_bytes(b'[{"id": "a"},\n{"id": "caf\xff"}]')
    with pytest.raises(ValueError, match=r"rows.json: line 2: not valid UTF-8"):
        list(DatasetEnv(path=str(bad_json)).scan(None))
    for template in ("{0}", "{}", "{prompt.__class__}", "{prompt[0]}", "{prompt"):
        with pytest.raises(ValueError, match="prompt_template"):
            DatasetEnv.check_options({"path": str(rows_file(tmp_path)), "prompt_template": template})


def test_empty_files_splits_and_shared_rows_are_refused_before_any_work(tmp_path):
    """Before: an empty dataset (or train split) hung forever after "stage starting"; an empty eval split was found
    after the whole stage trained; train and eval files sharing rows were accepted."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for options in ({"path": str(empty)}, {"train_path": str(empty), "eval_path": str(rows_file(tmp_path))},
                    {"train_path": str(rows_file(tmp_path)), "eval_path": str(empty)}):
        report = check_environment("dataset", lambda: DatasetEnv(**options))
        assert not report.ok and "empty.jsonl has no usable rows" in report.describe()
    shared = rows_file(tmp_path, ROWS[30:] + [{"id": "new", "prompt": "1+1=", "answer": "2"}], "eval.jsonl")
    report = check_environment("dataset", lambda: DatasetEnv(train_path=str(rows_file(tmp_path)), eval_path=str(shared)))
    assert "share 10 task ids ('q30', 'q31', 'q32')" in report.describe()
    assert "share 11 task prompts" in report.describe()


def test_an_over_long_row_is_refused_at_stage_start_naming_it(tmp_path):
    """Before: one 50 MB row crashed mid-stage (the rollout asked for 50 GiB)."""
    rows = [*ROWS, {"id": "huge", "prompt": "1+" * 2_000_000 + "1=", "answer": "2000001"}]
    cfg = parse_config(_run_config(tmp_path, {"path": str(rows_file(tmp_path, rows)), "eval_fraction": 0.1}))
    with pytest.raises(ValueError, match=r"task 'huge' \(.*rows.jsonl row 41\): its prompt is 4,000,002 characters, "
                                         r"far past rollout.max_context_tokens 512"):
        run_pipeline(cfg, tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run" / "stages" / "r" / "metrics.jsonl").exists()


def test_resume_refuses_changed_data(tmp_path):
    """Before: --resume after the dataset file was replaced reused buffered trajectories of the old data."""
    from opd_sao.io.data_fingerprint import check_data_record, write_data_record

    path = rows_file(tmp_path)
    write_data_record({"r": [str(path)]}, tmp_path)
    check_data_record({"r": [str(path)]}, tmp_path)  # unchanged
    path.touch()
    check_data_record({"r": [str(path)]}, tmp_path)  # touched, same bytes
    rows_file(tmp_path, ROWS[:-1])
    with pytest.raises(ValueError, match=rf"stage 'r': data file {path} changed \(size \d+ -> \d+"):
        check_data_record({"r": [str(path)]}, tmp_path)


def test_data_inspect_exits_non_zero_on_malformed_rows(tmp_path, capsys):
    """Before: `160 rows, 160 malformed`, exit status 0."""
    from opd_sao.app import cli

    path = rows_file(tmp_path, [{"question": r["prompt"]} for r in ROWS])
    assert cli.main(["data", "inspect", str(path)]) == 1
    assert f"{path}: 40 rows, 40 malformed" in capsys.readouterr().out
    assert cli.main(["data", "inspect", str(path), "--options", '{"prompt_key": "question"}']) == 0


# ------------------------------------------------------------------------------------------------- rewards
def test_a_python_reward_that_hangs_times_out_scores_zero_and_is_counted(tmp_path):
    """Before: a python reward that hung blocked the run forever. A call that spins is stopped by its CPU time
    (timeout_s): interrupted in Python code, killed by the kernel in C code (`any` over an endless iterator runs no
    Python code between items); one that sleeps by the wall-clock backstop (a reward error). Each scores 0."""
    from opd_sao.envs.dataset.rewards import PythonReward

    function = python_reward(tmp_path, "{'sleep': lambda: time.sleep(3600), 'spin': lambda: sum(1 for _ in "
                             "iter(int, 1)), 'spin in C': lambda: any(iter(int, 1))}[response]()")
    reward = PythonReward(function, timeout_s=0.2)  # the default backstop, 600 s: never reached by a CPU-bound call
    for response in ("spin", "spin in C"):
        verdict = reward.score(ROWS[0], response)
        assert verdict.score == 0.0 and verdict.info == {"timeout": True}, response
        assert reward.score(ROWS[1], ROWS[1]["answer"]).score == 1.0  # the same worker, or a fresh one
    assert reward.stats() == {"calls": 4, "timeouts": 2, "errors": 0, "output_bytes": 0}
    sleeping = PythonReward(function, backstop_s=2)
    assert sleeping.score(ROWS[0], ROWS[0]["answer"]).score == 1.0  # the worker is up (a fresh one gets startup_s)
    verdict = sleeping.score(ROWS[0], "sleep")
    assert verdict.score == 0.0 and verdict.info == {"error": "no answer within backstop_s=2.0 s"}
    assert sleeping.score(ROWS[1], ROWS[1]["answer"]).score == 1.0  # a fresh worker
    assert sleeping.stats()["errors"] == 1 and sleeping.stats()["timeouts"] == 0


def test_the_judge_honours_retry_after_and_reads_the_last_score():
    """Before: a 429 with Retry-After: 2 was retried three times in 0.07 s and the run stopped; "On a 0-10 scale:
    3" scored 0.0 and "10/10? no. 2" scored 1.0 (the first number won)."""
    from test_rewards import TASK, JudgeServer

    from opd_sao.envs.dataset.rewards import JudgeReward

    server = JudgeServer(fail_first=1, fail_status=429, retry_after="2")
    try:
        reward = JudgeReward(server.url, "m", retries=2, timeout_s=5, backoff_s=0.05)
        assert reward.score(TASK, "four").score == pytest.approx(0.7)
        assert server.times[1] - server.times[0] >= 2.0
    finally:
        server.close()
    for reply, score in (("On a 0-10 scale: 3", 0.3), ("10/10? no. 2", 0.2), ("Score: 8, not 10", 0.8)):
        server = JudgeServer(reply=reply)
        try:
            assert JudgeReward(server.url, "m", retries=0).score(TASK, "four").score == pytest.approx(score)
        finally:
            server.close()


def test_a_judge_down_during_a_run_ends_in_one_line(tmp_path, capsys):
    """Before: a judge that went down during a run ended it in a traceback (the rollout worker's error, wrapped)."""
    import yaml

    from opd_sao.app import cli

    cfg = _run_config(tmp_path, {"path": str(rows_file(tmp_path)), "reward": "judge",
                                 "reward_options": {"base_url": "http://127.0.0.1:9/v1", "model": "m", "retries": 1,
                                                    "backoff_s": 0.05, "timeout_s": 2}})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["run", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("opd-sao run: error: judge at http://127.0.0.1:9/v1 failed 2 times")


def test_math_strict_takes_only_a_marked_answer():
    """Before: there was no strict mode: `1==зе return+之旅` scored 1.0 against 1 (the last number)."""
    from opd_sao.envs.dataset.rewards import MathReward

    task = {"id": "m", "answer": "1"}
    assert MathReward().score(task, "\n1==зе return+之旅").score == 1.0  # the lenient default, as documented
    strict = MathReward(strict=True)
    assert strict.score(task, "\n1==зе return+之旅").score == 0.0
    assert strict.score(task, "so \\boxed{1}").score == 1.0 and strict.score(task, "... #### 1").score == 1.0


def test_audit_takes_env_options_and_a_jsonl_prompts_file_and_says_when_it_repeats(tmp_path, tiny_model_dir, capsys):
    """Before: `opd-sao audit` had no way to give the environment's options (a dataset env could not be audited),
    read a prompts file line by line (no multi-line prompts), and repeated prompts silently to reach --prompts."""
    from opd_sao.app import cli

    common = [str(tiny_model_dir), "--prompts", "12", "--max-new-tokens", "2", "--out", str(tmp_path / "audit")]
    options = json.dumps({"path": str(rows_file(tmp_path)), "eval_fraction": 0.1})
    cli.main(["audit", *common, "--env", "dataset", "--env-options", options])
    out = capsys.readouterr().out
    audit = json.loads((tmp_path / "audit" / "audit.json").read_text())
    assert audit["prompts"] == 12 and audit["distinct_prompts"] < 12
    assert f"note: only {audit['distinct_prompts']} distinct prompts, repeated to reach --prompts 12" in out
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in ["line one\nline two", {"prompt": "1+1="}] * 6))
    cli.main(["audit", *common, "--prompts-file", str(prompts)])
    assert "note:" not in capsys.readouterr().out
    assert json.loads((tmp_path / "audit" / "audit.json").read_text())["distinct_prompts"] == 12
    assert cli.main(["audit", *common, "--env", "dataset", "--env-options", "[1]"]) == 2
    assert "--env-options must be a JSON object" in capsys.readouterr().err


def test_a_prompt_past_the_models_positions_is_refused_naming_its_file_and_row(tmp_path):
    """Issue 43. Before: only rollout.max_context_tokens (512) was checked, so a prompt of ~110 tokens for a model
    of 64 positions trained to exit 0 without a word. Now `opd-sao run` refuses it at stage start in one line
    naming the file and the row, before any training step."""
    long_row = {"id": "long", "prompt": " ".join(str(i) for i in range(40)) + " =", "answer": "1"}
    path = rows_file(tmp_path, [*ROWS[:20], long_row, *ROWS[20:]])
    cfg = _run_config(tmp_path, {"path": str(path), "eval_fraction": 0.1})
    cfg["model"]["tiny"] = {**TINY, "max_positions": 64}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    done = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", "run", str(tmp_path / "run.yaml"), "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert re.fullmatch(rf"opd-sao run: error: dataset: task 'long' \({re.escape(str(path))} row 21\): its prompt is "
                        r"\d+ tokens, which with rollout.max_new_tokens 4 passes the model's max_position_embeddings "
                        r"64; shorten or drop the row, lower max_new_tokens, or set rollout.truncation "
                        r"\(left \| right\) to cut it", lines[0]), lines[0]
    assert not (tmp_path / "run" / "stages" / "r" / "metrics.jsonl").exists()


LONG_ROW = {"id": "long", "prompt": " ".join(str(i) for i in range(40)) + " =", "answer": "1"}


def test_an_opd_teachers_domain_with_a_prompt_past_the_models_positions_is_refused_before_the_first_stage(tmp_path):
    """Issue 43. Before: prompts were checked for RL stages' training pools only, so an OPD teacher's own dataset
    domain (and held-out evaluation) played a prompt past the model's positions. Now every stage's domains are
    checked once the base model exists, before the first stage trains, naming the file and the row."""
    path = rows_file(tmp_path, [*ROWS[:20], LONG_ROW, *ROWS[20:]], "long.jsonl")
    cfg = _run_config(tmp_path, {"max_operand": 9}, env="arithmetic")
    cfg["model"]["tiny"] = {**TINY, "max_positions": 64}
    cfg["stages"].append({"name": "o", "kind": "opd", "steps": 1, "gate": {"enabled": False}, "opd": {"teachers": [
        {"name": "t", "checkpoint": "r", "domains": ["dataset:long"], "rollout": {"max_new_tokens": 4},
         "env_options": {"path": str(path), "eval_fraction": 0.1}}]}})
    with pytest.raises(ValueError, match=rf"^dataset:long: task 'long' \({re.escape(str(path))} row 21\): its "
                                         r"prompt is \d+ tokens, which with rollout.max_new_tokens 4 passes the "
                                         r"model's max_position_embeddings 64"):
        run_pipeline(parse_config(cfg), tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run" / "stages" / "r" / "metrics.jsonl").exists()


def test_a_chat_prompt_past_the_models_positions_is_refused_before_the_first_stage(tmp_path, capsys):
    """Issue 43. Before: the chat environment's prompts were checked only as each episode started (building it
    loads, or first trains, its reward model), so a chat stage whose prompts leave no room to answer failed after
    the stages before it had trained. Now they are checked with every other domain's, on the environment built for
    its prompts alone: one line before the first stage, and the reward model is neither trained nor loaded."""
    from opd_sao.app import cli

    cfg = _run_config(tmp_path, {"max_operand": 9}, env="arithmetic")
    cfg["model"]["tiny"] = {**TINY, "max_positions": 64}
    cfg["stages"].append({"name": "c", "kind": "chat", "env": "chat", "steps": 1, "gate": {"enabled": False},
                          "env_options": {"judge": "reward_model", "judge_options": {"path": str(tmp_path / "rm")}},
                          "rollout": {"max_new_tokens": 60}})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["run", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"opd-sao run: error: chat: task 'chat-(train|eval)-\w+-\d-\w+': its prompt "
                                          r"is \d+ tokens, which with rollout.max_new_tokens 60 passes the model's "
                                          r"max_position_embeddings 64; .*", err[0]), err
    assert not (tmp_path / "run" / "stages" / "r" / "metrics.jsonl").exists()
    assert not (tmp_path / "rm").exists()  # the judge's reward model was not trained


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncation_cuts_a_prompt_to_what_leaves_room_to_answer(tmp_path, tokenizer, truncation):
    """`rollout.truncation: left | right` (verl's data.truncation): a prompt past the model's positions minus
    max_new_tokens keeps its last (left) or first (right) tokens that fit, as the episode plays it; the check
    before the first stage lets it through; `error` (the default) refuses it."""
    from opd_sao.checkpoints import PromptFormat
    from opd_sao.config import RolloutConfig
    from opd_sao.rl.rollout import PromptTooLong, check_prompts, episodes_for

    path = rows_file(tmp_path, [LONG_ROW, *ROWS[:20]])
    factory = lambda: DatasetEnv(path=str(path), eval_fraction=0.1)
    task = next(t for split in ("train", "eval") for t in factory().make_tasks(split, 100, 0) if t["id"] == "long")
    full = PromptFormat(tokenizer).prompt(factory().reset(task))
    room = 24 - 4  # positions minus max_new_tokens
    assert len(full) > room
    rollout = RolloutConfig(max_new_tokens=4, truncation=truncation)
    check_prompts(factory, [task], tokenizer, rollout, domain="d", max_positions=24)
    (episode,) = episodes_for(factory, task, tokenizer, rollout, domain="d", max_positions=24)
    assert episode.traj.prompt_ids == (full[-room:] if truncation == "left" else full[:room])
    with pytest.raises(PromptTooLong, match=r"row 1\): its prompt is \d+ tokens"):
        episodes_for(factory, task, tokenizer, RolloutConfig(max_new_tokens=4), domain="d", max_positions=24)


class _CountedWhere(DatasetEnv):
    """A dataset environment counting how often a task's file and row are looked up (each lookup reads the file)."""
    lookups = 0

    def where(self, task: dict) -> str:
        type(self).lookups += 1
        return super().where(task)


def test_prompts_are_checked_without_reading_the_data_file_again_for_each(tmp_path, tokenizer):
    """Before: every prompt check (and every episode) looked its row up in the file for a message it did not print,
    so checking a domain's prompts read the file once per row (O(rows^2); 1/3 of the SmolLM2 config's tiny run).
    The row is looked up only for the error that names it."""
    from opd_sao.config import RolloutConfig
    from opd_sao.rl.rollout import PromptTooLong, check_prompts

    path = rows_file(tmp_path, [*ROWS[:20], LONG_ROW, *ROWS[20:]])
    env = lambda: _CountedWhere(path=str(path), eval_fraction=0.1)
    tasks = env().make_tasks("train", 1000, seed=0)
    short = [task for task in tasks if task["id"] != "long"]
    check_prompts(env, short, tokenizer, RolloutConfig(), domain="dataset")
    assert _CountedWhere.lookups == 0
    with pytest.raises(PromptTooLong, match=rf"task 'long' \({re.escape(str(path))} row 21\)"):
        check_prompts(env, tasks, tokenizer, RolloutConfig(max_context_tokens=32), domain="dataset")
    assert _CountedWhere.lookups == 1
