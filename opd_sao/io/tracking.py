"""Metrics: one JSON line per step in the stage directory, mirrored to wandb (offline by default)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, path: Path, *, stage: str, wandb_run=None):
        self.path, self.stage, self.wandb_run = Path(path), stage, wandb_run
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.wandb_run is not None:
            scalars = {f"{self.stage}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
            self.wandb_run.log(scalars)


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a crash is not a record
            continue
    return records


def start_wandb(project: str, run_dir: Path, config: dict, enabled: bool):
    """A wandb run in offline mode unless WANDB_MODE says otherwise; None when disabled or unavailable."""
    if not enabled:
        return None
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        import wandb

        return wandb.init(project=project, dir=str(run_dir), config=config, name=Path(run_dir).name, reinit=True)
    except Exception as err:  # tracking must never take a run down
        print(f"warning: wandb disabled ({err})", file=sys.stderr)
        return None
