"""The asynchronous single-rollout loop, on a real tiny model and the real embedded engine."""
from __future__ import annotations

import copy
import itertools
import json
import math
import random
import threading
import time

import pytest

from opd_sao import algorithms as A
from opd_sao.checkpoints import load_causal_lm
from opd_sao.config import AlgoConfig, RolloutConfig, TrainerConfig
from opd_sao.engines import EmbeddedEngine
from opd_sao.engines.base import GenerationRequest, SamplingParams
from opd_sao.envs import ENVIRONMENTS
from opd_sao.io.tracking import MetricsLogger
from opd_sao.rl.learner import Learner, needs_critic
from opd_sao.rl.loop import RLLoop
from opd_sao.rl.rollout import Episode, RolloutWorker
from opd_sao.trainers import TorchTrainer


def _loop(tmp_path, tiny_model_dir, tokenizer, lengths, *, asynchronous=True, group_size=1, batch=2,
          max_staleness=8, algo="sao", rl=None, per_member=False, late=None, overlap=True, after_step=None):
    """`lengths`: response lengths, one per group (every member the same), or one per member (`per_member`).
    `late`: response length of stragglers held back (one at a time, so that the rest keep the trainer fed) until
    the policy is past the staleness bound for them, as on a machine whose engine is slow next to its trainer
    (whether a 200-token rollout finishes within a step or two is otherwise a matter of the machine's load)."""
    env_cls = ENVIRONMENTS.get("arithmetic")
    tasks = itertools.cycle(env_cls().make_tasks("train", 50, seed=0))
    lengths = iter(lengths)
    groups = itertools.count()
    arrivals: list[str] = []

    def make_episodes():
        task, group = next(tasks), next(groups)
        n = next(lengths, 2)
        sizes = [next(lengths, 2) if per_member and i else n for i in range(group_size)]
        return [Episode(env_cls(), task, tokenizer, SamplingParams(max_new_tokens=size, ignore_eos=True),
                        domain="arithmetic", max_turns=1, max_context_tokens=256, group=group,
                        traj_id=f"g{group}-{i}-len{size}")
                for i, size in enumerate(sizes)]

    engine = EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tokenizer.eos_token_id,
                            pad_id=tokenizer.pad_token_id, max_batch=8, overlap=overlap)
    cfg = TrainerConfig(train_batch_size=batch, critic_warmup_steps=0)
    rl = rl or AlgoConfig()
    backend = TorchTrainer(tiny_model_dir, cfg, with_critic=needs_critic(algo, rl))
    learner = Learner(backend, algo, rl, critic_steps=2, critic_warmup_steps=0)
    rollout = RolloutConfig(asynchronous=asynchronous, group_size=group_size, max_staleness=max_staleness)
    held, lock = [], threading.Lock()

    def release(step):  # after each step: the held stragglers now past the bound arrive
        if after_step is not None:
            after_step(loop, step)
        with lock:
            due = [t for t in held if loop.backend.policy_version - t.min_version > max_staleness]
            held[:] = [t for t in held if t not in due]
        for traj in due:
            arrive(traj)

    loop = RLLoop(engine=engine, learner=learner, make_episodes=make_episodes, rollout=rollout,
                  train_batch_size=batch, pad_id=tokenizer.pad_token_id,
                  logger=MetricsLogger(tmp_path / "metrics.jsonl", stage="t"), trained_log=tmp_path / "trained.jsonl",
                  after_step=release)
    put = loop.buffer.put

    def arrive(traj):
        arrivals.append(traj.traj_id)
        put(traj)

    def put_or_hold(traj):
        with lock:
            hold = late is not None and traj.traj_id.endswith(f"-len{late}") and not held
            if hold:
                held.append(traj)
        if not hold:
            arrive(traj)

    loop.buffer.put = put_or_hold
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


@pytest.mark.parametrize("overlap", [True, False])
def test_with_overlap_off_the_engine_waits_while_the_trainer_computes(tmp_path, tiny_model_dir, tokenizer, overlap):
    """engine.overlap false: the engine decodes nothing while a step (after_step included) runs, and whoever holds
    the trainer's turn may drive the engine itself (the gate's probes) without waiting for its own turn. With
    the default overlap the engine goes on generating meanwhile (the contrast: the measurement sees it)."""
    during, probes = [], []

    def after_step(loop, step):
        before = loop.engine.tokens_generated
        time.sleep(0.3)  # the trainer computing
        while overlap and not any(during) and loop.engine.tokens_generated == before:  # until the engine is seen
            time.sleep(0.01)  # decoding once (a busy machine may not run its thread within 0.3 s; off, never)
        during.append(loop.engine.tokens_generated - before)
        probe = GenerationRequest(tokenizer.encode("1 + 1 ="), SamplingParams(max_new_tokens=3, ignore_eos=True))
        # as the gate probes: on a shallow copy (its own batch state; the same weights, lock and turns)
        probes.append(len(copy.copy(loop.engine).generate_all([probe])[0].token_ids))

    lengths = [40] * 60  # long enough that the engine is always mid-generation when a step starts
    loop, _ = _loop(tmp_path, tiny_model_dir, tokenizer, lengths, batch=2, max_staleness=2, overlap=overlap,
                    after_step=after_step)
    history = loop.run(steps=4)
    assert len(history) == 4 and probes == [3] * 4
    assert (sum(during) == 0) is (not overlap), during


def _long_tailed(n: int, seed: int = 0, every: int = 13) -> list[int]:
    """Response lengths with a long tail: lognormal (median 3, capped at 96), and every `every`-th a 200-token
    straggler that finishes policy versions after the rollouts started beside it."""
    rng = random.Random(seed)
    return [200 if i % every == 5 else min(96, max(1, round(rng.lognormvariate(math.log(3), 1.3))))
            for i in range(n)]


def _metrics(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_staleness_bound_drops_old_trajectories(tmp_path, tiny_model_dir, tokenizer):
    """Variable lengths: a straggler finishes after the policy moved on, and is dropped, not trained on. (Which
    stragglers were late used to be up to the machine's load: a loaded run once saw none; now the 200-token ones
    arrive late by construction.)"""
    loop, arrivals = _loop(tmp_path, tiny_model_dir, tokenizer, _long_tailed(400, every=6), max_staleness=1,
                           batch=4, late=200)
    loop.run(steps=12)
    metrics = _metrics(tmp_path)
    assert all(m["staleness_max"] <= 1 for m in metrics)
    assert metrics[-1]["dropped_stale"] > 0  # the bound had something to drop
    trained = {t for step in _trained(tmp_path) for t in step}
    assert len(trained) == 48 and trained < set(arrivals)


@pytest.mark.parametrize("algo", ["grpo", "grpo_dis"])
def test_async_grpo_batches_hold_whole_groups_under_long_tailed_lengths_with_drops(tmp_path, tiny_model_dir,
                                                                                 tokenizer, algo):
    """A group with one stale member is dropped whole; every batch is whole groups (z-scores over whole groups)."""
    loop, arrivals = _loop(tmp_path, tiny_model_dir, tokenizer, _long_tailed(2000, seed=1), group_size=4, batch=8,
                           max_staleness=1, algo=algo, per_member=True, late=200)
    loop.run(steps=10)
    metrics, trained = _metrics(tmp_path), _trained(tmp_path)
    for step in trained:
        groups = [t.split("-")[0] for t in step]
        assert sorted(groups.count(g) for g in set(groups)) == [4, 4], step
    seen = [t.split("-")[0] for step in trained for t in step]
    assert len(seen) == len(set(seen)) * 4  # no group trained in two batches either
    assert all(m["staleness_max"] <= 1 for m in metrics)
    assert metrics[-1]["dropped_stale_groups"] > 0  # drops happened, group by group
    assert metrics[-1]["dropped_stale"] == 4 * metrics[-1]["dropped_stale_groups"]
    finished = {t.split("-")[0] for t in arrivals}
    assert {g for g in finished if sum(t.startswith(g + "-") for t in arrivals) == 4} >= set(seen)


CALLS: list[float] = []  # the mean advantage of each call of the estimator below


@A.register_advantage("reinforce")  # REINFORCE without a baseline: an algorithm added as a user's own file would
def raw_reward(x: A.AdvantageInputs, rl):
    """The reward plus 1: the untrained tiny model scores 0 on arithmetic, and a zero advantage moves nothing, so
    the shift is what lets the test see this function's advantages drive the update."""
    adv = A.broadcast_sequence_advantage(x.rewards.sum(-1) + 1.0, x.action_mask)
    CALLS.append(float(adv[x.action_mask.bool()].mean()))
    return adv, None


A.register_preset("reinforce", advantage="reinforce", policy_loss="dis")


@pytest.mark.parametrize("algo,rl", [("reinforce", AlgoConfig()), ("sao", AlgoConfig(advantage="reinforce"))])
def test_a_new_algorithm_is_one_registered_function(tmp_path, tiny_model_dir, tokenizer, algo, rl):
    """A new advantage estimator runs through the same loop, named by a preset or by `rl.advantage` beside the
    sao preset's DIS loss (no critic: the estimator reads no values)."""
    import torch

    loop, _ = _loop(tmp_path, tiny_model_dir, tokenizer, [2] * 50, algo=algo, rl=rl)
    before = {k: v.clone() for k, v in loop.learner.backend.policy.state_dict().items()}
    CALLS.clear()
    history = loop.run(steps=2)
    after = loop.learner.backend.policy.state_dict()
    assert len(history) == 2 and "policy_loss" in history[-1] and "value_loss" not in history[-1]
    assert loop.learner.backend.critic is None and loop.learner.algorithm.policy_loss.name == "dis"
    # the loop trained on this function's advantages (once per step, >= 1 each), and they moved the policy
    assert [m["adv_mean"] for m in history] == pytest.approx(CALLS) and len(CALLS) == 2 and min(CALLS) >= 1.0
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_ttur_order_the_policy_advantages_read_the_critic_after_its_k_updates(tiny_model_dir, tokenizer):
    """SAO's K critic updates come first; GAE then reads the updated values (issue: TTUR order)."""
    import torch

    from opd_sao.trajectory import Trajectory, collate

    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(4):
        traj = Trajectory(f"t{i}", "arithmetic", [1] + torch.randint(3, 50, (4,), generator=g).tolist())
        traj.append(torch.randint(3, 50, (3 + i,), generator=g).tolist(), action=True, logp=[-1.0] * (3 + i),
                    versions=[0] * (3 + i))
        traj.add_reward(float(i % 2))
        trajs.append(traj)
    batch = collate(trajs, tokenizer.pad_token_id)
    backend = TorchTrainer(tiny_model_dir, TrainerConfig(train_batch_size=4, critic_lr=0.05), with_critic=True)
    learner = Learner(backend, "sao", AlgoConfig(), critic_steps=2, critic_warmup_steps=5)  # warm-up: no policy step
    with torch.no_grad():
        before = backend.critic_values(batch, grad=False)
    metrics = learner.step(batch, temperature=1.0)
    with torch.no_grad():
        after = backend.critic_values(batch, grad=False)
    inputs = dict(rewards=batch.rewards, action_mask=batch.action_mask)
    used = A.sao_advantages(A.AdvantageInputs(values=after, **inputs), AlgoConfig())[0]
    stale = A.sao_advantages(A.AdvantageInputs(values=before, **inputs), AlgoConfig())[0]
    acted = batch.action_mask.bool()
    assert not torch.allclose(before, after)  # the K updates moved the critic
    assert metrics["adv_mean"] == pytest.approx(float(used[acted].mean()), abs=1e-6)
    assert metrics["adv_mean"] != pytest.approx(float(stale[acted].mean()), abs=1e-6)


def test_recovery_after_a_crash_reuses_groups_whole(tmp_path):
    """The write-ahead log after a crash: a group whose one member is too old is dropped whole, not split."""
    from opd_sao.rl.buffer import TrajectoryBuffer, recover
    from opd_sao.trajectory import Trajectory

    buffer = TrajectoryBuffer(2, spill_dir=tmp_path)
    for group, versions in enumerate([(3, 3), (1, 3), (2, 3)]):  # group 1 has a member from version 1
        for i, version in enumerate(versions):
            traj = Trajectory(f"g{group}-{i}", "d", [1], meta={"group": group})
            traj.append([5, 6], action=True, logp=[-1.0, -1.0], versions=[version, version])
            buffer.put(traj)
    buffer.close()
    reused, dropped = recover(tmp_path, trained_ids={"g2-0", "g2-1"}, current_version=3, max_staleness=1, group_size=2)
    assert sorted(t.traj_id for t in reused) == ["g0-0", "g0-1"] and dropped == 2


def test_beyond_its_memory_budget_the_buffer_reads_trajectories_back_from_its_log(tmp_path):
    """Past `memory_budget` waiting trajectories only their place in the log stays in memory; a batch taken later
    reads them back equal to what was put, in arrival order, and the count of spilled ones is kept."""
    from opd_sao.rl.buffer import TrajectoryBuffer
    from opd_sao.trajectory import Trajectory

    buffer = TrajectoryBuffer(1, spill_dir=tmp_path, memory_budget=3)
    put = []
    for i in range(8):
        traj = Trajectory(f"t{i}", "d", [1, 2][: 1 + i % 2], meta={"task_id": f"task {i}", "note": "é" * i})
        traj.append(list(range(i + 1)), action=True, logp=[-0.5 * i] * (i + 1), versions=[0] * (i + 1))
        traj.add_reward(i / 7)
        buffer.put(traj)
        put.append(traj.to_json())
    assert buffer.spilled == 5
    first = buffer.take(4, current_version=0, max_staleness=1, timeout=1)
    buffer.put(Trajectory("t8", "d", [3], meta={}))  # room again: the batch took the 3 held in memory
    assert buffer.spilled == 5
    rest = buffer.take(5, current_version=0, max_staleness=1, timeout=1)
    assert [t.to_json() for t in first + rest[:4]] == put and rest[4].traj_id == "t8"
    buffer.close()


def test_stop_returns_once_the_episodes_in_flight_have_handed_on_their_trajectories(tiny_model_dir, tokenizer):
    """Before: stop() joined the rollout thread for at most 60 s, so on a loaded machine the thread could still be
    stepping an episode after the stage had moved on, and then write to the buffer's log the loop had closed. Here an
    episode's environment step is held until stop() has closed the feed: stop waits for it, its trajectory first."""
    env_cls = ENVIRONMENTS.get("arithmetic")
    stepping, release = threading.Event(), threading.Event()

    class Held(env_cls):
        slow_steps = True

        def step(self, action):
            stepping.set()
            release.wait()
            return super().step(action)

    task = env_cls().make_tasks("train", 1, seed=0)[0]
    engine = EmbeddedEngine(load_causal_lm(tiny_model_dir), eos_id=tokenizer.eos_token_id,
                            pad_id=tokenizer.pad_token_id, max_batch=8)
    arrived, stopped, admitted = [], threading.Event(), iter([True])
    worker = RolloutWorker(engine, lambda: [Episode(Held(), task, tokenizer, SamplingParams(max_new_tokens=2),
                                                    domain="arithmetic", max_turns=1, max_context_tokens=256)],
                           lambda n: next(admitted, False), lambda traj: arrived.append(stopped.is_set()))
    worker.start()
    stepping.wait()
    stopper = threading.Thread(target=lambda: (worker.stop(), stopped.set()))
    stopper.start()
    while not worker.feed._closed:  # stop() has begun
        time.sleep(0.01)
    release.set()
    stopper.join()
    assert arrived == [False] and not worker.is_alive() and worker.error is None
