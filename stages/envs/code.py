"""Agent domain: write a one-line Python program, run it in the sandbox on hidden tests, fix it on failure.

Tasks are short and templated so the embedded tiny model can learn them on a CPU: the prompt is a
starter file whose comment states f(x) in math notation (`3(x+1)`), the model writes the line that
prints f(x) (`print(3*(x+1))`). The program runs once per action in the sandbox against all hidden
inputs (fed on stdin, one per test, by a fixed harness), and the reward is the pass fraction. On a
failure the observation names the first failing input (or the error) and the model may try again
within `rollout.max_turns`; each step's reward is the change in pass fraction, so an episode's total
reward is the pass fraction of its last program.
"""
from __future__ import annotations

import functools
import json
import logging
import random
import threading
from collections import OrderedDict
from typing import Optional

from stages.envs.sandbox import SandboxLimits, SandboxResult, detect_mode, run_python

from .base import Environment, register_env, shuffled

logger = logging.getLogger(__name__)

# (spec shown to the model, the Python expression that solves it, f itself for the expected outputs)
FORMS = [
    ("{a}x+{b}", "{a}*x+{b}", lambda a, b, x: a * x + b),
    ("{a}x-{b}", "{a}*x-{b}", lambda a, b, x: a * x - b),
    ("{a}(x+{b})", "{a}*(x+{b})", lambda a, b, x: a * (x + b)),
    ("{a}(x-{b})", "{a}*(x-{b})", lambda a, b, x: a * (x - b)),
]
STARTER = "x = int(input())\n"

# Runs in the sandbox: the submitted program (starter + action) once per stdin input, each with its own
# stdin and captured stdout; prints one JSON list of [stdout, error]. The program and inputs arrive on
# stdin, so the harness never interpolates model text into code.
HARNESS = """\
import contextlib, io, json, sys
job = json.loads(sys.stdin.read())
results = []
try:
    program = compile(job["source"], "main.py", "exec")
except SyntaxError as err:
    results = [["", f"SyntaxError: {err.msg}"]] * len(job["inputs"])
else:
    for value in job["inputs"]:
        sys.stdin, out = io.StringIO(f"{value}\\n"), io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(program, {"__name__": "__main__"})
            results.append([out.getvalue(), None])
        except BaseException as err:
            results.append([out.getvalue(), f"{type(err).__name__}: {err}"])
sys.__stdout__.write("\\n" + json.dumps(results) + "\\n")
"""


@functools.cache
def sandbox_mode(allow_rlimit_only: bool) -> str:
    """Decided once per process: a missing bubblewrap raises (loudly) unless rlimit-only is allowed."""
    return detect_mode(allow_rlimit_only)


class VerdictCache:
    """Identical harness + identical job -> the same verdict: skip the sandbox (~0.1 s a run) on repeats.

    Only runs that ended on their own are kept; a wall-clock kill may be machine load, so it is retried.
    """

    def __init__(self, size: int = 8192):
        self.size, self._items, self._lock = size, OrderedDict(), threading.Lock()  # episodes step on threads

    def run(self, job: str, limits: SandboxLimits, mode: str, harness: str = HARNESS) -> SandboxResult:
        """`harness` runs in the sandbox and reads `job` on stdin (the program and its tests)."""
        key = (harness, job)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        result = run_python(harness, stdin=job, limits=limits, mode=mode)
        if result.limit_hit != "wall":
            with self._lock:
                self._items[key] = result
                if len(self._items) > self.size:
                    self._items.popitem(last=False)
        return result


VERDICTS = VerdictCache()


@register_env("code")
class CodeEnv(Environment):
    """Options: `allow_rlimit_only` (run without bubblewrap, see opd_sao.sandbox), `wall_s` per run,
    `tests` hidden inputs per task, `eval_fraction` of the task space held out."""

    slow_steps = True  # every step runs a program in the sandbox

    def __init__(self, allow_rlimit_only: bool = False, wall_s: float = 3.0, tests: int = 3,
                 eval_fraction: float = 0.2):
        self.allow_rlimit_only, self.tests, self.eval_fraction = allow_rlimit_only, tests, eval_fraction
        self.limits = SandboxLimits(wall_s=wall_s, cpu_s=1, memory_mb=256, max_processes=8, output_bytes=16 * 1024)
        self.task, self.score = None, 0.0

    def _all_tasks(self, split: str) -> list[dict]:
        out = []
        for spec, expr, f in FORMS:
            for a in range(2, 10):
                for b in range(1, 10):
                    task_id = f"code-{spec.format(a=a, b=b)}"
                    if (random.Random(task_id).random() < self.eval_fraction) != (split == "eval"):
                        continue
                    inputs = random.Random(f"{task_id}-inputs").sample(range(-9, 20), self.tests)
                    out.append({"id": task_id, "spec": spec.format(a=a, b=b), "solution": expr.format(a=a, b=b),
                                "inputs": inputs, "expected": [str(f(a, b, x)) for x in inputs]})
        return out

    def make_tasks(self, split: str, n: int, seed: int) -> list[dict]:
        return shuffled(self._all_tasks(split), n, seed)

    def reset(self, task: dict) -> str:
        self.task, self.score = task, 0.0
        return f"# f(x) = {task['spec']}\n{STARTER}"

    def step(self, action: str) -> tuple[str, float, bool]:
        job = json.dumps({"source": STARTER + action, "inputs": self.task["inputs"]})
        try:
            result = VERDICTS.run(job, self.limits, sandbox_mode(self.allow_rlimit_only))
            passed, feedback = grade_outputs(result, self.task["inputs"], self.task["expected"])
        except Exception as err:  # noqa: BLE001  an infrastructure failure is a failed step, never a crash
            logger.warning("code env: sandbox run failed: %r", err)
            passed, feedback = 0, f"# sandbox error: {type(err).__name__}\n"
        score = passed / len(self.task["inputs"])
        reward, self.score = score - self.score, score
        return feedback, reward, score == 1.0

    def reference_actions(self, task: dict) -> list[str]:
        return [f"print({task['solution']})"]

    def noop_action(self, task: dict) -> str:
        return "pass"

    def corpus(self, n: int = 2000) -> list[str]:
        """Prompts, programs and the feedback lines the model will read, without running the sandbox."""
        texts = []
        for task in self.make_tasks("train", n, seed=0):
            x, want = task["inputs"][0], task["expected"][0]
            texts += [self.reset(task), *self.reference_actions(task), f"# x={x}: got {want}0, want {want}\n",
                      f"# x={x}: NameError: name 'y' is not defined\n", "# x=1: SyntaxError: invalid syntax\n"]
        return texts


def harness_outputs(result: SandboxResult, n: int) -> tuple[Optional[list], str]:
    """The harness's per-test [stdout, error] list (None when it broke or hit a limit) and, if None, why."""
    lines = result.stdout.strip().splitlines()
    try:
        outputs = json.loads(lines[-1]) if result.status == "ok" else None
    except (IndexError, json.JSONDecodeError):
        outputs = None
    if not isinstance(outputs, list) or len(outputs) != n:
        return None, f"{result.limit_hit} limit" if result.limit_hit else "no result (the program broke the harness)"
    return outputs, ""


def grade_outputs(result: SandboxResult, inputs: list, expected: list[str]) -> tuple[int, str]:
    """(tests passed, observation naming the first failure) of a HARNESS run: stdout must equal the expected."""
    outputs, why = harness_outputs(result, len(inputs))
    if outputs is None:
        return 0, f"# {why}\n"
    feedback = ""
    passed = 0
    for x, want, (out, error) in zip(inputs, expected, outputs):
        got = out.strip()
        if error is None and got == want:
            passed += 1
        elif not feedback:
            shown = error or f"got {got.splitlines()[0][:20] if got else 'nothing'}, want {want}"
            feedback = f"# x={x}: {shown[:60]}\n"
    return passed, feedback
