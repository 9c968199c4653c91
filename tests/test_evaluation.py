"""The held-out evaluation on a real tiny model: k samples per task, every episode's reward kept per task, the
same checkpoint scored the same under the same seed (the pipeline's seed fixes the samples), and two close
checkpoints compared on common random numbers."""
from __future__ import annotations

import statistics

import torch

from opd_sao.checkpoints import load_causal_lm, load_tokenizer, save_checkpoint
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


def test_close_checkpoints_draw_alike_on_the_same_seed(tiny_model_dir, tmp_path):
    """Every draw is keyed by (seed, task, sample, turn, position): a checkpoint a little off the first (every weight
    moved by 1% of noise) earns the same reward on most episodes under the same seed, and on far fewer under another
    seed, so the difference of two scores measures the checkpoints rather than the draws (what the OPD probes and the
    after / best-earlier ratio compare). Margin, over six perturbation seeds: 0.988-0.994 of the episodes agree under
    the same seed, 0.700-0.725 under another (thresholds 0.9 and a 0.15 gap); no model is trained."""
    tok = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    near = save_checkpoint(model, tok, tmp_path / "near")
    kwargs = dict(domain="any_digit", rollout=RolloutConfig(max_new_tokens=8),
                  eval_cfg=EvalConfig(num_tasks=40, samples_per_task=4))

    def flat(rewards):
        return [r for per_task in rewards.values() for r in per_task]

    base = flat(episode_rewards(tiny_model_dir, AnyDigitEnv, tok, seed=3, **kwargs))
    same = flat(episode_rewards(near, AnyDigitEnv, tok, seed=3, **kwargs))
    other = flat(episode_rewards(near, AnyDigitEnv, tok, seed=4, **kwargs))
    agree = statistics.fmean(a == b for a, b in zip(base, same))
    apart = statistics.fmean(a == b for a, b in zip(base, other))
    assert 0.1 < statistics.fmean(base) < 0.9  # both rewards occur, so agreeing is not trivial
    assert agree >= 0.9 and agree - apart >= 0.15, (agree, apart, statistics.fmean(base))
