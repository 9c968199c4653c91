"""The rollout engine interface: continuous-batching generation with per-token logprobs and versions."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    ignore_eos: bool = False  # benchmarks force response lengths with it (stop_token_ids are ignored too, as SGLang)
    top_k: int = -1  # sample among the k most likely tokens only (-1: all); 1 is greedy
    stop_token_ids: tuple[int, ...] = ()  # end the sequence like eos does (finish "stop")
    # SGLang's sampling_seed: the i-th token's draw depends only on (seed, i), not on the batch the request shares,
    # so two checkpoints evaluated with the same seeds see common random numbers (None: the engine's own stream)
    sampling_seed: Optional[int] = None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tag: Any = None  # handed back untouched with the result (the caller's episode)
    est_tokens: int = 0  # a length estimate, for load-aware routing
    cancelled: bool = False  # set when nobody waits for the result any more: the engine drops it at its next step
    # called with the tokens so far after each token, True ends the sequence (finish "stop"): serve's stop strings
    stop_check: Optional[Callable[[list[int]], bool]] = None


@dataclass
class GenerationResult:
    request: GenerationRequest
    token_ids: list[int]
    logprobs: list[float]  # of the distribution actually sampled from (temperature, top-p)
    versions: list[int]  # the policy version that sampled each token
    finish_reason: str  # "stop" (eos) or "length"
    # under softmax(logits/T) over the whole vocabulary, not renormalised to top-p (SGLang's output_token_logprobs)
    vocab_logprobs: list[float] = field(default_factory=list)
    # deterministic mode: the same tokens rescored alone (batch-invariant), kept beside the sampled logprobs (never
    # instead of them: the behaviour policy is what sampled), so a sampler fault shows as their difference
    recomputed_logprobs: Optional[list[float]] = None


ResultCallback = Callable[[GenerationResult], None]


class RequestFeed:
    """Requests other threads hand an engine while it generates (continuous batching), on a Condition, not a poll.

    The engine's `next()` gives a request put, else what `more()` makes (None: nothing now, it decodes what it
    has), and ends once `close()`d (raising `close(error)`'s error). With nothing to decode the engine blocks in
    `wait()` until a `put()`, `notify()` or `close()` came after its last `next()`: whoever changes what `more()`
    reads calls `notify()`."""

    def __init__(self, more: Callable[[], Optional[GenerationRequest]] = lambda: None):
        self._more = more
        self._queue: deque[GenerationRequest] = deque()
        self._cond = threading.Condition()
        self._changes = self._seen = 0
        self._closed = False
        self._error: Optional[BaseException] = None

    def put(self, request: GenerationRequest) -> None:
        with self._cond:
            self._queue.append(request)
            self._changed()

    def notify(self) -> None:
        with self._cond:
            self._changed()

    def close(self, error: Optional[BaseException] = None) -> None:
        with self._cond:
            self._closed, self._error = True, self._error or error
            self._changed()

    def _changed(self) -> None:
        self._changes += 1
        self._cond.notify_all()

    def __iter__(self) -> "RequestFeed":
        return self

    def __next__(self) -> Optional[GenerationRequest]:
        with self._cond:
            self._seen = self._changes
            if self._error is not None:
                raise self._error
            if self._closed:
                raise StopIteration
            if self._queue:
                return self._queue.popleft()
        return self._more()

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._changes != self._seen)


class RolloutEngine(ABC):
    """Generates from prompts; weights arrive from the trainer tagged with a policy version."""

    @property
    @abstractmethod
    def version(self) -> int: ...

    @abstractmethod
    def generate(self, requests: Iterable[Optional[GenerationRequest]], on_result: ResultCallback) -> None:
        """Run until `requests` is exhausted and every sequence has finished.

        Continuous batching: a request is pulled whenever a slot is free, and `on_result` is called the
        moment a sequence finishes. A RequestFeed may yield None, "nothing to add right now" (other iterables do not).
        """

    @abstractmethod
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...

    @property
    def rejoins(self) -> int:
        """How often a server came back into the fleet and was given the current weights since the engine
        started (0 for an engine that is one process): the consistency gate checks again after each."""
        return 0

    def trainer_turn(self) -> ContextManager:
        """Held by the trainer around a step. An engine computing where the trainer does (the embedded engine with
        engine.overlap false) does not decode meanwhile; by default nothing waits."""
        return nullcontext()

    def generate_all(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results: dict[int, GenerationResult] = {}
        order = {id(r): i for i, r in enumerate(requests)}
        self.generate(iter(requests), lambda res: results.__setitem__(order[id(res.request)], res))
        return [results[i] for i in range(len(requests))]

    def close(self) -> None:
        pass


class Turns:
    """The trainer and an in-process engine computing one at a time (engine.overlap false).

    The engine holds a turn for a busy spell: from the moment it has sequences to decode until it has none (its
    batch drained, new work held back by the staleness bound); the trainer holds one for a step. So a sequence is
    never cut off by a step and re-prefilled on the new weights for nothing, and neither waits while the other has
    nothing to do. Once the trainer asks, the engine starts no new spell. The thread holding a turn may drive the
    engine itself (the gate's probes, an evaluation) inside it.

    Why: at one torch thread per process, two threads issuing small ops at once pass the GIL back and forth on
    every op (torch releases it in each); on the tiny model that costs up to a fifth more CPU than the same work in
    turns (docs/benchmarks.md). On one accelerator, turns keep the two from competing for it.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._holder: Optional[int] = None  # the thread computing now
        self._trainer_asks = 0

    @contextmanager
    def trainer(self) -> Iterator[None]:
        with self._cond:
            self._trainer_asks += 1
            try:
                self._cond.wait_for(lambda: self._holder is None)
            finally:
                self._trainer_asks -= 1
            self._holder = threading.get_ident()
        try:
            yield
        finally:
            self.release()

    def engine(self) -> bool:
        """Take the engine's turn (waiting while the trainer holds or asks for one); False when this thread already
        holds a turn (nothing to release after)."""
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                return False
            self._cond.wait_for(lambda: self._holder is None and not self._trainer_asks)
            self._holder = me
            return True

    def release(self) -> None:
        with self._cond:
            self._holder = None
            self._cond.notify_all()
