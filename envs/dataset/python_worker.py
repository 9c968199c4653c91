"""The python reward's handler in its worker process (`worker_loop.py`): imports the reward function once, then
answers each {"task", "response"} job with {"score": a finite float, "info": a dict} or {"error": one line}.
Standalone (the stdlib only, as the math checker), so it starts fast; `import_function` is also the reward's,
which checks the name in the run. A process of its own so that a function that hangs can be killed at its deadline
(`timeout_s`); it sees the run's sys.path, so a function importable in the run is importable here.
"""
import importlib
import importlib.util
import json
import math
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


def handler(path: str, spec: str) -> Callable[[dict], dict]:
    sys.path[:] = json.loads(path)
    function = import_function(spec)

    def handle(job: dict) -> dict:
        out = function(job["task"], job["response"])
        info = {}
        if isinstance(out, (tuple, list)):
            if len(out) != 2 or not isinstance(out[1], dict):
                raise ValueError(f"must return a float or (float, dict), got {out!r:.80}")
            out, info = out
        return {"score": as_score(out), "info": json.loads(json.dumps(info, default=str))}

    return handle
