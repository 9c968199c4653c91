"""Sandbox for the model-written Python programs of the agent RL stage.

The reward is the fraction of hidden tests a program passes, so the program is
hostile by assumption: it may hang, fork-bomb, flood stdout, read or write the
host, or talk to the network.  Each run gets a bubblewrap sandbox (no network,
private PID/IPC/UTS/mount/user namespaces and no nested user namespace, read-only
system dirs, a size-capped tmpfs as work dir) plus rlimits set inside the sandbox
by a tiny wrapper before the program starts. Without bubblewrap we refuse to run
unless rlimit-only mode is asked for.

Nothing outlives its supervisor: bwrap runs with --die-with-parent, the program
only starts once it has told a live supervisor so (the `ready` pipe), and each
run first sweeps the work dirs (and any bwrap still using them) of supervisors
that died without cleaning up (kill -9). docs/reliability.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Literal

from opd_sao.errors import OpdSaoError

logger = logging.getLogger(__name__)

Mode = Literal["bwrap", "rlimit"]
LimitHit = Literal["wall", "cpu", "memory", "processes", "output", "file_size", "tmp"]

BWRAP_ENV = "OPD_SAO_BWRAP"  # path or name of the bwrap binary; tests point it elsewhere
SANDBOX_DIR = "/sandbox"  # the work dir as the program sees it
SANDBOX_UID = 1000  # uid/gid of the program inside the sandbox
# When we are root, the sandbox uid maps to this host uid: RLIMIT_NPROC is never
# enforced for host uid 0, even inside a user namespace.
HOST_UID = 65534
_KILL_GRACE_S = 2.0  # how long a killed sandbox may take to disappear
# Work dirs are named after their supervisor (PID namespace, pid and start time, so a reused pid is no
# match): a later run can tell the dirs of a supervisor that died without cleaning up.
WORKDIR_PREFIX = "opd-sao-sandbox-"
_WORKDIR_OWNER = re.compile(re.escape(WORKDIR_PREFIX) + r"(\d+)\.(\d+)\.(\d+)-")

# The sandbox's init (bwrap --as-pid-1; bwrap's own init would outlive bwrap and
# be left as a zombie on the host). The child sets the limits (NPROC only inside
# the user namespace, so it counts this sandbox alone), drops root, tells the
# parent the sandbox came up and becomes the program; init reaps everything and
# exits with the program's status (128+N for signal N). Its exit ends the sandbox.
# In rlimit mode (no bwrap --die-with-parent) init and program die with the
# supervisor by a parent-death signal.
_WRAPPER = """\
import os, resource, sys
flags = sys.argv[1]  # the program's interpreter flags: -s, or -IS for a stdlib-only program
ready, cpu, mem, nproc, fsize, uid, pdeathsig = map(int, sys.argv[2:9])
if pdeathsig:
    import ctypes
    prctl = ctypes.CDLL(None).prctl
    prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
program = os.fork()
if program == 0:
    for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
                            (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_FSIZE, fsize, fsize),
                            (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(res, (soft, hard))
    if uid >= 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if pdeathsig:
        prctl(1, 9)  # fork cleared it
    os.write(ready, b"1")  # EPIPE if the supervisor is gone: the program never starts
    os.close(ready)
    os.execv(sys.executable, [sys.executable, flags, *sys.argv[9:]])
os.close(ready)
os.closerange(0, 3)  # the program's stdin and output are its own: a process of its uid could reopen init's
while True:
    pid, status = os.wait()
    if pid == program:
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
"""


class SandboxUnavailableError(OpdSaoError, RuntimeError):
    """The sandbox cannot be built here; running anyway would be unsafe or meaningless."""


# The default wall limit: a hang catcher, not a bound on work. RLIMIT_CPU (`cpu_s`) bounds what a program computes
# and is the same on a busy machine; wall time is not (a correct program waiting for a CPU at load 16 takes many
# times its CPU time, and a wall kill scores it 0). The wall limit's one job is a program that waits without
# running (a sleep, a read of its own pipe); such a program holds one env-step worker thread for this long.
WALL_S = 30.0


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits; the defaults suit the small programs of the agent RL stage (`wall_s`: see WALL_S)."""

    wall_s: float = WALL_S
    cpu_s: int = 2  # per process (RLIMIT_CPU)
    memory_mb: int = 256  # address space per process (RLIMIT_AS)
    max_processes: int = 16  # processes + threads of the sandbox user (RLIMIT_NPROC)
    output_bytes: int = 64 * 1024  # stdout + stderr together
    file_size_mb: int = 1  # largest file the program may write (RLIMIT_FSIZE)
    tmp_mb: int = 16  # size of each private tmpfs: /sandbox (the work dir), /tmp and /dev/shm (bwrap mode)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"SandboxLimits.{field.name} must be > 0, got {getattr(self, field.name)!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run; exit_code follows the shell convention (128+N = killed by signal N)."""

    status: Literal["ok", "failed"]
    exit_code: int | None  # None when we killed the program (wall or output limit)
    wall_s: float
    output_bytes: int  # bytes of stdout+stderr produced, at most limits.output_bytes
    limit_hit: LimitHit | None
    stdout: str
    stderr: str

    def to_json(self) -> dict:
        """A JSON-serialisable dict of all fields, for logs and the CLI."""
        return dataclasses.asdict(self)


def bwrap_path() -> str | None:
    """The bubblewrap binary to use ($OPD_SAO_BWRAP, default `bwrap` on PATH), or None."""
    return shutil.which(os.environ.get(BWRAP_ENV, "bwrap"))


def detect_mode(allow_rlimit_only: bool) -> Mode:
    """Pick the isolation mode once at start-up, failing loudly rather than silently degrading."""
    try:
        _require_bwrap()
        return "bwrap"
    except SandboxUnavailableError as exc:
        if not allow_rlimit_only:
            raise
        logger.warning("%s -- falling back to rlimit-only mode because allow_rlimit_only is true", exc)
        return "rlimit"


def run_python(
    code: str, *, stdin: str = "", limits: SandboxLimits | None = None, mode: Mode = "bwrap", stdlib_only: bool = False
) -> SandboxResult:
    """Run `code` as main.py in a fresh, empty work dir and return what happened.

    `stdlib_only`: start it `python -I -S` (no site module, no site-packages; the grading harness): ~50 ms less
    CPU a run than `-s` here (site imports the base interpreter's site-packages and runs its .pth files).
    Raises SandboxUnavailableError when bwrap is missing or cannot start the
    sandbox (mode="bwrap"), never for anything the program itself does.
    """
    if mode not in ("bwrap", "rlimit"):
        raise ValueError(f"mode must be 'bwrap' or 'rlimit', got {mode!r}")
    if mode == "rlimit":
        _warn_rlimit_only()
    return _run_code(code, _require_bwrap() if mode == "bwrap" else None, stdin, limits or SandboxLimits(),
                     "-IS" if stdlib_only else "-s")


def _require_bwrap() -> str:
    """The bwrap binary, known to run a trivial program; raises SandboxUnavailableError otherwise."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise SandboxUnavailableError(
            f"bubblewrap not found ({BWRAP_ENV}={os.environ.get(BWRAP_ENV, 'bwrap')!r}): refusing to run "
            "untrusted code without isolation; install it (`apt-get install bubblewrap`) or set "
            "`allow_rlimit_only: true` in the config to run with rlimits only"
        )
    _probe(bwrap)
    return bwrap


@functools.cache  # only successes are cached: a broken sandbox keeps failing loudly
def _probe(bwrap: str) -> None:
    """A sandbox that cannot run `pass` (e.g. interpreter unreadable) would fail every program silently."""
    result = _run_code("pass", bwrap, "", SandboxLimits(), "-s")
    if result.status != "ok":
        raise SandboxUnavailableError(
            f"the sandbox cannot run a trivial program (exit {result.exit_code}): {result.stderr.strip()[-2000:]}"
        )


def _run_code(code: str, bwrap: str | None, stdin: str, limits: SandboxLimits, flags: str) -> SandboxResult:
    """One run in its own work dir, deleted whatever happens; `flags`: the program's interpreter flags."""
    sweep_stale_workdirs()
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{_process_tag(os.getpid())}-")
    try:
        Path(workdir, "main.py").write_text(code)
        return _run(workdir, bwrap, stdin, limits, flags)
    finally:
        _remove_tree(workdir)


@functools.cache
def _warn_rlimit_only() -> None:
    """Once per process, so RL loops do not drown the log."""
    logger.warning(
        "sandbox: running untrusted code WITHOUT bubblewrap (rlimit-only mode): no filesystem, network "
        "or PID isolation%s; install bubblewrap (`apt-get install bubblewrap`)",
        ", and no process limit because we run as root" if os.geteuid() == 0 else "",
    )


def _interpreter() -> tuple[str, str]:
    """(python, prefix) of the base interpreter: sandboxed programs get the stdlib, not our venv."""
    prefix = os.path.realpath(sys.base_prefix)
    python = os.path.realpath(os.path.join(prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}"))
    if not os.access(python, os.X_OK):
        raise SandboxUnavailableError(f"base interpreter {python} not found (sys.base_prefix={sys.base_prefix})")
    return python, prefix


def _bwrap_args(bwrap: str, workdir: str, prefix: str, limits: SandboxLimits, as_root: bool, fds: dict) -> list[str]:
    """The bubblewrap command line (everything before the wrapped command)."""
    args = [bwrap, "--unshare-all", "--unshare-user", "--as-pid-1", "--die-with-parent", "--new-session"]
    args += ["--hostname", "sandbox"]
    # bwrap waits on fds["block"] until we hold a pidfd of its init (and, as root, wrote the id maps)
    if as_root:
        args += ["--userns-block-fd", str(fds["block"])]
    else:
        args += ["--block-fd", str(fds["block"]), "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        args += ["--disable-userns"]
    args += ["--info-fd", str(fds["info"]), "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    if os.path.commonpath([prefix, "/usr"]) != "/usr":
        args += ["--ro-bind", prefix, prefix]
        for parent in Path(prefix).parents[:-1]:  # bwrap creates them 0700: let the sandbox user through
            args += ["--chmod", "0755", str(parent)]
    tmp_size = str(limits.tmp_mb << 20)
    # Every writable place is a size-capped tmpfs (memory the rlimits do not count); main.py is bound in
    # read-only, so the work dir on the host never grows.
    args += [
        "--dev", "/dev", "--perms", "1777", "--size", tmp_size, "--tmpfs", "/dev/shm", "--proc", "/proc",
        "--perms", "1777", "--size", tmp_size, "--tmpfs", "/tmp",
        "--perms", "0777", "--size", tmp_size, "--tmpfs", SANDBOX_DIR,
        "--ro-bind", os.path.join(workdir, "main.py"), f"{SANDBOX_DIR}/main.py",
        "--remount-ro", "/", "--chdir", SANDBOX_DIR, "--",
    ]  # fmt: skip
    return args


def _run(workdir: str, bwrap: str | None, stdin: str, limits: SandboxLimits, flags: str) -> SandboxResult:
    """Start bwrap (or, in rlimit mode, just the wrapper) on main.py and supervise it; never leaves it running."""
    python, prefix = _interpreter()
    as_root = bwrap is not None and os.geteuid() == 0
    if as_root:
        os.chown(workdir, HOST_UID, HOST_UID)
    fds: dict[str, int] = {}  # parent's pipe ends, closed at the end
    child_fds: dict[str, int] = {}  # bwrap's / the wrapper's ends, closed once the child has them
    fds["ready"], child_fds["ready"] = os.pipe()
    wrapper = [
        python, "-I", "-S", "-c", _WRAPPER, flags, str(child_fds["ready"]), str(limits.cpu_s),
        str(limits.memory_mb << 20), str(limits.max_processes), str(limits.file_size_mb << 20),
        str(SANDBOX_UID if as_root else -1), str(int(bwrap is None)), "main.py",
    ]  # fmt: skip
    if bwrap is not None:
        fds["info"], child_fds["info"] = os.pipe()
        child_fds["block"], fds["block"] = os.pipe()
        argv = _bwrap_args(bwrap, workdir, prefix, limits, as_root, child_fds) + wrapper
        env = _env(SANDBOX_DIR)
    else:
        argv, env = wrapper, _env(workdir)
    start = time.monotonic()
    deadline = start + limits.wall_s
    with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        try:
            proc = subprocess.Popen(
                argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
                pass_fds=list(child_fds.values()), start_new_session=True,
            )  # fmt: skip
        finally:
            for fd in child_fds.values():
                os.close(fd)
    inner = None
    try:
        if bwrap is not None:
            inner = _start_sandbox(proc, fds, deadline, as_root)
        return _supervise(proc, inner, fds, deadline, limits, start)
    finally:
        raising = proc.returncode is None
        if raising:  # take the sandbox down; closing the block fd below lets a waiting bwrap see it
            _kill(proc, inner)
        for fd in [*fds.values(), *([inner] if inner is not None else [])]:
            os.close(fd)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
        if raising:
            try:
                proc.wait(_KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid)
                proc.wait()


def _env(home: str) -> dict[str, str]:
    """Nothing of the parent's environment leaks in (tokens, paths, proxies)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


def _start_sandbox(proc: subprocess.Popen, fds: dict[str, int], deadline: float, as_root: bool) -> int | None:
    """Take a pidfd of the sandbox's init (to kill the whole PID namespace), as root map its ids, let it go.

    Returns None if bwrap died or stalled before creating the sandbox.
    """
    info = b""
    while (remaining := deadline - time.monotonic()) > 0 and select.select([fds["info"]], [], [], remaining)[0]:
        chunk = os.read(fds["info"], 4096)
        if not chunk:
            break
        info += chunk
    try:
        pid = json.loads(info)["child-pid"]
        inner = os.pidfd_open(pid)
    except (ValueError, ProcessLookupError):
        return None  # bwrap failed; _supervise reports its stderr
    if as_root:
        try:
            _map_ids(pid)
            _disable_nested_userns(pid)
        except (OSError, subprocess.CalledProcessError) as exc:
            _kill(proc, inner)
            os.close(inner)
            raise SandboxUnavailableError(f"cannot set up the user namespace of the sandbox: {exc}") from exc
    try:
        os.write(fds["block"], b"1")
    except BrokenPipeError:
        pass  # bwrap already gone; _supervise reports it
    return inner


def _map_ids(pid: int) -> None:
    """Sandbox root -> host root (only bwrap's setup and our wrapper use it), sandbox user -> HOST_UID.

    Root must stay mapped so setup can bind an interpreter that lives under /root
    (mode 700); the program itself always runs as SANDBOX_UID.
    """
    for kind in ("uid", "gid"):
        Path(f"/proc/{pid}/{kind}_map").write_text(f"0 0 1\n{SANDBOX_UID} {HOST_UID} 1\n")


def _disable_nested_userns(pid: int) -> None:
    """Set max_user_namespaces to 0 inside the sandbox's user namespace (what bwrap's --disable-userns does,
    which it refuses together with --userns-block-fd): a program that made its own user namespace could
    mount tmpfs outside every limit. Writing that sysctl needs a process inside the namespace, and setns
    into a user namespace needs a single-threaded one: a short nsenter."""
    nsenter = shutil.which("nsenter")
    if nsenter is None:
        raise OSError("nsenter (util-linux) not found")
    subprocess.run(
        [nsenter, f"--user=/proc/{pid}/ns/user", "--", "tee", "/proc/sys/user/max_user_namespaces"],
        input=b"0", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=True, env=_env("/"),
    )  # fmt: skip


def _supervise(
    proc: subprocess.Popen, inner: int | None, fds: dict[str, int], deadline: float, limits: SandboxLimits, start: float
) -> SandboxResult:
    """Pump output under the caps, enforce the wall clock, kill and reap everything, classify."""
    streams = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}  # type: ignore[union-attr]
    exit_fd = os.pidfd_open(proc.pid)
    watched = [*streams, exit_fd]
    produced = kept = 0
    limit_hit: LimitHit | None = None
    try:
        while watched:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if exit_fd in watched:
                    limit_hit = "wall"
                break  # else: exited, but a straggler (rlimit mode) holds the pipes
            for fd in select.select(watched, [], [], remaining)[0]:
                if fd == exit_fd:
                    watched.remove(fd)
                    if inner is None:  # rlimit mode: no PID namespace, kill what stayed in the group
                        _killpg(proc.pid)
                    continue
                data = os.read(fd, 65536)
                if not data:
                    watched.remove(fd)
                    continue
                produced += len(data)
                streams[fd].append(data[: max(0, limits.output_bytes - kept)])
                kept += len(streams[fd][-1])
                if produced > limits.output_bytes:
                    limit_hit = "output"
            if limit_hit:
                break
        if limit_hit:
            _kill(proc, inner)
        if not select.select([exit_fd], [], [], _KILL_GRACE_S)[0]:
            _killpg(proc.pid)  # bwrap did not follow its sandbox's init; take its whole group down
    finally:
        os.close(exit_fd)
    _, status, usage = os.wait4(proc.pid, 0)  # bwrap exits after reaping init, when the sandbox is empty
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall_s = time.monotonic() - start
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    stdout, stderr = (b"".join(chunks).decode(errors="replace") for chunks in streams.values())
    if limit_hit is None and not _came_up(fds["ready"]):
        raise SandboxUnavailableError(f"the sandbox failed to start (exit {code}): {stderr.strip()[-2000:]}")
    if limit_hit is None and code != 0:
        limit_hit = _classify(code, stderr, usage.ru_utime + usage.ru_stime, limits)
    return SandboxResult(
        status="ok" if code == 0 and limit_hit is None else "failed",
        exit_code=None if limit_hit in ("wall", "output") else code,
        wall_s=round(wall_s, 3),
        output_bytes=min(produced, limits.output_bytes),
        limit_hit=limit_hit,
        stdout=stdout,
        stderr=stderr,
    )


def _kill(proc: subprocess.Popen, inner: int | None) -> None:
    """Kill the sandbox's init: the kernel then kills the whole PID namespace, and bwrap reaps it and exits."""
    if inner is None:
        _killpg(proc.pid)
        return
    try:
        signal.pidfd_send_signal(inner, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _came_up(ready_fd: int) -> bool:
    """Whether the wrapper ran inside the sandbox: tells a broken sandbox from a failing program."""
    os.set_blocking(ready_fd, False)
    try:
        return os.read(ready_fd, 1) == b"1"
    except BlockingIOError:
        return False


def _classify(code: int, stderr: str, cpu_s: float, limits: SandboxLimits) -> LimitHit | None:
    """Name the limit a failed program ran into, from its exit signal, CPU time and last words."""
    sig = code - 128 if code > 128 else None
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits.cpu_s):
        return "cpu"
    if sig == signal.SIGXFSZ or "File too large" in stderr:
        return "file_size"
    if "No space left on device" in stderr:  # the only writable places are the tmp_mb-sized tmpfs mounts
        return "tmp"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    if "Resource temporarily unavailable" in stderr or "can't start new thread" in stderr:
        return "processes"
    return None


def _remove_tree(path: str) -> None:
    """Delete a work dir, whatever the program (dead by now) left in it: dirs chmod-ed to 000, or nested
    deeper than PATH_MAX and the recursion limit (os.walk and shutil.rmtree recurse). Iterative and
    fd-relative: each subdirectory's entries move up into the top dir, which is emptied level by level.
    A failure is logged, not raised: it must not hide the run's result; the dir is swept later."""
    try:
        os.chmod(path, 0o700)
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            moved = f".opd-sao-rm-{uuid.uuid4().hex}-"  # a name the dead program cannot have guessed
            count = 0
            while names := os.listdir(top):
                for name in names:
                    try:
                        os.unlink(name, dir_fd=top)  # files and symlinks (never followed)
                        continue
                    except IsADirectoryError:
                        pass
                    os.chmod(name, 0o700, dir_fd=top)  # a real dir: unlink removed any symlink
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                    try:
                        for child in os.listdir(sub):
                            os.rename(child, f"{moved}{count}", src_dir_fd=sub, dst_dir_fd=top)
                            count += 1
                    finally:
                        os.close(sub)
                    os.rmdir(name, dir_fd=top)
        finally:
            os.close(top)
        os.rmdir(path)
    except OSError as exc:
        logger.warning("sandbox: could not remove work dir %s: %s", path, exc)


def _process_tag(pid: int) -> str | None:
    """"pidns.pid.start-time" of a live process of our PID namespace, None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else f"{_PID_NAMESPACE}.{pid}.{fields[19]}"


_PID_NAMESPACE = os.stat("/proc/self/ns/pid").st_ino  # pids of another namespace sharing /tmp mean nothing here


def sweep_stale_workdirs() -> int:
    """Remove the work dirs of supervisors that died without cleaning up (kill -9), first killing any process
    still naming one: a bwrap killed between creating its sandbox and releasing it leaves the sandbox's
    first process blocked for good on an eventfd, with no parent-death signal. Returns how many dirs went.
    Cheap (one listing of the temp dir) unless something is stale; run before every sandbox run."""
    removed = 0
    for path in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        owner = _WORKDIR_OWNER.match(path.name)
        if owner is None or int(owner[1]) != _PID_NAMESPACE:
            continue  # not ours to judge
        if _process_tag(int(owner[2])) == ".".join(owner.groups()):
            continue  # its supervisor lives
        _kill_processes_naming(str(path))
        claimed = path.with_name(f"{WORKDIR_PREFIX}{_process_tag(os.getpid())}-swept-{uuid.uuid4().hex}")
        try:
            os.rename(path, claimed)  # another process sweeping at the same time gets FileNotFoundError
        except OSError:
            continue
        _remove_tree(str(claimed))
        removed += 1
    if removed:
        logger.warning("sandbox: removed %d work dir(s) of dead supervisors in %s", removed, tempfile.gettempdir())
    return removed


def _kill_processes_naming(path: str) -> None:
    """SIGKILL every process whose command line names `path` (checked again through a pidfd: no reused pid)."""
    needle = os.fsencode(path)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pidfd = os.pidfd_open(int(entry.name))
        except OSError:
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)


LIMIT_MAX = 2**31  # above this a limit overflows select's timeout or an rlimit instead of limiting anything


def _limit_arg(kind: type):
    """argparse type of a limit flag: a finite number in (0, LIMIT_MAX); inf, nan or 0 would disable the limit."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and 0 < value < LIMIT_MAX):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0 and < {LIMIT_MAX} (got {text})")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    """`opd-sao sandbox run FILE [--wall-s ...]`: argv is what follows `sandbox`; prints one JSON object."""
    parser = argparse.ArgumentParser(prog="opd-sao sandbox", description="Run untrusted Python in the sandbox.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run one Python file and print the result as one JSON object")
    run.add_argument("file", type=Path)
    defaults = SandboxLimits()
    for field in dataclasses.fields(SandboxLimits):
        default = getattr(defaults, field.name)
        run.add_argument(f"--{field.name.replace('_', '-')}", type=_limit_arg(type(default)), default=default)
    run.add_argument("--stdin", type=Path, help="file whose content is fed to the program's stdin")
    run.add_argument(
        "--allow-rlimit-only", action="store_true", help="run without bubblewrap (rlimits only) if it is unavailable"
    )
    args = parser.parse_args(argv)
    for path in (args.file, args.stdin):
        if path is not None and not path.is_file():
            parser.error(f"no such file: {path}")
    try:
        limits = SandboxLimits(**{field.name: getattr(args, field.name) for field in dataclasses.fields(SandboxLimits)})
    except ValueError as exc:
        parser.error(str(exc))
    result = run_python(
        args.file.read_text(),
        stdin=args.stdin.read_text() if args.stdin else "",
        limits=limits,
        mode=detect_mode(args.allow_rlimit_only),
    )
    print(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
