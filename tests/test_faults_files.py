"""Files that are not what they claim (issue 43): a FIFO, a link to /dev/zero or out of its store, an unreadable
file, where the logit cache or a dataset expects a file of bytes. Before, each hung a read, ran out of memory or
blamed the wrong thing; now each is refused naming the file (docs/reliability.md, "Files that are not files").
The call that hung runs as a real `opd-sao` subprocess with a deadline, so a hang fails the test instead of blocking
the suite; what follows it runs in this process (each `opd-sao` start costs 5-20 s of imports here)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_logit_cache import chunk_files, make_meta, teacher_rows

from opd_sao.cache import CorruptRecordError, LogitCache, encode_top_k
from opd_sao.cache.cli import gc, verify
from opd_sao.cache.cli import main as cache_main

DEADLINE_S = 300  # a refusal takes seconds; before the fix these runs never ended


def opd_sao(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opd_sao.app.cli", *args], capture_output=True, text=True,
                          timeout=DEADLINE_S, **kwargs)


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def replace(path: Path, how: str, tmp_path: Path) -> None:
    """Put a FIFO, a link to /dev/zero or a link to a file outside where `path` was."""
    path.unlink()
    if how == "fifo":
        os.mkfifo(path)
    elif how == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        (tmp_path / "elsewhere").write_bytes(b"\0" * 64)
        path.symlink_to(tmp_path / "elsewhere")


def cache_with_a_record(tmp_path: Path) -> tuple[Path, Path]:
    """(cache dir, teacher dir) holding record `traj` over two logp chunks."""
    root = tmp_path / "cache"
    rows, sampled = teacher_rows(4096, seed=5)
    teacher = LogitCache(root).open_teacher(make_meta("top_k", k=64))
    teacher.put("traj", encode_top_k(rows, 64, sampled))
    return root, teacher.path


@pytest.mark.parametrize("how", ["fifo", "dev-zero", "link-out"])
def test_a_chunk_that_is_no_file_of_the_store_is_a_corrupt_record_and_gc_drops_it(tmp_path, how):
    """Before: verify of a FIFO chunk hung for good, a chunk linked to /dev/zero read until MemoryError, a link
    out of the store was read. Now the record is corrupt (re-scored by the OPD stage) and gc removes the entry."""
    root, teacher_dir = cache_with_a_record(tmp_path)
    chunk = chunk_files(teacher_dir, "logp")[0]
    replace(chunk, how, tmp_path)
    done = opd_sao("cache", "verify", str(root))
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["problems"] == [f"{teacher_dir}: record 'traj' is corrupt (checksum mismatch or "
                                                   f"unreadable chunk)"]
    teacher = LogitCache(root).open_teacher(make_meta("top_k", k=64))
    with pytest.raises(CorruptRecordError, match="not a regular file|a link out of"):
        teacher.get("traj")
    with pytest.raises(CorruptRecordError):
        teacher.get_many(["traj"])
    assert gc(root)["teachers"]["reasoning-rl"]["corrupt_records_dropped"] == ["traj"]
    assert not os.path.lexists(chunk) and verify(root) == (True, [])
    if how == "link-out":
        assert (tmp_path / "elsewhere").read_bytes() == b"\0" * 64  # the link went, not what it pointed at


@pytest.mark.parametrize("name,how", [("index.log", "fifo"), ("index.log", "dev-zero"), ("zarr.json", "fifo"),
                                      ("zarr.json", "dev-zero"), ("logp/zarr.json", "link-out"),
                                      ("writer.lock", "fifo")])
def test_metadata_that_is_no_file_of_the_store_is_damage_named_by_its_path(tmp_path, capsys, name, how):
    """Before: a FIFO index.log or zarr.json hung verify (and gc), /dev/zero read until MemoryError. Now verify
    names the file and exits 1, gc says `damaged:` and the OPD stage's rebuild makes a working store. (A FIFO
    writer.lock hung every write.)"""
    root, teacher_dir = cache_with_a_record(tmp_path)
    path = teacher_dir / name
    replace(path, how, tmp_path)
    done = opd_sao("cache", "verify", str(root))
    assert done.returncode == 1, done.stderr
    problems = json.loads(done.stdout)["problems"]
    assert len(problems) == 1 and problems[0].startswith(f"{path}: "), problems
    assert "not a regular file" in problems[0] or "a link out of" in problems[0]
    assert cache_main(["gc", str(root)]) == 1
    assert one_error_line(capsys.readouterr().err).startswith(f"opd-sao cache: error: damaged: {path}: ")
    teacher = LogitCache(root).rebuild_teacher(make_meta("top_k", k=64))
    assert "traj" not in teacher and verify(root) == (True, [])


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
# Root reads a chmod-000 file anyway: the unreadable case drops the capabilities that let it (DAC override and
# read-search) from the process's bounding set, so the file is unreadable to the run as it is to any other user.
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"] \
    if os.geteuid() == 0 and shutil.which("setpriv") else []


def data_file(tmp_path: Path, how: str) -> Path:
    """rows.jsonl that is a FIFO, a link to /dev/zero, or a real file no one may read."""
    path = tmp_path / "rows.jsonl"
    if how == "fifo":
        os.mkfifo(path)
    elif how == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        if os.geteuid() == 0 and not NO_DAC:
            pytest.skip("running as root without setpriv: no way to make a file unreadable to this run")
        path.write_text('{"id": "q1", "prompt": "1+1=", "answer": "2"}\n')
        path.chmod(0)
    return path


@pytest.mark.parametrize("how,why", [("fifo", "not a regular file (a FIFO)"),
                                     ("dev-zero", "not a regular file (a character device)"),
                                     ("unreadable", "cannot be read (Permission denied)")])
def test_a_data_file_that_is_no_file_of_bytes_is_refused_naming_it(tmp_path, how, why):
    """Before: a FIFO hung the run for good, /dev/zero ended in MemoryError, and an unreadable file was reported
    as `the run directory is not writable`. Now `opd-sao run` and `opd-sao data inspect` refuse it in one line
    naming the file, and the refused run leaves no directory."""
    path = data_file(tmp_path, how)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(
        {"seed": 0, "model": {"tiny": TINY}, "logging": {"wandb": False, "progress": False},
         "trainer": {"train_batch_size": 4, "critic_warmup_steps": 0},
         "stages": [{"name": "r", "kind": "reasoning", "env": "dataset", "env_options": {"path": str(path)},
                     "steps": 3, "rollout": {"max_new_tokens": 4}, "gate": {"enabled": False}}]}))
    wrap = NO_DAC if how == "unreadable" else []
    run = subprocess.run([*wrap, sys.executable, "-m", "opd_sao.app.cli", "run", str(config), "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=DEADLINE_S)
    assert run.returncode == 2
    assert one_error_line(run.stderr) == f"opd-sao run: error: stage 'r': data file {path}: {why}"
    assert not (tmp_path / "run").exists()
    inspect = subprocess.run([*wrap, sys.executable, "-m", "opd_sao.app.cli", "data", "inspect", str(path)],
                             capture_output=True, text=True, timeout=DEADLINE_S)
    assert inspect.returncode == 2 and one_error_line(inspect.stderr).endswith(f"dataset file {path}: {why}")


@pytest.mark.parametrize("how,why", [("fifo", "not a regular file (a FIFO)"),
                                     ("dev-zero", "a link out of {root} (to /dev/zero)"),
                                     ("link-out", "a link out of {root} (to {elsewhere})")])
def test_a_saved_datasets_arrow_file_that_is_no_file_of_its_directory_is_refused_naming_it(tmp_path, how, why):
    """Before: the files of a `save_to_disk` directory were read by `datasets` unchecked (a FIFO for its Arrow
    file, a link to /dev/zero or to a file outside the directory). Now `opd-sao data inspect` refuses each in one
    line naming the file, as it does a data file of another format."""
    import datasets

    root = tmp_path / "saved"
    datasets.Dataset.from_list([{"id": "q1", "prompt": "1+1=", "answer": "2"}]).save_to_disk(str(root))
    arrow = next(root.glob("*.arrow"))
    replace(arrow, how, tmp_path)
    inspect = opd_sao("data", "inspect", str(root))
    assert inspect.returncode == 2, inspect.stderr
    expected = why.format(root=root, elsewhere=tmp_path / "elsewhere")
    assert one_error_line(inspect.stderr).endswith(f"dataset file {arrow}: {expected}")
