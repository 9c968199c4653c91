"""Where a stage's time goes: seconds per named phase, for metrics.jsonl (per step) and summary.json (per stage).

`PhaseTimer.phase(name)` brackets a piece of work; phases nest exclusively (a weight sync inside the gate counts
as sync, not as both), so the phases of an interval never sum past its wall time. One thread's time: the trainer
thread's, which is the one that waits on rollouts, scores teachers, trains, syncs, saves and evaluates.
"""
from __future__ import annotations

import resource
import time
from contextlib import contextmanager
from typing import Callable, Iterator

# every metrics.jsonl line carries these (0 when the step spent nothing on one), so the lines have one form
PHASES = ("generation", "teacher", "critic", "policy", "sync", "checkpoint", "gate", "evaluation")


class PhaseTimer:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.totals: dict[str, float] = {}  # the whole stage
        self._step: dict[str, float] = {}  # since the last `step_phases()`
        self._stack: list[list] = []  # [name, start of its current stretch]
        self._step_start = clock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        now = self.clock()
        if self._stack:  # the enclosing phase pauses
            self._charge(self._stack[-1], now)
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = self.clock()
            self._charge(self._stack.pop(), now)
            if self._stack:
                self._stack[-1][1] = now

    def _charge(self, entry: list, now: float) -> None:
        name, since = entry
        for acc in (self.totals, self._step):
            acc[name] = acc.get(name, 0.0) + (now - since)

    def begin_steps(self) -> None:
        """The first step's interval starts now (what came before, the stage's setup, is in the totals only)."""
        self._step, self._step_start = {}, self.clock()

    def step_phases(self) -> dict[str, float]:
        """`time/<phase>` seconds since the previous call (every PHASES name, and any other phase spent), and
        `time/step`: the wall time of that interval; then a new interval starts."""
        now = self.clock()
        spent = {**dict.fromkeys(PHASES, 0.0), **self._step}
        out = {f"time/{name}": round(s, 4) for name, s in spent.items()}
        out["time/step"] = round(now - self._step_start, 4)
        self._step, self._step_start = {}, now
        return out

    def stage_totals(self) -> dict[str, float]:
        return {name: round(s, 2) for name, s in sorted(self.totals.items(), key=lambda kv: -kv[1])}


def peak_memory() -> dict[str, float]:
    """The process's peak resident memory so far (ru_maxrss: it never goes down, so a stage's figure is the peak up
    to its end), and on CUDA the peak allocated since the last `reset_peak_memory()` (one stage's)."""
    out = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}  # KiB on Linux
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def process_cpu_s() -> float:
    """CPU-seconds of this process and of its children that have ended (sandboxed programs, reward workers): what a
    stage cost whatever else shared the machine, and however long the run was stopped (wall time counts both)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
