"""The reward contract: a `Reward` scores one response to one task, registered by name and chosen in YAML.

One interface for every scorer: the dataset env's rewards (`reward: math`, dataset/rewards.py: exact, math,
code_tests, reward_model, judge, python) and the chat env's quality judges (`judge: rule`, chat/judges.py:
rule, noisy; any registered reward can judge). A reward returns a `Verdict`: a score, a finite number in its
`reward_range` ([0, 1] unless it declares another; `checked` refuses anything else, naming the task), plus the
observation for another turn when the reward allows retries (`multi_turn`). Its options are its constructor's
keyword arguments, typed by their annotations: `check_reward` refuses an unknown, missing or mistyped one before
any work. Rewards are built once per process per (name, options) by `build_reward`: an environment is created
per episode and must stay cheap, while a reward model is a network and a math checker a worker process.

`verifier` says whether the reference answer must score 1 (the validity check holds the environment to it):
false for learned or LLM judges, whose scores are opinions that no reference is guaranteed to win.
"""
from __future__ import annotations

import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

from pydantic import ValidationError, create_model

from opd_sao.config import format_error
from opd_sao.errors import OpdSaoError, UsageError
from opd_sao.registry import Registry, check_keywords

REWARDS: Registry[type["Reward"]] = Registry("reward")
register_reward = REWARDS.register


class RewardFailure(OpdSaoError, RuntimeError):
    """A reward that could not be computed (an LLM judge that kept failing) and was told to stop the run."""


class BadScore(ValueError):
    """A score that is not a finite number in the reward's declared range: the task fails loudly, never trains."""


@dataclass
class Verdict:
    score: float
    feedback: str = ""  # the next observation, for a reward that allows another turn
    info: dict = field(default_factory=dict)


class Reward(ABC):
    verifier = True  # the reference answer must score 1 (validity check)
    stochastic = False  # the same response can score differently on another call (a noisy judge)
    multi_turn = False  # a partial score may be followed by another attempt, with `feedback` as the observation
    slow = False  # a step takes real time (a sandbox run, a network call): rollouts step it on a worker thread
    needs: tuple[str, ...] = ()  # task fields every row must have ("answer", "tests")
    reward_range: tuple[float, float] = (0.0, 1.0)  # every score must be a finite number in it (`checked`)

    @abstractmethod
    def score(self, task: dict, response: str) -> Verdict: ...

    def reference(self, task: dict) -> Optional[str]:
        """The oracle response: the row's answer (a code task's reference solution)."""
        return task.get("answer")

    @classmethod
    def feedback_examples(cls) -> list[str]:
        """Observations this reward writes, for the tokenizer corpus."""
        return []

    def stats(self) -> dict:
        """Counters for the stage summary (failures, timeouts); {} when there is nothing to report."""
        return {}

    def checked(self, task: dict, response: str) -> Verdict:
        """`score`, refusing (BadScore, naming the task) a score that is not a finite number in `reward_range`:
        NaN passes every comparison, so it would pass the validity check and train."""
        verdict = self.score(task, response)
        low, high = self.reward_range
        if not isinstance(verdict.score, (int, float)) or not low <= verdict.score <= high:
            raise BadScore(f"{type(self).__name__} scored task {task.get('id')!r} {verdict.score!r}: a score must be "
                           f"a finite number in reward_range [{low}, {high}]")
        return verdict


def build_reward(name: str, options: Optional[dict] = None) -> Reward:
    """The process-wide reward for (name, options), built on first use."""
    return REWARDS.build(name, options)


def check_reward(name: str, options: Optional[dict], *, also: tuple[str, ...] = (),
                 where: str = "reward_options") -> type[Reward]:
    """The reward class `name` (KeyError when none is registered), after refusing (ValueError, one line naming
    `where`) options its constructor would refuse: unknown or missing keys, or a value not of its annotated type.
    Nothing is built. `also`: keys the caller consumes itself."""
    cls = REWARDS.get(name)  # KeyError naming the registered ones
    options = options or {}
    try:
        check_keywords(cls, options, also=also)
    except ValueError as err:
        raise UsageError(f"{where} of {name!r}: {err}") from None
    hints = typing.get_type_hints(cls.__init__)
    typed = {key: (hints[key], ...) for key in options if key in hints}
    try:
        create_model(f"{cls.__name__}Options", **typed).model_validate({key: options[key] for key in typed})
    except ValidationError as err:
        raise UsageError(f"{where} of {name!r}: {format_error(err)}") from None
    return cls
