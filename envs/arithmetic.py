"""Reasoning domain: integer arithmetic with a verifier (binary reward)."""
from __future__ import annotations

import random

from .base import ExactAnswerEnv, register_env


@register_env("arithmetic")
class ArithmeticEnv(ExactAnswerEnv):
    """`a+b=` (and `a-b=`, `a*b=` when listed in `ops`); the answer is checked exactly.

    A task is in the eval split when a stable hash of its operands says so, so train and eval never overlap.
    """

    MAX_OPERAND = 999  # (999 + 1)^2 tasks per operation are built in memory; more never finishes

    def __init__(self, max_operand: int = 30, ops: str = "+", eval_fraction: float = 0.2):
        self.max_operand, self.ops, self.eval_fraction = max_operand, ops, eval_fraction

    @classmethod
    def check_options(cls, options: dict) -> None:
        """The values too (they size the task pool), before any work: a huge `max_operand` would build its
        (max_operand + 1)^2 tasks at stage start and never finish."""
        super().check_options(options)
        operand, ops = options.get("max_operand", 30), options.get("ops", "+")
        fraction = options.get("eval_fraction", 0.2)
        if type(operand) is not int or not 1 <= operand <= cls.MAX_OPERAND:
            raise ValueError(f"max_operand must be a whole number in 1..{cls.MAX_OPERAND} (got {operand!r})")
        if not isinstance(ops, str) or not ops or set(ops) - set("+-*") or len(set(ops)) < len(ops):
            raise ValueError(f"ops must be some of '+', '-', '*', each once (got {ops!r})")
        if type(fraction) not in (int, float) or not 0 < fraction < 1:
            raise ValueError(f"eval_fraction must be a number in (0, 1) (got {fraction!r})")

    def all_tasks(self, split: str) -> list[dict]:
        out = []
        for op in self.ops:
            for a in range(self.max_operand + 1):
                for b in range(self.max_operand + 1):
                    if op == "-" and b > a:
                        continue
                    in_eval = random.Random(f"{op}{a},{b}").random() < self.eval_fraction
                    if in_eval == (split == "eval"):
                        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
                        out.append({"id": f"arith-{a}{op}{b}", "prompt": f"{a}{op}{b}=", "answer": str(answer)})
        return out
