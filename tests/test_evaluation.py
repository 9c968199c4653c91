"""The held-out evaluation on a real tiny model: k samples per task, every episode's reward kept per task, the
same checkpoint scored the same under the same seed (the pipeline's seed fixes the samples), two close
checkpoints compared on common random numbers, greedy decoding, and a score's standard error over tasks."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from opd_sao.checkpoints import load_causal_lm, load_tokenizer, save_checkpoint
from opd_sao.config import EvalConfig, RolloutConfig
from opd_sao.engines.embedded import EmbeddedEngine
from opd_sao.envs.arithmetic import ArithmeticEnv
from opd_sao.rl.rollout import run_episodes
from opd_sao.runs.evaluation import episode_rewards, evaluate, evaluate_score, make_episodes, task_score


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


def test_standard_error_is_over_tasks_with_each_tasks_samples_averaged_first():
    # task means 1/2, 1, 0, 1/2: mean 1/2; sample variance ((0)^2 + (1/2)^2 + (1/2)^2 + 0^2) / 3 = 1/6;
    # standard error sqrt(1/6) / sqrt(4) = sqrt(1/24)
    score = task_score({"a": [1.0, 0.0], "b": [1.0, 1.0], "c": [0.0, 0.0], "d": [0.0, 1.0]})
    assert score.n == 4 and score.mean == 0.5
    assert score.stderr == pytest.approx(math.sqrt(1 / 24), rel=1e-12)
    # over the 8 episodes as if independent it would be sqrt(2/7) / sqrt(8), smaller: the samples of a task are not
    assert score.stderr > math.sqrt(2 / 7) / math.sqrt(8)
    assert task_score({"a": [0.25], "b": [0.75]}).stderr == pytest.approx(0.25)  # sd sqrt(1/8), n 2
    assert task_score({"only": [1.0, 0.0]}).stderr is None  # one task: no spread to measure
    assert task_score({"a": [0.3, 0.3]}).error() == {"stderr": None, "n": 1}


def test_evaluate_score_is_evaluates_mean_with_its_standard_error(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    kwargs = dict(domain="any_digit", rollout=RolloutConfig(max_new_tokens=8), seed=3,
                  eval_cfg=EvalConfig(num_tasks=12, samples_per_task=3))
    score = evaluate_score(tiny_model_dir, AnyDigitEnv, tok, **kwargs)
    assert score == task_score(episode_rewards(tiny_model_dir, AnyDigitEnv, tok, **kwargs))
    assert score.n == 12 and score.mean == evaluate(tiny_model_dir, AnyDigitEnv, tok, **kwargs)
    assert 0 < score.stderr < 0.5


def _tokens(tiny_model_dir, tok, **play):
    engine = EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                            max_batch=64, seed=0)
    tasks = AnyDigitEnv().make_tasks("eval", 24, seed=0)
    episodes = make_episodes(AnyDigitEnv, tasks, tok, RolloutConfig(max_new_tokens=8), domain="any_digit",
                             repeats=2, **play)
    with torch.no_grad():
        return [traj.token_ids for traj in run_episodes(engine, episodes)]


def test_greedy_decoding_is_the_argmax_whatever_the_seed(tiny_model_dir):
    """eval.greedy plays every episode by argmax: the same tokens under any sampling seed and for both samples of a
    task, and the tokens that sampling at a temperature near zero draws (which concentrates on the argmax), while
    sampling at T=1 differs between seeds."""
    tok = load_tokenizer(tiny_model_dir)
    greedy = _tokens(tiny_model_dir, tok, temperature=1.0, greedy=True, sampling_seed=3)
    assert greedy == _tokens(tiny_model_dir, tok, temperature=1.0, greedy=True, sampling_seed=4)
    assert greedy[0::2] == greedy[1::2]  # the two samples of every task
    assert greedy == _tokens(tiny_model_dir, tok, temperature=1e-4, sampling_seed=5)
    assert _tokens(tiny_model_dir, tok, temperature=1.0, sampling_seed=3) != \
        _tokens(tiny_model_dir, tok, temperature=1.0, sampling_seed=4)
    def rewards(greedy):
        return episode_rewards(tiny_model_dir, AnyDigitEnv, tok, domain="any_digit", seed=3,
                               rollout=RolloutConfig(max_new_tokens=8),
                               eval_cfg=EvalConfig(num_tasks=12, samples_per_task=3, greedy=greedy))

    assert any(len(set(r)) > 1 for r in rewards(False).values())  # sampled, a task's rewards differ
    assert all(len(set(r)) == 1 for r in rewards(True).values())  # eval.greedy reaches the episodes: they do not
