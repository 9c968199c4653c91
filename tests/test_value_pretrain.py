"""Value pre-training and critic carry-over: a real tiny model, the embedded engine, real rollouts."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from opd_sao.app.pipeline import run_pipeline
from opd_sao.checkpoints import load_causal_lm
from opd_sao.config import ConfigError, TrainerConfig, parse_config
from opd_sao.engines import EmbeddedEngine
from opd_sao.engines.base import SamplingParams
from opd_sao.envs import register_env
from opd_sao.envs.arithmetic import ArithmeticEnv
from opd_sao.rl.rollout import Episode
from opd_sao.rl.value_pretrain import critic_error, monte_carlo_returns, pretrain_critic, rollout_corpus
from opd_sao.trainers import TorchTrainer
from opd_sao.trainers.critic import ValueModel
from opd_sao.trajectory import collate


@register_env("any_digit_test")
class AnyDigitEnv(ArithmeticEnv):
    """Arithmetic prompts, reward 1 when the answer holds any digit: an untrained tiny policy earns it ~15% of
    the time, so the returns vary and there is something for a critic to predict."""

    def step(self, action: str) -> tuple[str, float, bool]:
        return "", float(any(c.isdigit() for c in action)), True

    def oracle_actions(self, task: dict) -> None:
        return None  # a lenient reward on purpose, not a verifier: echoing the prompt earns it, so no validity check

    def corpus(self, n: int = 2000) -> list[str]:
        return []  # the tiny tokenizer of later tests in the session stays the one the real domains give


def _episodes(tokenizer, seed: int):
    tasks = itertools.cycle(AnyDigitEnv().make_tasks("train", 10_000, seed=seed))
    params = SamplingParams(max_new_tokens=8)
    return lambda: [Episode(AnyDigitEnv(), next(tasks), tokenizer, params, domain="any_digit_test", max_turns=1,
                            max_context_tokens=64)]


def _level_error(trajectories, pad_id: int) -> float:
    """The value loss of the best constant critic on `trajectories`: the variance of their returns over action
    tokens (what a critic that learnt only the returns' level scores)."""
    batch = collate(trajectories, pad_id)
    returns = monte_carlo_returns(batch, 1.0)[batch.action_mask.bool()]
    return float(((returns - returns.mean()) ** 2).mean())


def test_value_pretraining_lowers_the_critics_error_on_fresh_rollouts(tiny_model_dir, tokenizer, train_seed):
    """On fresh rollouts, the zero head's error is the returns' second moment and a critic that learnt their level
    scores their variance: pretraining must close at least half of that gap. (A fixed 15% cut of the error was
    asserted before; the gap itself is about the mean return, 14-23% here, so that failed for 5 of the first 10
    seeds.) 20 of 20 seeds pass (pytest --train-seeds 20: rollouts, fresh tasks, critic fit); the share of the
    gap closed was 0.64-1.02."""
    torch.manual_seed(train_seed)
    engine = EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tokenizer.eos_token_id,
                            pad_id=tokenizer.pad_token_id, max_batch=64, seed=train_seed)
    backend = TorchTrainer(tiny_model_dir, TrainerConfig(critic_lr=3e-3), with_critic=True)
    fresh = rollout_corpus(engine, _episodes(tokenizer, seed=1000 + train_seed), 256)  # other tasks, other samples
    assert 0.05 < sum(t.total_reward for t in fresh) / len(fresh) < 0.5  # the returns vary
    before = critic_error(backend, fresh, gamma=1.0, pad_id=tokenizer.pad_token_id)
    policy_before = {k: v.clone() for k, v in backend.policy.state_dict().items()}
    report = pretrain_critic(backend, engine, _episodes(tokenizer, seed=train_seed), rollouts=512, steps=30,
                             batch_size=64, gamma=1.0, pad_id=tokenizer.pad_token_id, seed=train_seed)
    after = critic_error(backend, fresh, gamma=1.0, pad_id=tokenizer.pad_token_id)
    level = _level_error(fresh, tokenizer.pad_token_id)
    assert report["rollouts"] == 512 and report["steps"] == 30
    assert before["value_loss"] - after["value_loss"] > 0.5 * (before["value_loss"] - level), (before, after, level)
    assert all(torch.equal(v, backend.policy.state_dict()[k]) for k, v in policy_before.items())  # policy untouched
    engine.close()


def test_a_saved_critic_loads_with_its_trained_value_head(tiny_model_dir, tmp_path):
    backend = TorchTrainer(tiny_model_dir, TrainerConfig(), with_critic=True)
    with torch.no_grad():
        backend.critic.value_head.bias.fill_(0.25)
        backend.critic.backbone.layers[0].mlp.up_proj.weight.mul_(1.5)
    saved = backend.export_critic(tmp_path / "critic")
    again = TorchTrainer(tiny_model_dir, TrainerConfig(), with_critic=True, critic_from=saved)
    for key, value in backend.critic.state_dict().items():
        assert torch.equal(value, again.critic.state_dict()[key]), key
    fresh = ValueModel.from_pretrained(tiny_model_dir)  # from a policy directory: a zero head
    assert float(fresh.value_head.bias.detach()) == 0.0


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}


def _stage(name, **extra):
    return {"name": name, "kind": "reasoning", "env": "any_digit_test", "steps": 2,
            "rollout": {"max_new_tokens": 4}, "eval": {"num_tasks": 8}, **extra}


def test_pipeline_pretrains_the_critic_and_carries_it_to_the_next_stage_of_its_env(tmp_path):
    pretrain = {"rollouts": 8, "steps": 3, "batch_size": 4}
    cfg = parse_config({"seed": 1, "model": {"tiny": TINY}, "logging": {"wandb": False, "progress": False},
                        "trainer": {"train_batch_size": 4, "critic_warmup_steps": 0},
                        "stages": [_stage("first", critic_pretrain=pretrain),
                                   _stage("second", critic_pretrain={**pretrain, "carry_over": True})]})
    summary = run_pipeline(cfg, tmp_path, log=lambda m: None)
    first, second = summary["stages"]
    assert first["critic_pretrain"]["rollouts"] >= 8 and first["critic_pretrain"]["steps"] == 3
    assert "critic_from" not in first and second["critic_from"] == str(tmp_path / "stages" / "first" / "critic")
    assert (tmp_path / "stages" / "first" / "critic" / "value_head.safetensors").is_file()
    assert not (tmp_path / "stages" / "second" / "critic").exists()  # no later stage takes it
    record = tmp_path / "stages" / "second" / "critic_pretrain.json"
    assert json.loads(record.read_text()) == second["critic_pretrain"]


@pytest.mark.parametrize("stages, needle", [
    ([_stage("a", critic_pretrain={"rollouts": 8})], "rollouts and steps must both be > 0"),
    ([_stage("a", critic_pretrain={"carry_over": True})], "carry_over needs an earlier stage with env"),
])
def test_bad_critic_pretrain_settings_are_refused(stages, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config({"stages": stages})

