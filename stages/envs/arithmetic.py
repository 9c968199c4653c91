"""Reasoning domain: integer arithmetic with a verifier (binary reward)."""
from __future__ import annotations

import random

from .base import ExactAnswerEnv, register_env


@register_env("arithmetic")
class ArithmeticEnv(ExactAnswerEnv):
    """`a+b=` (and `a-b=`, `a*b=` when listed in `ops`); the answer is checked exactly.

    A task is in the eval split when a stable hash of its operands says so, so train and eval never overlap.
    """

    def __init__(self, max_operand: int = 30, ops: str = "+", eval_fraction: float = 0.2):
        self.max_operand, self.ops, self.eval_fraction = max_operand, ops, eval_fraction

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
