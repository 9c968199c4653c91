"""The embedded rollout engine: an in-process transformers model with continuous batching.

The active sequences share one left-padded KV cache; finished sequences leave the batch at once and
new requests take their slots (the cache is re-prefilled when the batch gains members), so a long
response never holds short ones back. Weights are swapped between decode steps under a lock; every token records the version
that sampled it. A cancelled request leaves the batch at the next step (with `on_cancel`, its tokens so far are
handed to it: serve answers an aborted request with them, as SGLang does). With `on_error`, a step that fails is
retried one sequence at a time, so only the sequences that fail on their own get the error (a server's
requests are strangers to each other); without it the error stops `generate` (an in-process run fails loudly).
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Iterator, Optional

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..checkpoints import stop_ids
from ..errors import UsageError
from ..model import llama_forward
from ..model.modeling import batch_kv_cache, position_ids_for, read_only_at, sample_tokens, sequence_logprobs
from .base import GenerationRequest, GenerationResult, ResultCallback, RolloutEngine, Turns


@dataclass
class _Sequence:
    request: GenerationRequest
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    vocab_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""

    @property
    def pending(self) -> int:
        """The newest token, which the KV cache has not seen yet."""
        return self.token_ids[-1] if self.token_ids else self.request.prompt_ids[-1]


class EmbeddedEngine(RolloutEngine):
    """Runs where its model's parameters are (build_engine puts them on `engine.device`); batches follow."""

    def __init__(self, model: torch.nn.Module, *, eos_id: Optional[int], pad_id: int, max_batch: int = 32,
                 seed: int = 0, deterministic: bool = False, overlap: bool = True,
                 own_forward: Optional[bool] = None):
        check_batchable(model.config)
        self.model = model.eval()
        self.device = next(self.model.parameters()).device
        # a Llama-family model runs through the engine's own forward (llama_forward.py) where `engine.own_forward`
        # (unset: on CPU only) asks for it, others through transformers'
        self.own_forward = (llama_forward.own_forward_on(self.device, own_forward)
                            and llama_forward.unsupported(model) is None)
        if own_forward:
            llama_forward.use_own(model)  # deterministic mode's rescoring (`sequence_logprobs`) too, on any device
        self.turns = None if overlap else Turns()  # overlap false: decode only while the trainer does not compute
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.stop_ids, self.pad_id, self.max_batch = stop_ids(model, eos_id), pad_id, max_batch
        self.deterministic = deterministic
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self._lock = threading.Lock()
        self._version = 0
        self.tokens_generated = 0
        self._cache = None  # KV cache of the active batch, left-padded; rebuilt on joins and weight updates
        self._mask = None
        self._rows: list[int] = []
        self._cache_version = -1
        self._targets: Optional[dict[str, torch.Tensor]] = None  # update_weights' name -> the model's tensor

    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy the named tensors into the model's own (names it does not have are ignored, as
        `load_state_dict(strict=False)` does; a shape that differs is refused before anything is copied).
        A copy per tensor into targets looked up once: `load_state_dict` walked every module on every sync."""
        if self._targets is None:
            self._targets = self.model.state_dict(keep_vars=True)
        names = [name for name in state_dict if name in self._targets]
        for name in names:
            if self._targets[name].shape != state_dict[name].shape:
                raise RuntimeError(f"weight {name}: shape {tuple(state_dict[name].shape)} does not match the "
                                   f"engine's {tuple(self._targets[name].shape)}")
        with self._lock, torch.no_grad():
            for name in names:
                self._targets[name].copy_(state_dict[name])
            self._version = version

    def trainer_turn(self) -> ContextManager:
        return self.turns.trainer() if self.turns is not None else nullcontext()

    def generate(self, requests: Iterable[Optional[GenerationRequest]], on_result: ResultCallback,
                 on_error: Optional[Callable[[GenerationRequest, Exception], None]] = None,
                 on_cancel: Optional[ResultCallback] = None) -> None:
        pending = iter(requests)
        self._rows, self._cache, self._mask = [], None, None
        active: list[_Sequence] = []
        exhausted, holding = False, False  # holding: a busy spell's turn (engine.overlap false) to give back
        try:
            while True:
                if self.turns is not None and not holding:
                    holding = self.turns.engine()
                exhausted = self._pull(pending, active, exhausted, on_cancel)
                if active:
                    active = self._iterate(active, on_result, on_error)
                    continue
                if holding:  # nothing to decode: the spell ends, the trainer may compute
                    self.turns.release()
                    holding = False
                if exhausted:
                    return
                pending.wait()  # a RequestFeed (only one yields None): until a request may be there
        finally:
            if holding:
                self.turns.release()

    def _pull(self, pending: Iterator[Optional[GenerationRequest]], active: list[_Sequence], exhausted: bool,
              on_cancel: Optional[ResultCallback] = None) -> bool:
        """Fill free slots from `pending` (until it yields None: nothing to add now); drop cancelled sequences,
        each handed to `on_cancel` with its tokens so far (finish_reason "abort"). Returns whether `pending` is
        exhausted."""
        while not exhausted and len(active) < self.max_batch:
            try:
                request = next(pending)
            except StopIteration:
                exhausted = True
                break
            if request is None:
                break
            if not request.cancelled:
                active.append(_Sequence(request))
            elif on_cancel is not None:
                on_cancel(GenerationResult(request, [], [], [], "abort"))
        if any(seq.request.cancelled for seq in active):
            for seq in active if on_cancel is not None else ():
                if seq.request.cancelled:
                    on_cancel(GenerationResult(seq.request, seq.token_ids, seq.logprobs, seq.versions, "abort",
                                               seq.vocab_logprobs))
            active[:] = self._drop_cancelled(active)
        return exhausted

    def _iterate(self, active: list[_Sequence], on_result: ResultCallback, on_error) -> list[_Sequence]:
        """One decode step of the batch; finished sequences go to `on_result`. Returns the ones still running."""
        try:
            self._decode_step(active)
        except Exception:
            if on_error is None:
                raise
            active = [seq for seq in active if self._step_alone(seq, on_error)]
            self._rows, self._cache, self._mask = [], None, None  # the survivors re-join together
        still_running = []
        for seq in active:
            if seq.finish_reason:
                on_result(self._finish(seq))
            else:
                still_running.append(seq)
        return still_running

    @torch.inference_mode()  # no autograd bookkeeping at all (~10% of a small model's decode forward); the
    # cache's tensors never leave the engine, and what does (tokens, logprobs) leaves as Python numbers
    def _decode_step(self, active: list[_Sequence]) -> None:
        """Feed every sequence's pending token (the last one not yet in the KV cache) and sample the next."""
        with self._lock:
            if self._cache_version != self._version:
                self._rows, self._cache, self._mask = [], None, None
                self._cache_version = self._version
            if len(self._rows) < len(active):
                self._admit(active[len(self._rows):])
            pending = torch.tensor([[s.pending] for s in active], device=self.device)
            self._mask = torch.cat([self._mask, torch.ones(len(active), 1, dtype=torch.long, device=self.device)],
                                   dim=1)
            positions = self._mask.sum(-1, keepdim=True) - 1
            if self.own_forward:
                logits = llama_forward.next_logits(self.model, pending, self._mask, positions, self._cache)
            else:
                logits = self.model(input_ids=pending, attention_mask=self._mask, position_ids=positions,
                                    cache=self._cache, use_cache=True).logits[:, -1]
            version = self._version
        temperature = torch.tensor([s.request.params.temperature for s in active], device=self.device)
        top_p = torch.tensor([s.request.params.top_p for s in active], device=self.device)
        top_k = torch.tensor([s.request.params.top_k for s in active], device=self.device)
        keys = [None if s.request.params.sampling_seed is None else (s.request.params.sampling_seed, len(s.token_ids))
                for s in active]
        ids, logps, vocab_logps = sample_tokens(logits, temperature, top_p, self.generator, top_k, keys)
        self.tokens_generated += len(active)
        for seq, token, logp, vocab_logp in zip(active, ids.tolist(), logps.tolist(), vocab_logps.tolist()):
            params = seq.request.params
            seq.token_ids.append(token)
            seq.logprobs.append(logp)
            seq.vocab_logprobs.append(vocab_logp)
            seq.versions.append(version)
            stops = not params.ignore_eos and (token in self.stop_ids or token in params.stop_token_ids)
            if stops or (seq.request.stop_check is not None and seq.request.stop_check(seq.token_ids)):
                seq.finish_reason = "stop"
            elif len(seq.token_ids) >= params.max_new_tokens:
                seq.finish_reason = "length"
        self._rows = [id(s) for s in active if not s.finish_reason]
        if len(self._rows) < len(active):
            self._drop_rows([i for i, s in enumerate(active) if not s.finish_reason])

    def _step_alone(self, seq: _Sequence, on_error) -> bool:
        """After a failed batched step: this sequence's step on a cache of its own; False, after
        on_error, if it fails alone too."""
        self._rows, self._cache, self._mask = [], None, None
        try:
            self._decode_step([seq])
            return True
        except Exception as err:
            on_error(seq.request, err)
            return False

    def _drop_cancelled(self, active: list[_Sequence]) -> list[_Sequence]:
        """Remove cancelled sequences and their rows of the batch cache (the first len(_rows) of `active`)."""
        keep = [i for i, seq in enumerate(active) if not seq.request.cancelled]
        cached = [i for i in keep if i < len(self._rows)]
        if self._cache is not None and len(cached) < len(self._rows):
            self._drop_rows(cached)
        self._rows = [self._rows[i] for i in cached]
        return [active[i] for i in keep]

    def _admit(self, joining: list[_Sequence]) -> None:
        """Prefill the joining sequences (all but their pending token) and merge them into the batch cache.

        After a weight update the whole batch re-joins, so no token is ever sampled from a cache that was
        computed with older weights than the version it records.
        """
        distinct: dict[tuple[int, ...], int] = {}  # a GRPO group's members share a prompt: prefilled once
        rows = [distinct.setdefault(tuple(s.request.prompt_ids + s.token_ids[:-1] if s.token_ids
                                          else s.request.prompt_ids[:-1]), len(distinct)) for s in joining]
        width = max(1, max(len(p) for p in distinct))  # the width, so each row's padding, as without sharing
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in distinct], dtype=torch.long,
                           device=self.device)  # one tensor for the whole join, not one per sequence
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in distinct], dtype=torch.long,
                            device=self.device)
        cache = batch_kv_cache(self.model)
        if self.own_forward:  # it stops at the last layer's keys and values
            llama_forward.prefill(self.model, ids, mask, position_ids_for(mask), cache)
        else:  # only the cache is wanted: one position's logits, not [B, T, V] (gigabytes at a real vocabulary), so
            # the last feed-forward block runs at that position alone (the last layer's keys and values are its input's)
            last = torch.zeros_like(mask, dtype=torch.bool)
            last[:, -1] = True
            with read_only_at(self.model, last):
                self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), cache=cache,
                           use_cache=True, logits_to_keep=1)
        if len(distinct) < len(joining):  # each sequence's rows of the shared prefill, copied
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            cache.batch_select_indices(index)
            mask = mask.index_select(0, index)
        if self._cache is None:
            self._cache, self._mask = cache, mask
        else:
            self._mask = _concat_left_padded(self._cache, self._mask, cache, mask)
        self._rows += [id(s) for s in joining]

    @torch.inference_mode()  # the cache is made of inference tensors (`_decode_step`)
    def _drop_rows(self, keep: list[int]) -> None:
        if not keep:
            self._cache, self._mask = None, None
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._mask = self._mask.index_select(0, index)
        self._cache.batch_select_indices(index)
        first_real = int(self._mask.any(0).long().argmax())  # columns of padding only are dropped
        if first_real:
            self._mask = self._mask[:, first_real:]
            _refill(self._cache, [(l.keys[:, :, first_real:], l.values[:, :, first_real:]) for l in self._cache.layers])

    def _finish(self, seq: _Sequence) -> GenerationResult:
        """The sampled logprobs are the behaviour policy's, always; deterministic mode adds a recomputation beside them."""
        recomputed = None
        uncut = seq.request.params.top_p >= 1.0 and seq.request.params.top_k < 1
        if self.deterministic and len(set(seq.versions)) == 1 and uncut:
            recomputed = self._rescore_alone(seq)
        return GenerationResult(seq.request, seq.token_ids, seq.logprobs, seq.versions, seq.finish_reason,
                                seq.vocab_logprobs, recomputed_logprobs=recomputed)

    @torch.no_grad()
    def _rescore_alone(self, seq: _Sequence) -> Optional[list[float]]:
        """Deterministic mode: the logprobs the trainer's kernel gives this sequence alone, unpadded (batch-invariant).

        None if the weights changed since the sequence was sampled (newer weights did not sample it)."""
        ids = torch.tensor([seq.request.prompt_ids + seq.token_ids], device=self.device)
        with self._lock:
            if self._version != seq.versions[0]:
                return None
            logp = sequence_logprobs(self.model, ids, torch.ones_like(ids), seq.request.params.temperature)
        return logp[0, len(seq.request.prompt_ids):].tolist()


def check_batchable(config) -> None:
    """The engine re-pads its batch's KV cache as rows join and leave, which needs every layer to keep keys and
    values per position (full, sliding-window or chunked attention). A layer with a recurrent state (linear
    attention, a state-space mixer) or one reading another layer's cache is refused in one line, before any
    work."""
    other = sorted({type(layer).__name__ for layer in DynamicCache(config=config).layers
                    if not isinstance(layer, DynamicLayer)})
    if other:
        raise UsageError(f"the embedded engine batches attention layers only, and this {config.model_type} model "
                         f"also has {', '.join(other)} (a recurrent state or a shared KV cache): use engine.kind http "
                         "with SGLang servers")


def _refill(cache: DynamicCache, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each layer of `cache` reset and filled with its new keys and values, as DynamicCache(ddp_cache_data=...)
    fills fresh layers, without re-deriving the layers from the model config (which cost more than the copy)."""
    for layer, (keys, values) in zip(cache.layers, layers):
        layer.reset()
        layer.update(keys, values)


def _concat_left_padded(cache_a, mask_a, cache_b, mask_b) -> torch.Tensor:
    """Stack cache_b under cache_a along the batch (into cache_a), padding the shorter one on the left; the mask."""
    width = max(mask_a.shape[1], mask_b.shape[1])

    def pad(t, dim):
        missing = width - t.shape[dim]
        if not missing:
            return t
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([t.new_zeros(shape), t], dim=dim)

    _refill(cache_a, [(torch.cat([pad(a.keys, 2), pad(b.keys, 2)]), torch.cat([pad(a.values, 2), pad(b.values, 2)]))
                      for a, b in zip(cache_a.layers, cache_b.layers)])
    return torch.cat([pad(mask_a, 1), pad(mask_b, 1)])
