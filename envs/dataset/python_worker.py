"""The python reward's handler in its worker process (`worker_loop.py`): imports the reward function once, then
answers each {"task", "response"} job with {"score": a finite float, "info": a dict} or {"error": one line}.
Standalone (the stdlib only, as the math checker), so it starts fast; `import_function` is also the reward's,
which checks the name in the run. It sees the run's sys.path, so a function importable in the run is importable here.

A call's limit is this process's CPU time (the job's "cpu_s"), never the wall clock, so a loaded machine slows a call
but cannot turn a score into a timeout: past it the call is interrupted (ITIMER_PROF) and answered {"over_cpu": true}
(also when the function catches the interruption), and a call stuck in C code, where no Python handler runs, is
killed by the kernel at about twice that (RLIMIT_CPU's soft limit: SIGXCPU). A process of its own because the kill
takes the process and signals reach only a main thread. What the function waits for without running (a sleep, a
subprocess, a socket) is the run's wall-clock backstop's (`PythonReward.backstop_s`).
"""
import importlib
import importlib.util
import json
import math
import resource
import signal
import sys
from pathlib import Path
from typing import Callable


def import_function(spec: str) -> Callable:
    """`package.module:function`, or `path/to/file.py:function`."""
    if ":" not in spec:
        raise ValueError(f"python reward: function {spec!r} must look like module:function or file.py:function")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            if not Path(where).is_file():
                raise ValueError(f"python reward: file {where!r} does not exist")
            module_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as err:
        raise ValueError(f"python reward: cannot import {where!r}: {err}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"python reward: {where!r} has no function {name!r}")
    return function


def as_score(value) -> float:
    """A finite float from what the function returned: a number (an int, a float, a numpy scalar), else ValueError."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise ValueError(f"must return a float or (float, dict), got {value!r:.80}")
    try:
        score = float(value)
    except OverflowError:
        raise ValueError(f"returned {str(value)[:40]}..., too large for a float") from None
    if not math.isfinite(score):
        raise ValueError(f"returned {score}, not a finite number")
    return score


class OverCpu(BaseException):
    """A call past its CPU time. Not an Exception, so that a function's `except Exception` does not swallow it."""


def handler(path: str, spec: str) -> Callable[[dict], dict]:
    sys.path[:] = json.loads(path)
    function = import_function(spec)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGXCPU kill leaves no core file
    fired = []

    def over_cpu(signum, frame):
        fired.append(signum)
        raise OverCpu

    signal.signal(signal.SIGPROF, over_cpu)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]

    def handle(job: dict) -> dict:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        kill_at = math.ceil(usage.ru_utime + usage.ru_stime + 2 * job["cpu_s"]) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (kill_at if hard == resource.RLIM_INFINITY else min(kill_at, hard), hard))
        fired.clear()
        try:
            try:
                signal.setitimer(signal.ITIMER_PROF, job["cpu_s"])
                out = function(job["task"], job["response"])
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        except OverCpu:  # here, or where the timer fired between the function's return and the line above
            pass
        finally:
            resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
        if fired:  # even when the function caught it and returned
            return {"over_cpu": True}
        info = {}
        if isinstance(out, (tuple, list)):
            if len(out) != 2 or not isinstance(out[1], dict):
                raise ValueError(f"must return a float or (float, dict), got {out!r:.80}")
            out, info = out
        return {"score": as_score(out), "info": json.loads(json.dumps(info, default=str))}

    return handle
