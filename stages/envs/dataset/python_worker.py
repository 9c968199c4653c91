"""The python reward's worker process: imports the reward function once, then reads {"task", "response"} lines and
writes {"out": the function's return value} or {"error": one line} lines. Standalone (the stdlib only, as the
math worker), so it starts fast; `import_function` is also the reward's, which checks the name in the run. A process of its own so that a function
that hangs can be killed at its deadline (`timeout_s`); it sees the run's sys.path (argv[1]), so a function
importable in the run is importable here. Ctrl-C is ignored: the run ends this process itself.
"""
import importlib
import importlib.util
import json
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


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = json.loads(sys.argv[1])
    function = import_function(sys.argv[2])
    for line in sys.stdin:
        job = json.loads(line)
        try:
            answer = {"out": function(job["task"], job["response"])}
            text = json.dumps(answer, default=float)  # numpy scalars too
        except Exception as err:  # the reward's own failure, reported to the run
            text = json.dumps({"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]})
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
