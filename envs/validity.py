"""The seeds' three-way environment validity check (000, section 6), run before any training.

On a sample of train and eval tasks: the oracle solution must score 1, a no-op must score 0, and the
untouched initial state (submitting nothing) must score 0, and every score must be a finite number in the
reward's range (a NaN fails no comparison, so it would pass the three checks). Two probes catch a verifier a policy
can game without solving anything (a math checker that evaluates the question's own expression): a response that
echoes the prompt verbatim must score 0, and so must one that restates the prompt's arithmetic expression
(envs/answers.py: `66 - 8` for "Calculate 66 - 8.", bare and as `\\boxed{66 - 8}`); the restate probe is
skipped on a task whose prompt holds no expression, or whose reference's final answer is itself an expression (a
task that asks for one). The probes run wherever the oracle check runs: every environment with oracle actions,
i.e. a verifier reward. A verifier that fails any of these would reward the wrong thing, so an environment that
fails is refused at stage start. Environments without
oracle actions (`Environment.oracle_actions`: by default the reference actions) have no oracle to check: the check is skipped. A stochastic reward (a noisy judge) is
replayed: the oracle must score 1 at least once, the no-op and the initial state never.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from opd_sao.envs.answers import prompt_expression, unevaluated
from opd_sao.envs.dataset.rewards import marked_answer
from opd_sao.envs.rewards import BadScore
from opd_sao.errors import UsageError

STOCHASTIC_REPLAYS = 64  # a noisy judge passing a good answer 1 time in 5 still misses all 64 with p ~ 1e-6
CHECKS = {"oracle": "the oracle does not score 1", "noop": "a no-op scores above 0",
          "initial": "the untouched initial state scores above 0", "echo": "echoing the prompt scores above 0",
          "restate": "restating the prompt's expression scores above 0",
          "reward": "the reward is not a finite number in its range"}


@dataclass
class ValidityReport:
    env: str
    tasks: list[str]  # the task ids checked
    failures: dict[str, list[str]] = field(default_factory=lambda: {name: [] for name in CHECKS})
    skipped: str = ""  # why the check does not apply, if it does not
    bad_scores: list[str] = field(default_factory=list)  # the refusals of scores outside the reward's range
    empty_splits: list[str] = field(default_factory=list)  # a split without tasks: nothing to train or evaluate on
    data_problems: list[str] = field(default_factory=list)  # Environment.data_problems: empty files, shared ids

    @property
    def ok(self) -> bool:
        return not any(self.failures.values()) and not self.empty_splits and not self.data_problems

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}

    def describe(self) -> str:
        """One line: which checks failed on which task ids."""
        if self.ok:
            return f"environment {self.env!r} passes its validity check on {len(self.tasks)} tasks"
        parts = [*self.data_problems, *(f"its {split} split has no tasks" for split in self.empty_splits)]
        for name, ids in self.failures.items():
            if ids:
                shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
                parts.append(f"{CHECKS[name]} on {len(ids)}/{len(self.tasks)} tasks ({shown})")
        first = f" (first: {self.bad_scores[0]})" if self.bad_scores else ""
        return f"environment {self.env!r} fails its validity check: " + "; ".join(parts) + first


def play(env, task: dict, actions: list[str]) -> float:
    """Total reward of an episode that submits `actions` in order, stopping when the environment is done."""
    env.reset(task)
    total = 0.0
    for action in actions:
        _, reward, done = env.step(action)
        total += reward
        if done:
            break
    return total


def probes(prompt: str, oracle: list[str]) -> dict[str, list[list[str]]]:
    """The gaming probes of one task: episodes that answer with the prompt, or with its expression restated."""
    out = {"echo": [[prompt]]}
    expression = prompt_expression(prompt)
    if expression and not (oracle and unevaluated(marked_answer(oracle[-1]) or oracle[-1])):
        out["restate"] = [[expression], [f"\\boxed{{{expression}}}"]]
    return out


def check_environment(name: str, env_factory, n: int = 16, seed: int = 0) -> ValidityReport:
    """Oracle, no-op, initial state and the gaming probes on up to n tasks, half from each split; fresh environment
    per play."""
    probe = env_factory()
    problems = probe.data_problems()
    train, held_out = probe.make_tasks("train", n - n // 2, seed), probe.make_tasks("eval", max(1, n // 2), seed)
    tasks = train + held_out[: n // 2]
    report = ValidityReport(name, [t["id"] for t in tasks])
    report.empty_splits = [split for split, got in (("train", train), ("eval", held_out)) if not got]
    report.data_problems = problems
    oracles = [probe.oracle_actions(t) for t in tasks]
    if not tasks or all(o is None for o in oracles):
        report.skipped = "no tasks" if not tasks else "no oracle actions: the reward is not a binary verifier"
        return report
    replays = STOCHASTIC_REPLAYS if probe.stochastic_reward else 1
    for task, oracle in zip(tasks, oracles):
        plays = [("oracle", oracle or []), ("noop", [probe.noop_action(task)]), ("initial", [""])]
        plays += [(check, actions) for check, tries in probes(probe.reset(task), oracle or []).items() for actions in tries]
        for check, actions in plays:
            if task["id"] in report.failures[check]:
                continue
            try:
                scores = [play(env_factory(), task, actions) for _ in range(replays)]
            except BadScore as err:
                scores = [math.nan]
                report.bad_scores.append(str(err))
            if not all(math.isfinite(s) for s in scores):  # NaN fails no comparison below: caught here
                if task["id"] not in report.failures["reward"]:
                    report.failures["reward"].append(task["id"])
            elif all(abs(s - 1.0) > 1e-6 for s in scores) if check == "oracle" else any(s > 1e-6 for s in scores):
                report.failures[check].append(task["id"])
    return report


def require_valid(name: str, env_factory, n: int = 16, seed: int = 0) -> ValidityReport:
    """Stage start: refuse (one line, naming the failing task ids) an environment that fails the check."""
    report = check_environment(name, env_factory, n, seed)
    if not report.ok:
        raise UsageError(report.describe() + "; refusing to train on it (see `opd-sao validate-env`)")
    return report
