"""The chat env's quality judges, rewards on the contract of envs/rewards.py (`judge: rule`).

A judge answers one question, "is this response good?" (a score, 1 or 0 for these), so an environment can
combine it with other criteria: the chat env multiplies it by a style check (docs/design.md §2.6). Any registered
reward can judge chat (`judge: reward_model`: the dataset env's reward model, binary at its threshold, which the
chat env trains from its preference pairs when `path` holds none).
"""
from __future__ import annotations

import random
import string
import threading
from collections import Counter

from opd_sao.envs.rewards import Reward, Verdict, build_reward, register_reward
from opd_sao.errors import UsageError

ENDINGS = ".!?~"


def words_of(text: str) -> list[str]:
    return [w.strip(string.punctuation + "~") for w in text.lower().split() if w.strip(string.punctuation + "~")]


@register_reward("rule")
class RuleReward(Reward):
    """1 when on topic (names the task's "topic"), well formed (ends a sentence), not too short or long, not
    repetitive; else 0."""

    needs = ("topic",)

    def __init__(self, min_words: int = 3, max_words: int = 12, max_repeats: int = 2):
        self.min_words, self.max_words, self.max_repeats = min_words, max_words, max_repeats

    def score(self, task: dict, response: str) -> Verdict:
        text, words = response.strip(), words_of(response)
        return Verdict(float(task["topic"] in words
                             and self.min_words <= len(words) <= self.max_words
                             and text != "" and text[-1] in ENDINGS
                             and max(Counter(words).values()) <= self.max_repeats))


@register_reward("noisy")
class NoisyReward(Reward):
    """Another reward made inconsistent and topic-dependent, as an LLM judge is: a response the inner reward
    scores is scored 0 with probability `miss_rate` x the topic's harshness (fixed per topic, uniform in
    [0, 1]). Expected quality then depends on the prompt, which a per-state critic can learn and a global
    baseline cannot: the online-learning simulation (docs/design.md §2.6b, whose paper judge is an LLM) was run with it
    to see whether that lets SAO's critic recover faster (it did not, docs/benchmarks.md)."""

    stochastic = True

    def __init__(self, inner: str = "rule", inner_options: dict | None = None, miss_rate: float = 0.5,
                 seed: int = 0):
        if not 0 <= miss_rate <= 1:
            raise UsageError(f"noisy judge: miss_rate must be in [0, 1] (got {miss_rate})")
        self.inner = build_reward(inner, inner_options)
        self.verifier, self.needs = self.inner.verifier, self.inner.needs
        self.miss_rate, self.rng, self.rng_lock = miss_rate, random.Random(seed), threading.Lock()

    @staticmethod
    def harshness(task: dict) -> float:
        return random.Random(f"harshness-{task.get('topic', task['prompt'])}").random()

    def score(self, task: dict, response: str) -> Verdict:
        verdict = self.inner.checked(task, response)
        if verdict.score == 0:
            return verdict
        with self.rng_lock:
            draw = self.rng.random()
        return verdict if draw >= self.miss_rate * self.harshness(task) else Verdict(0.0)
