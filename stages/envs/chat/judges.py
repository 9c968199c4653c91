"""Judges: pluggable quality scorers for open-ended responses, registered by name and chosen in YAML.

A judge answers one binary question, "is this response good?", so an environment can combine it
with other binary criteria (the chat env multiplies it by a style check, docs/design.md §2.6). Judges are
built once per process per (name, options): an environment is created per episode and must stay
cheap, while a reward model is a network to load (or train) once.
"""
from __future__ import annotations

import random
import string
import threading
from abc import ABC, abstractmethod
from collections import Counter
from pathlib import Path

from opd_sao.registry import Registry

JUDGES: Registry[type["Judge"]] = Registry("judge")
register_judge = JUDGES.register

ENDINGS = ".!?~"


class Judge(ABC):
    stochastic = False  # True when the same response can be judged differently on another call
    # False for a learned judge: its verdicts are opinions with a held-out error rate, so no reference answer is
    # guaranteed to pass (a reward model at 95% accuracy fails 1 of 16 oracles about half the time, and which
    # one depends on the machine's floating point): the validity check then has no oracle to hold it to.
    verifier = True

    @abstractmethod
    def quality(self, task: dict, response: str) -> bool:
        """`task` is the environment's task dict (at least "prompt"); True when the response is good."""


def words_of(text: str) -> list[str]:
    return [w.strip(string.punctuation + "~") for w in text.lower().split() if w.strip(string.punctuation + "~")]


@register_judge("rule")
class RuleJudge(Judge):
    """On topic (names the task's "topic"), well formed (ends a sentence), not too short or long, not repetitive."""

    def __init__(self, min_words: int = 3, max_words: int = 12, max_repeats: int = 2):
        self.min_words, self.max_words, self.max_repeats = min_words, max_words, max_repeats

    def quality(self, task: dict, response: str) -> bool:
        text, words = response.strip(), words_of(response)
        return (task["topic"] in words
                and self.min_words <= len(words) <= self.max_words
                and text != "" and text[-1] in ENDINGS
                and max(Counter(words).values()) <= self.max_repeats)


@register_judge("reward_model")
class RewardModelJudge(Judge):
    """A trained Bradley-Terry reward model (`reward_model.py`); good = score above its calibrated threshold.

    The model must exist; an environment that can make one (the chat env trains one from its preference
    pairs when `path` holds none) does so before building the judge, so judges never import an environment.
    Not a verifier (`Judge.verifier`), as the dataset env's reward_model reward is not.
    """

    verifier = False

    def __init__(self, path: str, threshold: float | None = None, device: str | None = None):
        from .reward_model import RewardModel

        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"reward_model judge: no reward model at {path} (train one with `opd-sao reward-model`)")
        self.model = RewardModel(path, device)  # device: the run's, passed in by the chat env (None: auto)
        self.threshold = self.model.threshold if threshold is None else threshold

    def quality(self, task: dict, response: str) -> bool:
        return float(self.model.score([task["prompt"]], [response])[0]) > self.threshold


@register_judge("noisy")
class NoisyJudge(Judge):
    """Another judge made inconsistent and topic-dependent, as an LLM judge is: a response the inner judge
    accepts is rejected with probability `miss_rate` x the topic's harshness (fixed per topic, uniform in
    [0, 1]). Expected quality then depends on the prompt, which a per-state critic can learn and a global
    baseline cannot: the online-learning simulation (docs/design.md §2.6b, whose paper judge is an LLM) was run with it
    to see whether that lets SAO's critic recover faster (it did not, docs/benchmarks.md)."""

    stochastic = True

    def __init__(self, inner: str = "rule", inner_options: dict | None = None, miss_rate: float = 0.5,
                 seed: int = 0):
        if not 0 <= miss_rate <= 1:
            raise ValueError(f"noisy judge: miss_rate must be in [0, 1] (got {miss_rate})")
        self.inner = build_judge(inner, inner_options)
        self.verifier = self.inner.verifier
        self.miss_rate, self.rng, self.rng_lock = miss_rate, random.Random(seed), threading.Lock()

    @staticmethod
    def harshness(task: dict) -> float:
        return random.Random(f"harshness-{task.get('topic', task['prompt'])}").random()

    def quality(self, task: dict, response: str) -> bool:
        if not self.inner.quality(task, response):
            return False
        with self.rng_lock:
            draw = self.rng.random()
        return draw >= self.miss_rate * self.harshness(task)


def build_judge(name: str, options: dict | None = None) -> Judge:
    """The process-wide judge for (name, options), built on first use."""
    return JUDGES.build(name, options)
