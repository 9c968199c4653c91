"""Episodes: how engine generations and environment steps become trajectories.

Single-turn and multi-turn tasks share one path: prompt, then action, observation, action, ...
Action spans keep exactly the token ids the engine sampled (no re-tokenisation); observation
tokens get action_mask 0 and no logprob. Prompts and observations are encoded by the stage's
`PromptFormat` (raw text, or the tokenizer's chat template). With compaction on, a long episode is
several trajectory segments (see opd_sao.rl.compaction), each exactly what the engine conditioned on.
"""
from __future__ import annotations

import logging
import math
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Optional

from opd_sao.checkpoints import PromptFormat
from opd_sao.engines.base import (
    GenerationRequest,
    GenerationResult,
    RequestFeed,
    RolloutEngine,
    SamplingParams,
)
from opd_sao.errors import UsageError
from opd_sao.model.modeling import seed_of
from opd_sao.rl.compaction import Compaction, next_segment, propagate_returns
from opd_sao.trajectory import Trajectory

# 64 random bits per trajectory id, from a generator seeded by the OS once per process (an id need not be secret,
# only distinct across processes and resumes; uuid4 read the OS's randomness once per episode)
_TRAJECTORY_IDS = random.Random(int.from_bytes(os.urandom(16), "little"))


class PromptTooLong(UsageError):
    """A task whose prompt leaves no room to answer in the context (one line naming the task)."""


CHARS_PER_TOKEN = 64  # more characters than this per token of context: too long without tokenizing (a 50 MB row)


TRUNCATE = "set rollout.truncation (left | right) to cut it"

STOP_REPORT_S = 600  # how often a rollout worker that does not end after its stop is named in the log
log = logging.getLogger(__name__)


def prompt_ids(prompt_format: PromptFormat, text: str, where: Callable[[], str], *, max_context_tokens: int,
               max_new_tokens: int, max_positions: Optional[int] = None, truncation: str = "error") -> list[int]:
    """The prompt's token ids when it leaves room to answer: fewer than `max_context_tokens` and, with
    `max_new_tokens`, at most the model's `max_positions`. Otherwise `truncation` "error" raises PromptTooLong
    naming `where()` (the task; a dataset's file and row: called only for the error, as finding the row reads the
    file again), "left" keeps the last tokens that fit and "right" the first (verl's data.truncation). A text far
    too long by characters alone is never tokenized whole: refused, or cut to CHARS_PER_TOKEN characters per token
    of context first."""
    chars = CHARS_PER_TOKEN * max_context_tokens
    if len(text) > chars:
        if truncation == "error":
            raise PromptTooLong(f"{where()}: its prompt is {len(text):,} characters, far past rollout.max_context_tokens "
                                f"{max_context_tokens}; shorten or drop the row, or {TRUNCATE}")
        text = text[-chars:] if truncation == "left" else text[:chars]
    ids = prompt_format.prompt(text)
    room = max_context_tokens - 1 if max_positions is None else min(max_context_tokens - 1,
                                                                    max_positions - max_new_tokens)
    if len(ids) <= room:
        return ids
    if truncation != "error" and room > 0:
        return ids[-room:] if truncation == "left" else ids[:room]
    if len(ids) >= max_context_tokens:
        raise PromptTooLong(f"{where()}: its prompt is {len(ids)} tokens, and rollout.max_context_tokens is "
                            f"{max_context_tokens}; shorten or drop the row, or {TRUNCATE}")
    raise PromptTooLong(f"{where()}: its prompt is {len(ids)} tokens, which with rollout.max_new_tokens {max_new_tokens} "
                        f"passes the model's max_position_embeddings {max_positions}; shorten or drop the row, lower "
                        f"max_new_tokens, or {TRUNCATE}")


def check_prompts(env_factory, tasks: list[dict], tokenizer, rollout, *, domain: str,
                  max_positions: Optional[int] = None) -> None:
    """Before any work: every task's prompt leaves room to answer (`prompt_ids`; with rollout.truncation "error",
    PromptTooLong names the first that does not, and its file and row), so a long row cannot stop a run mid-stage
    or run past the model's positions."""
    env = env_factory()
    prompt_format = PromptFormat.from_rollout(tokenizer, rollout)
    for task in tasks:
        prompt_ids(prompt_format, env.reset(task), lambda: f"{domain}: {env.where(task)}",
                   max_context_tokens=rollout.max_context_tokens, max_new_tokens=rollout.max_new_tokens,
                   max_positions=max_positions, truncation=rollout.truncation)


def episodes_for(env_factory, task: dict, tokenizer, rollout, *, domain: str, count: int = 1, group: int = -1,
                 temperature: Optional[float] = None, traj_ids: Optional[list[str]] = None,
                 sampling_seed: Optional[int] = None, top_k: Optional[int] = None,
                 max_positions: Optional[int] = None) -> list["Episode"]:
    """The `count` episodes of one task as every caller plays them (training, OPD, evaluation, gate probes):
    the rollout config's sampling, episode lengths, compaction and prompt format; `temperature` overrides the
    sampling one, `top_k` cuts it (1: greedy, evaluation's eval.greedy). With `sampling_seed` (evaluation) the
    i-th episode's draws are keyed by (seed, domain, task, i) alone: the same for any checkpoint, batch or engine
    load."""
    params = SamplingParams(rollout.temperature if temperature is None else temperature, rollout.top_p,
                            rollout.max_new_tokens, top_k=-1 if top_k is None else top_k)
    compaction, prompt_format = Compaction.from_rollout(rollout), PromptFormat.from_rollout(tokenizer, rollout)
    keyed = [params if sampling_seed is None else replace(params, sampling_seed=seed_of(
        sampling_seed, domain, str(task["id"]), i)) for i in range(count)]
    return [Episode(env_factory(), task, tokenizer, keyed[i], domain=domain, max_turns=rollout.max_turns,
                    max_context_tokens=rollout.max_context_tokens, group=group, compaction=compaction,
                    traj_id=traj_ids[i] if traj_ids else None, prompt_format=prompt_format,
                    max_positions=max_positions, truncation=rollout.truncation)
            for i in range(count)]


class Episode:
    def __init__(self, env, task: dict, tokenizer, params: SamplingParams, *, domain: str, max_turns: int,
                 max_context_tokens: int, group: int = -1, traj_id: Optional[str] = None,
                 compaction: Optional[Compaction] = None, prompt_format: Optional[PromptFormat] = None,
                 max_positions: Optional[int] = None, truncation: str = "error"):
        """`max_positions`: the model's max_position_embeddings (None: unchecked); `truncation`: the rollout's, for
        a prompt with no room to answer (see prompt_ids)."""
        self.env, self.task, self.tokenizer, self.params = env, task, tokenizer, params
        self.max_turns, self.max_context_tokens, self.compaction = max_turns, max_context_tokens, compaction
        self.format = prompt_format or PromptFormat(tokenizer)
        first_observation = env.reset(task)
        ids = prompt_ids(self.format, first_observation, lambda: f"{domain}: {env.where(task)}",
                         max_context_tokens=max_context_tokens, max_new_tokens=params.max_new_tokens,
                         max_positions=max_positions, truncation=truncation)
        traj_id = traj_id or f"{domain}-{_TRAJECTORY_IDS.getrandbits(64):016x}"
        self.traj = Trajectory(
            traj_id=traj_id, domain=domain, prompt_ids=ids, temperature=params.temperature, top_p=params.top_p,
            meta={"task_id": task["id"], "group": group, "turns": 0, "episode": traj_id, "segment": 0},
        )
        self.segments = [self.traj]  # self.traj is the last one, the segment being played
        self.turns = 0  # environment steps over all segments
        self._summarising: Optional[str] = None  # during a compaction turn: the latest observation

    def request(self) -> GenerationRequest:
        ids = self.traj.prompt_ids + self.traj.token_ids
        room = self.max_context_tokens - len(ids)
        seed = self.params.sampling_seed  # one key per request: the segment, the turn, a summary or an action
        params = SamplingParams(self.params.temperature, self.params.top_p,
                                max(1, min(self.params.max_new_tokens, room)), self.params.ignore_eos,
                                top_k=self.params.top_k, sampling_seed=None if seed is None else seed_of(
                                    seed, len(self.segments), self.turns, self._summarising is not None))
        return GenerationRequest(ids, params, tag=self, est_tokens=params.max_new_tokens)

    def on_result(self, result: GenerationResult) -> bool:
        """Record the action, step the environment; True when the episode is over."""
        traj = self.traj
        traj.append(result.token_ids, action=True, logp=result.logprobs, versions=result.versions)
        # a deterministic engine's batch-invariant recomputation, kept while every action span of the segment has one
        previous = traj.meta.pop("recomputed_logp", None)
        if result.recomputed_logprobs is not None and (previous is not None or traj.num_action_tokens == len(
                result.token_ids)):
            traj.meta["recomputed_logp"] = (previous or []) + list(result.recomputed_logprobs)
        stopped_on = result.token_ids[-1] if result.finish_reason == "stop" and result.token_ids else None
        if self._summarising is not None:
            return self._continue_after_summary(result.token_ids, stopped_on)
        self.turns += 1
        traj.meta["turns"] += 1
        # the environment reads the text without the stop token and without control tokens (<|im_end|>, ...)
        action_ids = result.token_ids[:-1] if stopped_on is not None else result.token_ids
        observation, reward, done = self.env.step(self.tokenizer.decode(action_ids, skip_special_tokens=True))
        if not math.isfinite(reward):  # NaN passes every comparison: it would train on, and poison the weights
            raise ValueError(f"{traj.domain}: task {self.task['id']!r}: the environment's reward is {reward}; "
                             f"rewards must be finite numbers")
        traj.add_reward(reward)
        traj.finish_reason = "done" if done else result.finish_reason
        if done:
            return self._end()
        obs_ids = self.format.observation(observation, stopped_on) if observation else []
        total = len(traj.prompt_ids) + len(traj.token_ids) + len(obs_ids)
        if self.turns >= self.max_turns:
            return self._end("max_turns")
        if self.compaction and total > self.compaction.budget:
            request = self.format.observation(observation, stopped_on, instruction=self.compaction.instruction)
            if len(traj.prompt_ids) + len(traj.token_ids) + len(request) < self.max_context_tokens - 1:
                traj.append(request, action=False)  # the next action is the summary
                self._summarising = observation
                return False
        if total >= self.max_context_tokens - 1:
            return self._end("context")
        if obs_ids:
            traj.append(obs_ids, action=False)
        return False

    def _continue_after_summary(self, summary_ids: list[int], stopped_on: Optional[int]) -> bool:
        """Close the segment on its summary; go on in a new one that starts from the compacted context."""
        observation, self._summarising = self._summarising, None
        self.traj.finish_reason = "compacted"
        obs_ids = self.format.observation(observation, stopped_on) if observation else []
        segment = next_segment(self.segments, summary_ids, obs_ids)
        if len(segment.prompt_ids) >= self.max_context_tokens - 1:
            return self._end("context")
        self.traj = segment
        self.segments.append(segment)
        return False

    def _end(self, reason: Optional[str] = None) -> bool:
        if reason:
            self.traj.finish_reason = reason
        propagate_returns(self.segments)
        return True


class EnvSteps:
    """Applies generation results to their episodes; slow environments step on worker threads.

    A sandboxed program takes ~0.1 s: stepping it on the engine's thread would stall every other
    sequence in the batch. Fast environments step inline, which keeps their order deterministic.
    An episode has one request in flight at a time, so its steps never run concurrently.
    """

    def __init__(self, on_finished: Callable[[Episode], None], feed: RequestFeed, workers: int = 8):
        """An episode's next request goes to `feed`; an environment's error closes it (the engine raises it)."""
        self.on_finished, self.feed = on_finished, feed
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env-step")
        self.error: Optional[BaseException] = None

    def __call__(self, result: GenerationResult) -> None:
        episode: Episode = result.request.tag
        if getattr(episode.env, "slow_steps", False):
            self._pool.submit(self._apply, episode, result)
        else:
            self._apply(episode, result)

    def _apply(self, episode: Episode, result: GenerationResult) -> None:
        try:
            if episode.on_result(result):
                self.on_finished(episode)
            else:
                self.feed.put(episode.request())
        except BaseException as err:  # raised on the rollout thread: by the engine's next request, or `check`
            self.error = self.error or err
            self.feed.close(err)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def run_episodes(engine: RolloutEngine, episodes: list[Episode]) -> list[Trajectory]:
    """Play episodes to the end with continuous batching (evaluation, probes, synchronous use).

    One trajectory per episode: its first segment, whose total reward is the episode's (all segments of a
    compacted episode are in `episode.segments`).
    """
    feed = RequestFeed()
    for ep in episodes:
        feed.put(ep.request())
    remaining = [len(episodes)]
    lock = threading.Lock()

    def finished(_episode: Episode) -> None:
        with lock:
            remaining[0] -= 1
            if not remaining[0]:
                feed.close()

    steps = EnvSteps(finished, feed)
    if not episodes:
        feed.close()
    try:
        engine.generate(feed, steps)
    finally:
        steps.close()
    steps.check()
    return [ep.segments[0] for ep in episodes]


class RolloutWorker(threading.Thread):
    """Keeps the engine busy: starts episodes while `admit()` allows, hands each finished trajectory on.

    `admit(n)` is the flow control (staleness bound, or lock-step batches in synchronous mode);
    `make_episodes()` returns the episodes of one prompt (one for SAO, G for a GRPO group).
    """

    def __init__(self, engine: RolloutEngine, make_episodes: Callable[[], list[Episode]],
                 admit: Callable[[int], bool], on_trajectory: Callable[[Trajectory], None]):
        super().__init__(daemon=True, name="rollout-worker")
        self.engine, self.make_episodes, self.admit, self.on_trajectory = engine, make_episodes, admit, on_trajectory
        self.error: Optional[BaseException] = None
        # episodes' next requests first, then a new episode's first when `admit` allows: whoever changes what it
        # reads (a step done, a stale trajectory dropped) calls `feed.notify()`
        self.feed = RequestFeed(self._next_request)
        self._steps = EnvSteps(self._finished, self.feed)
        self._waiting: list[Episode] = []  # the next group, built but not yet admitted
        self._staged: list[Episode] = []  # admitted, first requests not yet handed to the engine

    def _next_request(self) -> Optional[GenerationRequest]:
        if not self._staged:
            self._waiting = self._waiting or self.make_episodes()
            if not self.admit(len(self._waiting)):
                return None  # the engine decodes what it has, or waits for feed.notify() when it has nothing
            self._staged, self._waiting = self._waiting, []
        return self._staged.pop().request()

    def _finished(self, episode: Episode) -> None:
        for traj in episode.segments:
            self.on_trajectory(traj)

    def run(self) -> None:
        try:
            self.engine.generate(self.feed, self._steps)
        except BaseException as err:  # surfaced to the trainer thread, never swallowed
            self.error = err
        finally:
            self._steps.close()

    def stop(self) -> None:
        """No new episodes; returns once the thread has ended: the episodes in flight finish (each bounded by
        max_new_tokens and its environment's own limits) and hand their trajectories on first, so nothing of this
        worker touches the buffer or the engine after it returns (the caller closes the buffer's log next). No
        wall-clock bound, which a loaded machine can pass (a thread left running); one that hangs is logged."""
        self.feed.close()
        waited = 0
        while self.join(STOP_REPORT_S) or self.is_alive():
            waited += STOP_REPORT_S
            log.warning("the rollout worker has not ended %d s after its stop (episodes still in flight); waiting",
                        waited)
