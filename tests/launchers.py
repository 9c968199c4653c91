"""Starting servers and ranks for tests and benchmarks: a free loopback port, waiting for /health, slowed
SGLang-semantics workers, sglang-router, a DeepSpeed test worker's rank-0 set-up."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from opd_sao.engines.http import SGLangClient


def free_port() -> int:
    """A loopback port nothing listens on (yet)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long a server, router or command may take (to start, to end) before a test calls it hung: a hang catcher,
# not a margin. A
# worker has taken over 180 s to start on the 2-core machine at load 16; pytest-timeout's 900 s (pytest.ini)
# still ends a test that waits on several starts.
HANG_S = 600.0


def wait_for(condition, timeout: float = HANG_S, proc: subprocess.Popen | None = None) -> None:
    """Block until `condition()` holds: for what another thread or process does in its own time (a busy machine
    can make that late, never wrong); fails if `proc` exits first or `timeout` (a hang catcher) passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def wait_until_healthy(url: str, is_alive, timeout_s: float = HANG_S, poll_s: float = 0.2) -> None:
    """Block until the server at `url` answers /health; RuntimeError if `is_alive()` turns False (the process
    died) or `timeout_s` passes first (it hung)."""
    client, deadline = SGLangClient(url, timeout=1.0), time.monotonic() + timeout_s
    while not client.health():
        if not is_alive():
            raise RuntimeError(f"rollout server {url} exited before answering /health")
        if time.monotonic() > deadline:
            raise RuntimeError(f"rollout server {url} did not answer /health within {timeout_s:.0f} s")
        time.sleep(poll_s)


class SlowWorkers:
    """Slowed SGLang-semantics workers (tests/slow_sglang_worker.py: each decode step `step_s` longer, so requests
    are still generating when a test acts) on loopback ports, one torch thread and 8 slots each, each logging to a
    file in `logs` (a pipe nobody reads would block it); `stop()` kills them all."""

    SCRIPT = Path(__file__).resolve().parent / "slow_sglang_worker.py"

    def __init__(self, logs: Path, step_s: float):
        self.logs, self.step_s, self.procs = Path(logs), step_s, []

    def start(self, checkpoint, *args: str, patch: tuple[str, ...] = ()) -> str:
        """The URL of a new worker of `checkpoint` once it answers /health; `args`: more worker options;
        `patch`: `-c CODE` run first (it then runs the worker)."""
        port = free_port()
        with open(self.logs / f"worker-{port}.log", "w") as log:
            proc = subprocess.Popen([sys.executable, *patch, str(self.SCRIPT), str(self.step_s), str(checkpoint),
                                     "--port", str(port), "--threads", "1", "--max-batch", "8", *map(str, args)],
                                    stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, lambda: proc.poll() is None)
        return url

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def start_sglang_router(worker_urls: list[str], *args: str, timeout_s: float = HANG_S):
    """sglang-router (`pip install sglang-router`) on a free loopback port in front of `worker_urls`, with
    extra CLI `args`; returns (url, process) once it has registered every worker."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "error", "--prometheus-port", str(free_port()),  # two routers: two metrics ports
           "--worker-urls", *worker_urls, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url, lambda: proc.poll() is None, timeout_s=timeout_s)
    client, deadline = SGLangClient(url, timeout=10.0), time.monotonic() + timeout_s
    while len(client.router_workers() or []) < len(worker_urls):
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sglang-router at {url} did not register {worker_urls} within {timeout_s:.0f} s")
        time.sleep(0.2)
    return url, proc


def deepspeed_rank0_batch(student: str, batch_file: str):
    """In a torchrun test worker: join the process group; a non-zero rank follows rank 0's backend calls until it
    exits and gets None; rank 0 gets (tokenizer, the collated batch of the JSONL trajectories in `batch_file`)."""
    import os
    from pathlib import Path

    from opd_sao.checkpoints import load_tokenizer
    from opd_sao.trainers.deepspeed_backend import follow, init_distributed
    from opd_sao.trajectory import Trajectory, collate

    init_distributed()
    if int(os.environ["RANK"]) != 0:
        follow()
        return None
    tokenizer = load_tokenizer(student)
    lines = Path(batch_file).read_text().splitlines()
    return tokenizer, collate([Trajectory.from_json(line) for line in lines], tokenizer.pad_token_id)
