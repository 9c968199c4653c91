"""The asynchronous single-rollout training loop (docs/design.md §2.1), and its synchronous group-mode twin.

A rollout worker thread keeps the engine generating while the trainer trains; each trajectory
enters the buffer the moment it finishes; a train step fires as soon as `train_batch_size` fresh
trajectories are buffered; weights go to the engine every `sync_every` policy steps. In synchronous
mode the worker starts a batch only after the previous step, and a step waits for the whole batch.
"""
from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

from opd_sao.config import RolloutConfig
from opd_sao.engines.base import RolloutEngine
from opd_sao.io.tracking import MetricsLogger
from opd_sao.rl.buffer import TrajectoryBuffer
from opd_sao.rl.learner import Learner
from opd_sao.rl.rollout import Episode, RolloutWorker
from opd_sao.trainers.base import NonFiniteError
from opd_sao.trajectory import Trajectory, collate

StepHook = Callable[[int], None]
StopCheck = Callable[[int], bool]  # (policy steps done) -> stop training now


class RLLoop:
    def __init__(self, *, engine: RolloutEngine, learner: Learner, make_episodes: Callable[[], list[Episode]],
                 rollout: RolloutConfig, train_batch_size: int, pad_id: int, logger: MetricsLogger,
                 trained_log: Path, slowdown_s: float = 0.0, after_step: Optional[StepHook] = None,
                 progress=None, buffer: Optional[TrajectoryBuffer] = None, stop_when: Optional[StopCheck] = None):
        if train_batch_size % rollout.group_size:
            raise ValueError(f"train_batch_size {train_batch_size} must be a multiple of group_size {rollout.group_size}")
        self.engine, self.learner, self.make_episodes = engine, learner, make_episodes
        self.rollout, self.batch_size, self.pad_id = rollout, train_batch_size, pad_id
        self.logger, self.trained_log, self.slowdown_s = logger, Path(trained_log), slowdown_s
        self.after_step, self.progress, self.stop_when = after_step, progress, stop_when
        # the learner's: generation (waiting for a batch) and weight sync timed here, critic / policy / teacher in
        # the learner, the rest (gate, checkpoint, evaluation) in the stage's hooks: each metrics line's `time/*`
        self.timer = learner.timer
        self.buffer = buffer if buffer is not None else TrajectoryBuffer(rollout.group_size)
        self._started = 0
        self._steps_done = 0
        self._lock = threading.Lock()

    @property
    def backend(self):
        return self.learner.backend

    def _admit(self, n: int) -> bool:
        """Flow control: in async mode at most max_staleness batches ahead; in sync mode one batch per step.

        Trajectories dropped as stale give their places back, or a tight bound could starve the trainer.
        """
        ahead = self.rollout.max_staleness + 1 if self.rollout.asynchronous else 1
        with self._lock:
            if self._started - self.buffer.dropped_stale + n > (self._steps_done + ahead) * self.batch_size:
                return False
            self._started += n
            return True

    def sync_weights(self) -> None:
        with self.timer.phase("sync"):
            self.engine.update_weights(self.backend.policy_state_dict(), self.backend.policy_version)

    def run(self, steps: int, start_step: int = 0, waiting: list[Trajectory] = ()) -> list[dict]:
        """Train until `steps`, or until `stop_when(steps done)` says so (asked before the first step and after every
        step but the last); on resume, `waiting` holds trajectories recovered from the buffer's log."""
        if self.stop_when is not None and start_step < steps and self.stop_when(start_step):
            self.buffer.close()
            return []
        self._steps_done = start_step
        self._started = start_step * self.batch_size + len(waiting)  # reused ones count against the bound
        for traj in waiting:
            self.buffer.put(traj)
        worker = RolloutWorker(self.engine, self.make_episodes, self._admit, self.buffer.put)
        history = []
        t_start = time.perf_counter()
        tokens_start = getattr(self.engine, "tokens_generated", 0)
        idle_total = 0.0
        worker.start()
        self.timer.begin_steps()
        try:
            for step in range(start_step, steps):
                t0 = time.perf_counter()
                with self.timer.phase("generation"):
                    trajs = self._wait_for_batch(worker)
                idle = time.perf_counter() - t0
                idle_total += idle
                with self.engine.trainer_turn():  # engine.overlap false: the engine waits until the step is done
                    metrics = self._train_step(trajs)
                    worker.feed.notify()  # a step done: the next batch's rollouts may be admitted
                    elapsed = time.perf_counter() - t_start
                    tokens = getattr(self.engine, "tokens_generated", 0) - tokens_start
                    metrics.update(
                        trainer_idle_s=idle,
                        trainer_idle_fraction=idle_total / elapsed,
                        rollout_tokens_per_s=tokens / elapsed,
                        samples_per_s=(step + 1 - start_step) * self.batch_size / elapsed,
                        dropped_stale=self.buffer.dropped_stale,
                        dropped_stale_groups=self.buffer.dropped_stale_groups,
                        policy_version=self.backend.policy_version,
                    )
                    metrics.update(self.timer.step_phases())  # since the previous line: a checkpoint saved or a
                    # probe run after step k's line counts in step k+1's
                    self.logger.log(metrics, step)
                    history.append(metrics)
                    if self.progress is not None:
                        self.progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
                        self.progress.update(1)
                    if self.after_step is not None:
                        self.after_step(step)
                if self.stop_when is not None and step + 1 < steps and self.stop_when(step + 1):
                    break
        finally:
            worker.stop()
            self.buffer.close()
        return history

    def _wait_for_batch(self, worker: RolloutWorker) -> list[Trajectory]:
        while True:
            if worker.error is not None:  # as it was raised: a user error (a bad reward) stays one line
                raise worker.error
            trajs = self.buffer.take(self.batch_size, self.backend.policy_version, self.rollout.max_staleness, 0.5)
            worker.feed.notify()  # stale trajectories it dropped give their places back (_admit)
            if trajs is not None:
                return trajs

    def _train_step(self, trajs: list[Trajectory]) -> dict:
        version = self.backend.policy_version
        staleness = Counter(version - t.min_version for t in trajs)
        batch = collate(trajs, self.pad_id).to(self.backend.device)
        try:
            metrics = self.learner.step(batch, self.rollout.temperature)
        except NonFiniteError as err:
            shown = ", ".join(batch.traj_ids[:4]) + (f" and {len(trajs) - 4} more" if len(trajs) > 4 else "")
            raise NonFiniteError(f"step {self._steps_done}: {err} on the batch of trajectories {shown} (rewards "
                                 f"{[round(float(r), 4) for r in batch.rewards.sum(-1)[:8].tolist()]}); not applied, "
                                 f"nothing saved from it") from None
        if self.slowdown_s:
            time.sleep(self.slowdown_s)
        with self.trained_log.open("a") as f:
            f.write(json.dumps({"step": self._steps_done, "traj_ids": batch.traj_ids}) + "\n")
        if self.backend.policy_version != version and self.backend.policy_version % self.rollout.sync_every == 0:
            self.sync_weights()
        with self._lock:  # only now may the worker start the next batch's rollouts: on the new weights
            self._steps_done += 1
        metrics["staleness_mean"] = sum(k * v for k, v in staleness.items()) / len(trajs)
        metrics["staleness_max"] = max(staleness)
        metrics["staleness_hist"] = {str(k): v for k, v in sorted(staleness.items())}
        metrics["action_tokens"] = float(batch.action_mask.sum())
        return metrics
