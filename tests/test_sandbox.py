"""Sandbox tests against real bubblewrap and real subprocesses. No check times a run: each checks which limit
ended it and that its processes are gone; where a test waits, it waits for an event, bounded only by HANG_S."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest
from launchers import HANG_S

from opd_sao.envs import sandbox
from opd_sao.envs.sandbox import (
    SandboxLimits,
    SandboxUnavailableError,
    detect_mode,
    main,
    run_python,
)

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

# The wall limit is a hang catcher here: these programs end on their own or by another limit, and a busy machine
# must not cut one short. WALL_LIMITS is for programs only the wall limit stops (it stops them under any load).
LIMITS = SandboxLimits(wall_s=HANG_S, cpu_s=1)
WALL_LIMITS = SandboxLimits(wall_s=3, cpu_s=1)


def _processes_using(path: str) -> dict[int, str]:
    """Live processes whose cmdline, cwd or mounts mention `path` (a sandbox sees its work dir as a mount)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            seen = [cmdline.decode(errors="replace"), os.readlink(entry / "cwd"), (entry / "mountinfo").read_text()]
        except OSError:  # gone, or a zombie
            continue
        if any(path in text for text in seen):
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def _still_using(work: Path, within_s: float) -> dict[int, str]:
    """The processes still using `work` once they had `within_s` to exit (a killed process is gone only when the
    kernel has run it again: on a loaded machine, some time after its supervisor returned; rlimit mode's program is
    init's child, killed with the group but reaped by the host's init after run_python has returned). The programs
    these tests leave to a kill sleep an hour, so one still there after HANG_S was never killed."""
    deadline = time.monotonic() + within_s
    while (left := _processes_using(str(work))) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


@pytest.fixture(autouse=True)
def no_process_left_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Runs of this test get their work dirs under a unique path; nothing may still use it afterwards.

    (Other sessions may be running sandboxes on this machine at the same time.)
    """
    work = tmp_path / "sandbox-work"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    yield
    left = _still_using(work, within_s=HANG_S)
    assert not left, f"sandbox processes left behind: {left}"
    assert not list(work.iterdir()), "work dirs left behind"


def _run(code: str, limits: SandboxLimits = LIMITS, **kwargs) -> sandbox.SandboxResult:
    return run_python(code, limits=limits, **kwargs)


SUBPROCESS_BOMB = """
import subprocess, sys
children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"]) for _ in range(100)]
"""
FORK_BOMB_IGNORING_ERRORS = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
FILL_TMP = """
for i in range(64):
    with open(f"/tmp/f{i}", "wb") as f:
        f.write(b"x" * (1 << 20))
"""

HOSTILE = [  # a fork bomb that ignores its errors forks again as each child hits its CPU limit: only the wall stops it
    pytest.param("while True: pass", {"cpu"}, id="busy-loop"),
    pytest.param("import time\ntime.sleep(3600)", {"wall"}, id="sleep"),
    pytest.param("import os\nos.close(1)\nos.close(2)\nwhile True: pass", {"cpu"}, id="closed-pipes-loop"),
    pytest.param("import os\nwhile True: os.fork()", {"processes"}, id="fork-bomb"),
    pytest.param(SUBPROCESS_BOMB, {"processes"}, id="subprocess-bomb"),
    pytest.param(FORK_BOMB_IGNORING_ERRORS, {"processes", "cpu", "wall"}, id="fork-bomb-ignoring-errors"),
    pytest.param("import threading, time\nwhile True: threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()",
                 {"processes"}, id="thread-bomb"),  # fmt: skip
    pytest.param("import sys\nsys.stdout.write('x' * 100_000_000)", {"output"}, id="print-100mb"),
    pytest.param("import sys\nwhile True: sys.stderr.write('y' * 4096)", {"output"}, id="stderr-flood"),
    pytest.param("x = bytearray(1 << 30)", {"memory"}, id="alloc-1gb"),
    pytest.param("x = []\nwhile True: x.append(' ' * 10**6)", {"memory"}, id="alloc-loop"),
    pytest.param("open('big', 'wb').write(b'x' * (2 << 20))", {"file_size"}, id="big-file"),
    pytest.param(FILL_TMP, {"tmp"}, id="fill-tmp"),
]


@needs_bwrap
@pytest.mark.parametrize("code, expected", HOSTILE)
def test_hostile_program_is_contained(code: str, expected: set[str]) -> None:
    """The limit named is what ended the run; the autouse fixture checks that every process of it is gone."""
    tracemalloc.start()
    try:
        result = _run(code, WALL_LIMITS if "wall" in expected else LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.status == "failed"
    assert result.limit_hit in expected, result
    assert result.output_bytes <= LIMITS.output_bytes
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= LIMITS.output_bytes
    assert peak < 8 * LIMITS.output_bytes  # output is capped as it is read, never buffered whole
    if result.limit_hit in ("wall", "output"):
        assert result.exit_code is None


@needs_bwrap
def test_output_flood_is_cut_at_the_cap() -> None:
    """The supervisor kills a flood once it passes the cap (a flood left alone blocks on its full pipe until the wall
    limit, and would read `wall`), keeping exactly the cap."""
    result = _run("import sys\nsys.stdout.write('x' * 100_000_000)")
    assert (result.limit_hit, result.output_bytes, result.stdout) == ("output", LIMITS.output_bytes, "x" * (64 << 10))
    assert result.exit_code is None


@needs_bwrap
def test_ok_program() -> None:
    code = (
        "import os, sys\n"
        "print('hello', sys.stdin.read().strip())\n"
        "print(os.getcwd(), os.listdir('.'), os.getuid(), os.environ['HOME'])\n"
        "open('out.txt', 'w').write('writing my own dir is fine')\n"
        "print('oops', file=sys.stderr)\n"
    )
    result = _run(code, stdin="world\n")
    assert (result.status, result.exit_code, result.limit_hit) == ("ok", 0, None)
    assert result.stdout == "hello world\n/sandbox ['main.py'] 1000 /sandbox\n"
    assert result.stderr == "oops\n"
    assert result.output_bytes == len(result.stdout) + len(result.stderr)
    assert set(result.to_json()) >= {"status", "exit_code", "wall_s", "output_bytes", "limit_hit"}
    json.dumps(result.to_json())


@needs_bwrap
def test_stdlib_only_programs_start_without_site() -> None:
    """The grading harness runs `stdlib_only` (-I -S: ~50 ms less CPU a run); other programs keep site-packages."""
    code = "import sys\nprint(sys.flags.isolated, sys.flags.no_site, 'site' in sys.modules)"
    assert run_python(code, limits=LIMITS).stdout == "0 0 True\n"
    assert run_python(code, limits=LIMITS, stdlib_only=True).stdout == "1 1 False\n"


@needs_bwrap
@pytest.mark.parametrize(
    "code, exit_code",
    [
        pytest.param("raise ValueError('boom')", 1, id="raise"),
        pytest.param("import sys\nsys.exit(3)", 3, id="exit-3"),
        pytest.param("import os\nos.abort()", 134, id="abort"),
        pytest.param("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", 137, id="sigkill"),
        pytest.param("def f(): f()\nf()", 1, id="recursion"),
    ],
)
def test_crash_reports_exit_code(code: str, exit_code: int) -> None:
    result = _run(code)
    assert (result.status, result.exit_code, result.limit_hit) == ("failed", exit_code, None)


@needs_bwrap
@pytest.mark.parametrize(
    "code",
    [
        pytest.param("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)", id="setsid-child"),
        pytest.param(
            "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'],"
            " start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)",
            id="detached-subprocess",
        ),
    ],
)
def test_background_children_die_with_the_program(code: str) -> None:
    result = _run(code)
    assert (result.status, result.exit_code) == ("ok", 0)
    assert result.wall_s < LIMITS.wall_s  # not held (by the children's copies of its pipes) until the wall limit


@needs_bwrap
@pytest.mark.parametrize("where", ["/etc", "/usr", "/root", "/", "cwd", "tmp_path"])
def test_cannot_write_outside_work_dir(where: str, tmp_path: Path) -> None:
    directory = {"cwd": os.getcwd(), "tmp_path": str(tmp_path)}.get(where, where)
    target = Path(directory, f"opd_sao_sandbox_{uuid.uuid4().hex}")
    result = _run(f"open({str(target)!r}, 'w').write('pwned')")
    try:
        assert result.status == "failed"
        assert "Traceback" in result.stderr
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


@needs_bwrap
def test_private_tmp_does_not_reach_the_host() -> None:
    target = Path("/tmp", f"opd_sao_sandbox_{uuid.uuid4().hex}")
    result = _run(f"open({str(target)!r}, 'w').write('x')")
    try:
        assert result.status == "ok"
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


@needs_bwrap
@pytest.mark.parametrize("path", [__file__, "/etc/shadow"], ids=["this-test-file", "etc-shadow"])
def test_cannot_read_host_secrets(path: str) -> None:
    result = _run(f"print(open({path!r}).read())")
    assert result.status == "failed"
    assert "FileNotFoundError" in result.stderr or "PermissionError" in result.stderr


@pytest.fixture
def host_listener():
    """A TCP server on the host's loopback that the sandbox must not reach."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0)
        yield server


@needs_bwrap
@pytest.mark.parametrize(
    "target", ["host-loopback", "1.1.1.1:53", "8.8.8.8:443", "dns"]
)  # fmt: skip
def test_no_network(target: str, host_listener: socket.socket) -> None:
    if target == "dns":
        code = "import socket\nprint(socket.getaddrinfo('example.com', 80))"
    else:
        address = host_listener.getsockname() if target == "host-loopback" else target.split(":")
        code = f"import socket\nsocket.create_connection(({address[0]!r}, {int(address[1])}), timeout=2)"
    result = _run(code)
    assert result.status == "failed"
    assert "Traceback" in result.stderr
    with pytest.raises(BlockingIOError):
        host_listener.accept()


@pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=needs_bwrap), "rlimit"])
def test_clean_environment(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPD_SAO_SECRET", "hunter2")
    result = _run("import json, os\nprint(json.dumps(dict(os.environ)))", mode=mode)
    env = json.loads(result.stdout)
    assert "OPD_SAO_SECRET" not in env and "hunter2" not in result.stdout
    assert set(env) <= {"PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "PWD"}
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"


def test_missing_bwrap_refuses_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sandbox.BWRAP_ENV, "/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap.*allow_rlimit_only"):
        run_python("print('hi')")
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
        detect_mode(allow_rlimit_only=False)


def test_missing_bwrap_falls_back_when_allowed(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv(sandbox.BWRAP_ENV, "/nonexistent/bwrap")
    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        assert detect_mode(allow_rlimit_only=True) == "rlimit"
    assert "rlimit-only" in caplog.text
    result = _run("print('hi')", mode="rlimit")
    assert (result.status, result.stdout) == ("ok", "hi\n")


def test_broken_bwrap_is_loud(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: creating new namespace failed' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv(sandbox.BWRAP_ENV, str(fake))
    with pytest.raises(SandboxUnavailableError, match="creating new namespace failed"):
        run_python("print('hi')")


@pytest.mark.parametrize(
    "code, status, limit_hit",
    [
        pytest.param("print('hi')", "ok", None, id="ok"),
        pytest.param("import time\ntime.sleep(3600)", "failed", "wall", id="sleep"),
        pytest.param("import sys\nwhile True: sys.stdout.write('x' * 4096)", "failed", "output", id="output-flood"),
        pytest.param("x = bytearray(1 << 30)", "failed", "memory", id="alloc-1gb"),
        pytest.param("open('big', 'wb').write(b'x' * (2 << 20))", "failed", "file_size", id="big-file"),
    ],
)
def test_rlimit_mode(code: str, status: str, limit_hit: str | None) -> None:
    result = _run(code, limits=WALL_LIMITS if limit_hit == "wall" else LIMITS, mode="rlimit")
    assert (result.status, result.limit_hit) == (status, limit_hit)


@needs_bwrap
def test_supervisor_failure_takes_the_sandbox_down(monkeypatch: pytest.MonkeyPatch) -> None:
    run_python("pass")  # probe the sandbox before breaking the supervisor

    def broken_supervise(*args, **kwargs):
        raise RuntimeError("supervisor bug")

    monkeypatch.setattr(sandbox, "_supervise", broken_supervise)
    with pytest.raises(RuntimeError, match="supervisor bug"):  # at once: waiting for the program would pass
        run_python("import time\ntime.sleep(3600)")  # pytest's 900 s timeout (no wall-clock margin of ours)


def test_misuse_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="mode must be 'bwrap' or 'rlimit'"):
        run_python("", mode="docker")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="SandboxLimits.cpu_s must be > 0"):
        SandboxLimits(cpu_s=0)


@needs_bwrap
def test_cli_prints_one_json_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = tmp_path / "prog.py"
    program.write_text("print('from file')\nraise SystemExit(2)\n")
    assert main(["run", str(program), "--wall-s", str(HANG_S), "--memory-mb", "128"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    report = json.loads(out)
    assert report["status"] == "failed" and report["exit_code"] == 2 and report["limit_hit"] is None
    assert report["stdout"] == "from file\n" and report["output_bytes"] == 10
    assert isinstance(report["wall_s"], float)


def test_cli_misuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(tmp_path / "missing.py")])
    assert exit_info.value.code == 2
    assert "no such file" in capsys.readouterr().err


# --- faults (issue 15): the work dir's size, nested user namespaces, deep trees, a killed supervisor ---

WRITE_PAST_TMP = """
import os
stat = os.statvfs('.')
print(stat.f_blocks * stat.f_frsize >> 20, flush=True)
for i in range(64):
    with open(f"f{i}", "wb") as f:  # each file stays under file_size_mb
        f.write(b"x" * (1 << 19))
print("wrote 32 MB")
"""


@needs_bwrap
def test_work_dir_is_a_size_capped_tmpfs() -> None:
    """/sandbox was a bind of a host dir: 32 MB (400 MB in the probe) were written and the run ended ok."""
    result = _run(WRITE_PAST_TMP, dataclasses.replace(LIMITS, tmp_mb=4))
    assert (result.status, result.limit_hit, result.stdout) == ("failed", "tmp", "4\n"), result


NESTED_USERNS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000 | 0x00020000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS
    raise SystemExit(f"unshare: {os.strerror(ctypes.get_errno())}")
open("/proc/self/setgroups", "w").write("deny")
open("/proc/self/uid_map", "w").write("0 1000 1")
open("/proc/self/gid_map", "w").write("0 1000 1")
if libc.mount(b"none", b"/tmp", b"tmpfs", 0, b"size=64m") != 0:
    raise SystemExit(f"mount: {os.strerror(ctypes.get_errno())}")
for i in range(64):
    with open(f"/tmp/f{i}", "wb") as f:
        f.write(b"x" * (1 << 19))
print("escaped: 32 MB in a tmpfs of my own")
"""


@needs_bwrap
def test_nested_user_namespace_is_refused() -> None:
    """As root, bwrap's --disable-userns was not used: a program made its own user and mount namespaces and
    mounted a tmpfs outside memory_mb and tmp_mb."""
    result = _run(NESTED_USERNS, dataclasses.replace(LIMITS, tmp_mb=4))
    assert "escaped" not in result.stdout, result
    assert result.status == "failed" and result.stderr.startswith("unshare: "), result


DEEP_TREE = """
import os
os.symlink({canary!r}, "link-to-host-dir")
for _ in range(3000):
    os.mkdir("d")
    os.chdir("d")
open("leaf", "w").write("x")
os.symlink({canary!r}, "link")
os.chmod(".", 0)
print("deep")
"""


@pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=needs_bwrap), "rlimit"])
def test_deep_tree_is_cleaned_up(mode: str, tmp_path: Path, monkeypatch, capsys) -> None:
    """3,000 nested dirs (deeper than PATH_MAX and the recursion limit): os.walk raised RecursionError, no JSON
    came out and the work dir stayed. Symlinks out of the tree are removed, never followed."""
    canary = tmp_path / "canary"
    canary.mkdir(mode=0o755)
    (canary / "keep").write_text("keep")
    program = tmp_path / "deep.py"
    program.write_text(DEEP_TREE.format(canary=str(canary)))
    if mode == "rlimit":
        monkeypatch.setenv(sandbox.BWRAP_ENV, "/nonexistent/bwrap")
    assert main(["run", str(program), "--allow-rlimit-only", "--wall-s", str(HANG_S)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["status"], report["stdout"]) == ("ok", "deep\n"), report
    assert (canary / "keep").read_text() == "keep" and canary.stat().st_mode & 0o777 == 0o755
    # the autouse fixture checks that the work dir is gone


SUPERVISOR = """
import sys, threading
sys.path.insert(0, sys.argv[1])
import sandbox  # the module alone (stdlib only) starts in milliseconds; the stages package imports torch
limits = sandbox.SandboxLimits(wall_s=3600)  # only the supervisor's death ends these runs
kwargs = {"limits": limits, "mode": sys.argv[3]}
if sys.argv[3] == "bwrap":
    sandbox.detect_mode(allow_rlimit_only=False)  # as the code env does once; probes the sandbox
runs = [threading.Thread(target=sandbox.run_python, args=("import time; time.sleep(3600)",), kwargs=kwargs)
        for _ in range(int(sys.argv[2]))]
print("go", flush=True)
for run in runs:
    run.start()
for run in runs:
    run.join()
"""


def _programs_running(work: Path) -> int:
    return sum(cmdline.endswith(" -s main.py ") for cmdline in _processes_using(str(work)).values())


def _kill_supervisor(work: Path, runs: int, delay_s: float | None, mode: str = "bwrap", within_s: float = 0.3) -> int:
    """Start a supervisor with `runs` sandbox threads, kill -9 it `delay_s` after it starts them (None: once
    every program runs); returns how many processes still use the work dirs `within_s` later (before a sweep)."""
    env = {**os.environ, "TMPDIR": str(work)}
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(Path(sandbox.__file__).parent), str(runs), mode],
                            stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline() == b"go\n"
        if delay_s is not None:
            time.sleep(delay_s)
        deadline = time.monotonic() + HANG_S
        while delay_s is None and _programs_running(work) < runs and time.monotonic() < deadline:
            time.sleep(0.02)
        assert delay_s is not None or _programs_running(work) == runs
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    return len(_still_using(work, within_s))


def _next_start(work: Path, tmp_path: Path) -> None:
    """A fresh `sandbox run` (its first run sweeps what dead supervisors left)."""
    program = tmp_path / "ok.py"
    program.write_text("print('ok')")
    done = subprocess.run([sys.executable, sandbox.__file__, "run", str(program), "--wall-s", str(HANG_S)],
                          capture_output=True, env={**os.environ, "TMPDIR": str(work)}, timeout=HANG_S)
    assert json.loads(done.stdout)["status"] == "ok", done


@needs_bwrap
def test_supervisor_kill_9_leaves_nothing(tmp_path: Path) -> None:
    """kill -9 of the supervisor at 20 random times, half within 20 ms of bwrap starting, the rest up to 0.3 s
    later (sandbox set-up, program running): no process and no work dir is left once the next start has
    swept. Before: every kill left its work dir, and some a bwrap blocked for good."""
    work = Path(tempfile.gettempdir())  # the autouse fixture's per-test dir
    rng = random.Random(15)
    left_at_once = [_kill_supervisor(work, 1, rng.uniform(0, 0.02) if i % 2 else rng.uniform(0, 0.3))
                    for i in range(20)]
    _next_start(work, tmp_path)
    assert not _processes_using(str(work)), f"processes left behind (right after each kill: {left_at_once})"
    assert not list(work.iterdir()), "work dirs left behind"


@pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=needs_bwrap), "rlimit"])
def test_kill_9_of_a_threaded_supervisor_leaves_nothing(mode: str, tmp_path: Path) -> None:
    """As the agent stage runs them: 8 sandboxes on threads, supervisor killed while they run: everything
    goes at once (parent-death signals: bwrap's, and in rlimit mode the wrapper's); the next start removes
    the work dirs. Before: 8 work dirs were left, and in rlimit mode the 8 programs ran on."""
    work = Path(tempfile.gettempdir())  # their programs sleep an hour: one still there after HANG_S outlived it
    assert _kill_supervisor(work, 8, None, mode, within_s=HANG_S) == 0
    assert len(list(work.iterdir())) == 8
    _next_start(work, tmp_path)
    assert not _processes_using(str(work)) and not list(work.iterdir())


# --- the wall limit under load (issue 43): a hang catcher, not a bound on a correct program's work ---

STOP_S = 6.0  # longer than the old default wall limits (the code env's 3 s, code_tests' 5 s)


def _stopped_mid_run(score, stop_s: float = STOP_S):
    """Run score(name) on a thread; its program renames its process to `name`, then waits for a SIGCONT. Once that
    process shows, SIGSTOP it for `stop_s` (a program waiting for a CPU on a busy machine) and continue it.
    The program cannot end before the stop does. Returns what score returned."""
    name = f"stop-{uuid.uuid4().hex[:10]}"  # a process name (15 characters at most) no other test's program has
    results = []
    scoring = threading.Thread(target=lambda: results.append(score(name)))
    scoring.start()
    deadline, pid = time.monotonic() + HANG_S, None
    while pid is None and scoring.is_alive() and time.monotonic() < deadline:
        pid = next((int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _comm(p) == name), None)
        time.sleep(0.02)
    assert pid is not None, f"the program never showed (it ended with {results})"
    os.kill(pid, signal.SIGSTOP)
    time.sleep(stop_s)
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # the wall limit killed it while it was stopped (as it did at the old limits): its score says so
    scoring.join(HANG_S)
    return results[0]


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


def _waits_for_sigcont(name: str) -> str:
    """Python that, once, renames its process `name` (SIGCONT blocked first, so the continue cannot be lost) and
    waits for the SIGCONT; a file in the work dir says it did (an io job runs the program once per input)."""
    return ("import ctypes, os, signal\n"
            "if not os.path.exists('waited'):\n"
            "    open('waited', 'w').close()\n"
            "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCONT})\n"
            f"    ctypes.CDLL(None).prctl(15, {name.encode()!r})  # PR_SET_NAME\n"
            "    signal.sigwait({signal.SIGCONT})\n")


@needs_bwrap
def test_a_correct_program_stopped_past_the_old_wall_limit_still_passes_the_code_env() -> None:
    """Before: the code env's 3 s wall limit scored a correct program 0 when it waited for a CPU that long."""
    from opd_sao.envs.code import CodeEnv

    env = CodeEnv()
    task = env.make_tasks("train", 1, seed=0)[0]

    def step(name: str):
        env.reset(task)
        return env.step(_waits_for_sigcont(name) + env.reference_actions(task)[0])

    assert _stopped_mid_run(step) == ("", 1.0, True)


@needs_bwrap
def test_a_correct_program_stopped_past_the_old_wall_limit_still_passes_code_tests() -> None:
    """Before: code_tests' 5 s wall limit scored a correct program 0 when it waited for a CPU that long."""
    from opd_sao.envs.rewards import build_reward

    reward = build_reward("code_tests", {})
    task = {"id": "t", "tests": {"kind": "asserts", "asserts": ["assert f(1) == 2", "assert f(5) == 6"]}}
    verdict = _stopped_mid_run(lambda name: reward.score(task, _waits_for_sigcont(name) + "def f(x):\n    return x + 1\n"))
    assert (verdict.score, verdict.feedback) == (1.0, "")


@needs_bwrap
def test_a_program_that_sleeps_for_ever_is_still_ended_by_the_wall_limit() -> None:
    """The wall limit's one job: a program that waits without running (no CPU limit reaches it). The autouse
    fixture checks that its processes are gone."""
    from opd_sao.envs.code import CodeEnv
    from opd_sao.envs.rewards import build_reward

    env = CodeEnv(wall_s=2)
    task = env.make_tasks("train", 1, seed=0)[0]
    env.reset(task)
    sleeper = f"import time\ntime.sleep(3600)  # {uuid.uuid4().hex}\n"  # never a verdict cached by another run
    assert env.step(sleeper + env.reference_actions(task)[0]) == ("# wall limit\n", 0.0, False)
    verdict = build_reward("code_tests", {"wall_s": 2}).score(
        {"id": "t", "tests": {"kind": "asserts", "asserts": ["assert f(1) == 2"]}}, sleeper + "def f(x):\n    return x + 1\n")
    assert (verdict.score, verdict.feedback) == (0.0, "# wall limit\n")
