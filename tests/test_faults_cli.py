"""Hostile and careless input to `opd-sao run` and `opd-sao sandbox run`: one clear line, checked before any work.

Every case is refused with exit status 2 and one line that names what is wrong (never a traceback), and a
refused run leaves no run directory behind. The resume cases (an edited config.yaml) are in test_resume.py,
where a real interrupted run exists.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from cli_checks import refused as _refused

from opd_sao.app import cli
from opd_sao.envs import register_env
from opd_sao.envs.arithmetic import ArithmeticEnv

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}


@register_env("test-faults-noop-scores")
class NoopScoresEnv(ArithmeticEnv):
    """Fails the validity check at stage start (an empty answer scores 1): a failure after the run dir exists."""

    def step(self, action):
        return "", float(action.strip() in ("", self.task["answer"])), True


def _config(tmp_path, **stage):
    config = {"seed": 0, "model": {"tiny": TINY}, "logging": {"wandb": False, "progress": False},
              "trainer": {"train_batch_size": 4, "critic_warmup_steps": 0},
              "stages": [{"name": "r", "kind": "reasoning", "env": "arithmetic", "env_options": {"max_operand": 9},
                          "steps": 2, **stage}]}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)




@pytest.mark.parametrize("override", ["steps=[1", "stages.r.steps=[1", "trainer={policy_lr: 1"])
def test_an_override_whose_value_is_bad_yaml(tmp_path, capsys, override):
    line = _refused(capsys, "run", _config(tmp_path), override, "--run-dir", str(tmp_path / "run"))
    assert f"override {override!r}" in line and "not valid YAML" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("inside", [False, True])
def test_a_run_dir_that_is_a_file(tmp_path, capsys, inside):
    occupied = tmp_path / "notes.txt"
    occupied.write_text("mine")
    run_dir = occupied / "run" if inside else occupied
    line = _refused(capsys, "run", _config(tmp_path), "--run-dir", str(run_dir))
    assert str(run_dir) in line and ("is a file" in line or "Not a directory" in line)
    assert occupied.read_text() == "mine"


def test_an_unknown_env_option_names_the_stage_and_key_before_any_work(tmp_path, capsys):
    line = _refused(capsys, "run", _config(tmp_path), "stages.r.env_options.max_operandd=9",
                    "--run-dir", str(tmp_path / "run"))
    assert "stage 'r'" in line and "'max_operandd'" in line and "max_operand" in line
    assert not (tmp_path / "run").exists()  # the base model was not built


@pytest.mark.parametrize("options, needle", [
    ({"judge": "gpt"}, "judge: unknown reward 'gpt'"),
    ({"judge_options": {"min_wordz": 2}}, "judge_options of 'rule': unknown option 'min_wordz'"),
    ({"judge": "reward_model"}, "judge_options of 'reward_model': missing option 'path'"),
    ({"judge": "noisy", "judge_options": {"inner_options": {"x": 1}}},
     "judge_options.inner_options of 'rule': unknown option 'x'"),
    ({"judge": "noisy", "judge_options": {"miss_rate": "high"}},
     "judge_options of 'noisy': miss_rate: Input should be a valid number"),  # options are typed
])
def test_bad_judge_options_are_refused_before_any_work(tmp_path, capsys, options, needle):
    config = _config(tmp_path, env="chat", env_options=options)
    line = _refused(capsys, "run", config, "--run-dir", str(tmp_path / "run"))
    assert "stage 'r'" in line and needle in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("options, needle", [({"path": "x.jsonl", "answer_kee": "a"}, "answer_kee"),
                                             ({"path": "x.jsonl", "reward": "nope"}, "unknown reward 'nope'")])
def test_bad_dataset_env_options_are_refused_before_any_work(tmp_path, capsys, options, needle):
    line = _refused(capsys, "run", _config(tmp_path, env="dataset:mine", env_options=options),
                    "--run-dir", str(tmp_path / "run"))
    assert "stage 'r'" in line and needle in line
    assert not (tmp_path / "run").exists()


def test_a_huge_seed_names_the_field_before_the_run_dir_is_written(tmp_path, capsys):
    line = _refused(capsys, "run", _config(tmp_path), f"seed={10**23}", "--run-dir", str(tmp_path / "run"))
    assert "seed" in line and str(10**23) in line
    assert not (tmp_path / "run").exists()


def test_a_bad_per_stage_trainer_key_names_the_stage(tmp_path, capsys):
    line = _refused(capsys, "run", _config(tmp_path, trainer={"policy_lrr": 1e-3}), "--run-dir", str(tmp_path / "run"))
    assert "stages.0.trainer.policy_lrr: Extra inputs are not permitted" in line
    assert not (tmp_path / "run").exists()


def test_eval_domains_that_are_no_stages_env_are_refused_before_any_work(tmp_path, capsys):
    line = _refused(capsys, "run", _config(tmp_path), "eval_domains=[code]", "--run-dir", str(tmp_path / "run"))
    assert "eval_domains ['code']" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("existed", [False, True])
def test_a_failure_before_any_stage_output_leaves_no_run_dir(tmp_path, capsys, tiny_model_dir, existed):
    """The environment fails its validity check at stage start, after the run dir was written: what the run
    created is removed; what was there before stays."""
    run_dir = tmp_path / "run"
    if existed:
        run_dir.mkdir()
        (run_dir / "mine.txt").write_text("mine")
    config = _config(tmp_path, env="test-faults-noop-scores", env_options={})
    line = _refused(capsys, "run", config, f"model.path={tiny_model_dir}", "--run-dir", str(run_dir))
    assert "fails its validity check" in line
    if existed:
        assert [p.name for p in run_dir.iterdir()] == ["mine.txt"]
    else:
        assert not run_dir.exists()


@pytest.mark.parametrize("flag, value", [("--wall-s", "inf"), ("--wall-s", "nan"), ("--wall-s", "1e300"),
                                         ("--wall-s", "-1"), ("--cpu-s", "0"), ("--memory-mb", str(10**20)),
                                         ("--output-bytes", "-5")])
def test_sandbox_refuses_limits_that_are_not_finite_and_positive(tmp_path, capsys, flag, value):
    program = tmp_path / "p.py"
    program.write_text("print(1)\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sandbox", "run", str(program), flag, value, "--allow-rlimit-only"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"opd-sao sandbox run: error: argument {flag}: ")


def test_allow_config_change_without_resume_is_refused(tmp_path, capsys):
    line = _refused(capsys, "run", _config(tmp_path), "--allow-config-change", "--run-dir", str(tmp_path / "run"))
    assert "--allow-config-change only applies with --resume" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv", [["serve", "nowhere", "--port", "1"], ["run", "nowhere.yaml"]])
def test_a_user_error_found_before_any_work_is_reported_without_importing_torch(argv, tmp_path):
    """The line comes at once (0.3 CPU-s): serve's argument checks and a missing config file run before torch, and
    a user error's way out of `main` does not import the gate (5 CPU-s each, before)."""
    probe = ("import json, sys; from opd_sao.app.cli import main; code = main(%r); "
             "print(json.dumps([code, [m for m in ('torch', 'transformers') if m in sys.modules]]))" % (argv,))
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert json.loads(done.stdout.splitlines()[-1]) == [2, []], done
    assert done.stderr.startswith(f"opd-sao {argv[0]}: error:") and len(done.stderr.splitlines()) == 1, done.stderr


def test_the_cache_command_does_not_import_torch(tmp_path):
    """`opd-sao cache verify|inspect` read the store with numpy and zarr: the encoders that need torch are imported
    only by a writer that uses them (2.5 CPU-s a command before)."""
    import numpy as np

    from opd_sao.cache import CacheMeta, LogitCache, TeacherRecord

    teacher = LogitCache(tmp_path / "cache").open_teacher(CacheMeta("t", "ckpt", 16, "tok", "sampled"))
    teacher.put("traj-1", TeacherRecord(sampled_logp=np.array([-0.5, -2.0], np.float32)))
    for argv, code in ((["cache", "verify", "cache"], 0), (["cache", "inspect", "cache"], 0),
                       (["cache", "verify", "nowhere"], 2)):
        probe = ("import json, sys; from opd_sao.app.cli import main; code = main(%r); "
                 "print(json.dumps([code, [m for m in ('torch', 'transformers') if m in sys.modules]]))" % (argv,))
        done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert json.loads(done.stdout.splitlines()[-1]) == [code, []], (argv, done)
