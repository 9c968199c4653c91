"""The environment protocol and its registry.

An environment is a class registered by name and chosen in YAML (`env: arithmetic`). One instance
plays one episode: `reset(task)` gives the first observation (the prompt), `step(action)` gives
(observation, reward, done). Tasks are plain dicts with a unique "id".

An environment name is also a domain name (evaluation tables, OPD `domains:`). One class can be several
domains through a label after a colon: `dataset:gsm8k` and `dataset:mbpp` are both the `dataset` class,
each with the options of the stage that trains on it, and count as two domains.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Optional

from opd_sao.registry import Registry, check_keywords


class EnvironmentRegistry(Registry):
    """Looks `name:label` up as `name` (the label only tells domains of one class apart)."""

    def get(self, name: str):
        return super().get(name.split(":", 1)[0])

    def __contains__(self, name: str) -> bool:
        return super().__contains__(name.split(":", 1)[0])


ENVIRONMENTS: Registry[type["Environment"]] = EnvironmentRegistry("environment")
register_env = ENVIRONMENTS.register


class Environment(ABC):
    # True when `step` takes real time (a sandboxed program): rollouts then step it on a worker thread
    # while the engine keeps generating for other episodes, instead of stalling the batch.
    slow_steps = False
    # True when the same action can score differently on replay (a noisy judge): the validity check then
    # replays every episode, requiring the oracle to score 1 at least once and the others never to score.
    stochastic_reward = False
    # True when the texts of this domain come from the options (a data file) rather than the class: the
    # pipeline then trains the tiny model's tokenizer on the corpus of every configured instance too.
    corpus_from_options = False
    # True when the reward follows training progress (the chat env's style schedule): the RL stage passes
    # `train_step`, a callable giving the trainer's step count, to its training episodes' environments (SFT,
    # evaluation and validity checks build it without).
    reads_train_step = False
    # True when the environment runs a model (a reward-model judge): stages pass the run's `device`.
    reads_device = False

    @classmethod
    def check_options(cls, options: dict) -> None:
        """Raise ValueError for `env_options` the constructor would refuse; the pipeline checks every stage's
        before any work. An environment with nested options (the chat env's judge) checks those too."""
        check_keywords(cls, options)

    @classmethod
    def for_prompts(cls, options: dict) -> "Environment":
        """An instance whose tasks and prompts (`make_tasks`, `reset`, `where`) are those of `cls(**options)`, built
        without what only scoring needs: the one prompts are checked on before the first stage (the chat env's
        would otherwise load, or first train, its reward model)."""
        return cls(**options)

    @classmethod
    def data_files(cls, options: dict) -> list[str]:
        """The files the environment reads its tasks from, given its options (a run records their hashes, and a
        resume refuses them changed); [] for an environment whose tasks are its own."""
        return []

    def data_problems(self) -> list[str]:
        """What is wrong with the environment's data as a whole (rows are checked one by one): the validity check
        refuses the environment for any of these, at stage start, before any work."""
        return []

    @abstractmethod
    def make_tasks(self, split: str, n: int, seed: int) -> list[dict]:
        """`split` is "train" or "eval"; the two never share a task."""

    @abstractmethod
    def reset(self, task: dict) -> str: ...

    @abstractmethod
    def step(self, action: str) -> tuple[str, float, bool]: ...

    def where(self, task: dict) -> str:
        """Where the task comes from, for an error message about it (a file-backed environment names the row)."""
        return f"task {task['id']!r}"

    def reference_actions(self, task: dict) -> Optional[list[str]]:
        """Oracle actions that solve the task (SFT warm start, validity checks); None if unknown."""
        return None

    def oracle_actions(self, task: dict) -> Optional[list[str]]:
        """Actions the validity check requires to score 1: by default the reference actions. An environment
        whose reward is a score rather than a verifier (a reward model, an LLM judge) returns None: its
        references still teach (SFT), but nothing guarantees they score 1."""
        return self.reference_actions(task)

    def noop_action(self, task: dict) -> str:
        return ""

    def training_summary(self, rewards: list[float], settle: int = 0) -> dict:
        """What the RL stage's summary adds for this environment, given the mean reward of every step (`settle`:
        the first steps after a change whose batches may hold rollouts scored before it); {} for nothing."""
        return {}

    def corpus(self, n: int = 2000) -> list[str]:
        """Texts typical of this domain, to train the embedded tiny model's tokenizer."""
        texts = []
        for task in self.make_tasks("train", n, seed=0):
            texts.append(self.reset(task))
            texts.extend(self.reference_actions(task) or [])
        return texts


class ExactAnswerEnv(Environment):
    """Single-turn tasks `{"id", "prompt", "answer"}`: reward 1 for exactly the answer, the answer is the oracle.

    Subclasses list their tasks in `all_tasks(split)`; `make_tasks` samples from it.
    """

    task: Optional[dict] = None

    @abstractmethod
    def all_tasks(self, split: str) -> list[dict]: ...

    def make_tasks(self, split: str, n: int, seed: int) -> list[dict]:
        return shuffled(self.all_tasks(split), n, seed)

    def reset(self, task: dict) -> str:
        self.task = task
        return task["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        return "", float(action.strip() == self.task["answer"]), True

    def reference_actions(self, task: dict) -> list[str]:
        return [task["answer"]]


def shuffled(tasks: list[dict], n: int, seed: int) -> list[dict]:
    """`n` tasks of the list in a seeded random order (the usual `make_tasks`)."""
    tasks = list(tasks)
    random.Random(seed).shuffle(tasks)
    return tasks[:n]


def sample_tasks(tasks: list[dict], seed: int):
    """An endless shuffled stream over the task list."""
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order
