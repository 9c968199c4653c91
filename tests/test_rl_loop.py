"""The asynchronous single-rollout loop, on a real tiny model and the real embedded engine."""
from __future__ import annotations

import itertools
import json

from opd_sao.checkpoints import load_causal_lm
from opd_sao.config import RolloutConfig, SAOConfig, TrainerConfig
from opd_sao.engines import EmbeddedEngine
from opd_sao.engines.base import SamplingParams
from opd_sao.rl.learner import Learner
from opd_sao.rl.loop import RLLoop
from opd_sao.rl.rollout import Episode
from opd_sao.runs.tracking import MetricsLogger
from opd_sao.trainers import TorchTrainer
from stages.envs import ENVIRONMENTS


def _loop(tmp_path, tiny_model_dir, tokenizer, lengths, *, asynchronous=True, group_size=1, batch=2,
          max_staleness=8, algo="sao"):
    env_cls = ENVIRONMENTS.get("arithmetic")
    tasks = itertools.cycle(env_cls().make_tasks("train", 50, seed=0))
    lengths = iter(lengths)
    groups = itertools.count()
    arrivals: list[str] = []

    def make_episodes():
        task, group, n = next(tasks), next(groups), next(lengths, 2)
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        return [Episode(env_cls(), task, tokenizer, params, domain="arithmetic", max_turns=1,
                        max_context_tokens=256, group=group, traj_id=f"g{group}-{i}-len{n}")
                for i in range(group_size)]

    engine = EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tokenizer.eos_token_id,
                            pad_id=tokenizer.pad_token_id, max_batch=8)
    cfg = TrainerConfig(train_batch_size=batch, critic_warmup_steps=0)
    backend = TorchTrainer(tiny_model_dir, cfg, with_critic=algo == "sao")
    learner = Learner(backend, algo, SAOConfig(), critic_steps=2, critic_warmup_steps=0)
    rollout = RolloutConfig(asynchronous=asynchronous, group_size=group_size, max_staleness=max_staleness)
    loop = RLLoop(engine=engine, learner=learner, make_episodes=make_episodes, rollout=rollout,
                  train_batch_size=batch, pad_id=tokenizer.pad_token_id,
                  logger=MetricsLogger(tmp_path / "metrics.jsonl", stage="t"), trained_log=tmp_path / "trained.jsonl")
    put = loop.buffer.put
    loop.buffer.put = lambda traj: (arrivals.append(traj.traj_id), put(traj))
    return loop, arrivals


def _trained(tmp_path) -> list[list[str]]:
    return [json.loads(line)["traj_ids"] for line in (tmp_path / "trained.jsonl").read_text().splitlines()]


def test_async_loop_trains_in_arrival_order_without_waiting_for_stragglers(tmp_path, tiny_model_dir, tokenizer):
    # the first prompt asks for a very long response; the next ones are short
    loop, arrivals = _loop(tmp_path, tiny_model_dir, tokenizer, [120] + [2] * 50)
    history = loop.run(steps=3)
    trained = _trained(tmp_path)
    flat = [t for step in trained for t in step]
    assert len(history) == 3 and len(flat) == 6
    assert flat == arrivals[: len(flat)]  # exactly arrival order
    assert "g0-0-len120" not in flat  # the straggler did not hold back the short ones
    assert all(t.endswith("len2") for t in flat)
    assert len(set(flat)) == len(flat)


def test_sync_group_mode_waits_for_whole_groups(tmp_path, tiny_model_dir, tokenizer):
    loop, arrivals = _loop(tmp_path, tiny_model_dir, tokenizer, [2, 30, 2, 2], asynchronous=False,
                           group_size=2, batch=4, algo="grpo")
    loop.run(steps=2)
    trained = _trained(tmp_path)
    for step in trained:  # every batch holds whole groups
        groups = [t.split("-")[0] for t in step]
        assert all(groups.count(g) == 2 for g in groups)
    assert "g1-0-len30" in trained[0]  # the slow group is in the first batch: the step waited for it


def test_staleness_bound_drops_old_trajectories(tmp_path, tiny_model_dir, tokenizer):
    loop, _ = _loop(tmp_path, tiny_model_dir, tokenizer, [2] * 200, max_staleness=0, batch=2)
    loop.run(steps=4)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(m["staleness_max"] == 0 for m in metrics)
