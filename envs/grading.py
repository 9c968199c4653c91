"""Grading a model-written program against tests, outside the program (`grading_harness.py` runs in the sandbox).

The harness is the sandbox's main program; the model's program runs in a child interpreter it cannot escape to
the harness from (docs/reliability.md, "code tests"). `graded` gives a fresh nonce per run and accepts only the
result line that starts with it, so nothing the program prints can pass for a result. `VERDICTS` caches verdicts.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import secrets
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Optional

from opd_sao.envs.sandbox import SandboxLimits, detect_mode, run_python

HARNESS = (Path(__file__).parent / "grading_harness.py").read_text()

Verdict = tuple[int, Optional[list], str]  # (tests passed, [index, shown output, error] of the first failure, why)
TEST_WALL_S, TEST_CPU_S = 2e-4, 1e-4  # the harness's own time per test, added to the program's limits


@functools.cache
def sandbox_mode(allow_rlimit_only: bool) -> str:
    """Decided once per process: a missing bubblewrap raises (loudly) unless rlimit-only is allowed."""
    return detect_mode(allow_rlimit_only)


def graded(job: dict, n: int, limits: SandboxLimits, mode: str) -> tuple[Verdict, bool]:
    """One harness run: (its verdict, whether it ended on its own rather than by the wall clock). A run without
    a result line has passed nothing, and `why` says what stopped it. The limits grow by the harness's own
    time and output per test (a character), so 50,000 passing tests are not a limit the program hit, and an io
    job's process limit by the runner that forks the program per input (grading_harness.py).
    `job`: {"source", "kind": "asserts", "tests"} or {"source", "kind": "io", "inputs", "expected"}."""
    nonce = secrets.token_hex(16)
    limits = dataclasses.replace(limits, wall_s=limits.wall_s + n * TEST_WALL_S,
                                 cpu_s=limits.cpu_s + math.ceil(n * TEST_CPU_S), output_bytes=limits.output_bytes + n,
                                 max_processes=limits.max_processes + (job["kind"] == "io"))
    result = run_python(HARNESS, stdin=json.dumps({"nonce": nonce, **job}), limits=limits, mode=mode,
                        stdlib_only=True)
    for line in result.stdout.splitlines():
        if line.startswith(f"{nonce} "):
            summary = json.loads(line[len(nonce) + 1:])
            if len(summary["passed"]) == n:
                return (summary["passed"].count("1"), summary["first_failure"], ""), True
    why = f"{result.limit_hit} limit" if result.limit_hit else "no result (the harness broke)"
    return (0, None, why), result.limit_hit != "wall"


class VerdictCache:
    """Identical job -> the same verdict: skip the sandbox (~0.1 s a run) on repeats.

    Only runs that ended on their own are kept; a wall-clock kill may be machine load, so it is retried.
    """

    def __init__(self, size: int = 8192):
        self.size, self._items, self._lock = size, OrderedDict(), threading.Lock()  # episodes step on threads

    def run(self, job: dict, n: int, limits: SandboxLimits, mode: str) -> Verdict:
        key = (json.dumps(job, sort_keys=True), limits, mode)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        verdict, keep = graded(job, n, limits, mode)
        if keep:
            with self._lock:
                self._items[key] = verdict
                if len(self._items) > self.size:
                    self._items.popitem(last=False)
        return verdict


VERDICTS = VerdictCache()


def feedback(verdict: Verdict, labels: list[str]) -> str:
    """The observation after a run: "" when everything passed, else `# LABEL: what went wrong` for the first
    failing test (`labels[i]` names test i: `x=3`, an assert), or `# why` when the run gave no result."""
    passed, first, why = verdict
    if first is None:
        return f"# {why}\n" if why else ""
    index, shown, error = first
    return f"# {labels[index]}: {(error or shown)[:60]}\n"
