"""`reward: constraints`: instruction following with verifiable constraints (IFEval-style), on the contract of
envs/rewards.py.

A row carries a list of constraints (a metadata field, `constraints` by default: `metadata_keys: [constraints]`),
each a dict with a `kind` and its parameter:

  lowercase               no upper-case letter, and at least one letter
  min_words / max_words   `n`: at least / at most n words (whitespace-separated)
  include / exclude       `word`: the word appears / does not appear (whole word, any case)
  no_commas               no `,`
  start_with / end_with   `phrase`: the response (stripped) starts / ends with it, verbatim
  bullets                 `n`: exactly n lines that start with `- ` or `* `
  quoted                  the whole response (stripped) is wrapped in double quotes

Scored strictly: 1 when every constraint holds, else 0 (IFEval's strict prompt-level accuracy). A fraction would pay a
response for the constraints that an empty or off-topic answer meets anyway (no commas, at most n words). The
response is read after the last verbatim copy of the prompt (envs/answers.py), so an echoed prompt is held to
the constraints with nothing: data whose every row has a constraint that nothing fails (include, min_words,
end_with, bullets, quoted) passes the validity check's echo and no-op probes. `stats` counts failures per kind.
"""
from __future__ import annotations

import re
from collections import Counter

from opd_sao.envs.answers import after_prompt
from opd_sao.envs.rewards import Reward, Verdict, register_reward
from opd_sao.errors import UsageError

BULLET = re.compile(r"^\s*[-*] ", re.M)


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.I) is not None


# kind -> (its parameter, or None; the check of a stripped response against that parameter)
CHECKS = {
    "lowercase": (None, lambda text, _: text == text.lower() and any(ch.isalpha() for ch in text)),
    "min_words": ("n", lambda text, n: len(text.split()) >= n),
    "max_words": ("n", lambda text, n: len(text.split()) <= n),
    "include": ("word", lambda text, word: _has_word(text, word)),
    "exclude": ("word", lambda text, word: not _has_word(text, word)),
    "no_commas": (None, lambda text, _: "," not in text),
    "start_with": ("phrase", lambda text, phrase: text.startswith(phrase)),
    "end_with": ("phrase", lambda text, phrase: text.endswith(phrase)),
    "bullets": ("n", lambda text, n: len(BULLET.findall(text)) == n),
    "quoted": (None, lambda text, _: len(text) >= 2 and text[0] == text[-1] == '"'),
}


def failed_constraints(constraints: list, response: str, task_id: str = "?") -> list[str]:
    """The kinds of the constraints `response` fails (in order); a malformed constraint is refused in one line."""
    if not isinstance(constraints, list) or not constraints:
        raise UsageError(f"constraints reward: task {task_id!r}: the constraints must be a non-empty list")
    text, failed = response.strip(), []
    for constraint in constraints:
        kind = constraint.get("kind") if isinstance(constraint, dict) else None
        if kind not in CHECKS:
            raise UsageError(f"constraints reward: task {task_id!r}: unknown constraint {constraint!r} (kinds: "
                             f"{', '.join(CHECKS)})")
        param, check = CHECKS[kind]
        value = constraint.get(param) if param else None
        if param and not isinstance(value, int if param == "n" else str):
            raise UsageError(f"constraints reward: task {task_id!r}: constraint {kind!r} needs {param!r} "
                             f"({'an integer' if param == 'n' else 'a string'}), got {constraint!r}")
        if not check(text, value):
            failed.append(kind)
    return failed


@register_reward("constraints")
class ConstraintsReward(Reward):
    """1 when the response meets every constraint of its row (task["metadata"][`key`]), else 0."""

    needs = ("answer",)  # the reference answer that meets them: the SFT warm start's and the validity oracle's

    def __init__(self, key: str = "constraints"):
        self.key = key
        self.failures: Counter = Counter()

    def score(self, task: dict, response: str) -> Verdict:
        metadata = task.get("metadata") or {}
        if self.key not in metadata:
            raise UsageError(f"constraints reward: task {task.get('id')!r} has no metadata field {self.key!r} "
                             f"(add it to the dataset env's metadata_keys)")
        failed = failed_constraints(metadata[self.key], after_prompt(response, task.get("prompt")), task.get("id"))
        self.failures.update(failed)
        return Verdict(float(not failed), info={"failed": failed})

    def stats(self) -> dict:
        return {"failed": dict(self.failures)} if self.failures else {}
