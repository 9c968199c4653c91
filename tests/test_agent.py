"""The agent stage on real components: the code environment in the sandbox, multi-turn trajectories from the
embedded engine, skip-observation GAE in the learner, context compaction, and the validity check."""
from __future__ import annotations

import json
import re

import pytest
import torch

from opd_sao import algorithms
from opd_sao.app import cli
from opd_sao.checkpoints import load_causal_lm
from opd_sao.config import (
    AlgoConfig,
    ConfigError,
    RolloutConfig,
    RunConfig,
    StageConfig,
    TrainerConfig,
    parse_config,
)
from opd_sao.engines import EmbeddedEngine
from opd_sao.engines.base import SamplingParams
from opd_sao.envs import ENVIRONMENTS, grading, register_env
from opd_sao.envs.arithmetic import ArithmeticEnv
from opd_sao.envs.validity import check_environment
from opd_sao.rl.compaction import Compaction, propagate_returns
from opd_sao.rl.learner import Learner
from opd_sao.rl.rollout import Episode, run_episodes
from opd_sao.runs.evaluation import make_episodes
from opd_sao.stages import RunContext
from opd_sao.stages.rl import AgentStage
from opd_sao.trainers import TorchTrainer
from opd_sao.trajectory import Trajectory, collate

OPTIONS = {"allow_rlimit_only": True}  # bubblewrap where it exists; rlimits only where it is missing


def code_factory():
    return ENVIRONMENTS.get("code")(**OPTIONS)


@register_env("test-broken-noop")
class BrokenNoopEnv(ArithmeticEnv):
    """A verifier with a reward shortcut: an empty answer scores 1."""

    def step(self, action):
        return "", float(action.strip() in ("", self.task["answer"])), True


@register_env("test-failing-slow")
class FailingSlowEnv(ArithmeticEnv):
    """Steps on the rollout's worker threads (like the sandboxed code env), and its step raises."""

    slow_steps = True

    def step(self, action):
        raise RuntimeError("environment step failed")


def _task(task_id="code-2(x+6)"):
    env = code_factory()
    return next(t for t in env.make_tasks("train", 10**6, 0) + env.make_tasks("eval", 10**6, 0) if t["id"] == task_id)


def _recording_engine(model_dir, tokenizer, seed=0):
    """The embedded engine, keeping every GenerationResult it hands out (with its request)."""
    engine = EmbeddedEngine(load_causal_lm(model_dir), eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                            max_batch=8, seed=seed)
    results, generate = [], engine.generate
    engine.generate = lambda requests, on_result: generate(requests, lambda r: (results.append(r), on_result(r)))
    return engine, results


def _action_spans(traj: Trajectory) -> list[list[int]]:
    spans, current = [], []
    for token, acted in zip(traj.token_ids, traj.action_mask):
        if acted:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def _max_logp_gap(model_dir, tokenizer, trajs) -> float:
    """The trainer's recomputed logprob vs the engine's, over every action token."""
    trainer = TorchTrainer(model_dir, TrainerConfig(), with_critic=False)
    batch = collate(trajs, tokenizer.pad_token_id)
    logp = trainer.policy_logprobs(batch, 1.0, grad=False)
    acted = batch.action_mask.bool()
    return float((logp - batch.rollout_logp)[acted].abs().max())


@pytest.fixture(scope="module")
def multi_turn(tiny_model_dir, tokenizer):
    """Code-env episodes of the untrained tiny model: it fails, reads the error and tries again."""
    engine, results = _recording_engine(tiny_model_dir, tokenizer)
    rollout = RolloutConfig(max_new_tokens=10, max_turns=3)
    tasks = code_factory().make_tasks("train", 3, seed=0)
    trajs = run_episodes(engine, make_episodes(code_factory, tasks, tokenizer, rollout, domain="code", temperature=1.0))
    return trajs, results


# ----------------------------------------------------------------------------
# the environment
# ----------------------------------------------------------------------------

def test_an_error_in_a_slow_step_surfaces_instead_of_hanging(tiny_model_dir, tokenizer):
    engine = EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tokenizer.eos_token_id,
                            pad_id=tokenizer.pad_token_id, max_batch=4, seed=0)
    factory = ENVIRONMENTS.get("test-failing-slow")
    episodes = make_episodes(factory, factory().make_tasks("train", 3, seed=0), tokenizer, RolloutConfig(),
                             domain="arithmetic", temperature=1.0)
    with pytest.raises(RuntimeError, match="environment step failed"):
        run_episodes(engine, episodes)


def test_code_tasks_split_and_render():
    env = code_factory()
    train, held_out = env.make_tasks("train", 10**6, 0), env.make_tasks("eval", 10**6, 0)
    assert len(train) + len(held_out) == 288 and len(held_out) > 30
    assert not {t["id"] for t in train} & {t["id"] for t in held_out}
    assert env.make_tasks("eval", 5, 3) == env.make_tasks("eval", 5, 3)
    task = _task()
    assert env.reset(task) == "# f(x) = 2(x+6)\nx = int(input())\n"
    assert env.reference_actions(task) == ["print(2*(x+6))"] and task["expected"] == ["36", "4", "10"]


def test_code_env_runs_programs_in_the_sandbox_and_shows_failures():
    env, task = code_factory(), _task()
    env.reset(task)
    assert env.step("print(x+6)") == ("# x=12: got 18, want 36\n", 0.0, False)
    assert env.step("print(y)") == ("# x=12: NameError: name 'y' is not defined\n", 0.0, False)
    assert env.step("print(2*(x+6)")[0].startswith("# x=12: SyntaxError")
    observation, reward, done = env.step("print(36 if x == 12 else 0)")  # one hidden test of three
    assert (observation, done) == ("# x=-4: got 0, want 4\n", False) and reward == pytest.approx(1 / 3)
    observation, reward, done = env.step("print(2*(x+6))")  # fixed: the rewards add up to the last pass rate
    assert (observation, done) == ("", True) and reward == pytest.approx(2 / 3)


def test_a_hanging_program_or_a_broken_sandbox_is_a_failed_step(monkeypatch):
    env = code_factory()
    env.reset(_task())
    observation, reward, done = env.step("while True: pass")
    # the sandbox's CPU (or wall) limit ends the whole run, or the input's own process meets its CPU limit first
    # (SIGXCPU, -24: each input runs in its own process); which comes first depends on the machine's load
    assert (reward, done) == (0.0, False) and (
        observation in ("# cpu limit\n", "# wall limit\n") or re.fullmatch(r"# x=-?\d+: exit status -24\n", observation))

    def broken(*args, **kwargs):
        raise OSError("too many open files")

    monkeypatch.setattr(grading, "run_python", broken)
    assert env.step("print(x*3)") == ("# sandbox error: OSError\n", 0.0, False)


# ----------------------------------------------------------------------------
# trajectories: the token ids the engine sampled, and skip-observation GAE
# ----------------------------------------------------------------------------

def test_training_sees_exactly_the_sampled_ids_across_turns(multi_turn, tiny_model_dir, tokenizer):
    trajs, results = multi_turn
    assert all(len(_action_spans(t)) == 3 for t in trajs)  # the untrained model fails every turn
    for traj in trajs:
        mine = [r for r in results if r.request.tag.traj is traj]
        assert [r.token_ids for r in mine] == _action_spans(traj)
        done = 0
        for result in mine:  # each request was exactly the trajectory so far: no drift at span boundaries
            assert result.request.prompt_ids == traj.prompt_ids + traj.token_ids[:done]
            assert traj.rollout_logp[done: done + len(result.token_ids)] == result.logprobs
            done += len(result.token_ids)
            while done < len(traj.token_ids) and not traj.action_mask[done]:
                assert traj.rollout_logp[done] == 0.0 and traj.versions[done] == -1
                done += 1
    assert _max_logp_gap(tiny_model_dir, tokenizer, trajs) < 1e-4


def test_agent_advantages_are_gae_over_the_action_tokens_only(multi_turn, tiny_model_dir, monkeypatch):
    trajs = [Trajectory.from_json(t.to_json()) for t in multi_turn[0]]
    for i, traj in enumerate(trajs):
        traj.rewards[-1] += 1.0 - 0.5 * i  # a final reward, so every advantage is non-trivial
    batch = collate(trajs, pad_id=0)
    backend = TorchTrainer(tiny_model_dir, TrainerConfig(), with_critic=True)
    learner = Learner(backend, "sao", AlgoConfig(), critic_steps=1, critic_warmup_steps=0)
    seen = {}
    critic_values, policy_loss = backend.critic_values, algorithms.sao_policy_loss

    def values_spy(b, grad):  # GAE reads the last values: after the K critic updates (TTUR order)
        out = critic_values(b, grad)
        seen["values"] = out.detach().clone()
        return out

    def loss_spy(logp, rollout_logp, advantages, mask, *args):
        seen["advantages"] = advantages.clone()
        return policy_loss(logp, rollout_logp, advantages, mask, *args)

    monkeypatch.setattr(backend, "critic_values", values_spy)
    monkeypatch.setattr("opd_sao.rl.learner.A.sao_policy_loss", loss_spy)
    learner.step(batch, 1.0)
    advantages, values, mask = seen["advantages"], seen["values"], batch.action_mask.bool()
    assert (advantages[~mask] == 0).all()  # observation, prompt and padding tokens get none
    for row in range(len(trajs)):
        idx = mask[row].nonzero().squeeze(-1)
        rewards, v = batch.rewards[row, idx], values[row, idx]
        lam = 1 - 1 / (1.5 * len(idx))
        expected, next_value, next_adv = torch.zeros(len(idx)), 0.0, 0.0
        for k in reversed(range(len(idx))):  # plain GAE on the action-only subsequence, gamma = 1
            next_adv = rewards[k] + next_value - v[k] + lam * next_adv
            expected[k], next_value = next_adv, v[k]
        assert torch.allclose(advantages[row, idx], expected, atol=1e-5)


# ----------------------------------------------------------------------------
# compaction
# ----------------------------------------------------------------------------

def test_compaction_continues_from_the_summary_in_new_segments(tiny_model_dir, tokenizer):
    engine, results = _recording_engine(tiny_model_dir, tokenizer, seed=1)
    rollout = RolloutConfig(max_new_tokens=8, max_turns=4, max_context_tokens=256, compaction=True,
                            compaction_budget=40)
    compaction = Compaction.from_rollout(rollout)
    instruction = tokenizer.encode(rollout.compaction_instruction, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=rollout.max_new_tokens, ignore_eos=True)  # fixed lengths
    episodes = [Episode(code_factory(), task, tokenizer, params, domain="code", max_turns=4,
                        max_context_tokens=256, compaction=compaction, traj_id=f"ep{i}")
                for i, task in enumerate(code_factory().make_tasks("train", 2, seed=1))]
    firsts = run_episodes(engine, episodes)
    assert firsts == [ep.segments[0] for ep in episodes]  # one per episode, carrying the episode's reward
    segments = [s for ep in episodes for s in ep.segments]
    for ep in episodes:
        first = ep.segments[0]
        assert len(ep.segments) >= 2 and ep.turns == 4
        for k, (before, after) in enumerate(zip(ep.segments, ep.segments[1:]), start=1):
            summary = _action_spans(before)[-1]  # the compaction turn: a sampled, trained action
            assert before.finish_reason == "compacted" and before.action_mask[-len(summary):] == [1] * len(summary)
            # the next context is the first prompt + summary + latest observation, not the whole history
            assert after.prompt_ids[: len(first.prompt_ids) + len(summary)] == first.prompt_ids + summary
            observation = after.prompt_ids[len(first.prompt_ids) + len(summary):]
            asked = before.token_ids[: len(before.token_ids) - len(summary)]
            assert observation and asked[-len(instruction) - len(observation):] == observation + instruction
            assert after.meta["segment"] == k and after.meta["episode"] == ep.segments[0].traj_id
            assert len(after.prompt_ids) < len(before.prompt_ids) + len(before.token_ids)
    # every request the engine served is exactly one segment's prefix, and the trainer agrees on every segment
    prefixes = {tuple(s.prompt_ids + s.token_ids[:i]) for s in segments for i in range(len(s.token_ids) + 1)}
    assert all(tuple(r.request.prompt_ids) in prefixes for r in results)
    assert sum(s.num_action_tokens for s in segments) == sum(len(r.token_ids) for r in results)
    assert _max_logp_gap(tiny_model_dir, tokenizer, segments) < 1e-4


def test_evaluation_plays_episodes_with_the_stage_compaction(tiny_model_dir, tokenizer):
    rollout = RolloutConfig(max_new_tokens=8, max_turns=4, max_context_tokens=256, compaction=True,
                            compaction_budget=40)
    tasks = code_factory().make_tasks("eval", 2, seed=0)
    episodes = make_episodes(code_factory, tasks, tokenizer, rollout, domain="code", temperature=1.0)
    assert all(ep.compaction == Compaction.from_rollout(rollout) for ep in episodes)
    assert all(ep.compaction is None for ep in make_episodes(code_factory, tasks, tokenizer, RolloutConfig(),
                                                             domain="code", temperature=1.0))


def test_later_rewards_reach_every_earlier_segment():
    segments = []
    for own in (0.0, 0.25, 0.5):
        seg = Trajectory("t", "code", [1])
        seg.append([5, 6], action=True, logp=[0.0, 0.0], versions=[0, 0])
        seg.add_reward(own)
        segments.append(seg)
    propagate_returns(segments)
    assert [s.total_reward for s in segments] == [0.75, 0.75, 0.5]  # reward-to-go; the first = the episode's


def test_compaction_config_is_checked():
    with pytest.raises(ValueError, match="compaction_budget 500"):
        RolloutConfig(compaction=True, compaction_budget=500, max_context_tokens=512)
    stage = {"name": "a", "kind": "agent", "env": "code", "rollout": {"compaction": True}}
    with pytest.raises(ConfigError, match="compaction needs group_size 1"):
        parse_config({"algo": "grpo", "stages": [stage]})


# ----------------------------------------------------------------------------
# validity
# ----------------------------------------------------------------------------

def test_code_env_passes_its_validity_check():
    report = check_environment("code", code_factory, n=4)
    assert report.ok and len(report.tasks) == 4 and not report.skipped


def test_validate_env_cli_reports_the_broken_env(capsys):
    assert cli.main(["validate-env", "test-broken-noop", "--n", "4"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert not report["ok"] and report["failures"]["oracle"] == []
    assert report["failures"]["noop"] == report["failures"]["initial"] == report["tasks"]
    assert "a no-op scores above 0 on 4/4 tasks (arith-" in err
    assert cli.main(["validate-env", "arithmetic", "--n", "4"]) == 0


def test_a_failing_env_is_refused_at_stage_start(tmp_path, tiny_model_dir, tokenizer):
    stage = StageConfig(name="agent", kind="agent", env="test-broken-noop", sft={"steps": 5})
    ctx = RunContext(cfg=RunConfig(stages=[stage]), run_dir=tmp_path, base_checkpoint=tiny_model_dir,
                     tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"'test-broken-noop' fails its validity check: a no-op scores above 0 on "
                                         r"16/16 tasks \(arith-.*refusing to train") as err:
        AgentStage(stage, ctx).run()
    assert "\n" not in str(err.value)
    assert not (tmp_path / "stages" / "agent" / "sft_checkpoint").exists()  # refused before any work


def test_sandbox_cli_delegates(tmp_path, capsys):
    program = tmp_path / "p.py"
    program.write_text("print(6 * 7)\n")
    assert cli.main(["sandbox", "run", str(program), "--allow-rlimit-only"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "ok" and result["stdout"] == "42\n" and result["limit_hit"] is None
