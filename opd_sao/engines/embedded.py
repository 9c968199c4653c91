"""The embedded rollout engine: an in-process transformers model with continuous batching.

Each decode step re-runs the (tiny) model over the active sequences, left-padded; finished sequences
leave the batch at once and new requests take their slots, so a long response never holds short
ones back. Weights are swapped between decode steps under a lock; every token records the version
that sampled it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from ..modeling import forward_logits, sample_tokens, sequence_logprobs
from .base import GenerationRequest, GenerationResult, ResultCallback, RolloutEngine


@dataclass
class _Sequence:
    request: GenerationRequest
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""


class EmbeddedEngine(RolloutEngine):
    def __init__(self, model: torch.nn.Module, *, eos_id: int, pad_id: int, max_batch: int = 32,
                 seed: int = 0, deterministic: bool = False):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.eos_id, self.pad_id, self.max_batch = eos_id, pad_id, max_batch
        self.deterministic = deterministic
        self.generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        self._version = 0
        self.tokens_generated = 0

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self.model.load_state_dict(state_dict, strict=False)
            self._version = version

    def generate(self, requests: Iterable[Optional[GenerationRequest]], on_result: ResultCallback) -> None:
        pending = iter(requests)
        exhausted = False
        active: list[_Sequence] = []
        while True:
            while not exhausted and len(active) < self.max_batch:
                try:
                    request = next(pending)
                except StopIteration:
                    exhausted = True
                    break
                if request is None:
                    break
                active.append(_Sequence(request))
            if not active:
                if exhausted:
                    return
                time.sleep(0.002)
                continue
            self._decode_step(active)
            still_running = []
            for seq in active:
                if seq.finish_reason:
                    on_result(self._finish(seq))
                else:
                    still_running.append(seq)
            active = still_running

    @torch.no_grad()
    def _decode_step(self, active: list[_Sequence]) -> None:
        rows = [s.request.prompt_ids + s.token_ids for s in active]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row):] = torch.tensor(row)
            attention[i, width - len(row):] = 1
        temperature = torch.tensor([s.request.params.temperature for s in active])
        top_p = torch.tensor([s.request.params.top_p for s in active])
        with self._lock:
            logits = forward_logits(self.model, input_ids, attention)[:, -1]
            version = self._version
        ids, logps = sample_tokens(logits, temperature, top_p, self.generator)
        self.tokens_generated += len(active)
        for seq, token, logp in zip(active, ids.tolist(), logps.tolist()):
            params = seq.request.params
            seq.token_ids.append(token)
            seq.logprobs.append(logp)
            seq.versions.append(version)
            if token == self.eos_id and not params.ignore_eos:
                seq.finish_reason = "stop"
            elif len(seq.token_ids) >= params.max_new_tokens:
                seq.finish_reason = "length"

    def _finish(self, seq: _Sequence) -> GenerationResult:
        logprobs = seq.logprobs
        same_version = len(set(seq.versions)) == 1
        if self.deterministic and same_version and seq.request.params.top_p >= 1.0:
            logprobs = self._rescore_alone(seq)
        return GenerationResult(seq.request, seq.token_ids, logprobs, seq.versions, seq.finish_reason)

    @torch.no_grad()
    def _rescore_alone(self, seq: _Sequence) -> list[float]:
        """Deterministic mode: the logprobs the trainer's kernel gives this sequence alone, unpadded."""
        ids = torch.tensor([seq.request.prompt_ids + seq.token_ids])
        with self._lock:
            logp = sequence_logprobs(self.model, ids, torch.ones_like(ids), seq.request.params.temperature)
        return logp[0, len(seq.request.prompt_ids):].tolist()
