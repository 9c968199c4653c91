"""Progress of a stage as plain lines on stdout: readable in a log file, a pipe or a terminal alike.

A stepped task (SFT, critic pre-training, the training loop) prints a line every `every` steps, after its last
step, and whenever `interval_s` has passed since the last line; between steps, and during work with no steps
(evaluation, the consistency gate), a heartbeat thread prints the current state once `interval_s` has passed with
no line, so a run is never silent for longer than that. Each line: stage, task, step/steps, the task's own
figures (reward, loss), seconds per step and the ETA of the task.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional


def duration(seconds: float) -> str:
    """A short human duration: 42s, 3m05s, 2h07m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Task:
    """One stepped task: tqdm's `update` and `set_postfix`, which the SFT loop, critic pre-training and the RL
    loop call."""

    def __init__(self, progress: "StageProgress", what: str, total: int):
        self.progress, self.what, self.total = progress, what, total
        self.n = self.first = 0  # steps done; steps done before timing began (a resumed task's)
        self.postfix: dict[str, str] = {}
        self.started = progress.clock()
        self.shown_n = 0

    def update(self, n: int = 1) -> None:
        self.n += n
        if n > 1:  # a jump (a resumed task's steps done before): not timed
            self.first, self.started = self.n, self.progress.clock()
        if self.n - self.shown_n >= self.progress.every or self.n >= self.total:
            self.progress.emit(self.line())

    def set_postfix(self, **fields) -> None:
        self.postfix.update({k: str(v) for k, v in fields.items()})

    def line(self) -> str:
        self.shown_n = self.n
        parts = [f"{self.what} step {self.n}/{self.total}"] + [f"{k} {v}" for k, v in self.postfix.items()]
        done = self.n - self.first
        if done > 0:
            per_step = (self.progress.clock() - self.started) / done
            parts.append(f"{per_step:.2f} s/step, ETA {duration(per_step * max(0, self.total - self.n))}")
        return ", ".join(parts)


class StageProgress:
    """A stage's progress lines (`logging.progress`); disabled, it prints nothing and starts no thread."""

    def __init__(self, stage: str, *, enabled: bool = True, every: int = 10, interval_s: float = 30.0,
                 out: Optional[Callable[[str], None]] = None, clock: Callable[[], float] = time.monotonic):
        self.stage, self.enabled, self.every, self.interval_s = stage, enabled, max(1, every), interval_s
        self.out = out or (lambda line: print(line, file=sys.stdout, flush=True))
        self.clock = clock
        self._stack: list[tuple[str, object, float]] = []  # (what, Task or None, since)
        self._lock = threading.Lock()
        self._last_line = clock()
        self._stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None

    def emit(self, text: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._last_line = self.clock()
            self.out(f"[{self.stage}] {text}")

    @contextmanager
    def task(self, what: str, total: int) -> Iterator[Task]:
        """A stepped task; yields its tqdm-shaped counter."""
        task = Task(self, what, total)
        with self._entered(what, task):
            yield task

    @contextmanager
    def activity(self, what: str) -> Iterator[None]:
        """Work with no steps (an evaluation, a gate check): the heartbeat names it and how long it has run."""
        with self._entered(what, None):
            yield

    @contextmanager
    def _entered(self, what: str, task: Optional[Task]):
        with self._lock:
            self._stack.append((what, task, self.clock()))
        self._start_heartbeat()
        try:
            yield
        finally:
            with self._lock:
                self._stack.pop()

    def status(self) -> str:
        """What the stage is doing now: the innermost stepped task's line, then the work under way inside it."""
        with self._lock:
            stack = list(self._stack)
        last = max((i for i, (_, task, _) in enumerate(stack) if task is not None), default=-1)
        parts = [stack[last][1].line()] if last >= 0 else []
        now = self.clock()
        parts += [f"{what} running for {duration(now - since)}" for what, _, since in stack[last + 1:]]
        return "; ".join(parts) or "working"

    def _start_heartbeat(self) -> None:
        if not self.enabled or self._heartbeat is not None:
            return
        self._heartbeat = threading.Thread(target=self._beat, name=f"progress-{self.stage}", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(min(self.interval_s, 1.0)):
            with self._lock:
                quiet = self._stack and self.clock() - self._last_line >= self.interval_s
            if quiet:
                self.emit(self.status())

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
