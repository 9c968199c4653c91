"""A run and its directory under hostile conditions (issue 25): two runs on one directory, Ctrl-C and SIGTERM, a
full disk and a read-only directory. Real `opd-sao run` subprocesses; each ending is one line with the exact
`--resume` command, and the resume loses nothing (docs/reliability.md, "Runs and their directory")."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from launchers import HANG_S, wait_for

from opd_sao.io.model_fingerprint import check_model_record
from opd_sao.io.tracking import read_jsonl

STEPS = 12


def config(tmp_path: Path, model: Path, slowdown_s: float = 0.5) -> str:
    """A reasoning stage on the session's tiny model (no tokenizer to build), slowed so a signal lands mid-stage."""
    cfg = {"seed": 0, "model": {"path": str(model)}, "logging": {"wandb": False, "progress": False}, "torch_threads": 1,
           "trainer": {"train_batch_size": 4, "slowdown_s": slowdown_s},
           "stages": [{"name": "r", "kind": "reasoning", "env": "arithmetic", "env_options": {"max_operand": 9},
                       "steps": STEPS, "checkpoint_every": 2, "rollout": {"max_new_tokens": 4},
                       "eval": {"num_tasks": 2}, "gate": {"enabled": False}}]}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "opd_sao.app.cli", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def lock_holder(run_dir: Path) -> int | None:
    """The pid named in the run's lock file; None while a new holder has truncated it and not yet written (a poll
    that read the file then failed on an empty one: 1 of 1 runs of the four fault files at load 20)."""
    text = (run_dir / ".lock").read_text()
    return json.loads(text)["pid"] if text.strip() else None


def trained_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir / "stages" / "r" / "trained.jsonl")]


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.startswith("opd-sao run:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def resume_completes(run_dir: Path) -> None:
    """The command the line gave, run: the stage ends with every step trained exactly once."""
    done = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", "run", "--resume", str(run_dir)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert trained_steps(run_dir) == list(range(STEPS))


def test_a_second_run_on_a_live_run_dir_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path, tiny_model_dir):
    """Before: two runs on one directory both finished with interleaved steps, and a resume next to the live
    original trained its trajectories twice."""
    run_dir = tmp_path / "run"
    first = start(config(tmp_path, tiny_model_dir, slowdown_s=20.0), "--run-dir", str(run_dir))
    try:
        wait_for(lambda: (run_dir / "stages" / "r" / "trained.jsonl").is_file(), proc=first)
        # held mid-stage (SIGSTOP keeps its lock) while the others try: before, it ran on and, on a busy machine
        # where the two took most of its 11 x 20 s of remaining steps to start, could end before they did
        first.send_signal(signal.SIGSTOP)
        second, third = start("--resume", str(run_dir)), start(config(tmp_path, tiny_model_dir), "--run-dir", str(run_dir))
        for other in (second, third):
            _, err = other.communicate(timeout=HANG_S)
            assert other.returncode == 2
            assert f"is in use by the opd-sao run of pid {first.pid} on host {socket.gethostname()}" in one_line(err)
        assert first.poll() is None  # untouched: still running, its files in place
        assert (run_dir / "config.yaml").is_file()
    finally:
        first.kill()
        first.wait()
    assert lock_holder(run_dir) == first.pid  # a dead holder's name stays; its flock not
    resumed = start("--resume", str(run_dir))
    try:
        wait_for(lambda: lock_holder(run_dir) == resumed.pid, proc=resumed)
    finally:
        resumed.send_signal(signal.SIGTERM)
        _, err = resumed.communicate(timeout=HANG_S)
    assert "continue with: opd-sao run --resume" in one_line(err)


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_ctrl_c_and_sigterm_end_in_one_line_with_the_resume_command(tmp_path, tiny_model_dir, how):
    """Before: Ctrl-C printed two full tracebacks (and, with a math reward, a false "timed out"), no resume hint."""
    run_dir = tmp_path / "run"
    proc = start(config(tmp_path, tiny_model_dir), "--run-dir", str(run_dir))
    wait_for(lambda: len(trained_steps(run_dir)) >= 3, proc=proc)
    proc.send_signal(getattr(signal, how))
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 128 + getattr(signal, how)
    line = one_line(err)
    assert line.endswith(f"continue with: opd-sao run --resume {shlex.quote(str(run_dir))}")
    assert ("SIGTERM" if how == "SIGTERM" else "Ctrl-C") in line
    resume_completes(run_dir)


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MB tmpfs (the tests run as root), unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    try:
        _mount("-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where))
    except (subprocess.CalledProcessError, FileNotFoundError):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_and_a_read_only_run_dir_end_in_one_line_and_lose_nothing(tmp_path, small_disk, tiny_model_dir):
    """Before: a full disk while writing a checkpoint ended in a traceback; a read-only run dir on --resume was an
    EROFS traceback. The disk fills (a filler file takes what is left) once the stage has saved state."""
    run_dir = small_disk / "run"
    proc = start(config(tmp_path, tiny_model_dir), "--run-dir", str(run_dir))
    wait_for(lambda: (run_dir / "stages" / "r" / "state" / "loop.json").is_file(), proc=proc)
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError:  # ENOSPC: full
            pass
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 1
    line = one_line(err)
    assert "the disk is full" in line and line.endswith(f"--resume {shlex.quote(str(run_dir))}")
    filler.unlink()
    saved = json.loads((run_dir / "stages" / "r" / "state" / "loop.json").read_text())["step"]
    assert saved >= 2
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    _mount("--bind", str(run_dir), str(read_only))
    try:
        _mount("-o", "remount,bind,ro", str(read_only))
        done = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", "run", "--resume", str(read_only)],
                              capture_output=True, text=True, timeout=HANG_S)
        assert done.returncode == 1
        assert "the run directory is read-only" in one_line(done.stderr)
    finally:
        subprocess.run(["umount", str(read_only)], check=False)
    resume_completes(run_dir)


def fill(disk: Path) -> None:
    """Take every byte left on the tmpfs (ENOSPC ends the write)."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError:
            pass


def test_a_fresh_run_into_a_full_disk_leaves_neither_its_lock_nor_its_directory(tmp_path, small_disk, tiny_model_dir):
    """Issue 43. Before: writing the lock holder's name failed with ENOSPC before the run's cleanup was armed, so
    the new directory stayed with an empty `.lock` (and a directory that existed kept a `.lock` it never had)."""
    fill(small_disk)
    existing = small_disk / "existing"
    existing.mkdir()
    (existing / "mine.txt").touch()  # an inode, no data: fits on the full disk
    for run_dir in (small_disk / "new", existing):
        done = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", "run", config(tmp_path, tiny_model_dir),
                               "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 1
        assert "the disk is full" in one_line(done.stderr) and "nothing was saved yet" in done.stderr
    assert not (small_disk / "new").exists()
    assert os.listdir(existing) == ["mine.txt"]


def test_resume_refuses_a_base_model_swapped_for_another_of_the_same_shape(tmp_path, tiny_model_dir, perturbed_teacher):
    """Issue 43. Before: the data files were fingerprinted, the model not: another model of the same shape put in
    model.path between a kill and `--resume` was loaded and trained on. Now the resume is refused in one line
    naming the weights file; a copy of the same model (new mtime) passes."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = yaml.safe_load(Path(config(tmp_path, tiny_model_dir, slowdown_s=20.0)).read_text())
    cfg["model"]["path"] = str(model)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    proc = start(str(tmp_path / "run.yaml"), "--run-dir", str(run_dir))
    try:
        wait_for(lambda: (run_dir / "model.fingerprint.json").is_file(), proc=proc)
    finally:
        proc.kill()
        proc.wait()
    weights = model / "model.safetensors"
    assert weights.stat().st_size == (perturbed_teacher / "model.safetensors").stat().st_size  # the same shape
    shutil.copyfile(perturbed_teacher / "model.safetensors", weights)
    done = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", "run", "--resume", str(run_dir)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 2
    assert one_line(done.stderr).startswith(f"opd-sao run: error: model.path: {weights} changed (size ")
    shutil.copyfile(tiny_model_dir / "model.safetensors", weights)  # the original back, as a copy: mtime is new
    check_model_record(model, run_dir)


def test_resume_refuses_a_teacher_checkpoint_replaced_since_the_run_started(tmp_path, tiny_model_dir,
                                                                             perturbed_teacher):
    """Issue 43. Before: the base model and data files were fingerprinted, an OPD teacher's checkpoint not: one
    replaced between a kill and `--resume` taught the rest of the run. Now the resume is refused in one line
    naming the stage, the teacher and its weights file; the original back (a copy: new mtime) passes."""
    teacher = tmp_path / "teacher"
    shutil.copytree(perturbed_teacher, teacher)
    cfg = yaml.safe_load(Path(config(tmp_path, tiny_model_dir, slowdown_s=20.0)).read_text())
    cfg["stages"].append({"name": "o", "kind": "opd", "domains": ["arithmetic"], "steps": 1, "gate": {"enabled": False},
                          "opd": {"teachers": [{"name": "t", "checkpoint": str(teacher), "domains": ["arithmetic"]}]}})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    proc = start(str(tmp_path / "run.yaml"), "--run-dir", str(run_dir))
    try:
        wait_for(lambda: (run_dir / "model.fingerprint.json").is_file(), proc=proc)
    finally:
        proc.kill()
        proc.wait()
    weights = teacher / "model.safetensors"
    assert weights.stat().st_size == (tiny_model_dir / "model.safetensors").stat().st_size  # the same shape
    shutil.copyfile(tiny_model_dir / "model.safetensors", weights)
    done = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", "run", "--resume", str(run_dir)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 2
    assert one_line(done.stderr).startswith(f"opd-sao run: error: stage 'o': teacher 't': {weights} changed (size ")
    shutil.copyfile(perturbed_teacher / "model.safetensors", weights)
    check_model_record(tiny_model_dir, run_dir, {"stage 'o': teacher 't'": teacher})


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_that_lands_in_a_finalizer_still_stops_the_run(how):
    """Busy run of c422ccf: SIGTERM reached a resumed run while the main thread was in a finalizer (regex's
    `Group.__del__`); Python printed "Exception ignored ... KeyboardInterrupt" and dropped it, and the run trained
    on to its end. Here a finalizer signals its own process and keeps running Python code, so the handler's
    exception is raised inside it, every time: the stop must still reach the code after it, with no traceback."""
    script = f"""
import os, signal
from opd_sao.app.cli import _catch_stop_signals
_catch_stop_signals()

class Finalised:
    def __del__(self):
        os.kill(os.getpid(), signal.{how})
        for _ in range(100_000):  # the handler runs here, inside the finalizer
            pass

try:
    Finalised()
    for _ in range(10_000_000):  # the stop lands within a few bytecodes, or never
        pass
    print("not stopped")
except KeyboardInterrupt as stop:
    print("stopped", stop.args)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert done.stdout.strip() == ("stopped ('SIGTERM',)" if how == "SIGTERM" else "stopped ()"), done
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
