"""Hostile configs (issue 43): names that would become paths outside the run, YAML bombs and duplicate keys,
unreadable files, bad launcher variables, numbers that cannot run, a later stage's setting that only its stage
would have found, and SIGTERM after the run has finished.

Every refusal is exit status 2 and one `opd-sao run: error:` line naming what is wrong (never a traceback), before
any work: no run directory is left and nothing outside it is touched (docs/reliability.md, "Hostile configs").
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_checks import refused as _refused
from launchers import HANG_S

from opd_sao.app import cli
from opd_sao.errors import UsageError
from opd_sao.io.files import inside


def _config(tmp_path: Path, model: str = "tiny", **stage) -> str:
    """A two-step reasoning stage `r` on the arithmetic env; `model`: a model directory (no tokenizer to build)."""
    config = {"seed": 0, "model": {"path": model}, "logging": {"wandb": False, "progress": False}, "torch_threads": 1,
              "trainer": {"train_batch_size": 4, "critic_warmup_steps": 0},
              "stages": [{"name": "r", "kind": "reasoning", "env": "arithmetic", "env_options": {"max_operand": 9},
                          "steps": 2, "rollout": {"max_new_tokens": 4, "max_context_tokens": 64},
                          "eval": {"num_tasks": 2},
                          "gate": {"enabled": False}, **stage}]}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


# ---- names that become paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../escape", "ABSOLUTE", "", ".", "a/b"],
                         ids=["dot-dot", "absolute", "empty", "dot", "separator"])
def test_a_stage_name_that_is_not_one_folder_name_is_refused(tmp_path, capsys, name):
    """Before: `../../escape` ran (exit 0) and wrote outside the run dir; an absolute name wrote into that dir and
    (keep_state none) deleted the state/ and buffer/ found there; an empty name wrote straight into stages/."""
    outside = tmp_path / "outside"
    (outside / "state").mkdir(parents=True)
    (outside / "buffer").mkdir()
    name = str(outside) if name == "ABSOLUTE" else name
    run_dir = tmp_path / "a" / "run"
    line = _refused(capsys, "run", _config(tmp_path), f"stages.0.name={name!r}", "checkpointing.keep_state=none",
                    "--run-dir", str(run_dir))
    assert "stages.0.name" in line and "folder name" in line
    assert not run_dir.exists() and not (tmp_path / "escape").exists() and not (tmp_path / "a" / "escape").exists()
    assert sorted(p.name for p in outside.iterdir()) == ["buffer", "state"]


def test_a_teacher_name_that_is_a_path_is_refused(tmp_path, capsys):
    """Before: the teacher's disk-tier copy was written at `<name>-<hash>` (an absolute name: outside the run) and
    removed with rmtree when the stage ended."""
    config = yaml.safe_load(Path(_config(tmp_path)).read_text())
    config["stages"].append({"name": "o", "kind": "opd", "domains": ["arithmetic"], "steps": 1, "opd": {
        "teachers": [{"name": str(tmp_path / "tier"), "checkpoint": "r", "domains": ["arithmetic"]}]}})
    path = tmp_path / "opd.yaml"
    path.write_text(yaml.safe_dump(config))
    line = _refused(capsys, "run", str(path), "--run-dir", str(tmp_path / "run"))
    assert "teachers.0.name" in line and "folder name" in line
    assert not (tmp_path / "run").exists()


def test_inside_refuses_paths_and_links_out_of_its_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "stages").mkdir(parents=True)
    outside.mkdir()
    (root / "stages" / "link").symlink_to(outside)
    (root / "file-link").symlink_to(outside / "f")
    assert inside(root, "stages/r/state") == root / "stages" / "r" / "state"  # need not exist yet
    assert inside(root, root / "stages") == root / "stages"
    for path in ("../outside", str(outside), "stages/link", "stages/link/state", "file-link"):
        with pytest.raises(UsageError, match="leads outside"):
            inside(root, path)


def test_a_stage_dir_linked_outside_the_run_is_neither_written_nor_emptied(tmp_path, capsys, tiny_model_dir):
    """A run dir whose stages/r is a symlink to another place holding state/ and buffer/: refused at stage start,
    the other place untouched (before: the stage wrote there and, keep_state none, deleted both)."""
    outside = tmp_path / "outside"
    for part in ("state", "buffer"):
        (outside / part).mkdir(parents=True)
        (outside / part / "keep.txt").write_text("mine")
    run_dir = tmp_path / "run"
    (run_dir / "stages").mkdir(parents=True)
    (run_dir / "stages" / "r").symlink_to(outside)
    line = _refused(capsys, "run", _config(tmp_path, str(tiny_model_dir)), "checkpointing.keep_state=none",
                    "--run-dir", str(run_dir))
    assert "leads outside" in line
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == [
        "buffer", "buffer/keep.txt", "state", "state/keep.txt"]


# ---- YAML and the config file ----------------------------------------------------------------------------------


BOMB = "".join(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("text, needle", [
    ("trainer:\n  deepspeed_config:\n    a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
     + "".join("    " + line + "\n" for line in BOMB.splitlines()), "alias bomb"),
    ("stages: [{name: r, kind: reasoning, env: arithmetic}]\nseed: 1\nstages: []\n",
     "line 3: key 'stages' is set twice (first on line 1)"),
    ("trainer: {deepspeed_config: " + "[" * 100 + "]" * 100 + "}\n", "levels deep"),
], ids=["alias-bomb", "duplicate-key", "deep-nesting"])
def test_hostile_yaml_is_one_line(tmp_path, capsys, text, needle):
    """Before: the ~900-byte alias bomb grew past 3 GB and died; a second `stages:` silently replaced the first."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    line = _refused(capsys, "run", str(path), "--run-dir", str(tmp_path / "run"))
    assert str(path) in line and needle in line
    assert not (tmp_path / "run").exists()


def test_an_alias_bomb_in_an_override_is_one_line(tmp_path, capsys):
    bomb = "{a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol], " + BOMB.replace("\n", ", ") + "}"
    line = _refused(capsys, "run", _config(tmp_path), f"trainer.deepspeed_config={bomb}",
                    "--run-dir", str(tmp_path / "run"))
    assert "override 'trainer.deepspeed_config=" in line and "alias bomb" in line


@pytest.mark.parametrize("case", ["not-utf8", "directory", "unreadable"])
def test_a_config_file_that_cannot_be_read_is_one_line(tmp_path, capsys, case):
    path = tmp_path / "run.yaml"
    if case == "not-utf8":
        path.write_bytes(b"seed: 0\nstages: [{name: \xff\xfe}]\n")
        needle = "is not UTF-8 text (byte 0xff at offset 24)"
    elif case == "directory":
        path.mkdir()
        needle = "is not a file"
    else:
        Path(_config(tmp_path)).chmod(0)
        if os.access(path, os.R_OK):
            pytest.skip("this user (root) reads a mode-000 file; the directory case covers an unreadable path")
        needle = "cannot read config file"
    line = _refused(capsys, "run", str(path), "--run-dir", str(tmp_path / "run"))
    assert str(path) in line and needle in line


# ---- launcher variables ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("env, needle", [({"RANK": "abc"}, "RANK='abc' is not a whole number"),
                                         ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number"),
                                         ({"RANK": "2", "WORLD_SIZE": "2"}, "a rank is in [0, WORLD_SIZE)")],
                         ids=["rank", "world-size", "rank-past-world"])
def test_bad_launcher_variables_are_refused_before_any_work(tmp_path, capsys, monkeypatch, env, needle):
    """Before: RANK=abc was a ValueError traceback; WORLD_SIZE=abc one only after the whole run had finished."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    line = _refused(capsys, "run", _config(tmp_path), "--run-dir", str(tmp_path / "run"))
    assert needle in line
    assert not (tmp_path / "run").exists()


# ---- numbers that cannot run -----------------------------------------------------------------------------------


@pytest.mark.parametrize("override, needle", [
    ("trainer.slowdown_s=.inf", "trainer.slowdown_s: Input should be a finite number"),
    ("trainer.policy_lr=.inf", "trainer.policy_lr: Input should be a finite number"),
    ("trainer.policy_lr=.nan", "trainer.policy_lr: Input should be a finite number"),
    ("stages.r.rl.alpha=1e-300", "stages.0.rl.alpha: Input should be greater than or equal to 1"),
    ("stages.r.env_options.max_operand=1000000000000000000000", "max_operand must be a whole number in 1..999"),
    ("model.tiny.num_heads=3", "hidden_size 64 must be a multiple of 2 x num_heads 3"),
    ("model.tiny.num_kv_heads=8", "num_kv_heads 8 must divide num_heads 4"),
    ("model.tiny.num_kv_heads=3", "num_kv_heads 3 must divide num_heads 4"),
    ("trainer.train_batch_size=100000000000000000000000", "trainer.train_batch_size: Input should be less than or "
                                                          "equal to 1048576"),
    ("stages.r.steps=true", "stages.0.steps: Value error, a number is needed, not the boolean true"),
    ("torch_threads=1000000000", "torch_threads: Input should be less than or equal to 4096"),
], ids=["slowdown-inf", "lr-inf", "lr-nan", "alpha-tiny", "max-operand-huge", "heads-not-dividing-hidden",
        "kv-heads-above-heads", "kv-heads-not-dividing", "batch-huge", "steps-true", "threads-huge"])
def test_numbers_that_cannot_run_are_refused_before_any_work(tmp_path, capsys, override, needle):
    """Before: each was accepted; then a run that never ended (inf slowdown, 10**23 batch, 10**21 operand), NaN
    weights (inf lr, alpha 1e-300), a model build error mid-run (heads), or `steps: true` read as 1."""
    line = _refused(capsys, "run", _config(tmp_path), override, "--run-dir", str(tmp_path / "run"))
    assert needle.replace("Value error, ", "") in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env, options, needle", [
    ("reasoning_gym", {"task": "basic_arithmetic", "task_options": {"max_digits": 1_000_000}},
     "generating its items failed: ValueError: Exceeds the limit (4300 digits)"),
    ("reasoning_gym", {"task": "basic_arithmetic", "task_options": {"max_digits": float("inf")}},
     "generating its items failed: OverflowError: cannot convert float infinity to integer"),
    ("reasoning_gym", {"task": "chain_sum", "train_size": 10**9}, "train_size: Input should be less than or equal "
                                                                  "to 100000"),
    ("dataset", {"metadata_keys": ["prompt"]}, "metadata_keys: 'prompt' is prompt_template's name"),
    ("dataset", {"metadata_keys": ["a", "a"]}, "metadata_keys: 'a' is listed twice"),
    ("dataset", {"prompt_key": ""}, "prompt_key: a field name is needed, not an empty string"),
    ("dataset", {"eval_fraction": 0.5, "split": True}, "eval_fraction: it splits `path`'s rows"),
], ids=["rg-digits-huge", "rg-digits-inf", "rg-size-huge", "ds-metadata-prompt", "ds-metadata-twice", "ds-key-empty",
        "ds-fraction-unused"])
def test_environment_option_values_are_refused_before_any_work(tmp_path, capsys, env, options, needle):
    """Before: each was accepted by the options check and failed at stage start with a traceback (reasoning-gym
    generating its items, `str.format` given `prompt` twice) or not at all (a billion items generated in memory,
    an empty key numbering every row, an eval_fraction that separate train and eval files ignore)."""
    if env == "dataset":
        rows = tmp_path / "rows.jsonl"
        rows.write_text("".join(f'{{"id": "q{i}", "prompt": "{i}+{i}=", "answer": "{2 * i}", "a": 1}}\n'
                                for i in range(20)))
        files = {"train_path": str(rows), "eval_path": str(rows)} if options.pop("split", False) else {"path": str(rows)}
        options = {**files, **options}
    line = _refused(capsys, "run", _config(tmp_path, env=env, env_options=options), "--run-dir", str(tmp_path / "run"))
    assert line.startswith(f"opd-sao run: error: stage 'r': env_options of {env!r}: ") and needle in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, needle", [
    ("engine.weight_sync_options={bucket_mb: 64}",
     "engine.weight_sync 'disk': weight_sync_options.bucket_mb: Extra inputs are not permitted"),
    ("engine.routing=round_robin", "engine.routing 'round_robin': use one of least_loaded"),
], ids=["weight-sync-option", "routing"])
def test_an_unknown_weight_sync_option_or_routing_policy_is_refused_before_any_work(tmp_path, capsys, override,
                                                                                     needle):
    """A registry's name or a component's `Options` key, refused in one line naming it (the built-in modes take no
    options: the key is a typo of engine.weight_sync_bucket_mb); the embedded engine's config is checked too."""
    line = _refused(capsys, "run", _config(tmp_path), override, "--run-dir", str(tmp_path / "run"))
    assert needle in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--port", "0"], ["--port", "1", "--threads", "-1"]],
                         ids=["port-above", "port-zero", "threads-negative"])
def test_serve_refuses_ports_and_thread_counts_out_of_range(tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as stop:
        cli.main(["serve", str(tmp_path), *argv])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"opd-sao serve: error: argument {argv[-2]}: ") and "is not in" in last


# ---- a later stage's setting -----------------------------------------------------------------------------------


def test_an_opd_top_k_above_the_vocabulary_is_refused_before_the_first_stage(tmp_path, capsys, tiny_model_dir):
    """Before: the reasoning stage trained first, then the OPD stage failed at its start."""
    config = yaml.safe_load(Path(_config(tmp_path, str(tiny_model_dir))).read_text())
    config["stages"].append({"name": "o", "kind": "opd", "domains": ["arithmetic"], "steps": 1, "opd": {
        "top_k": 100_000, "teachers": [{"name": "t", "checkpoint": "r", "domains": ["arithmetic"]}]}})
    path = tmp_path / "opd.yaml"
    path.write_text(yaml.safe_dump(config))
    line = _refused(capsys, "run", str(path), "--run-dir", str(tmp_path / "run"))
    assert "stage 'o': opd.top_k 100000 is more than the base model's vocabulary" in line
    assert not (tmp_path / "run").exists()  # nothing ran: the run dir is removed


# ---- SIGTERM once the run has finished -------------------------------------------------------------------------


def test_sigterm_after_run_finished_exits_0_without_a_traceback(tmp_path, tiny_model_dir):
    """Before: the signal raised KeyboardInterrupt into the summary's printing or the interpreter's teardown: a
    traceback, after a run that had finished."""
    proc = subprocess.Popen([sys.executable, "-m", "opd_sao.app.cli", "run", _config(tmp_path, str(tiny_model_dir)),
                             "--run-dir", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if line.startswith("run finished:"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()
