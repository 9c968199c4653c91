"""kill -9 mid-stage, then `opd-sao run --resume`: stages complete, no trajectory trained twice."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import yaml

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}


def _stage(name, steps, **extra):
    return {"name": name, "kind": "reasoning", "env": "arithmetic", "env_options": {"max_operand": 9},
            "steps": steps, "checkpoint_every": 3, "rollout": {"max_new_tokens": 3, "max_staleness": 2},
            "eval": {"num_tasks": 4}, "gate": {"mean_abs_diff": 1.0e-3, "p99_abs_diff": 1.0e-2}, **extra}


def _trained_records(run_dir, stage):
    path = run_dir / "stages" / stage / "trained.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sigkill_mid_stage_then_resume(tmp_path):
    config = {
        "seed": 3, "model": {"tiny": TINY}, "logging": {"wandb": False, "progress": False},
        "trainer": {"train_batch_size": 4, "critic_warmup_steps": 1, "slowdown_s": 0.25},
        "stages": [_stage("first", 3, sft={"steps": 2, "batch_size": 4}), _stage("second", 12)],
    }
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "opd_sao.cli", "run"]
    proc = subprocess.Popen([*cmd, str(cfg_path), "--run-dir", str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 240
    while len(_trained_records(run_dir, "second")) < 5:  # past the step-3 state save, mid-stage
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "the run did not reach the middle of the second stage"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first_checkpoint = run_dir / "stages" / "first" / "checkpoint" / "model.safetensors"
    first_mtime = first_checkpoint.stat().st_mtime_ns

    resumed = subprocess.run([*cmd, "--resume", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "[first] already complete, skipped" in resumed.stdout
    assert first_checkpoint.stat().st_mtime_ns == first_mtime  # the completed stage was not re-run

    summary = json.loads((run_dir / "summary.json").read_text())
    assert [s["name"] for s in summary["stages"]] == ["first", "second"]
    second = summary["stages"][1]
    assert second["resume"]["from_step"] >= 3
    assert second["resume"]["buffer_reused"] + second["resume"]["buffer_dropped_stale"] > 0  # the log was read
    metrics = (run_dir / "stages" / "second" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == list(range(12))
    assert all(json.loads(line)["staleness_max"] <= 2 for line in metrics)  # the bound holds across the resume
    records = _trained_records(run_dir, "second")
    assert [r["step"] for r in records] == list(range(12))
    ids = [traj_id for r in records for traj_id in r["traj_ids"]]
    assert len(ids) == 12 * 4 and len(set(ids)) == len(ids)  # no trajectory trained on twice
    assert (run_dir / "stages" / "second" / "checkpoint" / "config.json").is_file()
