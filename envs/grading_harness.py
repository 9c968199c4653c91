"""The grading harness: runs in the sandbox as its main program, with the stdlib only (`envs/grading.py`).

It grades a model-written program without ever running it in its own interpreter, so the program cannot reach
the tests, the results or the line that reports them:
- assert tests run HERE; the program runs in a child interpreter, and its functions are called over a pipe,
  arguments and results crossing as plain data (None, bool, int, float, str, bytes, complex, list, tuple, set,
  frozenset, dict, by exact type): an object that lies about equality cannot cross;
- stdin/stdout tests run the program once per input in a fresh process, stdin the input, stdout a file: forked
  from a runner interpreter that compiled the program but never ran it, and that holds no nonce and no expected
  output (RUNNER below);
- the program's output is never echoed (a program may print 100 KB), and the child's stdout and stderr are
  not the sandbox's;
- the result is one line that starts with a nonce the job brings on stdin; this process is not dumpable, so a
  program of the same uid cannot read the nonce out of it (/proc/PID/mem, fd, environ) to forge that line.

Job (stdin, JSON): {"nonce", "source", "kind": "asserts", "tests": [str]} or {"nonce", "source", "kind": "io",
"inputs": [str], "expected": [str]}. Result: `NONCE {"passed": "1101", "first_failure": [index, shown, error]}`
(a character per test; shown: what a failing program printed, against what was wanted; null when all passed).
"""
import ctypes
import io
import json
import os
import subprocess
import sys
from contextlib import ExitStack, redirect_stdout

RESPONSE_BYTES = 16 << 20  # the largest value a program function may return

# The program's side: defines the functions, then answers calls. Shares the codec below with the harness.
CODEC = r'''
import json, math
SCALARS = (type(None), bool, int, str)
def enc(v, depth=0):
    if depth > 100:
        raise ValueError("nested more than 100 deep")
    t = type(v)
    if t in SCALARS:
        return v
    if t is float:
        return v if math.isfinite(v) else {"$f": repr(v)}
    if t is list:
        return [enc(x, depth + 1) for x in v]
    tags = {tuple: "$t", set: "$s", frozenset: "$fs"}
    if t in tags:
        return {tags[t]: [enc(x, depth + 1) for x in v]}
    if t is dict:
        return {"$d": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"$b": v.hex()}
    if t is complex:
        return {"$c": [v.real, v.imag]}
    raise TypeError(f"a {t.__name__} cannot be passed between the program and its tests (plain data only)")
def dec(v):
    if type(v) is list:
        return [dec(x) for x in v]
    if type(v) is not dict:
        return v
    (tag, x), = v.items()
    if tag == "$f":
        return float(x)
    if tag in ("$t", "$s", "$fs"):
        return {"$t": tuple, "$s": set, "$fs": frozenset}[tag](dec(y) for y in x)
    if tag == "$d":
        return {dec(k): dec(y) for k, y in x}
    return bytes.fromhex(x) if tag == "$b" else complex(*x)
def describe(err):
    text = str(err)
    return f"{type(err).__name__}: {text}"[:300] if text else type(err).__name__
'''

PROGRAM_SIDE = CODEC + r'''
import os, sys
requests, answers = os.fdopen(int(sys.argv[1]), "r"), os.fdopen(int(sys.argv[2]), "w")
def answer(message):
    try:
        line = json.dumps(message)
    except BaseException as err:
        line = json.dumps(["err", describe(err)])
    answers.write(line + "\n")
    answers.flush()
namespace = {"__name__": "__main__"}
try:
    exec(compile(json.loads(requests.readline()), "main.py", "exec"), namespace)
except BaseException as err:
    answer(["err", describe(err)])
    raise SystemExit(0)
names = {}
for name, value in list(namespace.items()):
    if name.startswith("__"):
        continue
    if type(value).__name__ == "module":
        names[name] = ["module", value.__name__]
    elif callable(value):
        names[name] = ["call"]
    else:
        try:
            names[name] = ["data", enc(value)]
        except BaseException:
            pass
answer(["ok", names])
for line in requests:
    try:
        name, args, kwargs = json.loads(line)
        result = ["ok", enc(namespace[name](*dec(args), **dec(kwargs)))]
    except BaseException as err:
        result = ["err", describe(err)]
    answer(result)
'''
_codec: dict = {}
exec(CODEC, _codec)  # the child's enc, dec, describe, here too (one definition for both sides)
enc, dec, describe = _codec["enc"], _codec["dec"], _codec["describe"]


class ProgramGone(Exception):
    """The program's process ended or answered out of bounds: every test from here on fails."""


class Program:
    """The program in a child interpreter; `call` runs one of its functions on plain data."""

    def __init__(self, source: str):
        requests_r, self.requests = os.pipe()
        self.answers, answers_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", PROGRAM_SIDE, str(requests_r), str(answers_w)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     pass_fds=(requests_r, answers_w))
        os.close(requests_r)
        os.close(answers_w)
        self.out, self.inp = os.fdopen(self.requests, "w"), os.fdopen(self.answers, "r")
        self.error, self.names = None, {}
        status, value = self._ask(source)
        if status == "ok":
            self.names = value
        else:
            self.error = value

    def _ask(self, message):
        try:
            self.out.write(json.dumps(message) + "\n")
            self.out.flush()
        except (BrokenPipeError, OSError):
            raise ProgramGone("the program exited") from None
        line = self.inp.readline(RESPONSE_BYTES)
        if not line.endswith("\n"):
            self.proc.kill()
            raise ProgramGone("the program exited" if not line else "the program returned more than 16 MB")
        try:
            status, value = json.loads(line)
        except ValueError:
            raise ProgramGone("the program's answer was not readable") from None
        return status, value

    def call(self, name: str, args: tuple, kwargs: dict):
        status, value = self._ask([name, enc(list(args)), enc(kwargs)])
        if status != "ok":
            raise RuntimeError(f"in {name}: {value}")
        return dec(value)

    def namespace(self) -> dict:
        """What the tests see: proxies for the program's functions, its data, the modules it imported."""
        import importlib

        namespace = {"__name__": "__main__"}
        for name, (kind, *value) in self.names.items():
            if kind == "call":
                namespace[name] = lambda *args, _name=name, **kwargs: self.call(_name, args, kwargs)
            elif kind == "data":
                namespace[name] = dec(value[0])
            else:
                try:
                    namespace[name] = importlib.import_module(value[0])
                except ImportError:
                    pass
        return namespace


def run_asserts(source: str, tests: list) -> list:
    try:
        program = Program(source)
    except ProgramGone as gone:
        return [[False, "", str(gone)]] * len(tests)
    if program.error is not None:
        return [[False, "", program.error]] * len(tests)
    namespace, results, compiled = program.namespace(), [], {}
    with redirect_stdout(io.StringIO()) as printed:  # a test's prints are not the program's output
        for i, test in enumerate(tests):
            try:
                if test not in compiled:
                    compiled[test] = compile(test, "test.py", "exec")
                exec(compiled[test], namespace)
                results.append([True, "", None])
            except ProgramGone as gone:
                results += [[False, "", str(gone)]] * (len(tests) - i)
                break
            except BaseException as err:  # the test failed, whatever it raised
                results.append([False, "", describe(err)])
            printed.seek(0)
            printed.truncate()
    program.proc.kill()
    return results


# The io side: a clean interpreter (the runner) compiles the program once, then per input forks a child that runs
# it on that input's own stdin, stdout and stderr files and closes every other; the runner writes each child's exit
# status. A fork of an interpreter that has never run the program is as fresh as a new interpreter, for ~5 ms of
# CPU instead of ~13. The runner is the program's side (same uid, dumpable): it holds nothing the program may not
# see, not the nonce, not the expected outputs, and a status it is made to forge could only pass a run whose
# output was right anyway (the program can exit 0 itself).
RUNNER = r'''
import gc, os, sys
statuses, source, *files = map(int, sys.argv[1:])
with open(source) as f:
    source = f.read()
try:
    program = compile(source, "main.py", "exec")
except BaseException as err:  # raised by every run instead, as a fresh interpreter would
    program = err
gc.freeze()  # a run's collections then leave the runner's objects, and the pages they share, alone
for first in range(0, len(files), 3):
    pid = os.fork()
    if pid == 0:
        break
    for fd in files[first:first + 3]:
        os.close(fd)
    os.write(statuses, b"%d\n" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
else:
    raise SystemExit
for target, fd in enumerate(files[first:first + 3]):
    os.dup2(fd, target)
os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the status pipe, the other inputs' files
sys.argv = ["main.py"]
if isinstance(program, BaseException):
    raise program
exec(program, {"__name__": "__main__"})
'''
RUNNER_INPUTS = 100  # inputs per runner: it holds their three files each until their turn


def scratch_file():
    """A nameless file in /tmp (the sandbox's private tmpfs): tempfile.TemporaryFile, less ~5 ms of imports."""
    return open(os.open("/tmp", os.O_RDWR | os.O_TMPFILE, 0o600), "w+b")


def run_io(source: str, inputs: list, expected: list) -> list:
    """Each input in a fresh process (forked by a runner), with its own stdin, stdout and stderr files, as when
    each had its own interpreter; files the program writes stay in the work dir for the next input."""
    results = []
    with scratch_file() as program:
        program.write(source.encode())
        for first in range(0, len(inputs), RUNNER_INPUTS):
            program.seek(0)
            results += run_inputs(program.fileno(), *(part[first:first + RUNNER_INPUTS] for part in (inputs, expected)))
    return results


def run_inputs(program: int, inputs: list, expected: list) -> list:
    """One runner's share of the inputs."""
    results = []
    with ExitStack() as files:
        runs = [[files.enter_context(scratch_file()) for _ in range(3)] for _ in inputs]
        for (stdin, _, _), value in zip(runs, inputs):
            stdin.write(f"{value}\n".encode())
            stdin.seek(0)
        fds = [file.fileno() for run in runs for file in run]
        status_r, status_w = os.pipe()
        runner = subprocess.Popen([sys.executable, "-I", "-S", "-c", RUNNER, str(status_w), str(program), *map(str, fds)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  pass_fds=(status_w, program, *fds))
        os.close(status_w)
        with os.fdopen(status_r) as statuses:
            for (_, out, err), want in zip(runs, expected):
                try:
                    returncode = int(statuses.readline())
                except ValueError:  # the runner died (a program can kill its parent) or was made to write garbage
                    results.append([False, f"got nothing, want {want[:20]}", "the program's runner died"])
                    continue
                out.seek(0)
                got = out.read(1 << 20).decode(errors="replace").strip()
                err.seek(0)
                last_words = err.read()[-2000:].decode(errors="replace").strip().splitlines()
                error = (last_words[-1][:300] if last_words else f"exit status {returncode}") if returncode else None
                shown = f"got {got.splitlines()[0][:20] if got else 'nothing'}, want {want[:20]}"
                results.append([error is None and got == want, shown, error])
    runner.kill()
    runner.wait()
    return results


def main() -> None:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the program cannot read this process
    job = json.loads(sys.stdin.read())
    nonce = job.pop("nonce")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the job's file is not left open for anyone
    if job["kind"] == "asserts":
        results = run_asserts(job["source"], job["tests"])
    else:
        results = run_io(job["source"], job["inputs"], job["expected"])
    first = next(([i, *result[1:]] for i, result in enumerate(results) if not result[0]), None)
    summary = {"passed": "".join("1" if result[0] else "0" for result in results), "first_failure": first}
    os.write(1, f"\n{nonce} {json.dumps(summary)}\n".encode())


if __name__ == "__main__":
    main()
