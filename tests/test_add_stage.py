"""Adding a teacher stage is one file in stages/ plus config: nothing else in the project changes."""
from __future__ import annotations

import pytest

from opd_sao import stages
from opd_sao.app.pipeline import run_pipeline
from opd_sao.config import ConfigError, parse_config

# A complete new stage kind, written as a user would drop it into stages/.
STAGE_FILE = '''
"""A teacher made by supervised fine-tuning on one environment's reference solutions."""
from pydantic import BaseModel, Field

from opd_sao.supervised import run_sft, sft_examples
from opd_sao.stages.base import ENV_SECTIONS, Stage, StageResult, register_stage
from opd_sao.envs import ENVIRONMENTS


@register_stage("sft_teacher")
class SFTTeacherStage(Stage):
    sections = ENV_SECTIONS | {"sft"}  # the config sections it reads beyond name, kind, init_from, trainer, options

    class Options(BaseModel, extra="forbid"):
        examples: int = Field(1000, ge=1, description="reference solutions to learn from")

    def run(self):
        env_cls = ENVIRONMENTS.get(self.cfg.env)
        examples = sft_examples(lambda: env_cls(**self.cfg.env_options), self.ctx.tokenizer, self.options.examples,
                                self.ctx.cfg.seed)
        start = self.ctx.resolve_checkpoint(self.cfg.init_from)
        checkpoint = run_sft(start, self.dir / "checkpoint", examples, self.ctx.tokenizer, self.cfg.sft,
                             self.ctx.cfg.seed)
        return StageResult(checkpoint, {"sft_examples": len(examples)}, start_checkpoint=start)
'''

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}


def test_a_new_stage_is_one_file_plus_config(tmp_path):
    folder = tmp_path / "more_stages"  # stands for the stages/ folder: it is on the package's path
    folder.mkdir()
    (folder / "sft_teacher.py").write_text(STAGE_FILE)
    stages.__path__.append(str(folder))
    try:
        cfg = parse_config({
            "model": {"tiny": TINY}, "logging": {"wandb": False, "progress": False},
            "trainer": {"train_batch_size": 4, "critic_warmup_steps": 0},
            "stages": [
                {"name": "teacher", "kind": "sft_teacher", "env": "arithmetic", "env_options": {"max_operand": 9},
                 "options": {"examples": 40}, "sft": {"steps": 5, "batch_size": 8}, "eval": {"num_tasks": 4}},
                {"name": "rl", "kind": "reasoning", "env": "arithmetic", "env_options": {"max_operand": 9},
                 "init_from": "teacher", "steps": 2, "rollout": {"max_new_tokens": 3}, "eval": {"num_tasks": 4}},
            ],
        })
        summary = run_pipeline(cfg, tmp_path / "run", log=lambda m: None)
    finally:
        stages.__path__.remove(str(folder))
    teacher, rl = summary["stages"]
    assert teacher["kind"] == "sft_teacher" and 0 < teacher["sft_examples"] <= 40  # its typed option was read
    assert "arithmetic" in teacher["eval_after"]
    assert rl["start_checkpoint"] == teacher["checkpoint"]  # the next stage starts from the new stage's output
    assert (tmp_path / "run" / "report.md").is_file()


def test_a_stage_kinds_options_are_validated_with_the_config():
    with pytest.raises(ConfigError, match=r"stage 'r' \(reasoning\): options.speed: Extra inputs are not permitted"):
        parse_config({"stages": [{"name": "r", "kind": "reasoning", "env": "arithmetic", "options": {"speed": 2}}]})


# Two RL kinds a plugin adds: one with its own options, DIS band, episode length and check; one declaring nothing.
KINDS_FILE = '''
from pydantic import BaseModel, Field

from opd_sao.stages.base import register_stage
from opd_sao.stages.rl import RLStage


@register_stage("careful")
class CarefulStage(RLStage):
    defaults = {"rl": {"eps_low": 0.1, "eps_high": 1.5}, "rollout": {"max_new_tokens": 7}}

    class Options(BaseModel, extra="forbid"):
        patience: int = Field(3, ge=1, description="steps without progress before it stops")

    @classmethod
    def validate_in_run(cls, cfg, run):
        super().validate_in_run(cfg, run)
        if cls.parse_options(cfg).patience > cfg.steps:
            raise ValueError(f"stage {cfg.name!r}: options.patience is more than its {cfg.steps} steps")


@register_stage("plain")
class PlainStage(RLStage):
    """Declares no DIS band of its own."""
'''


def test_a_plugin_kind_brings_its_options_defaults_and_checks_and_config_py_names_no_kind(tmp_path, monkeypatch):
    import ast
    from pathlib import Path

    import opd_sao.config as config_module
    from opd_sao.config import DEFAULT_DIS_BOUNDS, STAGES
    from opd_sao.stages.rl import ReasoningStage

    (tmp_path / "kinds.py").write_text(KINDS_FILE)
    monkeypatch.chdir(tmp_path)
    # reasoning's band changed: a kind that declares none still gets the schema's default, not reasoning's
    monkeypatch.setattr(ReasoningStage, "defaults", {"rl": {"eps_low": 0.5, "eps_high": 2.0}})

    def stages(careful: dict) -> list[tuple]:
        cfg = parse_config({"plugins": ["kinds.py"], "stages": [
            {"name": "c", "kind": "careful", "env": "arithmetic", **careful},
            {"name": "p", "kind": "plain", "env": "arithmetic"},
            {"name": "r", "kind": "reasoning", "env": "arithmetic"}]})
        return [(s.rl.eps_low, s.rl.eps_high, s.rollout.max_new_tokens) for s in cfg.stages]

    careful, plain, reasoning = stages({})
    assert careful == (0.1, 1.5, 7) and plain[:2] == DEFAULT_DIS_BOUNDS and reasoning[:2] == (0.5, 2.0)
    assert stages({"rl": {"eps_high": 4.0}, "rollout": {"max_new_tokens": 9}})[0] == (0.1, 4.0, 9)  # given wins
    with pytest.raises(ConfigError, match=r"stage 'c' \(careful\): options.patience: Input should be greater"):
        stages({"options": {"patience": 0}})
    with pytest.raises(ConfigError, match="stage 'c': options.patience is more than its 20 steps"):
        stages({"options": {"patience": 21}})
    # its `sections` (RLStage's) are checked by the schema as a built-in kind's are
    with pytest.raises(ConfigError, match=r"^stage 'c' \(careful\): `opd:` is not read by careful stages \(their "
                                          r"sections: algo, buffer_memory, .*steps\)$"):
        stages({"opd": {"top_k": 4}})
    # config.py knows kinds only through the registry: it compares nothing with a kind's name, keys nothing by one
    tree = ast.parse(Path(config_module.__file__).read_text())
    operands = [n for node in ast.walk(tree) for n in ([node.left, *node.comparators] if isinstance(node, ast.Compare)
                                                       else node.keys if isinstance(node, ast.Dict) else [])]
    named = {n.value for n in operands if isinstance(n, ast.Constant)} & set(STAGES.names())
    assert {"careful", "plain", "reasoning", "opd", "sft"} <= set(STAGES.names()) and not named, named
