"""Digit-string domains: small tasks a tiny model learns in minutes, distinct enough to need different teachers.

The tokenizer keeps digits apart, so every digit is one token and these tasks are token-level
manipulations: `digits_reverse` ("rev 4821=" -> "1284"), `digits_sort` ("sort 4821=" -> "1248") and
`digits_copy` ("copy 4821=" -> "4821"). A model fine-tuned on one of them scores near 0 on the others
(they answer the same kind of input differently), which is what the multi-teacher OPD demo needs.
Binary reward for an exact answer. A string is in the eval split when a stable hash says so, so the
splits never share a task.
"""
from __future__ import annotations

import itertools
import random

from opd_sao.errors import UsageError

from .base import ExactAnswerEnv, register_env


class DigitTaskEnv(ExactAnswerEnv):
    verb = ""

    def __init__(self, min_len: int = 3, max_len: int = 4, eval_fraction: float = 0.2):
        if not 1 <= min_len <= max_len <= 6:
            raise UsageError(f"need 1 <= min_len <= max_len <= 6, got {min_len}, {max_len}")
        self.min_len, self.max_len, self.eval_fraction = min_len, max_len, eval_fraction

    @staticmethod
    def solve(digits: str) -> str:
        raise NotImplementedError

    def all_tasks(self, split: str) -> list[dict]:
        tasks = []
        for length in range(self.min_len, self.max_len + 1):
            for combo in itertools.product("0123456789", repeat=length):
                digits = "".join(combo)
                in_eval = random.Random(f"digits-{digits}").random() < self.eval_fraction
                if in_eval == (split == "eval"):
                    tasks.append({"id": f"{self.verb}-{digits}", "prompt": f"{self.verb} {digits}=",
                                  "answer": self.solve(digits)})
        return tasks


@register_env("digits_reverse")
class DigitReverseEnv(DigitTaskEnv):
    verb = "rev"

    @staticmethod
    def solve(digits: str) -> str:
        return digits[::-1]


@register_env("digits_sort")
class DigitSortEnv(DigitTaskEnv):
    verb = "sort"

    @staticmethod
    def solve(digits: str) -> str:
        return "".join(sorted(digits))


@register_env("digits_copy")
class DigitCopyEnv(DigitTaskEnv):
    verb = "copy"

    @staticmethod
    def solve(digits: str) -> str:
        return digits
