"""Hostile python rewards (issue 43): a reward that prints, forks, leaves helpers behind, exits or returns what is
not a number. Real worker processes and a real `opd-sao run`; each case failed on the code before the fix (3eaa783;
docs/reliability.md, "Hostile rewards and serve start-up")."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from launchers import HANG_S, wait_for

from opd_sao.envs.dataset.rewards import MathReward, PythonReward

# the reward's behaviour is chosen by the response; an ordinary response scores len(response) / 10
REWARD = '''
import json, os, subprocess, sys, time

def score(task, response):
    if response == "print":
        print("debugging", task["id"])
        subprocess.run(["echo", "a subprocess writes too"])
        print("an error line", file=sys.stderr)
    elif response == "print only":  # a print to stdout alone, block-buffered without PYTHONUNBUFFERED
        print("debugging", task["id"])
    elif response == "fake answer":
        print(json.dumps({"out": 0.9}))
        print(json.dumps({"id": 2, "score": 0.9, "info": {}}))
    elif response == "fork":
        if os.fork() == 0:
            return 0.9  # the forked copy's return must never be taken for an answer
        os.wait()
    elif response == "helper":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", task["marker"]])
    elif response == "helper and hang":  # the helper says it runs (a file) before anything can stop it
        subprocess.Popen([sys.executable, "-c", "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(600)",
                          task["started"], task["marker"]])
        time.sleep(600)
    elif response == "stalled":  # running until the test says go
        open(task["started"], "w").close()
        while not os.path.exists(task["go"]):
            time.sleep(0.01)
        return 1.0
    elif response == "exit":
        sys.exit(3)
    elif response.startswith("return "):
        return eval(response[len("return "):])
    elif response == "raise":
        raise KeyError("no such field")
    return len(response) / 10
'''


def reward_file(tmp_path: Path) -> str:
    (tmp_path / "hostile_reward.py").write_text(REWARD)
    return f"{tmp_path / 'hostile_reward.py'}:score"


def processes_naming(marker: str) -> list[int]:
    """The live processes whose command line holds `marker` (zombies have none)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def sigkilled(pid: int) -> bool:
    """Whether the process has been sent SIGKILL (or is gone): a process-wide SIGKILL (kill, killpg) stays in
    /proc/PID/status's ShdPnd from the moment it is sent until the process is reaped, zombie included, so no wait
    for it to die is needed, however loaded the machine."""
    try:
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except (FileNotFoundError, ProcessLookupError):
        return True
    return bool((int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)) & 1 << (signal.SIGKILL - 1))


def gone(marker: str) -> bool:
    """Whether every process naming `marker` is gone or on its way (sent SIGKILL); any other is killed, so a failing
    test leaves nothing behind."""
    left = [pid for pid in processes_naming(marker) if not sigkilled(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return not left


@pytest.fixture(scope="module")
def reward(tmp_path_factory) -> PythonReward:
    return PythonReward(reward_file(tmp_path_factory.mktemp("reward")), timeout_s=20)  # 9 errors in all: < max_errors


@pytest.mark.parametrize("response", ["print", "fake answer", "fork"])
def test_what_a_reward_prints_or_forks_is_never_its_answer(reward, response):
    """Before: a print crashed the run (JSONDecodeError); a printed JSON line or a fork's second answer was taken for
    this call's score, and every later call read the answer of the one before."""
    printed = reward.stats().get("output_bytes", 0)
    assert reward.score({"id": "t1"}, response).score == pytest.approx(len(response) / 10)
    assert [reward.score({"id": f"t{i}"}, "x" * i).score for i in range(2, 6)] == pytest.approx([0.2, 0.3, 0.4, 0.5])
    if response == "print":
        # counted, not parsed: by a thread of the run as it reads the pipe, after the answer on a busy machine
        wait_for(lambda: reward.stats()["output_bytes"] > printed)


def test_a_print_is_counted_when_its_call_ends_with_buffered_output(tmp_path, monkeypatch):
    """Before: without PYTHONUNBUFFERED, a reward's print to stdout stayed in the worker's 8 KB buffer, so
    output_bytes missed it (and its first line was not logged) until the buffer filled or the worker died. Each
    call's output is flushed before its answer now."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    reward = PythonReward(reward_file(tmp_path))
    assert reward.score({"id": "t1"}, "print only").score == pytest.approx(1.0)
    wait_for(lambda: reward.stats()["output_bytes"] >= len("debugging t1\n"))
    reward.worker.close()


@pytest.mark.parametrize("value", ["'0.5'", "None", "10**400", "float('nan')", "float('inf')", "(0.5, 'x')", "[1]"])
def test_a_return_that_is_not_a_number_is_a_counted_reward_error(reward, value):
    """Before: a string or (0.5, 'x') raised ValueError out of the run, 10**400 an OverflowError, NaN stopped the
    run as a BadScore; now each scores 0, named and counted."""
    errors = reward.stats().get("errors", 0)
    verdict = reward.score({"id": "bad"}, f"return {value}")
    assert verdict.score == 0.0 and verdict.info["error"]
    assert reward.stats()["errors"] == errors + 1
    assert reward.score({"id": "next"}, "x" * 7).score == pytest.approx(0.7)


@pytest.mark.parametrize("response", ["exit", "raise"])
def test_sys_exit_or_an_exception_is_a_reward_error_not_a_timeout(reward, response):
    """Before: sys.exit(3) in the reward read as a timeout (the worker died), an exception stopped the run."""
    stats = reward.stats()
    verdict = reward.score({"id": "bad"}, response)
    assert verdict.score == 0.0 and ("SystemExit: 3" if response == "exit" else "KeyError") in verdict.info.get("error", "")
    after = reward.stats()
    assert (after["errors"], after["timeouts"]) == (stats.get("errors", 0) + 1, stats["timeouts"])
    assert "failed on task 'bad'" in after["first_error"]


def test_a_reward_error_below_zero_scores_the_low_end_of_its_range(tmp_path):
    reward = PythonReward(reward_file(tmp_path), reward_range=(0.25, 1.0))
    assert reward.checked({"id": "bad"}, "raise").score == 0.25  # 0 would be refused as out of range


def test_helpers_a_reward_started_die_with_its_worker_and_with_the_run(tmp_path):
    """Before: a helper the reward started outlived the worker that was replaced after a timeout, and the command.
    The backstop must fire after the helper runs, or the test proves nothing: on a machine too busy for that within
    the backstop, it is asked again with twice the backstop until the helper had started (its file)."""
    function, marker = reward_file(tmp_path), f"opd-sao-helper-{os.getpid()}-{time.time_ns()}"
    backstop_s, started = 2.0, tmp_path / "helper-started"
    while True:
        reward = PythonReward(function, backstop_s=backstop_s)
        assert reward.score({"id": "up"}, "x").score == pytest.approx(0.1)  # up: a fresh worker's first call
        verdict = reward.score(  # would wait its start-up allowance (60 s) besides the backstop
            {"id": "a", "marker": marker + "-1", "started": str(started)}, "helper and hang")
        assert "no answer within backstop_s" in verdict.info["error"]
        if started.exists():
            break
        assert backstop_s < HANG_S, "the helper never started"
        backstop_s *= 2
    assert gone(marker + "-1"), "the replaced worker's helper is still running"
    script = (f"from opd_sao.envs.dataset.rewards import PythonReward\n"
              f"print(PythonReward({function!r}).score({{'id': 'b', 'marker': {marker + '-2'!r}}}, 'helper').score)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0 and out.stdout.strip() == "0.6", out.stderr[-2000:]
    assert gone(marker + "-2"), "the helper outlived the command"


def test_a_python_reward_stopped_mid_call_past_its_timeout_still_scores(tmp_path):
    """Before: timeout_s was wall-clock time, so a call that waited for a CPU on a busy machine past it scored 0 as a
    timeout. Here the worker is stopped (SIGSTOP) in the middle of a call for 3 s, three times its timeout_s, which
    a busy machine does at random: the score stays (timeout_s is the worker's CPU time)."""
    reward, result = PythonReward(reward_file(tmp_path), timeout_s=1), []
    assert reward.score({"id": "up"}, "x").score == pytest.approx(0.1)  # the worker is up
    started, go = tmp_path / "started", tmp_path / "go"
    call = threading.Thread(target=lambda: result.append(
        reward.score({"id": "s", "started": str(started), "go": str(go)}, "stalled").score))
    call.start()
    while not started.exists():  # the call is running in the worker, and cannot end before `go`
        time.sleep(0.01)
    pid = reward.worker._proc.pid
    os.kill(pid, signal.SIGSTOP)
    go.touch()
    time.sleep(3)  # the stall itself, past timeout_s of wall-clock time
    os.kill(pid, signal.SIGCONT)
    call.join()
    assert result == [1.0]
    assert reward.stats()["timeouts"] == 0 and reward.stats()["errors"] == 0


def test_the_math_checker_still_times_out_and_is_replaced():
    """The math reward goes through the same worker: a check past its backstop is killed and counted (a reward
    error: its CPU-time limit cannot stop a checker that does not run)."""
    reward = MathReward(timeout_s=1, backstop_s=3)
    assert reward.score({"answer": "\\frac{1}{2}"}, "\\boxed{0.5}").score == 1.0
    os.kill(reward.checker._proc.pid, signal.SIGSTOP)  # a checker stuck past every timeout of its own
    assert reward.score({"answer": "\\frac{1}{3}"}, "\\boxed{2/6}").info == {"error": "no answer within backstop_s"}
    assert reward.score({"answer": "\\frac{1}{4}"}, "\\boxed{0.25}").score == 1.0  # a fresh checker
    assert reward.stats()["errors"] == 1


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
ROWS = [{"id": f"q{i}", "prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
FAILING = ("def score(task, response):\n"
           "    if response.strip() == task['answer']:\n        return 1.0\n"
           "    if response.strip() in ('', 'pass'):\n        return 0.0\n"
           "    raise ValueError('cannot score ' + repr(response[:10]))\n")


@pytest.mark.parametrize("limit", ["tolerated", "default"])
def test_reward_errors_are_in_summary_json_and_too_many_stop_the_run_in_one_line(tmp_path, limit):
    """Before: the first exception stopped the run with a traceback. Now: with max_errors high the run completes and
    summary.json counts the errors; with the defaults (10 and 5%) the run stops in one line naming the error."""
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "failing.py").write_text(FAILING)
    options = {"function": f"{tmp_path / 'failing.py'}:score", **({"max_errors": 100000} if limit == "tolerated" else {})}
    config = {"seed": 0, "model": {"tiny": TINY}, "logging": {"wandb": False, "progress": False},
              "trainer": {"train_batch_size": 4, "critic_warmup_steps": 0},
              "stages": [{"name": "r", "kind": "reasoning", "env": "dataset", "steps": 3, "gate": {"enabled": False},
                          "env_options": {"path": str(tmp_path / "rows.jsonl"), "reward": "python",
                                          "reward_options": options},
                          "rollout": {"max_new_tokens": 4}, "eval": {"num_tasks": 2}}]}
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    out = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", "run", str(tmp_path / "run.yaml"), "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    if limit == "tolerated":
        assert out.returncode == 0, out.stderr[-3000:]
        summary = json.loads((tmp_path / "run" / "stages" / "r" / "summary.json").read_text())["reward"]
        assert summary["errors"] >= 12 and summary["errors"] <= summary["calls"]
        assert "ValueError: cannot score" in summary["first_error"]
    else:
        assert out.returncode != 0 and "Traceback" not in out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert "ValueError: cannot score" in last and "more than max_errors=10 and max_error_rate=0.05" in last
