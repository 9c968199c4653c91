"""The python reward's worker process: imports the reward function once, then reads {"task", "response"} lines and
writes {"out": the function's return value} or {"error": one line} lines. A process of its own so that a function
that hangs can be killed at its deadline (`timeout_s`); it sees the run's sys.path (argv[1]), so a function
importable in the run is importable here. Ctrl-C is ignored: the run ends this process itself.
"""
import json
import signal
import sys

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = json.loads(sys.argv[1])
    from stages.envs.dataset.rewards import import_function

    function = import_function(sys.argv[2])
    for line in sys.stdin:
        job = json.loads(line)
        try:
            answer = {"out": function(job["task"], job["response"])}
            text = json.dumps(answer, default=float)  # numpy scalars too
        except Exception as err:  # noqa: BLE001  the reward's own failure, reported to the run
            text = json.dumps({"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]})
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
