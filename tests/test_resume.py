"""kill -9 mid-stage, then `opd-sao run --resume`: in every stage kind, nothing is trained twice.

One run holds one stage of each kind (sft, reasoning, agent, chat, opd). It is started as a real subprocess and
killed with SIGKILL in the middle of each stage in turn (once the stage has saved resumable state and trained
past it), each time resumed with `--resume`; the last resume completes it. Between the first kill and resume,
an edited config.yaml is refused.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import yaml
from launchers import HANG_S

from opd_sao.app import cli

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
RL_STEPS, SFT_STEPS, BATCH, EVERY = 6, 150, 4, 2
RL_COMMON = {"steps": RL_STEPS, "checkpoint_every": EVERY, "eval": {"num_tasks": 2}, "gate": {"probe_size": 2},
             "rollout": {"max_new_tokens": 3, "max_staleness": 2}}


def _config() -> dict:
    stages = [
        {"name": "warm", "kind": "sft", "domains": ["arithmetic"], "checkpoint_every": 5,
         "sft": {"steps": SFT_STEPS, "batch_size": 16}},
        {"name": "reason", "kind": "reasoning", "env": "arithmetic", "env_options": {"max_operand": 9}, **RL_COMMON},
        {"name": "agent", "kind": "agent", "env": "code", "env_options": {"allow_rlimit_only": True, "tests": 1},
         **RL_COMMON, "rollout": {"max_new_tokens": 6, "max_turns": 2, "max_staleness": 2}},
        {"name": "chat", "kind": "chat", "env": "chat", "env_options": {"judge": "rule"}, **RL_COMMON},
        {"name": "opd", "kind": "opd", "domains": ["arithmetic"], **RL_COMMON,
         "opd": {"probe_every": 0,  # a fixed budget: a probe would end it at step 0 (its teacher scores 0)
                 "teachers": [{"name": "t", "checkpoint": "reason", "domains": ["arithmetic"]}]}},
    ]
    return {"seed": 3, "model": {"tiny": TINY}, "logging": {"wandb": False, "progress": False},
            "eval_domains": ["arithmetic"],
            "trainer": {"train_batch_size": BATCH, "critic_warmup_steps": 1, "slowdown_s": 0.2}, "stages": stages}


def _records(run_dir, stage, name="trained.jsonl"):
    path = run_dir / "stages" / stage / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def _mid_stage(run_dir, stage: str, kind: str) -> bool:
    """Resumable state saved and training past it: a kill now loses steps that must not count as trained."""
    if kind == "sft":
        return (run_dir / "stages" / stage / "sft_state" / "loop.json").is_file()
    return (run_dir / "stages" / stage / "state" / "loop.json").is_file() and len(_records(run_dir, stage)) > EVERY


def _launch(args, log):
    return subprocess.Popen([sys.executable, "-m", "opd_sao.app.cli", "run", *args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill_mid(proc, run_dir, stage, kind, log_path):
    deadline = time.time() + HANG_S
    while not _mid_stage(run_dir, stage, kind):
        assert proc.poll() is None, log_path.read_text()
        assert time.time() < deadline, f"the run did not reach the middle of stage {stage!r}"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "stages" / stage / "checkpoint" / "config.json").exists(), f"{stage} finished before the kill"


def _refuse_edited_config(run_dir, capsys):
    """An edited config.yaml is refused, naming the field (a started stage's or a run-wide one); a logging change
    only with --allow-config-change."""
    path = run_dir / "config.yaml"
    original = path.read_text()
    for edit, named in [(lambda c: c["stages"][0]["domains"].append("code"), "stages.warm.domains"),
                        (lambda c: c["stages"][0]["sft"].update(steps=300), "stages.warm.sft.steps"),
                        (lambda c: c["trainer"].update(train_batch_size=8), "trainer.train_batch_size")]:
        config = yaml.safe_load(original)
        edit(config)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        for flag in ([], ["--allow-config-change"]):
            assert cli.main(["run", "--resume", str(run_dir), *flag]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and named in err[0] and "was changed since the run started" in err[0], err
    config = yaml.safe_load(original)
    config["logging"]["progress"] = True
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    assert cli.main(["run", "--resume", str(run_dir)]) == 2
    assert "logging.progress (False -> True)" in capsys.readouterr().err  # safe, but not without the flag


def test_sigkill_mid_stage_of_every_kind_then_resume(tmp_path, capsys):
    config = _config()
    cfg_path, run_dir, log_path = tmp_path / "run.yaml", tmp_path / "run", tmp_path / "run.log"
    cfg_path.write_text(yaml.safe_dump(config))
    kinds = [(s["name"], s["kind"]) for s in config["stages"]]
    mtimes: dict[str, int] = {}
    with log_path.open("w") as log:
        proc = _launch([str(cfg_path), "--run-dir", str(run_dir)], log)
    _kill_mid(proc, run_dir, *kinds[0], log_path)
    _refuse_edited_config(run_dir, capsys)  # config.yaml now differs in logging.progress only
    for i, (stage, kind) in enumerate(kinds[1:], start=1):
        with log_path.open("w") as log:
            proc = _launch(["--resume", str(run_dir), "--allow-config-change"], log)
        _kill_mid(proc, run_dir, stage, kind, log_path)
        out = log_path.read_text()
        assert "resuming with changed logging.progress" in out
        for done, _ in kinds[:i - 1]:  # completed before this process started: skipped, not re-run
            assert f"[{done}] already complete, skipped" in out
            assert (run_dir / "stages" / done / "checkpoint" / "model.safetensors").stat().st_mtime_ns == mtimes[done]
        previous = kinds[i - 1][0]
        mtimes[previous] = (run_dir / "stages" / previous / "checkpoint" / "model.safetensors").stat().st_mtime_ns
    resumed = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", "run", "--resume", str(run_dir),
                              "--allow-config-change"], capture_output=True, text=True, timeout=HANG_S)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    summary = {s["name"]: s for s in json.loads((run_dir / "summary.json").read_text())["stages"]}
    assert list(summary) == [name for name, _ in kinds]
    warm = summary["warm"]  # SFT: continued from its last saved step, drawing what an uninterrupted run draws
    assert 5 <= warm["resume"]["sft_from_step"] < SFT_STEPS
    sft_log = _records(run_dir, "warm", "sft.jsonl")
    assert [r["step"] for r in sft_log] == list(range(SFT_STEPS))
    rng, pool = random.Random(config["seed"]), warm["examples_per_domain"]
    assert [i for r in sft_log for i in r["examples"]] == [rng.randrange(pool) for _ in range(SFT_STEPS * 16)]
    assert not (run_dir / "stages" / "warm" / "sft_state").exists()
    for stage, _ in kinds[1:]:  # RL and OPD: every step once, every trajectory trained on once
        assert summary[stage]["resume"]["from_step"] >= EVERY, stage
        assert summary[stage]["processes"] == 2, stage  # its cost: the killed process's share (saved with its
        # state) and the resumed one's
        resume = summary[stage]["resume"]
        assert resume["buffer_reused"] + resume["buffer_dropped_stale"] > 0, stage  # the write-ahead log was read
        metrics = _records(run_dir, stage, "metrics.jsonl")
        assert [m["step"] for m in metrics] == list(range(RL_STEPS)), stage
        assert all(m["staleness_max"] <= 2 for m in metrics), stage  # the bound holds across the resume
        records = _records(run_dir, stage)
        assert [r["step"] for r in records] == list(range(RL_STEPS)), stage
        ids = [traj_id for r in records for traj_id in r["traj_ids"]]
        assert len(ids) == RL_STEPS * BATCH and len(set(ids)) == len(ids), stage
        assert (run_dir / "stages" / stage / "checkpoint" / "config.json").is_file()


@pytest.mark.parametrize("flag", [[], ["--allow-config-change"]])
def test_the_fingerprint_passes_the_same_config_and_a_logging_change_only_with_the_flag(tmp_path, flag):
    from opd_sao.config import parse_config
    from opd_sao.io.fingerprint import check_resume, write_record

    config = parse_config(_config()).model_dump(mode="json")
    write_record(config, tmp_path)
    assert check_resume(config, tmp_path, allow_change=bool(flag)) == []
    changed = json.loads(json.dumps(config))
    changed["logging"]["wandb_project"] = "other"
    if flag:
        assert check_resume(changed, tmp_path, allow_change=True) == ["logging.wandb_project"]
    else:
        with pytest.raises(ValueError, match=r"logging.wandb_project \('opd-sao' -> 'other'\).*--allow-config-change"):
            check_resume(changed, tmp_path)


def test_a_resume_accepts_edits_to_stages_not_started_and_refuses_edits_to_started_ones(tmp_path):
    """warm finished, reason interrupted (files in their directories); agent, chat and opd not started."""
    from opd_sao.config import parse_config
    from opd_sao.io.fingerprint import RECORD, check_resume, write_record

    config = parse_config(_config()).model_dump(mode="json")
    write_record(config, tmp_path)
    for stage in ("warm", "reason"):
        (tmp_path / "stages" / stage / "state").mkdir(parents=True)
        (tmp_path / "stages" / stage / "state" / "loop.json").write_text("{}")
    (tmp_path / "stages" / "agent").mkdir()  # a directory without a file: not started

    def edited(change):  # the recorded config (accepted edits included), changed
        copy = json.loads((tmp_path / RECORD).read_text())["config"]
        change(copy)
        return copy

    def stage(c, name):
        return next(s for s in c["stages"] if s["name"] == name)

    accepted = [
        (lambda c: stage(c, "opd")["opd"]["teachers"][0].update(checkpoint="warm"), ["stages.opd.opd.teachers.t.checkpoint"]),
        (lambda c: stage(c, "chat").update(steps=60), ["stages.chat.steps"]),
        (lambda c: c["stages"].append({**stage(c, "reason"), "name": "reason2"}), ["stages.order"]),
        (lambda c: c["stages"].remove(stage(c, "agent")), ["stages.order"]),
    ]
    for change, named in accepted:
        new = edited(change)
        assert check_resume(new, tmp_path) == named
        assert check_resume(new, tmp_path) == []  # recorded: the next resume sees no change
    refused = [
        (lambda c: stage(c, "reason").update(steps=60), r"stages\.reason\.steps \(6 -> 60\)"),
        (lambda c: stage(c, "warm")["sft"].update(lr=1.0), r"stages\.warm\.sft\.lr"),
        (lambda c: c["trainer"].update(policy_lr=1.0), r"trainer\.policy_lr"),
        (lambda c: c["stages"].remove(stage(c, "warm")), r"stages\.order"),
        (lambda c: c["stages"].insert(1, {**stage(c, "chat"), "name": "chat0"}), r"stages\.order"),
        (lambda c: (stage(c, "chat").update(steps=7), stage(c, "reason").update(steps=7)), r"stages\.reason\.steps"),
    ]
    for change, needle in refused:
        with pytest.raises(ValueError, match=needle):
            check_resume(edited(change), tmp_path)
        with pytest.raises(ValueError, match=needle):  # the flag is for logging settings only
            check_resume(edited(change), tmp_path, allow_change=True)
    assert stage(json.loads((tmp_path / RECORD).read_text())["config"], "chat")["steps"] == 60  # refusals record nothing


def test_a_setting_added_by_an_upgrade_does_not_block_a_resume(tmp_path):
    """A run recorded before a config field existed resumes after the upgrade; edits to recorded fields still fail."""
    from opd_sao.config import parse_config
    from opd_sao.io.fingerprint import check_resume, write_record

    config = parse_config(_config()).model_dump(mode="json")
    older = json.loads(json.dumps(config))
    del older["device"], older["stages"][0]["rollout"]["prompt_format"]  # settings this session added
    write_record(older, tmp_path)
    (tmp_path / "stages" / "warm").mkdir(parents=True)
    (tmp_path / "stages" / "warm" / "sft.jsonl").write_text("")  # started: its settings are fixed
    assert check_resume(config, tmp_path) == []
    edited = json.loads(json.dumps(config))
    edited["stages"][0]["sft"]["steps"] += 1  # (an sft stage's own steps: its config.yaml holds no other)
    with pytest.raises(ValueError, match=r"stages\.warm\.sft\.steps"):
        check_resume(edited, tmp_path)
