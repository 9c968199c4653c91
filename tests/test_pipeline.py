"""End to end: `opd-sao run` on the tiny model, and the CLI's handling of bad input."""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_checks import refused
from launchers import HANG_S
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd_sao.app.pipeline import run_pipeline
from opd_sao.config import ConfigError, parse_config
from opd_sao.io.timing import PHASES

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}


def _config(**stage_overrides):
    stage = {"name": "reasoning", "kind": "reasoning", "env": "arithmetic", "env_options": {"max_operand": 9},
             "steps": 4, "sft": {"steps": 3, "batch_size": 8}, "rollout": {"max_new_tokens": 4},
             "eval": {"num_tasks": 8}, **stage_overrides}
    return {"seed": 1, "model": {"tiny": TINY}, "logging": {"wandb": False, "progress": False},
            "trainer": {"train_batch_size": 4, "critic_warmup_steps": 1}, "stages": [stage]}


@pytest.mark.parametrize("algo", ["sao", "grpo", "grpo_dis", "ppo", "running_mean"])
def test_reasoning_stage_end_to_end(tmp_path, algo, capsys):
    overrides = {"rollout": {"max_new_tokens": 4, "group_size": 2}} if algo.startswith("grpo") else {}
    cfg = parse_config(_config(algo=algo, **overrides))
    summary = run_pipeline(cfg, tmp_path, log=lambda m: None)
    stage = summary["stages"][0]
    assert stage["name"] == "reasoning" and stage["kind"] == "reasoning" and stage["algo"] == algo
    assert set(stage["eval_before"]) == set(stage["eval_after"]) == {"arithmetic"}
    assert "arithmetic" in stage["eval_init"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["stages"][0]["eval_after"] == stage["eval_after"]
    stage_dir = tmp_path / "stages" / "reasoning"
    metrics = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4
    assert {"reward_mean", "mask_fraction", "staleness_hist", "trainer_idle_fraction", "samples_per_s"} <= set(metrics[-1])
    for line in metrics:  # where each step's time went; the phases never add up past the step (4-place rounding)
        phases = [line[f"time/{p}"] for p in PHASES]
        assert all(t >= 0 for t in phases) and sum(phases) <= line["time/step"] + 1e-3, line
    assert metrics[-1]["time/policy"] > 0  # (a critic algorithm's first step only warms the critic up)
    assert (metrics[0]["time/critic"] > 0) == (algo in ("sao", "ppo"))  # only critic algorithms spend time there
    assert stage["wall_s"] > 0 and stage["cpu_s"] > 0 and stage["peak_rss_mb"] > 0
    assert {"sft", "evaluation", "policy", "gate", "checkpoint", "generation"} <= set(stage["phases_s"])
    assert sum(stage["phases_s"].values()) <= stage["wall_s"] + 0.1  # totals rounded to 0.01 s, wall time to 0.1 s
    for field in ("eval_init_error", "eval_before_error", "eval_after_error"):
        assert stage[field]["arithmetic"]["n"] == 8 and stage[field]["arithmetic"]["stderr"] >= 0
    report = (tmp_path / "report.md").read_text()
    assert re.search(r"\| arithmetic \| \d\.\d{3} ± \d\.\d{3} \(n=8\) \|", report)
    assert "## Time and memory per stage" in report
    assert re.search(r"\| reasoning \| [\d.]+ \| \d+ \| ", report.split("Time and memory")[1])  # wall s, CPU s
    trained = [t for line in (stage_dir / "trained.jsonl").read_text().splitlines() for t in json.loads(line)["traj_ids"]]
    assert len(trained) == 16 and len(set(trained)) == 16
    # the end of the line: plain transformers loads the checkpoint with its tokenizer, in the configured shape, and
    # it is the trained model (its logits are not the base model's)
    model = AutoModelForCausalLM.from_pretrained(stage_dir / "checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(stage_dir / "checkpoint")
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (TINY["hidden_size"], TINY["num_layers"])
    ids = tokenizer("3+4=", return_tensors="pt").input_ids
    with torch.no_grad():
        logits, base = model(ids).logits, AutoModelForCausalLM.from_pretrained(tmp_path / "base_model")(ids).logits
    assert logits.shape[-1] >= len(tokenizer) and torch.isfinite(logits).all()
    assert not torch.allclose(logits, base)
    if algo == "sao":
        _check_samples(tmp_path, cfg, capsys)


def _check_samples(run_dir: Path, cfg, capsys) -> None:
    """`opd-sao samples` shows each held-out task's first sample as the evaluation drew it: the same rewards as the
    evaluation's first sample of those tasks; a stage the run lacks is one line."""
    from opd_sao.app import cli
    from opd_sao.checkpoints import load_tokenizer
    from opd_sao.runs.evaluation import episode_rewards
    from opd_sao.stages.domains import Domain

    capsys.readouterr()
    assert cli.main(["samples", str(run_dir), "--stage", "reasoning", "--n", "3"]) == 0
    shown = re.findall(r"^=== arithmetic, task (\S+): reward (\S+)$", capsys.readouterr().out, re.M)
    assert len(shown) == 3
    domain = Domain("arithmetic", None, cfg.stages, cfg.device)
    rewards = episode_rewards(run_dir / "stages" / "reasoning" / "checkpoint", domain.factory,
                              load_tokenizer(run_dir / "base_model"), domain="arithmetic", rollout=domain.eval_rollout,
                              eval_cfg=domain.eval_cfg, seed=cfg.seed, attn_implementation=cfg.model.attn_implementation)
    assert [(task, float(reward)) for task, reward in shown] == [(t, r[0]) for t, r in list(rewards.items())[:3]]
    assert cli.main(["samples", str(run_dir), "--stage", "chat"]) == 2
    assert "the run's stages are reasoning (or base)" in capsys.readouterr().err


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "opd_sao.app.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=HANG_S)


def test_invalid_config_is_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - {name: r, kind: reasoning, env: arithmetic, algo: sarsa}\n")
    line = refused(capsys, "run", str(bad))  # in this process: a subprocess spends ~5 CPU-s on imports for one line
    assert line.startswith("opd-sao run: error: stages.0.algo: unknown algo 'sarsa'; registered: ")
    registered = line.split("registered: ")[1].split(" (got")[0].split(", ")  # with any algorithm another test of
    assert {"grpo", "grpo_dis", "ppo", "running_mean", "sao"} <= set(registered)  # this process registered


@pytest.mark.parametrize("override,needle", [
    ("trainer.policy_lr=-1", "trainer.policy_lr"),
    ("stages.nope.steps=3", "no list item 'nope'"),
    ("stages.0.kind=dance", "unknown stage kind 'dance'"),
])
def test_bad_overrides_are_reported(tmp_path, override, needle, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("stages:\n  - {name: r, kind: reasoning, env: arithmetic}\n")
    assert needle in refused(capsys, "run", str(good), override, "--run-dir", str(tmp_path / "run"))


def test_missing_config_file(tmp_path):
    result = _cli("run", "nowhere.yaml", cwd=tmp_path)
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_run_prints_progress_lines_with_an_eta_on_stdout(tmp_path):
    """`opd-sao run` with its output in a pipe (no terminal): plain progress lines on stdout, every
    logging.progress_every steps and after each task's last, each with the step, the task's figure, seconds per
    step and the ETA."""
    cfg = _config()
    cfg["logging"] = {"wandb": False, "progress_every": 2, "progress_interval_s": 3600}  # no heartbeat lines (their
    # test is in test_timing_progress.py): a loaded machine gets the same lines
    (tmp_path / "run.yaml").write_text(json.dumps(cfg))
    result = _cli("run", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    figure = r", [0-9.]+ s/step, ETA \d+(s|m\d\ds|h\d\dm)"
    sft = [line for line in lines if line.startswith("[reasoning] sft")]
    assert [line.split(",")[0] for line in sft] == ["[reasoning] sft step 2/3", "[reasoning] sft step 3/3"]
    assert all(re.fullmatch(r"\[reasoning\] sft step \d/3, loss [0-9.]+" + figure, line) for line in sft), sft
    sao = [line for line in lines if re.fullmatch(r"\[reasoning\] sao step \d/4, reward [0-9.]+" + figure, line)]
    assert [line.split(",")[0] for line in sao] == ["[reasoning] sao step 2/4", "[reasoning] sao step 4/4"]


def test_sft_stage_warms_up_every_domain_before_the_rl_stages(tmp_path):
    warmup = {"name": "warmup", "kind": "sft", "domains": ["arithmetic", "digits_reverse"],
              "sft": {"steps": 3, "batch_size": 8}}
    reverse = {"name": "reverse", "kind": "reasoning", "env": "digits_reverse", "steps": 2,
               "rollout": {"max_new_tokens": 4}, "eval": {"num_tasks": 8}}
    cfg = _config()
    cfg["stages"] = [warmup, {**cfg["stages"][0], "sft": {"steps": 0}}, reverse]
    summary = run_pipeline(parse_config(cfg), tmp_path, log=lambda m: None)
    first, second = summary["stages"][:2]
    assert first["kind"] == "sft" and first["algo"] == "sft" and first["domains"] == ["arithmetic", "digits_reverse"]
    assert set(first["eval_after"]) == {"arithmetic", "digits_reverse"}
    assert second["start_checkpoint"] == first["checkpoint"]  # the RL stage starts from the warm start
    warm, base = (AutoModelForCausalLM.from_pretrained(p) for p in (first["checkpoint"], tmp_path / "base_model"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():  # the warm start trained: its logits are not the base model's
        assert not torch.allclose(warm(ids).logits, base(ids).logits)


def test_eval_start_false_leaves_the_base_model_unscored_and_the_start_column_empty(tmp_path):
    """The quickstart's tiny model is built at random: `eval_start: false` skips scoring it (a tenth of the run)."""
    cfg = _config(steps=2, sft={"steps": 0})
    summary = run_pipeline(parse_config({**cfg, "eval_start": False}), tmp_path, log=lambda m: None)
    stage = summary["stages"][0]
    assert stage["eval_before"] == {} and stage["eval_before_error"] == {}
    assert set(stage["eval_after"]) == {"arithmetic"}
    row = next(line for line in (tmp_path / "report.md").read_text().splitlines() if line.startswith("| arithmetic |"))
    assert row.split("|")[2].strip() == "-" and re.match(r"\d\.\d{3}", row.split("|")[3].strip())


def test_a_resumed_run_reads_the_scores_it_had_measured_and_scores_other_weights_or_settings_anew(
        tmp_path, tiny_model_dir, perturbed_teacher, tokenizer):
    """evaluations.json keeps each (checkpoint weights, domain, settings) score as it is measured: a new Evaluator
    on the run directory (a resumed run) reads a kept score (a planted one comes back), and scores a checkpoint
    with other weights, or the same one under other eval settings, anew beside it."""
    from opd_sao.app.pipeline import Evaluator

    cfg = parse_config({**_config(), "model": {"path": str(tiny_model_dir)}})
    first = Evaluator(cfg, tokenizer, run_dir=tmp_path).scores(tiny_model_dir)["arithmetic"]
    record_path = tmp_path / Evaluator.RECORD
    (key, kept), = json.loads(record_path.read_text()).items()
    assert kept == {"mean": first.mean, "stderr": first.stderr, "n": 8}
    record_path.write_text(json.dumps({key: {"mean": 0.123, "stderr": 0.01, "n": 8}}))
    assert Evaluator(cfg, tokenizer, run_dir=tmp_path).scores(tiny_model_dir)["arithmetic"].mean == 0.123
    Evaluator(cfg, tokenizer, run_dir=tmp_path).scores(perturbed_teacher)
    fewer = parse_config({**_config(eval={"num_tasks": 6}), "model": {"path": str(tiny_model_dir)}})
    assert Evaluator(fewer, tokenizer, run_dir=tmp_path).scores(tiny_model_dir)["arithmetic"].n == 6
    assert len(json.loads(record_path.read_text())) == 3


def test_sft_stage_without_domains_is_refused(tmp_path):
    cfg = _config()
    cfg["stages"] = [{"name": "warmup", "kind": "sft", "sft": {"steps": 3}}]
    with pytest.raises(ValueError, match="warmup.*needs `domains:`"):
        run_pipeline(parse_config(cfg), tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run").exists()  # refused before any work


def test_report_states_what_was_forgotten_and_recovered(tmp_path):
    from opd_sao.runs.report import forgetting, write_report

    stages = [{"name": n, "kind": k, "algo": k, "steps": 1, "eval_before": {"a": 0.1, "b": 0.2}, "eval_after": after}
              for n, k, after in [("rl1", "reasoning", {"a": 0.9, "b": 0.3}), ("rl2", "chat", {"a": 0.5, "b": 0.8}),
                                  ("opd", "opd", {"a": 0.8, "b": 0.7})]]
    (tmp_path / "summary.json").write_text(json.dumps({"stages": stages}))
    assert forgetting({"stages": stages}) == {
        "a": {"best_earlier": 0.9, "before_last_stage": 0.5, "after_last_stage": 0.8},
        "b": {"best_earlier": 0.8, "before_last_stage": 0.8, "after_last_stage": 0.7}}
    report = write_report(tmp_path).read_text()
    assert "| a | 0.900 | 0.500 | 0.800 | 0.400 | 75% (+0.300) |" in report
    assert "| b | 0.800 | 0.800 | 0.700 | 0.000 | nothing to recover (-0.100) |" in report
    assert (tmp_path / "plots" / "domains.png").is_file()


def test_eval_scope_reached_scores_each_domain_from_its_own_stage_on(tmp_path):
    """`eval_scope: reached`: a stage scores its own domain and the earlier stages' only; a later domain is first
    scored as its own stage's `before`, on the previous checkpoint, and shown in that checkpoint's column."""
    from opd_sao.app.pipeline import Evaluator

    reverse = {"name": "reverse", "kind": "reasoning", "env": "digits_reverse", "steps": 2,
               "rollout": {"max_new_tokens": 4}, "eval": {"num_tasks": 8}}
    cfg = _config(steps=2, sft={"steps": 0})
    cfg["stages"].append(reverse)
    summary = run_pipeline(parse_config({**cfg, "eval_scope": "reached"}), tmp_path, log=lambda m: None)
    first, second = summary["stages"]
    assert set(first["eval_before"]) == set(first["eval_after"]) == set(first["eval_after_error"]) == {"arithmetic"}
    assert set(second["eval_before"]) == set(second["eval_after"]) == {"arithmetic", "digits_reverse"}
    assert second["eval_before"]["arithmetic"] == first["eval_after"]["arithmetic"]  # the same checkpoint
    kept = {key.split("/")[1] for key in json.loads((tmp_path / Evaluator.RECORD).read_text())}
    assert kept == {"arithmetic", "digits_reverse"}
    row = next(line for line in (tmp_path / "report.md").read_text().splitlines()
               if line.startswith("| digits_reverse |")).split("|")
    before = f"{second['eval_before']['digits_reverse']:.3f} ± "
    assert row[2].strip() == "-" and row[3].strip().startswith(before)  # the first stage's column: its checkpoint's


def test_report_fills_a_domain_a_stage_left_unscored_from_the_next_stages_before_on_its_checkpoint(tmp_path):
    """eval_scope: reached leaves `b` unscored after rl1; rl2's `before` on rl1's checkpoint is that checkpoint's
    score (and counts as an earlier score for forgetting); a stage that started elsewhere fills nothing."""
    from opd_sao.runs.report import checkpoint_scores, domain_table, forgetting

    def stage(name, start, before, after):
        return {"name": name, "kind": "reasoning", "checkpoint": f"/run/{name}", "start_checkpoint": start,
                "eval_before": before, "eval_after": after}

    stages = [stage("rl1", "/run/base", {"a": 0.1}, {"a": 0.6}),
              stage("rl2", "/run/rl1", {"a": 0.6, "b": 0.3}, {"a": 0.4, "b": 0.7}),
              stage("opd", "/run/rl2", {"a": 0.4, "b": 0.7}, {"a": 0.55, "b": 0.65})]
    assert checkpoint_scores(stages, 0) == {"a": 0.6, "b": 0.3}
    assert domain_table({"stages": stages})[2] == {"a": [0.1, 0.6, 0.4, 0.55], "b": [None, 0.3, 0.7, 0.65]}
    assert forgetting({"stages": stages})["b"] == {"best_earlier": 0.7, "before_last_stage": 0.7,
                                                  "after_last_stage": 0.65}
    stages[1]["start_checkpoint"] = "/elsewhere"
    assert checkpoint_scores(stages, 0) == {"a": 0.6}


@pytest.mark.parametrize("stage, needle", [
    ({"name": "r", "kind": "reasoning"}, "needs `env:`"),
    ({"name": "r", "kind": "reasoning", "env": "sudoku"}, "unknown environment 'sudoku'"),
    ({"name": "o", "kind": "opd", "domains": ["arithmetic"],
      "opd": {"teachers": [{"name": "t", "checkpoint": "reasoning", "domains": ["chat"]}]}}, "have no teacher"),
])
def test_a_stage_config_its_kind_cannot_run_is_refused_before_any_work(tmp_path, stage, needle):
    cfg = _config()
    cfg["stages"] = [cfg["stages"][0], stage]  # the first stage is fine: nothing of it may run
    with pytest.raises((ValueError, KeyError), match=needle):
        run_pipeline(parse_config(cfg), tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run").exists()


SFT_WARMUP = {"name": "warmup", "kind": "sft", "domains": ["arithmetic"], "sft": {"steps": 3}}


@pytest.mark.parametrize("stage, line", [
    ({**SFT_WARMUP, "opd": {"teachers": [{"name": "t", "checkpoint": "reasoning", "domains": ["arithmetic"]}]}},
     "stage 'warmup' (sft): `opd:` is not read by sft stages (their sections: checkpoint_every, domains, rollout, "
     "sft)"),
    ({**SFT_WARMUP, "steps": 30}, "stage 'warmup' (sft): `steps:` is not read by sft stages"),
    ({"name": "r", "kind": "reasoning", "env": "arithmetic", "opd": {"top_k": 4}},
     "stage 'r' (reasoning): `opd:` is not read by reasoning stages (their sections: algo, buffer_memory, "
     "checkpoint_every, critic_pretrain, env, env_options, eval, gate, rl, rollout, sft, steps)"),
    ({"name": "a", "kind": "agent", "env": "code", "domains": ["code"]},
     "stage 'a' (agent): `domains:` is not read by agent stages"),
    ({"name": "c", "kind": "chat", "env": "chat", "opd": {"divergence": "jsd"}},
     "stage 'c' (chat): `opd:` is not read by chat stages"),
    ({"name": "o", "kind": "opd", "domains": ["arithmetic"], "critic_pretrain": {"rollouts": 8, "steps": 4}},
     "stage 'o' (opd): `critic_pretrain:` is not read by opd stages (their sections: buffer_memory, checkpoint_every, "
     "domains, eval, gate, opd, rl, rollout, steps)"),
    ({"name": "o", "kind": "opd", "domains": ["arithmetic"], "env": "arithmetic"},
     "stage 'o' (opd): `env:` is not read by opd stages"),
])
def test_a_section_its_kind_does_not_read_is_refused_in_one_line(stage, line):
    """By the config schema itself: a config that loads sets only sections its stages' kinds read."""
    cfg = _config()
    cfg["stages"].append(stage)  # after a valid stage: the teacher above is that earlier stage
    with pytest.raises(ConfigError) as refused:
        parse_config(cfg)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


def test_the_cli_refuses_a_foreign_section_in_one_line_before_any_work(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(json.dumps({"stages": [{**SFT_WARMUP, "opd": {"top_k": 4}}]}))
    line = refused(capsys, "run", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert line == ("opd-sao run: error: stage 'warmup' (sft): `opd:` is not read by sft stages (their sections: "
                    "checkpoint_every, domains, rollout, sft)")


def test_a_stage_is_written_out_with_its_kinds_sections_and_an_older_full_one_still_loads():
    """A run's config.yaml holds each stage's common fields and the sections its kind reads, and `--resume` reads it
    back unchanged; one written before (every field, other kinds' sections at their defaults) loads too, as a
    foreign section set to its default does. Set to anything else, it is refused."""
    from opd_sao.config import COMMON_STAGE_FIELDS, StageConfig
    from opd_sao.stages import STAGES

    cfg = _config()
    cfg["stages"].append({**SFT_WARMUP, "opd": {"top_k": 16}, "steps": 20})  # both the defaults
    parsed = parse_config(cfg)
    written = parsed.model_dump(mode="json")
    for stage in written["stages"]:
        assert set(stage) == COMMON_STAGE_FIELDS | STAGES.get(stage["kind"]).sections
    assert parse_config(written).model_dump() == parsed.model_dump()
    every_field = [{name: getattr(stage, name) for name in StageConfig.model_fields} for stage in parsed.stages]
    assert parse_config({**written, "stages": every_field}).model_dump() == parsed.model_dump()
    cfg["stages"][1]["steps"] = 30
    with pytest.raises(ConfigError, match="`steps:` is not read by sft stages"):
        parse_config(cfg)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_and_the_config_yaml_its_run_writes_pass_the_checks(path, monkeypatch):
    from opd_sao.app.pipeline import check_before_work
    from opd_sao.config import load_config
    from opd_sao.model_import import registry_gguf

    monkeypatch.chdir(ROOT)  # the configs' data paths are relative to the repository root
    # smollm2.yaml's model is written by `opd-sao models fetch smollm2` (its first lines): checked on the GGUF file
    # that command converts, which model.path may name too
    cfg = load_config(path, [f"model.path={registry_gguf('smollm2')}"] if path.name == "smollm2.yaml" else [])
    check_before_work(cfg)
    check_before_work(parse_config(cfg.model_dump(mode="json")))  # written out, as in a run's config.yaml


def test_every_built_in_stage_in_the_docs_yaml_sets_only_sections_its_kind_reads():
    """The README's and docs' YAML blocks are often fragments (a plugin file, a teacher directory elsewhere): each
    stage in them is checked alone."""
    import re

    import yaml

    from opd_sao.config import StageConfig
    from opd_sao.stages import STAGES

    def stages_in(node):
        if isinstance(node, dict):
            if node.get("kind") in ("sft", "reasoning", "agent", "chat", "opd") and "name" in node:
                yield node
            for value in node.values():
                yield from stages_in(value)
        elif isinstance(node, list):
            for item in node:
                yield from stages_in(item)

    from pydantic import ValidationError

    checked = 0
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```yaml\n(.*?)```", doc.read_text(), re.S):
            loaded = yaml.safe_load(block)
            for stage in stages_in(loaded):
                try:
                    validated = StageConfig.model_validate(stage)
                except ValidationError as err:
                    # a recipe's block names what its own plugin file registers (a divergence, ...): with the
                    # plugin not loaded here, only such unknown registry names may fail, and only in such a block
                    plugins = isinstance(loaded, dict) and loaded.get("plugins")
                    assert plugins and all("registered:" in e["msg"] for e in err.errors()), (doc.name, err)
                    continue
                STAGES.get(stage["kind"]).check_sections(validated)
                checked += 1
    assert checked >= 10, checked


def test_optimizer_settings_reach_both_optimizers_and_bad_betas_are_refused(tiny_model_dir):
    from opd_sao.config import TrainerConfig
    from opd_sao.trainers import TorchTrainer

    backend = TorchTrainer(tiny_model_dir, TrainerConfig(adam_betas=(0.5, 0.9), weight_decay=0.1), with_critic=True)
    for opt in (backend.policy_opt, backend.critic_opt):
        group = opt.param_groups[0]
        assert group["betas"] == (0.5, 0.9) and group["weight_decay"] == 0.1
    cfg = _config()
    cfg["trainer"]["adam_betas"] = [0.9, 1.0]
    with pytest.raises(Exception, match=r"adam_betas must both be in \[0, 1\)"):
        parse_config(cfg)


def test_dis_bounds_default_to_the_papers_values_for_the_stage_kind_and_explicit_values_win():
    stages = [{"name": "r", "kind": "reasoning", "env": "arithmetic"},
              {"name": "a", "kind": "agent", "env": "code"},
              {"name": "a2", "kind": "agent", "env": "code", "rl": {"eps_high": 2.0}},
              {"name": "r2", "kind": "reasoning", "env": "arithmetic", "rl": {"eps_low": 0.1, "eps_high": 1.0}},
              {"name": "c", "kind": "chat", "env": "chat"}]
    cfg = parse_config({"stages": stages})
    bounds = {s.name: (s.rl.eps_low, s.rl.eps_high) for s in cfg.stages}
    assert bounds == {"r": (0.3, 5.0), "a": (0.8, 3.0), "a2": (0.8, 2.0), "r2": (0.1, 1.0), "c": (0.3, 5.0)}
    override = parse_config({"stages": stages[1:2]}, ["stages.a.rl.eps_low=0.5"])
    assert (override.stages[0].rl.eps_low, override.stages[0].rl.eps_high) == (0.5, 3.0)
    again = parse_config(cfg.model_dump(mode="json"))  # the run dir's config.yaml reads back the same
    assert {s.name: (s.rl.eps_low, s.rl.eps_high) for s in again.stages} == bounds


def test_the_old_sao_section_still_loads_with_a_one_line_warning(caplog):
    """`sao:` was the RL settings' key before `rl:`: a config or an override using it still loads."""
    stage = {"name": "a", "kind": "agent", "env": "code"}
    with caplog.at_level(logging.WARNING, logger="opd_sao.config"):
        cfg = parse_config({"stages": [{**stage, "sao": {"eps_high": 2.0}}]})
    assert (cfg.stages[0].rl.eps_low, cfg.stages[0].rl.eps_high) == (0.8, 2.0)
    assert [r.getMessage() for r in caplog.records] == [
        "stage 'a': the `sao:` section is deprecated; rename it `rl:` (the RL algorithm's settings)"]
    mixed = parse_config({"stages": [{**stage, "rl": {"eps_low": 0.5}}]}, ["stages.a.sao.eps_high=2.0"])
    assert (mixed.stages[0].rl.eps_low, mixed.stages[0].rl.eps_high) == (0.5, 2.0)
    with pytest.raises(ConfigError, match=r"sao \(the old name of rl\) and rl both set \['eps_high'\]"):
        parse_config({"stages": [{**stage, "rl": {"eps_high": 1.0}}]}, ["stages.a.sao.eps_high=2.0"])


@pytest.mark.parametrize("teacher, needle", [
    ({"name": "t", "checkpoint": "best", "domains": ["arithmetic", "code"]}, "exactly one domain"),
    ({"name": "t", "checkpoint": "nowhere", "domains": ["arithmetic"]}, "neither a local directory"),
])
def test_best_teacher_config_is_checked_before_any_work(teacher, needle):
    cfg = _config()
    cfg["stages"].append({"name": "o", "kind": "opd", "domains": teacher["domains"], "opd": {"teachers": [teacher]}})
    with pytest.raises(ValueError, match=needle):
        parse_config(cfg)
    cfg["stages"] = cfg["stages"][1:]
    with pytest.raises(ValueError, match="needs an earlier stage|neither a local directory"):
        parse_config(cfg)


def test_a_wrong_dataset_path_in_the_last_stage_is_refused_before_the_first_stage_starts(tmp_path, tiny_model_dir,
                                                                                          capsys):
    cfg = _config()
    cfg["model"] = {"path": str(tiny_model_dir)}  # (a tiny base model would read the file for its tokenizer first)
    cfg["stages"].append({"name": "mine", "kind": "reasoning", "env": "dataset",
                          "env_options": {"path": str(tmp_path / "gsm8k.jsonl")}, "steps": 2})
    (tmp_path / "run.yaml").write_text(json.dumps(cfg))
    line = refused(capsys, "run", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run"))
    assert line == (f"opd-sao run: error: stage 'mine': env_options of 'dataset': dataset file "
                    f"{str(tmp_path / 'gsm8k.jsonl')!r} does not exist")
    assert not (tmp_path / "run").exists()  # no stage started (its progress lines would be in it too)


def test_a_critic_trained_layers_above_the_models_layers_is_refused_before_the_first_stage_starts(
        tmp_path, tiny_model_dir):
    """The tiny model has 2 decoder layers: a later stage's critic that trains its last 6 stops the run before the
    first stage, in one line, not when that stage builds its critic."""
    cfg = _config()
    cfg["model"] = {"path": str(tiny_model_dir)}
    cfg["stages"].append({**cfg["stages"][0], "name": "later", "trainer": {"critic_trained_layers": 6}})
    logged = []
    with pytest.raises(ValueError, match=r"^stages\.later: trainer\.critic_trained_layers is 6, but the model has 2 "
                                         r"decoder layers$"):
        run_pipeline(parse_config(cfg), tmp_path / "run", log=logged.append)
    assert not any("stage starting" in line for line in logged) and not (tmp_path / "run").exists()


def test_a_teacher_with_another_tokenizer_is_refused_before_the_first_stage_starts(tmp_path, corpus):
    from real_models import build_llama

    alien = build_llama(tmp_path / "alien", [f"zebra quokka {i}" for i in range(300)])
    cfg = _config()
    cfg["stages"].append({"name": "distil", "kind": "opd", "domains": ["arithmetic"], "steps": 2,
                          "opd": {"teachers": [{"name": "t", "checkpoint": str(alien), "domains": ["arithmetic"]}]}})
    logged = []
    with pytest.raises(ValueError, match=r"^stage 'distil': teacher 't' \(.*alien\) cannot teach student .*base_model: "
                                         r".*\(OPD needs a shared tokenizer\)$"):
        run_pipeline(parse_config(cfg), tmp_path / "run", log=logged.append)
    assert logged == [] and not (tmp_path / "run").exists()  # no stage started; the built base model went too
