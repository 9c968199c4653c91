"""Adding a teacher stage is one file in stages/ plus config: nothing else in the project changes."""
from __future__ import annotations

import pytest

from opd_sao import stages
from opd_sao.config import parse_config
from opd_sao.pipeline import run_pipeline

# A complete new stage kind, written as a user would drop it into stages/.
STAGE_FILE = '''
"""A teacher made by supervised fine-tuning on one environment's reference solutions."""
from pydantic import BaseModel, Field

from opd_sao.supervised import run_sft, sft_examples
from opd_sao.stages.base import ENV_SECTIONS, Stage, StageResult, register_stage
from opd_sao.stages.envs import ENVIRONMENTS


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


def test_a_stage_kinds_options_are_validated_before_any_work(tmp_path):
    cfg = parse_config({"model": {"tiny": TINY}, "logging": {"wandb": False, "progress": False},
                        "stages": [{"name": "r", "kind": "reasoning", "env": "arithmetic", "options": {"speed": 2}}]})
    with pytest.raises(ValueError, match=r"stage 'r' \(reasoning\): options.speed: Extra inputs are not permitted"):
        run_pipeline(cfg, tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run" / "base_model").exists()  # refused before the base model was built
