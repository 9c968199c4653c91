"""Resumable stage state: the trainer's state and the loop's step, saved atomically every N steps.

On resume the stage restarts from the last saved step; the per-step logs (trained.jsonl,
metrics.jsonl) are cut back to that step, so a trajectory is recorded as trained only if the
weights that learnt from it were saved.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from opd_sao.io.files import atomic_write, inside
from opd_sao.io.tracking import read_jsonl
from opd_sao.trainers.base import NonFiniteError


class StageState:
    def __init__(self, stage_dir: Path, name: str = "state"):
        """`name`: the state's folder in the stage directory (an RL stage's SFT warm start keeps its own)."""
        self.path = inside(stage_dir, name)

    def exists(self) -> bool:
        return (self.path / "loop.json").is_file()

    def save(self, backend, step: int, extra: dict) -> None:
        """Write to a fresh directory, then swap it in: a crash leaves the old or the new state, whole. Weights
        holding a NaN or an infinity are refused (the last good state stays)."""
        bad = backend.nonfinite_weights()
        if bad:
            raise NonFiniteError(f"step {step}: non-finite weights in {', '.join(bad[:3])}"
                                 f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}; state not saved")
        tmp = self.path.with_name(self.path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        backend.save_state(tmp)
        (tmp / "loop.json").write_text(json.dumps({"step": step, "policy_version": backend.policy_version, **extra}))
        old = self.path.with_name(self.path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if self.path.exists():
            os.replace(self.path, old)
        os.replace(tmp, self.path)
        shutil.rmtree(old, ignore_errors=True)

    def load(self, backend) -> dict:
        if not self.exists():
            old = self.path.with_name(self.path.name + ".old")  # a crash between the two renames
            if (old / "loop.json").is_file():
                os.replace(old, self.path)
            else:
                raise FileNotFoundError(f"no saved state in {self.path}")
        backend.load_state(self.path)
        return json.loads((self.path / "loop.json").read_text())

    def step(self) -> Optional[int]:
        """The step the saved state continues from (None when there is none)."""
        for path in (self.path, self.path.with_name(self.path.name + ".old")):
            if (path / "loop.json").is_file():
                return json.loads((path / "loop.json").read_text())["step"]
        return None

    def discard(self) -> None:
        for suffix in ("", ".tmp", ".old"):
            shutil.rmtree(self.path.with_name(self.path.name + suffix), ignore_errors=True)


BUFFER_DIR = "buffer"  # the trajectory buffer's write-ahead log (opd_sao.rl.buffer), read by a resume only
STATE_DIRS = ("state", "state.old", "state.tmp", BUFFER_DIR)  # a save's leftovers after a crash too


def discard_state(stage_dir: Path, parts: tuple[str, ...]) -> None:
    """Delete `parts` (directory names, STATE_DIRS: all) of a finished stage's resumable state: nothing reads them
    again once the run has recorded the stage as finished (a resume skips it)."""
    for name in parts:
        shutil.rmtree(inside(stage_dir, name), ignore_errors=True)


def disk_use(path: Path) -> int:
    """Bytes of the files under `path` (links not followed)."""
    return sum(p.lstat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink())


def truncate_step_log(path: Path, before_step: int) -> list[dict]:
    """Keep the records of steps < before_step (and drop a line torn by a crash); return them."""
    kept = [r for r in read_jsonl(path) if r.get("step", -1) < before_step]
    if Path(path).exists():
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept
