"""The held-out evaluation on a real tiny model: k samples per task, every episode's reward kept per task, and the
same checkpoint scored the same under the same seed (the pipeline's seed fixes the samples)."""
from __future__ import annotations

import statistics

from opd_sao.checkpoints import load_tokenizer
from opd_sao.config import EvalConfig, RolloutConfig
from opd_sao.runs.evaluation import episode_rewards, evaluate
from opd_sao.stages.envs.arithmetic import ArithmeticEnv


class AnyDigitEnv(ArithmeticEnv):
    """Arithmetic prompts, reward 1 when the answer holds any digit: the untrained tiny model earns it now and
    then, so a task's samples differ and a seed's choice of them shows in the score."""

    def step(self, action: str) -> tuple[str, float, bool]:
        return "", float(any(c.isdigit() for c in action)), True


def test_k_samples_per_task_and_the_same_score_for_the_same_seed(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    kwargs = dict(domain="any_digit", rollout=RolloutConfig(max_new_tokens=8),
                  eval_cfg=EvalConfig(num_tasks=20, samples_per_task=4))
    rewards = episode_rewards(tiny_model_dir, AnyDigitEnv, tok, seed=3, **kwargs)
    assert len(rewards) == 20 and all(len(r) == 4 for r in rewards.values())
    score = evaluate(tiny_model_dir, AnyDigitEnv, tok, seed=3, **kwargs)
    assert 0 < score < 1 and score == statistics.fmean(r for per_task in rewards.values() for r in per_task)
    assert evaluate(tiny_model_dir, AnyDigitEnv, tok, seed=3, **kwargs) == score  # same checkpoint, same seed
    assert episode_rewards(tiny_model_dir, AnyDigitEnv, tok, seed=4, **kwargs) != rewards  # the seed picks samples
