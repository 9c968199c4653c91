"""Reward functions of dataset environments: exact, math (a hand-written table), code tests, a reward model built
here, an LLM judge behind a real loopback HTTP server, and your own python function."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from opd_sao.envs.dataset.rewards import (
    CodeTestsReward,
    ExactReward,
    JudgeReward,
    MathReward,
    RewardFailure,
    RewardModelReward,
)
from opd_sao.envs.rewards import build_reward

# (prediction, reference, equal): LaTeX fractions, equivalent forms, GSM8K answers, and wrong answers.
MATH_TABLE = [
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{\frac12}", r"\frac{1}{2}", True),
    ("the answer is 1/2", r"\frac{1}{2}", True),
    (r"\boxed{\dfrac{2}{3}}", r"\frac{2}{3}", True),
    (r"\boxed{\frac{6}{8}}", r"\frac{3}{4}", True),
    (r"\boxed{\frac{3}{4}}", "0.75", True),
    (r"\boxed{0.75}", r"\frac{3}{5}", False),
    (r"\boxed{\frac{1}{3}}", "0.33", False),
    (r"\boxed{\frac{-1}{2}}", r"-\frac{1}{2}", True),
    (r"\boxed{1.5}", r"\frac{3}{2}", True),
    (r"\boxed{3/2}", "1.5", True),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", True),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", True),
    (r"\boxed{\sqrt{3}}", "1.732", False),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", True),
    (r"\boxed{x+1}", "x-1", False),
    (r"\boxed{2x}", r"x \cdot 2", True),
    (r"\boxed{x=3}", "3", True),
    (r"\boxed{2^{10}}", "1024", True),
    (r"\boxed{1024}", "2^{10}", True),
    (r"\boxed{1023}", "2^{10}", False),
    (r"\boxed{e^{0}}", "1", True),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", True),
    (r"\boxed{(1,2)}", "(1, 2)", True),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", True),
    (r"\boxed{10\%}", "10", True),
    (r"\boxed{\infty}", r"\infty", True),
    (r"\boxed{-5}", "-5", True),
    (r"\boxed{5}", "-5", False),
    (r"\boxed{7}", "#### 8", False),
    ("#### 72", "72", True),
    ("so 3+4=7\n#### 7", "#### 7", True),
    ("#### 1,000", "1000", True),
    ("4+4=8\n#### 8", "4+4=8\n#### 8", True),
    ("4+4=8\n#### 9", "#### 8", False),
    ("the total is 42.", "42", True),
    ("the total is 41.", "42", False),
    ("answer: 12 apples", "#### 12", True),
    ("", "5", False),
    ("no idea", "5", False),
]


def test_math_table_is_judged_correctly():
    assert len(MATH_TABLE) >= 30
    reward = MathReward(timeout_s=3)
    wrong = [(p, r) for p, r, want in MATH_TABLE if (reward.score({"answer": r}, p).score == 1.0) != want]
    assert wrong == []
    assert reward.stats()["timeouts"] == 0


# (response, reference, score) by hand: a final answer is a value, not the question's operation left to do, and never
# the prompt echoed (envs/answers.py). PROMPT is the task's prompt for every row.
PROMPT = "Calculate 66 - 8. Give the final answer as a number."
UNEVALUATED_TABLE = [
    ("66 - 8", "58", 0.0),
    ("Calculate 66 - 8.", "58", 0.0),
    (PROMPT, "58", 0.0),
    (PROMPT + " ", "58", 0.0),
    (r"\boxed{66 - 8}", "58", 0.0),
    (r"\boxed{2 \times 29}", "58", 0.0),
    ("#### 116/2", "58", 0.0),
    (r"\boxed{\frac{116}{2}}", "58", 0.0),
    ("(50 + 8)", "58", 0.0),
    ("58 = 66 - 8", "58", 0.0),  # the last expression is the final answer
    ("58", "58", 1.0),
    ("The answer is 58.", "58", 1.0),
    ("66 - 8 = 58", "58", 1.0),
    (r"\boxed{58}", "58", 1.0),
    ("#### 58", "58", 1.0),
    (PROMPT + "\n58", "58", 1.0),  # the prompt repeated, then answered
    ("-5 * -6", "30", 0.0),
    ("The answer is -30.", "-30", 1.0),  # a leading sign is no operation
    (r"\frac{1}{2}", "1/2", 1.0),
    ("0.5", "1/2", 1.0),
    ("1/2", "1/2", 1.0),
    ("2/4", r"\frac{1}{2}", 1.0),  # a fraction that is not whole is a value
    ("1 - 1/2", "1/2", 0.0),
    ("3*4+2", "3*4+2", 1.0),  # the reference is itself an expression: compared as before
    ("116/2", "116/2", 1.0),
]


def test_math_refuses_unevaluated_answers_and_echoed_prompts():
    reward = MathReward(timeout_s=3)
    wrong = [(p, r) for p, r, want in UNEVALUATED_TABLE
             if reward.score({"answer": r, "prompt": PROMPT}, p).score != want]
    assert wrong == []
    assert reward.score({"answer": "58"}, PROMPT).score == 0.0  # the prompt's own last expression, prompt unknown
    stats = reward.stats()
    assert stats["unevaluated"] == 11 and stats["no_answer"] == 2 and stats["timeouts"] == 0


def test_math_check_with_no_answer_within_its_backstop_is_a_counted_reward_error():
    reward = MathReward(timeout_s=1, backstop_s=1)
    reward.checker.startup_s = -1.0  # a fresh checker's deadline, backstop_s + startup_s, is then 0 s
    assert reward.score({"answer": r"\frac{1}{2}"}, r"\boxed{0.5}").info == {"error": "no answer within backstop_s"}
    assert reward.stats()["errors"] == 1 and reward.stats()["timeouts"] == 0


def test_math_check_past_its_cpu_time_scores_zero_as_it_would_on_an_idle_machine():
    reward = MathReward(timeout_s=0.001)  # no check of a fresh expression takes less CPU than this
    assert reward.score({"answer": "1"}, r"\boxed{\sin^2 q + \cos^2 q}").score == 0.0
    assert reward.stats()["timeouts"] == 1


def test_math_verdict_does_not_depend_on_the_wall_clock():
    """Before: math-verify's own wall-clock limit (signal.alarm, timeout_s per parse) ran out while the checker waited
    for a CPU on a busy machine, and the parse read as "no answer": `\\boxed{2\\sqrt{2}}` against `\\sqrt{8}`
    scored 0. Here the checker is stopped (SIGSTOP) in the middle of a check for longer than timeout_s of wall
    time, which a busy machine does at random: the verdict stays. Each try is a fresh expression (math-verify caches
    parses); a try whose check ended before the stop landed proves nothing and is skipped."""
    reward, landed = MathReward(timeout_s=1), []
    assert reward.score({"answer": r"\sqrt{8}"}, r"\boxed{2\sqrt{2}}").score == 1.0  # the checker is up
    for letter in "abcdfghkmnpqrstuvwz":
        pid, result = reward.checker._proc.pid, []
        before = cpu_ticks(pid)
        check = threading.Thread(target=lambda: result.append(
            reward.score({"answer": "1"}, rf"\boxed{{\sin^2 {letter} + \cos^2 {letter}}}").score))
        check.start()
        while cpu_ticks(pid) < before + 2 and check.is_alive():  # the checker is 20 ms into this check
            time.sleep(0.001)
        os.kill(pid, signal.SIGSTOP)
        stopped_mid_check = check.is_alive()
        if stopped_mid_check:
            time.sleep(1.5)  # past timeout_s of wall-clock time
        os.kill(pid, signal.SIGCONT)
        check.join()
        if stopped_mid_check:
            landed.append(result[0])
        if len(landed) == 3:
            break
    assert landed == [1.0, 1.0, 1.0]
    assert reward.stats()["timeouts"] == 0 and reward.stats()["errors"] == 0


def cpu_ticks(pid: int) -> int:
    """A process's user + system CPU time, in clock ticks (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.parametrize("response, answer, score", [(" Paris. ", "paris", 1.0), ("Pari s", "paris", 0.0),
                                                     ("new  york", "New York", 1.0)])
def test_exact_normalises(response, answer, score):
    assert ExactReward().score({"answer": answer}, response).score == score
    assert ExactReward(case_sensitive=True).score({"answer": "Paris"}, "paris").score == 0.0


def test_code_tests_asserts_and_stdin_pairs():
    reward = CodeTestsReward(allow_rlimit_only=True)
    asserts = {"kind": "asserts", "asserts": ["assert add3(1) == 4", "assert add3(0) == 3", "assert add3(-3) == 0"]}
    assert reward.score({"tests": asserts}, "def add3(x):\n    return x + 3").score == 1.0
    half = reward.score({"tests": asserts}, "def add3(x):\n    return 3 if x == 0 else 4")
    assert half.score == pytest.approx(2 / 3) and half.feedback.startswith("# assert add3(-3) == 0: AssertionError")
    broken = reward.score({"tests": asserts}, "def add3(x) return x")
    assert broken.score == 0.0 and "SyntaxError" in broken.feedback
    fenced = reward.score({"tests": asserts}, "```python\ndef add3(x):\n    return x + 3\n```")
    assert fenced.score == 1.0
    io = {"kind": "io", "inputs": ["2 3", "10 -1"], "outputs": ["5\n", "9"]}
    assert reward.score({"tests": io}, "a, b = map(int, input().split())\nprint(a + b)").score == 1.0
    wrong = reward.score({"tests": io}, "a, b = map(int, input().split())\nprint(a * b)")
    assert wrong.score == 0.0 and "want 5" in wrong.feedback


def write_module(tmp_path, body: str) -> str:
    (tmp_path / "my_rewards.py").write_text(body)
    return str(tmp_path / "my_rewards.py")


def test_python_reward_float_and_info(tmp_path, monkeypatch):
    path = write_module(tmp_path, "def length(task, response):\n    return len(response) / 10\n\n"
                                  "def graded(task, response):\n"
                                  "    ok = response.strip() == task['answer']\n"
                                  "    return float(ok), {'feedback': '' if ok else 'try again'}\n\n"
                                  "def bad(task, response):\n    return 'yes'\n")
    assert build_reward("python", {"function": f"{path}:length"}).score({}, "abcde").score == 0.5
    monkeypatch.syspath_prepend(str(tmp_path))  # module:function form, importable from sys.path
    verdict = build_reward("python", {"function": "my_rewards:graded"}).score({"answer": "4"}, "5")
    assert (verdict.score, verdict.feedback) == (0.0, "try again")
    bad = build_reward("python", {"function": f"{path}:bad"}).score({}, "x")  # a reward error: 0, counted
    assert bad.score == 0.0 and "must return a float" in bad.info["error"]
    with pytest.raises(ValueError, match="has no function 'missing'"):
        build_reward("python", {"function": f"{path}:missing"})
    with pytest.raises(ValueError, match="module:function"):
        build_reward("python", {"function": "no_colon"})


@pytest.fixture(scope="module")
def sequence_classifier(tiny_model_dir, tmp_path_factory):
    """A tiny AutoModelForSequenceClassification directory, built (untrained) from the session's tiny model."""
    from transformers import AutoModelForSequenceClassification

    from opd_sao.checkpoints import load_tokenizer, pretrained, save_checkpoint

    tok = load_tokenizer(tiny_model_dir)
    model = pretrained(AutoModelForSequenceClassification, tiny_model_dir, num_labels=1, pad_token_id=tok.pad_token_id)
    return save_checkpoint(model, tok, tmp_path_factory.mktemp("rm") / "classifier")


def test_reward_model_scores_in_batches(sequence_classifier):
    from opd_sao.envs.chat.reward_model import RewardModel

    reward = RewardModelReward(str(sequence_classifier), batch_size=8, batch_wait_s=0.3)
    tasks = [{"prompt": f"user: tell me about {t}.\nbot:"} for t in ("cats", "tea", "rain", "snow")] * 4
    responses = [" i like it a lot.", " no", "...", " cats are great!"] * 4
    scores = [None] * len(tasks)

    def one(i):
        scores[i] = reward.score(tasks[i], responses[i]).score

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(tasks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    direct = RewardModel(sequence_classifier).score([t["prompt"] for t in tasks], responses).sigmoid().tolist()
    assert scores == pytest.approx(direct, abs=1e-5)
    assert 2 <= reward.stats()["batches"] < len(tasks)  # concurrent steps shared forward passes
    binary = RewardModelReward(str(sequence_classifier), binary=True, threshold=-1e9)
    assert binary.score(tasks[0], responses[0]).score == 1.0


class JudgeServer:
    """A real OpenAI-compatible chat endpoint on loopback: replies with `reply`, or fails `fail_first` times with
    HTTP `fail_status` (and a `Retry-After` header when given); records the prompts it saw, when, and the most
    requests it had in flight at once."""

    def __init__(self, reply: str = "Score: 7", fail_first: int = 0, delay_s: float = 0.0, fail_status: int = 500,
                 retry_after: str | None = None):
        self.reply, self.fail_first, self.delay_s = reply, fail_first, delay_s
        self.fail_status, self.retry_after, self.times = fail_status, retry_after, []
        self.seen, self.in_flight, self.max_in_flight, self.lock = [], 0, 0, threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    server.seen.append(body)
                    server.times.append(time.monotonic())
                    failing = server.fail_first > 0
                    server.fail_first -= failing
                time.sleep(server.delay_s)
                with server.lock:
                    server.in_flight -= 1
                if self.path != "/v1/chat/completions" or failing:
                    self.send_response(server.fail_status)
                    if server.retry_after is not None:
                        self.send_header("Retry-After", server.retry_after)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                out = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": server.reply}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def judge_server():
    servers = []

    def start(**kwargs):
        servers.append(JudgeServer(**kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


TASK = {"id": "t1", "prompt": "what is 2+2?", "answer": "4"}


def test_judge_scores_through_the_endpoint(judge_server):
    server = judge_server(reply="Score: 7/10")
    reward = JudgeReward(server.url, "judge-model", template="P={prompt} R={response} REF={reference}")
    verdict = reward.score(TASK, "four")
    assert verdict.score == pytest.approx(0.7)
    assert server.seen[0]["model"] == "judge-model"
    assert server.seen[0]["messages"] == [{"role": "user", "content": "P=what is 2+2? R=four REF=4"}]
    assert reward.stats() == {"requests": 1, "failed_tries": 0, "failed_judgements": 0}


def test_judge_retries_then_counts_failures(judge_server):
    server = judge_server(fail_first=1)
    reward = JudgeReward(server.url, "m", retries=1, timeout_s=5)
    assert reward.score(TASK, "four").score == pytest.approx(0.7)  # the retry succeeded
    assert reward.stats() == {"requests": 2, "failed_tries": 1, "failed_judgements": 0}
    down = judge_server(fail_first=10**6)
    raising = JudgeReward(down.url, "m", retries=1, timeout_s=5)
    with pytest.raises(RewardFailure) as err:
        raising.score(TASK, "four")
    assert "failed 2 times on task 't1'" in str(err.value) and "\n" not in str(err.value)
    zero = JudgeReward(down.url, "m", retries=0, timeout_s=5, on_failure="zero")
    assert zero.score(TASK, "four").score == 0.0
    assert zero.stats()["failed_judgements"] == 1
    unparsable = JudgeReward(judge_server(reply="I cannot rate this").url, "m", retries=0, on_failure="zero")
    assert unparsable.score(TASK, "four").score == 0.0 and unparsable.stats()["failed_judgements"] == 1


def test_judge_concurrency_limit(judge_server):
    server = judge_server(delay_s=0.2)
    reward = JudgeReward(server.url, "m", concurrency=2)
    threads = [threading.Thread(target=reward.score, args=(TASK, "four")) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(server.seen) == 6 and server.max_in_flight == 2


def test_judge_bad_options_are_one_line():
    with pytest.raises(ValueError, match="template may only use"):
        JudgeReward("http://127.0.0.1:9/v1", "m", template="{question}")
    with pytest.raises(ValueError, match="on_failure"):
        JudgeReward("http://127.0.0.1:9/v1", "m", on_failure="ignore")
    with pytest.raises(KeyError, match="unknown reward 'regex'"):
        build_reward("regex")


def test_a_reward_model_trained_from_a_file_is_retrained_when_the_file_changes(tmp_path):
    """train_from: the model records what it was trained from; an unchanged file reuses it, an edited file (or
    other training settings) trains it again, and a model it did not train is refused, never overwritten. No
    assertion reads the model's quality: 20 of 20 training seeds pass (scripts/seed_pass_rate.py train_from)."""
    import shutil

    from opd_sao.envs.dataset.files import DatasetError
    from opd_sao.envs.dataset.preferences import train_from_file

    rows = [{"prompt": f"tell me about topic {i}", "chosen": f"topic {i} is a fine thing to learn about.",
             "rejected": "no."} for i in range(30)]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rm"
    recorded = lambda: json.loads((out / "config.json").read_text())["reward_model"]["trained_from"]
    assert train_from_file(prefs, out, steps=2)["train_pairs"] > 0
    first = recorded()
    assert train_from_file(prefs, out, steps=2) == {} and recorded() == first  # current: reused as it is
    prefs.write_text(prefs.read_text() + json.dumps({"prompt": "one more", "chosen": "yes, one more.",
                                                      "rejected": "no."}) + "\n")
    assert train_from_file(prefs, out, steps=2)["train_pairs"] > 0  # the file changed: trained again
    assert recorded()["sha256"] != first["sha256"]
    assert train_from_file(prefs, out, steps=3)["steps"] == 3 and recorded()["steps"] == 3  # settings changed too

    own = tmp_path / "own"
    shutil.copytree(out, own)
    config = json.loads((own / "config.json").read_text())
    del config["reward_model"]["trained_from"]
    (own / "config.json").write_text(json.dumps(config))
    with pytest.raises(DatasetError, match="not trained from"):
        train_from_file(prefs, own, steps=3)
    assert "trained_from" not in json.loads((own / "config.json").read_text())["reward_model"]
