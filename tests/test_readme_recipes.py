"""The extension recipes run exactly as printed: each recipe's two fenced blocks (the one Python file and its
config, after a `<!-- recipe: NAME -->` marker) are written to a fresh directory as they stand in README.md (or
docs/extending.md, which has three more) and run through the real CLI (`python -m opd_sao.app.cli run`, a subprocess) on the tiny model; each test then checks
from the run's own records that the extension did its job, not only that the run finished.

The commands run from a directory holding only the two files and a link to the repository's examples/ (what a
reader at the repository root has). The weight-sync recipe's placeholders (CHECKPOINT, port 30001) are filled in
on the command line: a tiny checkpoint and a free port (two for the routing recipe)."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml
from launchers import HANG_S, free_port, wait_until_healthy

ROOT = Path(__file__).resolve().parents[1]
RECIPE = re.compile(r"<!-- recipe: (\w+) -->\n```python\n(.*?)```\n\n```yaml\n(.*?)```", re.S)
FILE_NAME = re.compile(r"\A# ([\w.]+\.(?:py|yaml))\b")
KINDS = ["reward", "stage", "teacher", "weight_sync", "algorithm"]  # README.md's
MORE = ["divergence", "teacher_option", "routing"]  # docs/extending.md's
PAGES = ("README.md", "docs/extending.md")


def _recipes() -> dict[str, dict]:
    """name -> {page, py: (file name, text), yaml: (file name, text)}, as printed in README.md and extending.md."""
    found = {}
    for page in PAGES:
        for name, code, config in RECIPE.findall((ROOT / page).read_text(encoding="utf-8")):
            assert name not in found, name
            found[name] = {kind: (FILE_NAME.match(text).group(1), text) for kind, text in (("py", code), ("yaml", config))}
            found[name]["page"] = page
    return found


def _write(recipe: dict, where: Path) -> str:
    """The recipe's two files in `where`, examples/ linked beside them; returns the config's file name."""
    for file_name, text in (recipe["py"], recipe["yaml"]):
        (where / file_name).write_text(text)
    (where / "examples").symlink_to(ROOT / "examples")
    return recipe["yaml"][0]


def _run(where: Path, config: str, *overrides: str, timeout: int = 900) -> dict:
    """`opd-sao run CONFIG --run-dir run [overrides]` in `where`; the run's summary.json."""
    out = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", "run", config, "--run-dir", "run", *overrides],
                         cwd=where, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((where / "run" / "summary.json").read_text())


def _recipe_run(name: str, tmp_path: Path, *overrides: str) -> tuple[dict, Path]:
    recipe = _recipes()[name]
    summary = _run(tmp_path, _write(recipe, tmp_path), *overrides)
    return summary, tmp_path / "run"


def test_the_readme_has_the_five_recipes_and_extending_three_more_each_one_file_plus_its_config():
    recipes = _recipes()
    assert {name: recipe["page"] for name, recipe in recipes.items()} == {
        **{name: "README.md" for name in KINDS}, **{name: "docs/extending.md" for name in MORE}}
    for name, recipe in recipes.items():
        py_name, code = recipe["py"]
        config = yaml.safe_load(recipe["yaml"][1])
        assert config["plugins"] == [py_name], name  # the config names its one file, and nothing else
        registered = re.search(r"""register\w*\((?:")?([\w]+)""", code).group(1)
        assert registered in recipe["yaml"][1] or name == "algorithm", (name, registered)


@pytest.mark.parametrize("name, refusal", [
    ("reward", "unknown reward 'near_number'"),
    ("stage", "unknown stage kind 'sft_teacher'"),
    ("weight_sync", "engine.weight_sync 'safetensors_body': use one of"),
    ("algorithm", "unknown algo 'reinforce'"),
    ("divergence", "unknown divergence 'symmetric_kl'"),
    ("teacher_option", "unknown teacher kind 'in_process_cast'"),
    ("routing", "engine.routing 'primary': use one of least_loaded"),
])
def test_without_its_plugin_a_recipes_config_is_refused(name, refusal, tmp_path, monkeypatch):
    """The recipes' runs below are not vacuous: the names they use exist only through their plugins. Checked in
    a fresh interpreter: in this one, other tests may have registered the same names (test_rl_loop registers
    a `reinforce` of its own)."""
    monkeypatch.chdir(tmp_path)
    config = _write(_recipes()[name], tmp_path)
    check = ("import sys\nfrom opd_sao.config import load_config\nfrom opd_sao.app.pipeline import check_before_work\n"
             "check_before_work(load_config(sys.argv[1], ['plugins=[]']))")
    out = subprocess.run([sys.executable, "-c", check, str(config)], capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode != 0 and refusal in out.stderr, out.stderr[-2000:]


def test_the_reward_recipe(tmp_path):
    summary, run = _recipe_run("reward", tmp_path)
    stage = summary["stages"][0]
    steps = [json.loads(line) for line in (run / "stages" / "gsm8k" / "metrics.jsonl").open()]
    assert len(steps) == 3
    trained = sum(s["batch_size"] for s in steps)
    assert stage["reward"]["name"] == "near_number" and stage["reward"]["scored"] >= trained  # its stats(): it
    # scored every trained rollout (and the validity check's and evaluation's)


def test_the_stage_recipe(tmp_path):
    summary, run = _recipe_run("stage", tmp_path)
    stage = summary["stages"][0]
    assert stage["kind"] == "sft_teacher" and 0 < stage["sft_examples"] <= 64  # its own summary entry
    assert (run / "stages" / "teacher" / "checkpoint" / "config.json").is_file()
    assert "arithmetic" in stage["eval_after"]  # the pipeline evaluated what it made


def test_the_teacher_recipe(tmp_path):
    summary, run = _recipe_run("teacher", tmp_path)
    distil = summary["stages"][1]
    assert distil["teachers"]["reverse_bf16"]["kind"] == "in_process_bf16"  # built from TEACHER_KINDS by that name
    assert distil["prefetch"]["loads"] >= 1 and distil["schedule"]["ended"] == "budget"
    steps = [json.loads(line) for line in (run / "stages" / "distil" / "metrics.jsonl").open()]
    assert len(steps) == 3 and all(s["cache_hits"] + s["cache_misses"] == s["batch_size"] for s in steps)
    assert all(s["kl_teacher/reverse_bf16"] > 0 for s in steps)  # every step trained on what it scored
    assert (run / "stages" / "distil" / "logit_cache" / "reverse_bf16" / "index.log").stat().st_size > 0


def test_the_weight_sync_recipe(tmp_path, tiny_model_dir, start_server):
    port = free_port()
    recipe = _recipes()["weight_sync"]
    config = _write(recipe, tmp_path)
    url, proc = start_server(tiny_model_dir, "--plugin", str(tmp_path / recipe["py"][0]), port=port)
    wait_until_healthy(url, lambda: proc.poll() is None)
    summary = _run(tmp_path, config, f"model.path={tiny_model_dir}", f"engine.urls=[{url}]")
    stage = summary["stages"][0]
    assert stage["gate"]["passed"]  # the served weights matched the trainer's at every check
    info = requests.get(url + "/get_model_info", timeout=10).json()
    assert info["weight_version"] == "3"  # three steps, each synced by the plugin's route (the only one named)
    proc.kill()


def test_the_algorithm_recipe(tmp_path):
    """The advantages are the raw binary rewards on every action token: with p the share of action tokens in
    rewarded trajectories, their mean is p and their (unbiased) std sqrt(p (1 - p) n / (n - 1)); a baseline, a
    critic or a group z-score would break that identity."""
    summary, run = _recipe_run("algorithm", tmp_path)
    assert summary["stages"][0]["algo"] == "reinforce"
    steps = [json.loads(line) for line in (run / "stages" / "reasoning" / "metrics.jsonl").open()]
    assert len(steps) == 3 and not any("value_loss" in s for s in steps)  # no critic
    assert any(s["reward_mean"] > 0 for s in steps), steps  # the warm start solves some tasks: not a vacuous check
    for s in steps:
        p, n = s["adv_mean"], s["action_tokens"]
        assert 0 <= p <= 1 and (p > 0) == (s["reward_mean"] > 0)
        assert abs(s["adv_std"] - math.sqrt(p * (1 - p) * n / (n - 1))) < 1e-5, s


def test_the_divergence_recipe(tmp_path):
    """The trained divergence is the plugin's: the reported `kl` is the reverse KL alone, so the symmetric one
    (forward plus reverse) is above it at every step (with the default reverse_kl the two are equal)."""
    summary, run = _recipe_run("divergence", tmp_path)
    assert summary["stages"][1]["divergence"] == "symmetric_kl"
    steps = [json.loads(line) for line in (run / "stages" / "distil" / "metrics.jsonl").open()]
    assert len(steps) == 3 and all(s["divergence"] > s["kl"] > 0 for s in steps), steps


def test_the_teacher_option_recipe(tmp_path):
    summary, run = _recipe_run("teacher_option", tmp_path)
    teacher = summary["stages"][1]["teachers"]["reverse"]
    assert teacher["kind"] == "in_process_cast" and teacher["options"] == {"dtype": "bfloat16"}
    assert teacher["checkpoint_hash"].endswith("-bfloat16")  # the option reached the kind's cache identity
    steps = [json.loads(line) for line in (run / "stages" / "distil" / "metrics.jsonl").open()]
    assert len(steps) == 3 and all(s["kl_teacher/reverse"] > 0 for s in steps)


def test_a_misspelled_teacher_option_is_refused_in_one_line_before_any_work(tmp_path):
    recipe = _recipes()["teacher_option"]
    config = _write(recipe, tmp_path)
    (tmp_path / config).write_text(recipe["yaml"][1].replace("{dtype: bfloat16}", "{dtpye: bfloat16}"))
    out = subprocess.run([sys.executable, "-m", "opd_sao.app.cli", "run", config, "--run-dir", "run"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "teacher 'reverse' (kind in_process_cast): options.dtpye: Extra inputs are not permitted" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def test_the_routing_recipe(tmp_path, tiny_model_dir, start_server):
    """Two servers; the plugin's policy sends every request (rollouts, gate probes, evaluation) to the first.
    least_loaded would send the second request of a batch to the idle second server."""
    config = _write(_recipes()["routing"], tmp_path)
    servers = [start_server(tiny_model_dir) for _ in range(2)]
    for url, proc in servers:
        wait_until_healthy(url, lambda proc=proc: proc.poll() is None)
    urls = [url for url, _ in servers]
    summary = _run(tmp_path, config, f"model.path={tiny_model_dir}", f"engine.urls=[{','.join(urls)}]")
    assert summary["stages"][0]["gate"]["passed"]
    generated = [requests.get(url + "/server_info", timeout=10).json()["tokens_generated"] for url in urls]
    assert generated[0] > 0 and generated[1] == 0, generated
    info = requests.get(urls[1] + "/get_model_info", timeout=10).json()
    assert info["weight_version"] == "3"  # the standby got every sync all the same
    for _, proc in servers:
        proc.kill()
