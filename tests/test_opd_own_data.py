"""OPD on the user's own datasets (each teacher carries its domains' environment options), the refusals found
before the first stage (a domain with no tasks, a stage whose steps are all critic warm-up), and the defaults that
follow the model (a checkpoint as model.path gets real-model values for what the config leaves unset)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from opd_sao.app import cli
from opd_sao.app.pipeline import check_before_work, run_pipeline
from opd_sao.config import load_config, parse_config
from opd_sao.io.data_fingerprint import RECORD
from opd_sao.stages.domains import Domain

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"
QUIET = {"logging": {"wandb": False, "progress": False}, "torch_threads": 1}
GSM8K = {"path": str(DATA / "gsm8k.jsonl"), "prompt_key": "question", "prompt_template": "q: {prompt}\na: ",
         "reward": "math"}


def _words_file(tmp_path: Path) -> Path:
    """A second dataset with its own field names and exact-match reward: 'say it backwards' on short words."""
    words = ["cat", "dog", "sun", "pen", "cup", "hat", "map", "box", "bed", "car", "bus", "egg", "ink", "jar", "key",
             "leg", "net", "owl", "pig", "rat", "toy", "van", "web", "yak", "zip", "ant", "bat", "cow", "elk", "fox"]
    path = tmp_path / "words.jsonl"
    path.write_text("".join(json.dumps({"word": w, "backwards": w[::-1]}) + "\n" for w in words))
    return path


def _opd_config(tiny_model_dir, perturbed_teacher, words: Path) -> dict:
    words_options = {"path": str(words), "prompt_key": "word", "answer_key": "backwards",
                     "prompt_template": "backwards: {prompt} =", "eval_fraction": 0.3, "reward": "exact"}
    teachers = [{"name": "t_math", "checkpoint": str(perturbed_teacher), "domains": ["dataset:gsm8k"],
                 "env_options": GSM8K, "rollout": {"max_new_tokens": 6}},
                {"name": "t_words", "checkpoint": str(tiny_model_dir), "domains": ["dataset:words"],
                 "env_options": words_options, "eval": {"num_tasks": 3}}]
    stage = {"name": "distil", "kind": "opd", "steps": 2, "rollout": {"max_new_tokens": 4}, "eval": {"num_tasks": 2},
             "gate": {"enabled": False},
             "opd": {"granularity": "top_k", "top_k": 8, "probe_every": 0, "vocab_chunk": 128, "teachers": teachers}}
    return {"seed": 0, "model": {"path": str(tiny_model_dir)}, **QUIET, "trainer": {"train_batch_size": 4},
            "stages": [stage]}


def test_an_opd_stage_over_two_datasets_with_their_own_options_needs_no_earlier_stage(tmp_path, tiny_model_dir,
                                                                                   perturbed_teacher):
    cfg = parse_config(_opd_config(tiny_model_dir, perturbed_teacher, _words_file(tmp_path)))
    stage = cfg.stages[0]
    math, words = Domain("dataset:gsm8k", stage, cfg.stages), Domain("dataset:words", stage, cfg.stages)
    # each domain its teacher's options, episode and eval settings; the rest the stage's
    assert math.factory().make_tasks("train", 1, 0)[0]["prompt"].startswith("q: ")
    assert words.factory().make_tasks("eval", 1, 0)[0]["prompt"].startswith("backwards: ")
    assert (math.rollout.max_new_tokens, words.rollout.max_new_tokens) == (6, 4)
    assert (math.eval_cfg.num_tasks, words.eval_cfg.num_tasks) == (2, 3)
    summary = run_pipeline(cfg, tmp_path / "run", log=lambda _msg: None)
    distil = summary["stages"][0]
    assert sorted(distil["distillation"]) == ["dataset:gsm8k", "dataset:words"]
    assert distil["steps"] == 2 and all(n > 0 for n in distil["schedule"]["rollouts"].values())
    assert distil["distillation"]["dataset:words"]["teacher"] == "t_words"
    assert distil["schedule"]["rollouts"].keys() == {"dataset:gsm8k", "dataset:words"}
    # the run records both files it read (a resume refuses them changed)
    record = json.loads((tmp_path / "run" / RECORD).read_text())["distil"]
    assert "gsm8k.jsonl" in json.dumps(record) and "words.jsonl" in json.dumps(record)


def test_a_teacher_rollout_may_set_episode_settings_only():
    teacher = {"name": "t", "checkpoint": "r", "domains": ["arithmetic"], "rollout": {"temperature": 0.5}}
    stages = [{"name": "r", "kind": "reasoning", "env": "arithmetic", "steps": 20},
              {"name": "o", "kind": "opd", "opd": {"teachers": [teacher]}}]
    with pytest.raises(ValueError, match=r"teacher 't': rollout.temperature is the stage's"):
        parse_config({"stages": stages})


@pytest.mark.parametrize("teacher_options,needle", [
    (None, "stage 'distil': domain 'dataset:mine': environment 'dataset:mine' has no train tasks with no "
           "env_options"),
    ({"path": str(DATA / "gsm8k.jsonl"), "prompt_kye": "question"}, "stage 'distil': env_options of 'dataset:mine': "
                                                                     "dataset env option prompt_kye: Extra inputs"),
])
def test_an_opd_domain_that_cannot_be_built_is_refused_before_the_first_stage(tmp_path, capsys, teacher_options,
                                                                              needle):
    teacher = {"name": "t", "checkpoint": "r", "domains": ["dataset:mine"]}
    if teacher_options is not None:
        teacher["env_options"] = teacher_options
    config = {"seed": 0, "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64}}, **QUIET,
              "trainer": {"critic_warmup_steps": 0},
              "stages": [{"name": "r", "kind": "reasoning", "env": "arithmetic", "steps": 1},
                         {"name": "distil", "kind": "opd", "steps": 1, "opd": {"teachers": [teacher]}}]}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["run", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists()  # refused before the first stage: nothing written


def test_a_stage_whose_steps_are_all_critic_warm_up_is_refused_in_one_line(tmp_path, capsys):
    stage = {"name": "r", "kind": "reasoning", "env": "arithmetic", "steps": 3}
    config = {"seed": 0, **QUIET, "stages": [stage]}  # critic_warmup_steps: the default 10
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["run", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "opd-sao run: error: stage 'r': steps 3 <= trainer.critic_warmup_steps 10: the policy would never be trained "
        "(only the critic warms up); raise steps or lower critic_warmup_steps"]
    assert not (tmp_path / "run").exists()
    check_before_work(parse_config({**config, "stages": [{**stage, "algo": "grpo"}]}))  # no critic: no warm-up
    check_before_work(parse_config({**config, "stages": [{**stage, "steps": 0}]}))  # a stage that trains nothing
    check_before_work(parse_config({**config, "stages": [{**stage, "steps": 11}]}))


def test_a_checkpoint_gets_real_model_defaults_for_what_is_unset_and_its_run_keeps_them(tmp_path, tiny_model_dir):
    stage = {"name": "warm", "kind": "sft", "domains": ["arithmetic"], "sft": {"steps": 1, "batch_size": 4}}
    reasoning = {"name": "r", "kind": "reasoning", "env": "arithmetic", "steps": 20}
    config = {"seed": 0, "model": {"path": str(tiny_model_dir)}, **QUIET, "stages": [stage]}
    cfg = parse_config({**config, "stages": [stage, reasoning]})
    assert (cfg.trainer.policy_lr, cfg.trainer.critic_lr, cfg.prompt_format) == (1e-6, 1e-5, "chat")
    assert cfg.stages[1].rollout.prompt_format == "chat"  # (its tokenizer has a chat template)
    lines = cfg.tiny_defaults_left()  # one line per setting, naming the stages
    assert len(lines) == 3 and all(line.startswith(f"model.path {str(tiny_model_dir)!r} is a checkpoint: ")
                                   for line in lines)
    assert "rollout.max_new_tokens is the tiny model's default 16 in stage 'r';" in lines[0]
    assert "rollout.max_context_tokens is the tiny model's default 512 in stage 'r';" in lines[1]
    assert "sft.lr is the tiny model's default 0.003 in stage 'warm';" in lines[2]  # (sft stages generate nothing)
    # what the user set is kept
    mine = parse_config({**config, "prompt_format": "raw", "trainer": {"policy_lr": 3e-4}})
    assert (mine.trainer.policy_lr, mine.trainer.critic_lr, mine.prompt_format) == (3e-4, 1e-5, "raw")
    # the tiny model keeps its own
    tiny = parse_config({**config, "model": {"path": "tiny"}})
    assert (tiny.trainer.policy_lr, tiny.trainer.critic_lr, tiny.prompt_format) == (1e-4, 5e-4, "raw")
    assert tiny.tiny_defaults_left() == []
    # a tokenizer without a chat template: raw
    plain = shutil.copytree(tiny_model_dir, tmp_path / "plain")
    (plain / "chat_template.jinja").unlink()
    assert parse_config({**config, "model": {"path": str(plain)}}).prompt_format == "raw"
    # the run's config.yaml holds the resolved values, and --resume reads them back unchanged
    cfg, logged = parse_config(config), []
    run_pipeline(cfg, tmp_path / "run", log=logged.append)  # the run says what is left at the tiny model's
    assert logged[0] == f"warning: {cfg.tiny_defaults_left()[0]}" and "sft.lr" in logged[0]
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert written["trainer"]["policy_lr"] == 1e-6 and written["trainer"]["critic_lr"] == 1e-5
    assert written["prompt_format"] == "chat" and written["stages"][0]["rollout"]["prompt_format"] == "chat"
    resumed = load_config(tmp_path / "run" / "config.yaml")
    assert resumed.model_dump() == cfg.model_dump() and resumed.tiny_defaults_left() == []
    logged = []
    run_pipeline(resumed, tmp_path / "run", log=logged.append, resume=True)
    assert logged[0] == "[warm] already complete, skipped"
