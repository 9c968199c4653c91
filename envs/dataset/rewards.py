"""The dataset env's rewards (`reward: math`), on the contract of envs/rewards.py.

Each scores one response to a task dict of `DatasetEnv` ("prompt" text, "answer", "tests", "metadata"):
exact, math, code_tests (multi-turn: the observation names the first failing test), reward_model, judge (an
LLM behind an OpenAI-compatible endpoint), python (a user's function, declaring its own range). Verifiers:
exact, math, code_tests and (by default) python; not the reward model and the judge.
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from opd_sao.engines.retry import call_with_retries
from opd_sao.envs.answers import after_prompt, unevaluated
from opd_sao.envs.rewards import Reward, RewardFailure, Verdict, register_reward
from opd_sao.envs.sandbox import WALL_S, SandboxLimits
from opd_sao.errors import UsageError

from .python_worker import import_function

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- exact
def normalise(text: str) -> str:
    """Lower case, single spaces, no surrounding spaces or final full stop."""
    return " ".join(text.lower().split()).rstrip(".")


@register_reward("exact")
class ExactReward(Reward):
    """1 when the response equals the answer after normalisation (`case_sensitive` keeps case)."""

    needs = ("answer",)

    def __init__(self, case_sensitive: bool = False):
        self.case_sensitive = case_sensitive

    def score(self, task: dict, response: str) -> Verdict:
        a, b = response, task["answer"]
        if self.case_sensitive:
            return Verdict(float(" ".join(a.split()).rstrip(".") == " ".join(b.split()).rstrip(".")))
        return Verdict(float(normalise(a) == normalise(b)))


# ---------------------------------------------------------------------------------------------- math
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def marked_answer(text: str) -> Optional[str]:
    """The answer a solution marks as final: the last \\boxed{}, else what follows the last GSM8K `####`;
    None when nothing is marked. Commas inside numbers are dropped (`1,000` -> `1000`)."""
    found = last_boxed(text)
    if found is None and "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        found = tail.splitlines()[0] if tail else None
    if found is None:
        return None
    return re.sub(r"(?<=\d),(?=\d{3})", "", found.strip().rstrip("."))


def last_number(text: str) -> Optional[str]:
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


class Worker:
    """One worker process (`worker_loop.py` with the handler script `script` of this package and `args`), asked one
    JSON job at a time over a socket of its own, each answer matched to its request by id. A job past its deadline
    kills the worker (a new one starts on the next job) and has no answer (None); a worker that dies answers
    {"error": ...}. The worker runs in a session of its own, and its whole process group (what the reward forked)
    is killed with it: when it is replaced, when the run exits, and by the worker itself when the run is gone. Its
    stdout and stderr (a reward's prints) are read and counted (`output_bytes`), never parsed; the first line is
    logged once. Workers are outside the terminal's process group: Ctrl-C reaches the run, which ends them."""

    def __init__(self, script: str, args: tuple[str, ...] = (), startup_s: float = 60.0, isolated: bool = True):
        here = Path(__file__).parent
        self.command = [sys.executable, *(["-I"] if isolated else []), str(here / "worker_loop.py")]
        self.args = (str(here / script), *args)
        self.startup_s, self._proc, self._lock = startup_s, None, threading.Lock()
        self._channel: Optional[socket.socket] = None
        self._buffer, self._next_id, self.output_bytes = b"", 0, 0
        atexit.register(self.close)

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen([*self.command, str(theirs.fileno()), *self.args], pass_fds=(theirs.fileno(),),
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        theirs.close()
        self._channel, self._buffer = ours, b""
        threading.Thread(target=self._drain, args=(self._proc.stdout,), daemon=True).start()

    def _drain(self, output) -> None:
        """Counts what the worker (the reward) prints; logs its first line once, so a debugging print is seen."""
        while chunk := output.read1(65536):
            if not self.output_bytes:
                logger.warning("a reward worker (%s) printed %r...; its output is counted (output_bytes), not kept",
                               Path(self.args[0]).name, chunk.splitlines()[0][:200].decode(errors="replace"))
            self.output_bytes += len(chunk)
        output.close()

    def _read(self, request_id: int, deadline: float) -> Optional[dict]:
        """The answer to `request_id`; None at the deadline; {"error"} when the worker closed its end."""
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                answer = json.loads(line)
                if answer.pop("id", None) == request_id:
                    return answer
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._channel], [], [], left)[0]:
                return None
            chunk = self._channel.recv(65536)
            if not chunk:
                code = self._proc.wait()
                return {"error": f"the worker process exited (code {code}) before answering", "exit_code": code}
            self._buffer += chunk

    def ask(self, job: dict, deadline_s: float) -> Optional[dict]:
        with self._lock:
            fresh = self._proc is None
            if fresh:
                self._start()
            self._next_id += 1
            try:
                self._channel.sendall((json.dumps({"id": self._next_id, "job": job}, default=str) + "\n").encode())
                answer = self._read(self._next_id, time.monotonic() + deadline_s + (self.startup_s if fresh else 0))
            except (BrokenPipeError, ConnectionResetError):
                code = self._proc.wait()
                answer = {"error": f"the worker process exited (code {code}) before answering", "exit_code": code}
            if answer is None or self._proc.poll() is not None:
                self._stop()
            return answer

    def _stop(self) -> None:
        """Kills the worker's process group (the worker and whatever the reward started) and closes its socket."""
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()
        self._channel.close()
        self._proc, self._channel = None, None

    def close(self) -> None:
        """At exit: kill the group, without the lock (a rollout thread may be waiting on this worker)."""
        proc = self._proc
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@register_reward("math")
class MathReward(Reward):
    """1 when the response's final answer equals the reference's, by math-verify (with latex2sympy2-extended):
    `\\frac{1}{2}`, `0.5` and `1/2` agree. The final answer is the last \\boxed{}, else what follows GSM8K's
    `####`, else (a response) the last expression or number math-verify finds, or (a reference) the whole
    answer field, as MATH-style datasets store bare LaTeX answers. With `strict`, a response must mark its answer
    (\\boxed{} or `####`): an unmarked one scores 0 (a stray last number, `1==зе return`, is no answer).

    A final answer is a value, not an operation left to do (envs/answers.py): when the final expression of
    the marked answer, or of an unmarked response, holds an operation between plain numbers (`66 - 8`,
    `Calculate 66 - 8.`, `\\boxed{2 \\times 29}`, `116/2`; not a leading sign, not a non-whole fraction `1/2`),
    it scores 0 (counted: `unevaluated`), unless the reference's final answer is itself such an expression. The
    answer is read after the last verbatim copy of the prompt in the response, so an echoed prompt answers nothing.

    Each check gets `timeout_s` seconds of CPU time (in a checker process, `math_worker.py`; the kernel kills it at
    about twice that), never of wall-clock time, so a busy machine cannot change a score: a check past it scores 0
    and is counted (`timeouts`), as it would be on an idle machine. What goes to sympy is bounded first: a marked
    answer or a reference longer than `max_answer_chars` scores 0 (counted: `too_long`), and of an unmarked
    response only the last `max_answer_chars` characters (from a word boundary) are read, math-verify taking the
    last expression anyway. A checker that dies otherwise, or gives no answer within `backstop_s` of wall-clock time
    (a process blocked without using CPU), is a reward error: scored 0, counted (`errors`) and logged, never cached.
    `stats`: checks, timeouts, errors, too_long, no_answer, unevaluated.
    """

    needs = ("answer",)

    def __init__(self, timeout_s: float = 5, startup_s: float = 60.0, strict: bool = False,
                 max_answer_chars: int = 1000, backstop_s: float = 600.0):
        if not 0 < timeout_s < math.inf or not 0 < backstop_s < math.inf or max_answer_chars < 1:
            raise UsageError(f"math reward: need timeout_s and backstop_s > 0 and finite, max_answer_chars >= 1 (got "
                             f"{timeout_s}, {backstop_s}, {max_answer_chars})")
        self.timeout_s, self.backstop_s, self.max_answer_chars = float(timeout_s), float(backstop_s), max_answer_chars
        self.checker, self.strict = Worker("math_worker.py", startup_s=startup_s), strict
        self._cache: dict[tuple[str, str], bool] = {}
        self.counts = {"checks": 0, "timeouts": 0, "errors": 0, "too_long": 0, "no_answer": 0, "unevaluated": 0}

    def score(self, task: dict, response: str) -> Verdict:
        reference = marked_answer(task["answer"]) or task["answer"].strip()  # MATH-style answers are bare LaTeX
        response = after_prompt(response, task.get("prompt"))
        prediction = marked_answer(response)
        if prediction is None and (self.strict or (last_number(response) is None and "\\" not in response)):
            self.counts["no_answer"] += 1
            return Verdict(0.0)
        if unevaluated(response if prediction is None else prediction) and not unevaluated(reference):
            self.counts["unevaluated"] += 1
            return Verdict(0.0)
        if reference in (prediction, prediction is None and last_number(response)):
            return Verdict(1.0)
        if max(len(reference), len(prediction or "")) > self.max_answer_chars:
            self.counts["too_long"] += 1
            return Verdict(0.0)
        # a marked answer is LaTeX; an unmarked response goes whole, and math-verify takes its last expression
        key = (f"${prediction}$" if prediction is not None else self._tail(response), f"${reference}$")
        if key not in self._cache:
            self.counts["checks"] += 1
            answer = self.checker.ask({"prediction": key[0], "reference": key[1], "cpu_s": self.timeout_s},
                                      self.backstop_s)
            if answer is not None and answer.get("exit_code") == -signal.SIGXCPU:  # killed at its CPU limit
                answer = {"equal": False, "over_cpu": True}
            if answer is None or "equal" not in answer:
                self.counts["errors"] += 1
                why = "no answer within backstop_s" if answer is None else answer.get("error", answer)
                logger.warning("math reward: checking %r against %r failed (%s); scored 0 (reward error %d)", *key,
                               why, self.counts["errors"])
                return Verdict(0.0, info={"error": str(why)})
            if answer.get("over_cpu"):
                self.counts["timeouts"] += 1
                logger.warning("math reward: checking %r against %r took more than timeout_s=%s CPU seconds; "
                               "scored 0", *key, self.timeout_s)
            self._cache[key] = bool(answer["equal"])
        return Verdict(float(self._cache[key]))

    def _tail(self, response: str) -> str:
        """The response's last `max_answer_chars` characters, from a word boundary (a number is never cut)."""
        if len(response) <= self.max_answer_chars:
            return response
        tail = response[-self.max_answer_chars:]
        return tail if response[-self.max_answer_chars - 1].isspace() else tail.split(None, 1)[-1]

    def stats(self) -> dict:
        return dict(self.counts)


# ---------------------------------------------------------------------------------------- code tests
@register_reward("code_tests")
class CodeTestsReward(Reward):
    """The response is a program, graded in the bubblewrap sandbox (envs/sandbox.py) by the grading harness
    (envs/grading.py), and the score is the fraction of the task's tests passed. Tests are assert statements
    (MBPP / HumanEval), run in the harness, never in the program's interpreter: the program's functions are
    called in a child process on plain data; or stdin/stdout pairs (APPS / CodeContests), one run per input,
    graded as the code environment grades. With `strict`, the score is 1 when every test passes, else 0 (a wrong
    program that passes an easy test earns nothing). The program's output is never the harness's (it may print freely). A failure's observation names the first failing test, so the agent stage's
    multi-turn retry works as in the code environment. `setup` (a row's `test_setup_code`) is not supported.
    `cpu_s` bounds the program's work (CPU time per process: the same under any load); `wall_s` is a hang catcher
    for a program that waits without running (sandbox.WALL_S), set far above a correct program's time on a busy machine.
    """

    needs = ("tests",)
    multi_turn = True
    slow = True

    def __init__(self, allow_rlimit_only: bool = False, wall_s: float = WALL_S, cpu_s: int = 2, memory_mb: int = 256,
                 strip_fences: bool = True, strict: bool = False):
        self.allow_rlimit_only, self.strip_fences, self.strict = allow_rlimit_only, strip_fences, strict
        self.limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, max_processes=8,
                                    output_bytes=64 * 1024)
        self.counts = {"runs": 0, "sandbox_errors": 0}

    def program(self, response: str) -> str:
        """The code in a response: the first ``` fenced block when there is one (and `strip_fences`)."""
        if self.strip_fences and "```" in response:
            block = response.split("```", 2)[1]
            return block.split("\n", 1)[1] if "\n" in block and block.split("\n", 1)[0].strip().isalnum() else block
        return response

    def score(self, task: dict, response: str) -> Verdict:
        from opd_sao.envs.grading import VERDICTS, feedback, sandbox_mode
        from opd_sao.envs.sandbox import SandboxUnavailableError

        tests, source = task["tests"], self.program(response)
        self.counts["runs"] += 1
        try:
            mode = sandbox_mode(self.allow_rlimit_only)
            if tests["kind"] == "asserts":
                job, labels = {"kind": "asserts", "source": source, "tests": tests["asserts"]}, \
                    [test.strip()[:60] for test in tests["asserts"]]
            else:
                job = {"kind": "io", "source": source, "inputs": tests["inputs"],
                       "expected": [out.strip() for out in tests["outputs"]]}
                labels = [f"x={x}" for x in tests["inputs"]]
            verdict = VERDICTS.run(job, len(labels), self.limits, mode)
        except SandboxUnavailableError:
            raise
        except Exception as err:  # an infrastructure failure is a failed step, never a crash
            self.counts["sandbox_errors"] += 1
            logger.warning("code_tests reward: sandbox run failed: %r", err)
            return Verdict(0.0, f"# sandbox error: {type(err).__name__}\n")
        passed = verdict[0] / len(labels)
        return Verdict(float(passed == 1.0) if self.strict else passed, feedback(verdict, labels))

    @classmethod
    def feedback_examples(cls) -> list[str]:
        return ["# assert f(1) == 2: AssertionError\n", "# NameError: name 'x' is not defined\n",
                "# SyntaxError: invalid syntax\n"]

    def stats(self) -> dict:
        return dict(self.counts)


# -------------------------------------------------------------------------------------- reward model
class _Batcher:
    """Scores that arrive together (episodes step on worker threads) go through the model as one batch:
    the first caller waits `wait_s` for others, then scores up to `batch_size` waiting requests at once."""

    def __init__(self, score_many: Callable[[list, list], list[float]], batch_size: int, wait_s: float = 0.005):
        self.score_many, self.batch_size, self.wait_s = score_many, batch_size, wait_s
        self._pending: list[list] = []  # [prompt, response, event, result]
        self._lock = threading.Lock()
        self.batches = 0

    def __call__(self, prompt: str, response: str) -> float:
        item = [prompt, response, threading.Event(), None]
        with self._lock:
            self._pending.append(item)
            leader = len(self._pending) == 1
        if leader:
            time.sleep(self.wait_s)
        while not item[2].is_set():
            with self._lock:
                batch, self._pending = self._pending[: self.batch_size], self._pending[self.batch_size:]
            if batch:
                try:
                    scores = self.score_many([b[0] for b in batch], [b[1] for b in batch])
                except BaseException as err:  # every waiter of the batch sees the failure
                    scores = [err] * len(batch)
                self.batches += 1
                for b, s in zip(batch, scores):
                    b[3] = s
                    b[2].set()
            else:
                item[2].wait(0.001)
        if isinstance(item[3], BaseException):
            raise item[3]
        return item[3]


@register_reward("reward_model")
class RewardModelReward(Reward):
    """A local HF `AutoModelForSequenceClassification` directory scores (prompt, response), batched, on
    `device`. The score is sigmoid(raw - threshold) (the threshold the project's reward-model training
    calibrated, else 0), or with `binary` 1/0 for above/below it. With `train_from`, a preference file (rows
    with `prompt`, `chosen`, `rejected`: the keys are options), the model at `path` is trained from it first
    unless it already was, from the same contents and settings (`envs/chat/reward_model.py`, on a
    tiny backbone built from the file).
    Concurrent scores (episodes step on worker threads) wait up to `batch_wait_s` to share a forward pass.
    """

    verifier = False

    def __init__(self, path: str, device: str = "cpu", batch_size: int = 32, binary: bool = False,
                 threshold: Optional[float] = None, train_from: Optional[str] = None, prompt_key: str = "prompt",
                 chosen_key: str = "chosen", rejected_key: str = "rejected", train_steps: int = 200, seed: int = 0,
                 batch_wait_s: float = 0.005):
        from opd_sao.envs.chat.reward_model import RewardModel

        if train_from:
            from .preferences import train_from_file

            train_from_file(Path(train_from), Path(path), prompt_key=prompt_key, chosen_key=chosen_key,
                            rejected_key=rejected_key, steps=train_steps, seed=seed)
        elif not (Path(path) / "config.json").is_file():
            raise UsageError(f"reward_model reward: no model at {path!r} and no `train_from` preference file")
        self.model = RewardModel(path, device=device)
        self.binary = binary
        self.threshold = self.model.threshold if threshold is None else float(threshold)
        self._batch = _Batcher(self._score_many, batch_size, batch_wait_s)

    def _score_many(self, prompts: list[str], responses: list[str]) -> list[float]:
        import torch

        raw = self.model.score(prompts, responses) - self.threshold
        return ((raw > 0).float() if self.binary else torch.sigmoid(raw)).tolist()

    def score(self, task: dict, response: str) -> Verdict:
        return Verdict(float(self._batch(task["prompt"], response)))

    def stats(self) -> dict:
        return {"batches": self._batch.batches}


# --------------------------------------------------------------------------------------------- judge
DEFAULT_TEMPLATE = ("Rate the response to the prompt from 0 to 10 (10 = perfect).\n\nPrompt:\n{prompt}\n\n"
                    "Reference answer (may be empty):\n{reference}\n\nResponse:\n{response}\n\n"
                    "Reply with the score only.")


@register_reward("judge")
class JudgeReward(Reward):
    """An LLM judge behind an OpenAI-compatible chat endpoint (the `openai` client): `template` is filled with
    {prompt}, {response} and {reference} and sent as one user message to `model` at `base_url`. The score is read
    from the reply: an explicit `Score: N` field (the last one) when there is one, else the LAST number (a reply
    that reasons first, "on a 0-10 scale: 3", ends with its verdict); with `score_pattern`, its last match (its
    first group when it has one). Divided by `max_score` and clipped to [0, 1]. At most `concurrency` requests are
    in flight per process; each gets `timeout_s` and up to `retries` more tries (a connection error, an HTTP error,
    or a reply without a score is a failed try), waiting `backoff_s` doubling between tries, or what the server
    asks for in `Retry-After` (429, 503), up to `max_wait_s`: engines/retry.py's `call_with_retries`.

    A judgement that still fails is counted (`stats`: requests, failed tries, failed judgements) and, by
    default (`on_failure: raise`), stops the run with a one-line error: a judge that is down must not look
    like a policy that got worse. `on_failure: zero` scores it 0 instead and logs a warning every time.
    """

    verifier = False
    slow = True

    def __init__(self, base_url: str, model: str, template: str = DEFAULT_TEMPLATE, api_key: str = "EMPTY",
                 score_pattern: Optional[str] = None, max_score: float = 10.0, concurrency: int = 8,
                 timeout_s: float = 60.0, retries: int = 2, temperature: float = 0.0, max_tokens: int = 16,
                 on_failure: str = "raise", backoff_s: float = 1.0, max_wait_s: float = 60.0):
        import openai

        if on_failure not in ("raise", "zero"):
            raise UsageError(f"judge reward: on_failure must be 'raise' or 'zero' (got {on_failure!r})")
        if max_score <= 0 or concurrency < 1 or retries < 0:
            raise UsageError("judge reward: need max_score > 0, concurrency >= 1, retries >= 0")
        try:
            template.format(prompt="", response="", reference="")
        except (KeyError, IndexError) as err:
            raise UsageError(f"judge reward: template may only use {{prompt}}, {{response}}, {{reference}} "
                             f"(found {err})") from None
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)
        try:
            self.pattern = re.compile(score_pattern) if score_pattern else None
        except re.error as err:
            raise UsageError(f"judge reward: score_pattern {score_pattern!r} is not a regular expression: {err}") from None
        self.model, self.template = model, template
        self.backoff_s, self.max_wait_s = backoff_s, max_wait_s
        self.max_score, self.retries, self.on_failure = max_score, retries, on_failure
        self.temperature, self.max_tokens, self.base_url = temperature, max_tokens, base_url
        self._slots = threading.BoundedSemaphore(concurrency)
        self._count_lock = threading.Lock()
        self.counts = {"requests": 0, "failed_tries": 0, "failed_judgements": 0}

    def _count(self, key: str) -> None:
        with self._count_lock:
            self.counts[key] += 1

    def _ask(self, content: str) -> float:
        """One try: the parsed score, or an exception."""
        self._count("requests")
        with self._slots:
            reply = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": content}], temperature=self.temperature,
                max_tokens=self.max_tokens)
        text = reply.choices[0].message.content or ""
        found = judge_score(text, self.pattern)
        if found is None:
            raise ValueError(f"no score in the judge's reply {text[:80]!r}")
        return min(1.0, max(0.0, found / self.max_score))

    def score(self, task: dict, response: str) -> Verdict:
        content = self.template.format(prompt=task["prompt"], response=response, reference=task.get("answer") or "")
        try:
            score, tries = call_with_retries(lambda: self._ask(content), self.retries, self.backoff_s,
                                             self.max_wait_s, on_failed_try=lambda _err: self._count("failed_tries"))
            return Verdict(score, info={"tries": tries})
        except Exception as err:  # every try failed: counted, then raised or scored 0
            error = err
        self._count("failed_judgements")
        why = f"judge at {self.base_url} failed {self.retries + 1} times on task {task['id']!r}: {str(error).splitlines()[0]}"
        if self.on_failure == "raise":
            raise RewardFailure(why + " (on_failure: raise)")
        logger.warning("%s; scored 0 (on_failure: zero)", why)
        return Verdict(0.0, info={"failed": True})

    def stats(self) -> dict:
        return dict(self.counts)


SCORE_FIELD = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
NUMBER_ONLY = re.compile(r"-?\d+(?:\.\d+)?")


def judge_score(text: str, pattern: Optional[re.Pattern] = None) -> Optional[float]:
    """The score in a judge's reply: the last match of `pattern` (its first group if it has one); by default the
    last `Score: N` field, else the last number. None when there is none."""
    matches = list((pattern or SCORE_FIELD).finditer(text))
    if not matches and pattern is None:
        matches = list(NUMBER_ONLY.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    try:
        return float(last.group(1) if last.re.groups else last.group(0))
    except ValueError:
        return None


# -------------------------------------------------------------------------------------------- python
@register_reward("python")
class PythonReward(Reward):
    """Your own function, `function: module:function` (or `file.py:function`), called as f(task, response) and
    returning a float or (float, info dict); an info "feedback" string is the next observation when
    `multi_turn`. `verifier: false` when the reference answer need not score 1; `needs` lists the task fields
    it reads ("answer", "tests"), so rows without them are reported as malformed; `reward_range` is the range its
    scores must lie in ([0, 1]).

    It runs in a worker process (`python_worker.py` under `worker_loop.py`, as the math checker), one call at a
    time, answering over a socket of its own: the function may print, run subprocesses or fork freely. Each call gets
    `timeout_s` seconds of the worker's CPU time, never of wall-clock time, so a busy machine cannot change a score: a
    call past it (interrupted, or killed by the kernel at about twice that) scores 0 and is counted (`stats`: calls,
    timeouts) and logged, as it would be on an idle machine. A call that gives no answer within `backstop_s` of
    wall-clock time (it waits without running: a sleep, a subprocess, a socket) kills the worker (and whatever it
    started) and is a reward error. A reward error (that, an exception, `sys.exit`, a worker that dies, a return that
    is not a finite number or (number, dict): a string, None, 10**400, NaN) scores 0 too (the low end of
    `reward_range` when 0 is outside it), counted (`errors`, `first_error`) and logged; the run stops with one line once there are more than
    `max_errors` of them and they are more than `max_error_rate` of the calls: a function that fails on most tasks is
    a bug to fix, not a reward to train on."""

    def __init__(self, function: str, verifier: bool = True, multi_turn: bool = False, slow: bool = False,
                 needs: tuple[str, ...] = (), reward_range: tuple[float, float] = (0.0, 1.0), timeout_s: float = 30.0,
                 startup_s: float = 60.0, max_errors: int = 10, max_error_rate: float = 0.05, backstop_s: float = 600.0):
        import_function(function)  # a bad name is one line now, not a dead worker later
        self.name = function
        self.verifier, self.multi_turn, self.slow, self.needs = verifier, multi_turn, slow, tuple(needs)
        if (len(reward_range) != 2 or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in reward_range)
                or reward_range[0] >= reward_range[1]):
            raise UsageError(f"python reward: reward_range must be [low, high], finite, low < high (got {reward_range!r})")
        if not 0 < timeout_s < math.inf or not 0 < backstop_s < math.inf:
            raise UsageError(f"python reward: timeout_s and backstop_s must be > 0 and finite (got {timeout_s}, "
                             f"{backstop_s})")
        if max_errors < 0 or not 0 <= max_error_rate <= 1:
            raise UsageError(f"python reward: need max_errors >= 0 and max_error_rate in [0, 1] (got {max_errors}, "
                             f"{max_error_rate})")
        self.reward_range = (float(reward_range[0]), float(reward_range[1]))
        self.zero = min(max(0.0, self.reward_range[0]), self.reward_range[1])  # what a failed call scores
        self.timeout_s, self.backstop_s = float(timeout_s), float(backstop_s)
        self.max_errors, self.max_error_rate = max_errors, max_error_rate
        self.worker = Worker("python_worker.py", (json.dumps(sys.path), function), startup_s, isolated=False)
        self.counts = {"calls": 0, "timeouts": 0, "errors": 0}
        self.first_error = ""

    def score(self, task: dict, response: str) -> Verdict:
        self.counts["calls"] += 1
        answer = self.worker.ask({"task": task, "response": response, "cpu_s": self.timeout_s}, self.backstop_s)
        if answer is None:
            return self._error(task, f"no answer within backstop_s={self.backstop_s} s")
        if answer.get("over_cpu") or answer.get("exit_code") == -signal.SIGXCPU:  # killed at its CPU limit
            self.counts["timeouts"] += 1
            logger.warning("python reward %s: task %r took more than timeout_s=%s CPU seconds; scored %s", self.name,
                           task.get("id"), self.timeout_s, self.zero)
            return Verdict(self.zero, info={"timeout": True})
        if "error" in answer:
            return self._error(task, answer["error"])
        info = answer["info"]
        return Verdict(answer["score"], str(info.get("feedback", "")), info)

    def _error(self, task: dict, error: str) -> Verdict:
        """A reward error: scored `zero`, counted and logged; past the limits, the end of the run."""
        why = f"python reward {self.name} failed on task {task.get('id')!r}: {error}"
        self.counts["errors"] += 1
        self.first_error = self.first_error or why
        errors, calls = self.counts["errors"], self.counts["calls"]
        if errors > self.max_errors and errors > self.max_error_rate * calls:
            raise RewardFailure(f"{why} ({errors} reward errors in {calls} calls: more than max_errors="
                                f"{self.max_errors} and max_error_rate={self.max_error_rate})")
        logger.warning("%s; scored %s (reward error %d)", why, self.zero, errors)
        return Verdict(self.zero, info={"error": error})

    def stats(self) -> dict:
        return {**self.counts, "output_bytes": self.worker.output_bytes,
                **({"first_error": self.first_error} if self.first_error else {})}
