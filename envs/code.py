"""Agent domain: write a one-line Python program, run it in the sandbox on hidden tests, fix it on failure.

Tasks are short and templated so the embedded tiny model can learn them on a CPU: the prompt is a
starter file whose comment states f(x) in math notation (`3(x+1)`), the model writes the line that
prints f(x) (`print(3*(x+1))`). The program runs once per action in the sandbox against all hidden
inputs (fed on stdin, one run per input, by the grading harness: `grading.py`), and the reward is the pass fraction. On a
failure the observation names the first failing input (or the error) and the model may try again
within `rollout.max_turns`; each step's reward is the change in pass fraction, so an episode's total
reward is the pass fraction of its last program.
"""
from __future__ import annotations

import logging
import random

from opd_sao.envs.grading import VERDICTS, feedback, sandbox_mode
from opd_sao.envs.sandbox import WALL_S, SandboxLimits

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

@register_env("code")
class CodeEnv(Environment):
    """Options: `allow_rlimit_only` (run without bubblewrap, see opd_sao.envs.sandbox), `wall_s` per run (a hang
    catcher for a program that waits without running, sandbox.WALL_S; the 1 s CPU limit is what bounds a program's
    work, under any load), `tests` hidden inputs per task, `eval_fraction` of the task space held out."""

    slow_steps = True  # every step runs a program in the sandbox

    def __init__(self, allow_rlimit_only: bool = False, wall_s: float = WALL_S, tests: int = 3,
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
        inputs, expected = self.task["inputs"], self.task["expected"]
        job = {"kind": "io", "source": STARTER + action, "inputs": [str(x) for x in inputs], "expected": expected}
        try:
            verdict = VERDICTS.run(job, len(inputs), self.limits, sandbox_mode(self.allow_rlimit_only))
            passed, observation = verdict[0], feedback(verdict, [f"x={x}" for x in inputs])
        except Exception as err:  # an infrastructure failure is a failed step, never a crash
            logger.warning("code env: sandbox run failed: %r", err)
            passed, observation = 0, f"# sandbox error: {type(err).__name__}\n"
        score = passed / len(self.task["inputs"])
        reward, self.score = score - self.score, score
        return observation, reward, score == 1.0

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
