"""Where a stage's time goes: seconds per named phase, for metrics.jsonl (per step) and summary.json (per stage).

`PhaseTimer.phase(name)` brackets a piece of work; phases nest exclusively (a weight sync inside the gate counts
as sync, not as both), so the phases of an interval never sum past its wall time. One thread's time: the trainer
thread's, which is the one that waits on rollouts, scores teachers, trains, syncs, saves and evaluates.
"""
from __future__ import annotations

import json
import resource
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from opd_sao.io.files import write_json

# every metrics.jsonl line carries these (0 when the step spent nothing on one), so the lines have one form
PHASES = ("generation", "teacher", "critic", "policy", "sync", "checkpoint", "gate", "evaluation")


class PhaseTimer:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.totals: dict[str, float] = {}  # the whole stage
        self._step: dict[str, float] = {}  # since the last `step_phases()`
        self._stack: list[list] = []  # [name, start of its current stretch]
        self._step_start = clock()
        self._lock = threading.Lock()  # StageCost reads the totals from its own thread
        self.listeners: list[Callable[[str], None]] = []  # called with a phase's name when it ends

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            now = self.clock()
            if self._stack:  # the enclosing phase pauses
                self._charge(self._stack[-1], now)
            self._stack.append([name, now])
        try:
            yield
        finally:
            with self._lock:
                now = self.clock()
                self._charge(self._stack.pop(), now)
                if self._stack:
                    self._stack[-1][1] = now
        for listener in self.listeners:  # a phase that ended well (after one that raised, its error goes on)
            listener(name)

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
        """Seconds per phase so far, the phase under way counted up to now."""
        with self._lock:
            totals = dict(self.totals)
            if self._stack:
                name, since = self._stack[-1]
                totals[name] = totals.get(name, 0.0) + (self.clock() - since)
        return _by_size(totals)


def _by_size(phases: dict[str, float]) -> dict[str, float]:
    return {name: round(s, 2) for name, s in sorted(phases.items(), key=lambda kv: -kv[1])}


class StageCost:
    """What a stage cost over every process that worked on it: a stage resumed after a kill (a preempted job, a
    machine's reboot) adds the earlier processes' wall time, CPU-seconds and phases to this one's, and its peak
    memory is the highest any of them reached. Work a killed process did after its last saved step is counted
    (it was spent, and done again). Kept in `path` (the run's costs/<stage>.json), rewritten whenever a checkpoint phase
    ends (a resume starts from a saved state, so its earlier share is on disk), every `every_s` seconds by a daemon
    thread, and at `close()`: a killed process loses at most the last `every_s` of its share."""

    def __init__(self, path: Path, timer: PhaseTimer, every_s: float = 10.0):
        self.path, self.timer = Path(path), timer
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.earlier = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.t0, self.cpu0 = time.perf_counter(), process_cpu_s()
        self._lock = threading.Lock()  # one writer at a time: the thread's save and close()'s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, args=(every_s,), name="stage-cost", daemon=True)
        self._thread.start()
        timer.listeners.append(lambda phase: phase == "checkpoint" and self.save())

    def totals(self) -> dict:
        """wall_s, cpu_s, phases_s, peak memory (peak_rss_mb; peak_cuda_mb on CUDA) and `processes`: how many
        processes the figures add up."""
        earlier = self.earlier
        phases = dict(earlier.get("phases_s", {}))
        for name, s in self.timer.stage_totals().items():
            phases[name] = phases.get(name, 0.0) + s
        peaks = {key: max(mb, earlier.get(key, 0.0)) for key, mb in peak_memory().items()}
        return {"wall_s": round(earlier.get("wall_s", 0.0) + time.perf_counter() - self.t0, 1),
                "cpu_s": round(earlier.get("cpu_s", 0.0) + process_cpu_s() - self.cpu0, 1),
                "phases_s": _by_size(phases), **peaks, "processes": earlier.get("processes", 0) + 1}

    def save(self) -> dict:
        with self._lock:
            totals = self.totals()
            write_json(self.path, totals)
        return totals

    def _keep(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.save()
            except OSError:  # a full disk: the stage's own writes fail and say so; these figures wait for the next
                pass

    def close(self) -> dict:
        """Stop the thread; save and return the totals (unsaved when the disk refuses them: a failing stage's
        error is the one to see)."""
        self._stop.set()
        self._thread.join()
        try:
            return self.save()
        except OSError:
            return self.totals()


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
