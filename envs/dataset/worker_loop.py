"""The loop of a reward's worker process (`rewards.Worker`): `python worker_loop.py FD HANDLER_FILE ARGS...`.

It loads HANDLER_FILE by path (math_worker.py, python_worker.py: stdlib-only scripts, so a worker starts fast and
nothing of ours lands on the reward's sys.path), builds its handler with `handler(*ARGS)`, then answers
{"id", "job"} lines read from the socket FD with {"id", ...the handler's dict} lines on the same socket. The
socket is the only channel: the reward's stdout and stderr (a `print`, a subprocess's output) go to a pipe the run
drains and counts, its stdin is empty, and FD is not inherited by subprocesses, so nothing the reward writes can
pass for an answer. A fork of the reward that returns from it exits here instead of answering. When the run's
end of the socket closes, the worker kills its whole process group (the run starts it in a session of its
own), so helpers the reward forked do not outlive the run. Ctrl-C is ignored: the run ends this process itself.
"""
import importlib.util
import json
import os
import signal
import socket
import sys


def one_line(err: BaseException) -> str:
    """`Type: message`, the message's first line, at most 300 characters."""
    text = f"{type(err).__name__}: {err}".splitlines()
    return (text[0] if text else type(err).__name__)[:300]


def flush_output() -> None:
    """Flushes the reward's stdout and stderr, which are block-buffered into a pipe unless PYTHONUNBUFFERED is set,
    so a print is counted (and its first line logged) when the call ends, not 8 KB later or when the worker dies."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # a reward that closed or replaced the stream
            pass


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd, handler_file, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    os.set_inheritable(fd, False)
    channel = socket.socket(fileno=fd)
    spec = importlib.util.spec_from_file_location("_opd_sao_worker_handler", handler_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    handle, me = module.handler(*args), os.getpid()
    for line in channel.makefile("rb"):
        request = json.loads(line)
        try:
            answer = handle(request["job"])
        except BaseException as err:  # sys.exit and KeyboardInterrupt in the reward included: an answer, not a death
            answer = {"error": one_line(err)}
        if os.getpid() != me:  # a fork made by the reward came back through here: only the worker answers
            os._exit(0)
        flush_output()  # what the call printed is in the run's pipe before its answer is on the socket
        channel.sendall((json.dumps({"id": request["id"], **answer}) + "\n").encode())
    os.killpg(0, signal.SIGKILL)  # the run is gone: take whatever the reward started with us


if __name__ == "__main__":
    main()
