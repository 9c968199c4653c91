"""The config a run started with, recorded in the run directory so `--resume` can refuse an edited config.yaml.

A resumed stage continues from saved state and logs that belong to the config they were made with: another
env, step count or batch size would mix two runs into one (trajectories of one task in a stage of another, a
stage "finished" at the old step count). Only fields that cannot change what is trained may differ, and only
when asked for (`opd-sao run --resume DIR --allow-config-change`).

Stages that have not started yet are another matter: nothing of theirs exists, so their settings may be edited,
and stages added or removed after the last started one, freely (a fixed teacher path, a longer last stage). A
stage has started once its directory holds a file; edits to a started stage (finished or interrupted) and to
run-wide settings are refused as before. An accepted edit becomes the recorded config.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from opd_sao.errors import UsageError
from opd_sao.io.files import write_json

RECORD = "config.fingerprint.json"
SAFE_ON_RESUME = ("logging.",)  # prefixes of dotted fields that change how a run reports, not what it trains
SHOWN = 6  # changed fields named in the refusal; the rest are counted


def fingerprint(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def write_record(config: dict, run_dir: Path) -> None:
    """`config` is the validated config as JSON (every default filled in); written atomically."""
    write_json(Path(run_dir) / RECORD, {"sha256": fingerprint(config), "config": config}, indent=1)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted field -> value; list items with a name (stages, teachers) go by their name, other lists are values."""
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out or {prefix.rstrip("."): {}}
    if isinstance(data, list) and data and all(isinstance(item, dict) and "name" in item for item in data):
        names = [item["name"] for item in data]
        out = {f"{prefix}order": names} if len(set(names)) == len(names) else {prefix.rstrip("."): data}
        for item in data:
            out.update(flatten(item, f"{prefix}{item['name']}."))
        return out
    return {prefix.rstrip("."): data}


def changed_fields(before: dict, after: dict) -> list[tuple[str, Any, Any]]:
    """(dotted field, value before, value after) for every field both configs have and that differs.

    A setting only one side has is not a change the user made: an upgrade of opd-sao added it (the resumed
    run gets its default, as a new run would) or removed it (nothing reads it any more). A stage or teacher
    added or removed still shows, in the list's `order`."""
    old, new = flatten(before), flatten(after)
    return [(key, old[key], new[key]) for key in sorted(old.keys() & new.keys()) if old[key] != new[key]]


def started_stages(run_dir: Path) -> set[str]:
    """Names of the stages whose directory holds a file (finished, or interrupted part way)."""
    stages = Path(run_dir) / "stages"
    return {d.name for d in stages.iterdir() if d.is_dir() and any(p.is_file() for p in d.rglob("*"))} \
        if stages.is_dir() else set()


def unstarted_edit(key: str, before: Any, after: Any, started: set[str], old_order: list[str]) -> bool:
    """Whether this change touches only stages that have not started: their own settings, or the stage list past
    the started ones (which keep their places)."""
    if key == "stages.order":
        k = sum(name in started for name in old_order)
        return after[:k] == before[:k] and not started & (set(before[k:]) | set(after[k:]))
    parts = key.split(".")
    return len(parts) > 2 and parts[0] == "stages" and parts[1] not in started


def check_resume(config: dict, run_dir: Path, *, allow_change: bool = False) -> list[str]:
    """Raise ValueError (one line naming the changed fields) when `config` differs from the recorded one in a way
    not allowed; returns the fields that differ and were allowed (edits of stages not started yet always are,
    and then become the record). A run without a record (started before records existed) gets one now."""
    path = Path(run_dir) / RECORD
    if not path.is_file():
        write_record(config, run_dir)
        return []
    recorded = json.loads(path.read_text())
    if recorded["sha256"] == fingerprint(config):
        return []
    changes = changed_fields(recorded["config"], config)
    if not changes:  # only settings an upgrade added or removed differ
        return []
    started = started_stages(run_dir)
    old_order = [stage["name"] for stage in recorded["config"].get("stages", [])]
    unstarted = [c for c in changes if unstarted_edit(*c, started, old_order)]
    changes = [c for c in changes if c not in unstarted]
    if not changes:
        write_record(config, run_dir)
        return [key for key, _, _ in unstarted]
    unsafe = [c for c in changes if not c[0].startswith(SAFE_ON_RESUME)]
    if unsafe or not allow_change:
        shown = unsafe or changes
        named = ", ".join(f"{key} ({a!r} -> {b!r})" for key, a, b in shown[:SHOWN])
        more = f" and {len(shown) - SHOWN} more" if len(shown) > SHOWN else ""
        hint = "start a new run for these" if unsafe else "resume with --allow-config-change for these"
        raise UsageError(f"{Path(run_dir) / 'config.yaml'} was changed since the run started: {named}{more}; "
                         f"a resume continues with the config it started with ({hint}; --allow-config-change "
                         f"allows only {', '.join(p + '*' for p in SAFE_ON_RESUME)}, and stages not started yet "
                         f"may be edited freely)")
    if unstarted:  # recorded from now on; the safe changes stay changes (named again on the next resume)
        safe_sections = {prefix.rstrip(".") for prefix in SAFE_ON_RESUME}
        write_record({key: recorded["config"].get(key, value) if key in safe_sections else value
                      for key, value in config.items()}, run_dir)
    return [key for key, _, _ in unstarted + changes]
