"""The seeds' three-way environment validity check (000, section 6), run before any training.

On a sample of train and eval tasks: the oracle solution must score 1, a no-op must score 0, and the
untouched initial state (submitting nothing) must score 0. A verifier that fails any of these would
reward the wrong thing, so an environment that fails is refused at stage start. Environments without
reference actions (judge-scored ones, e.g. chat) have no binary verifier to check: the check is skipped.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

CHECKS = {"oracle": "the oracle does not score 1", "noop": "a no-op scores above 0",
          "initial": "the untouched initial state scores above 0"}


@dataclass
class ValidityReport:
    env: str
    tasks: list[str]  # the task ids checked
    failures: dict[str, list[str]] = field(default_factory=lambda: {name: [] for name in CHECKS})
    skipped: str = ""  # why the check does not apply, if it does not

    @property
    def ok(self) -> bool:
        return not any(self.failures.values())

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}

    def describe(self) -> str:
        """One line: which checks failed on which task ids."""
        if self.ok:
            return f"environment {self.env!r} passes its validity check on {len(self.tasks)} tasks"
        parts = []
        for name, ids in self.failures.items():
            if ids:
                shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
                parts.append(f"{CHECKS[name]} on {len(ids)}/{len(self.tasks)} tasks ({shown})")
        return f"environment {self.env!r} fails its validity check: " + "; ".join(parts)


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


def check_environment(name: str, env_factory, n: int = 16, seed: int = 0) -> ValidityReport:
    """Oracle, no-op and initial state on up to n tasks, half from each split; fresh environment per play."""
    probe = env_factory()
    tasks = probe.make_tasks("train", n - n // 2, seed) + probe.make_tasks("eval", n // 2, seed)
    report = ValidityReport(name, [t["id"] for t in tasks])
    oracles = [probe.reference_actions(t) for t in tasks]
    if not tasks or all(o is None for o in oracles):
        report.skipped = "no tasks" if not tasks else "no reference actions: the reward is not a binary verifier"
        return report
    for task, oracle in zip(tasks, oracles):
        scores = {"oracle": play(env_factory(), task, oracle or []),
                  "noop": play(env_factory(), task, [probe.noop_action(task)]),
                  "initial": play(env_factory(), task, [""])}
        for check, score in scores.items():
            if (abs(score - 1.0) > 1e-6) if check == "oracle" else (score > 1e-6):
                report.failures[check].append(task["id"])
    return report


def require_valid(name: str, env_factory, n: int = 16, seed: int = 0) -> ValidityReport:
    """Stage start: refuse (one line, naming the failing task ids) an environment that fails the check."""
    report = check_environment(name, env_factory, n, seed)
    if not report.ok:
        raise ValueError(report.describe() + "; refusing to train on it (see `opd-sao validate-env`)")
    return report
