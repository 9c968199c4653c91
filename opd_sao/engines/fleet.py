"""A fleet of SGLang-API rollout workers as one RolloutEngine: routing, failover, discovery, rejoin.

Generation: each request goes to a live server picked by the routing policy (`engine.routing`, `routing.py`;
by default least_loaded: the one with the fewest estimated tokens in flight, `est_tokens` else
`max_new_tokens`, so long and short trajectories spread evenly instead of piling up round-robin). Policy versions travel as SGLang's
`weight_version` string: every result's tokens carry the version its server reported, so the staleness
bound holds per worker. Weights: the mode `engine.weight_sync` names (`weight_sync/`) loads them on every
live worker, and each confirms the new `weight_version` (`/model_info`). A bucketed sync (tensor,
distributed) runs with the workers' generation paused (`/pause_generation` mode abort ...
`/continue_generation`): the requests it aborts are sent again on the new weights, so no trajectory mixes
two versions and no bucket waits for a generation to finish. With `partial_rollouts` (slime's), an aborted
request keeps the tokens it had and continues from them instead: prompt + those token ids (no retokenisation)
with the rest of its budget; its result carries each token's version, so one trajectory holds spans of two
versions, each labelled truly (the learner's staleness rule reads the oldest).

Generation and control are separate: a URL may be an external router (sglang-router), which generation
goes through, while weight syncs, version checks and health checks go to the workers behind it (listed,
or asked from the router's `/workers`). A request at top_p < 1 asks `return_sampling_mask`, which
sglang-router 0.3.2 drops when it forwards: it goes to a worker directly, picked by the routing policy.

Faults: the client retries transient errors (`retry.py`); a request that still fails is sent again (at
most MAX_SENDS times), and its server is declared dead only if its `/health` fails too. A router that
answers with an error is alive: its workers are health-checked instead, and the dead ones taken out. A dead
server's or worker's `/health` is probed in the background; once it answers, a worker is given the current
weights back (`RolloutEngine.rejoins` counts it), and either rejoins. A run fails only when every server,
or every worker, has been down for `down_timeout` seconds.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from opd_sao.errors import UsageError

from .base import GenerationRequest, GenerationResult, ResultCallback, RolloutEngine
from .http import Aborted, PromptLogprobs, ServerDown, ServerError, SGLangClient
from .retry import ROUTER_TRANSIENT_STATUS
from .routing import ROUTINGS
from .weight_sync import WEIGHT_SYNCS, SyncSettings

log = logging.getLogger(__name__)

MAX_SENDS = 5  # a request that fails this many sends (timeouts, aborts, dying servers) fails the run


def discover_fleet(urls: Iterable[str], workers: Iterable[str] = (), timeout: float = 600.0, **client_options):
    """Check a fleet before any work: every URL answers /health, and each router (a URL that answers
    /workers) has workers, `workers` if listed, else those it reports. Returns ([(client, is_router)] per
    URL, the worker URLs weight syncs go to: the URLs that are servers, then the routers' workers)."""
    targets, listed, discovered = [], [SGLangClient(u, timeout, **client_options).url for u in workers], []
    for url in urls:
        client = SGLangClient(url, timeout, **client_options)
        if not client.health():
            raise UsageError(f"rollout server {client.url} is not answering /health")
        behind = client.router_workers()
        if behind is not None and not (listed or behind):
            raise UsageError(f"engine.urls: {client.url} is a router with no workers registered and engine.workers "
                             "is empty: weight syncs need the workers' URLs")
        if behind is not None:
            client.transient = ROUTER_TRANSIENT_STATUS
        discovered += behind or []
        targets.append((client, behind is not None))
    servers = [client.url for client, is_router in targets if not is_router]
    for url in listed or discovered:
        if url not in servers and not SGLangClient(url, timeout, **client_options).health():
            raise UsageError(f"rollout worker {url} is not answering /health")
    return targets, list(dict.fromkeys(servers + (listed or discovered)))


@dataclass
class _Server:
    client: SGLangClient
    slots: int = 0  # generation slots (0: a worker listed without a router, used for control only)
    pool: Optional[ThreadPoolExecutor] = None
    is_router: bool = False  # generation goes through it, weight syncs to the workers behind it
    alive: bool = True
    down_since: float = 0.0  # time.monotonic() when it was declared dead
    inflight: int = 0  # requests sent, not answered
    load: int = 0  # their estimated tokens
    requests: int = 0
    tokens: int = 0
    requeued: int = 0
    revived: int = 0  # times it came back after being declared dead


@dataclass
class _Call:
    """One generate() call's bookkeeping (several calls may share the engine: rollouts and gate probes)."""

    on_result: ResultCallback
    wake: Callable[[], None]  # the caller's RequestFeed.notify: generate() may be waiting on its feed
    retry: deque = field(default_factory=deque)
    outstanding: int = 0
    error: Optional[BaseException] = None
    callback_lock: threading.Lock = field(default_factory=threading.Lock)
    failed_sends: dict = field(default_factory=dict)  # id(request) -> failed sends, while it waits to be sent again
    # partial rollouts: id(continuation) -> (the caller's request, the result so far: tokens kept from aborts)
    prefixes: dict = field(default_factory=dict)



def _joined(request: GenerationRequest, first: GenerationResult, then: GenerationResult) -> GenerationResult:
    """`request`'s result: the tokens `first` generated, then those `then` continued with (each with its own
    logprobs and version); `then` says how it finished."""
    return GenerationResult(request, first.token_ids + then.token_ids, first.logprobs + then.logprobs,
                            first.versions + then.versions, then.finish_reason,
                            first.vocab_logprobs + then.vocab_logprobs)


class Fleet(RolloutEngine):
    """Continuous batching over SGLang-API servers: up to `max_inflight` requests in flight on each.

    `checkpoint` is what the workers must hold at policy version 0 (loaded at start, as every later sync);
    its config and tokenizer files are the template of disk syncs, written under `weights_dir` (a directory
    the workers can read; default a temporary one). `weight_sync` names the mode (`weight_sync/`), with
    `sync` its settings; `workers` the URLs behind a router in `urls` (default: asked from it). With every
    server (or worker) dead, generation waits up to `down_timeout` seconds for one to come back, probing
    each `probe_s`. `partial_rollouts`: an aborted request continues from the tokens it had (else it is sent
    again whole). `client_options` go to each SGLangClient (api_key, admin_api_key, retries, ...).
    """

    def __init__(self, urls: list[str] | str, *, checkpoint: Optional[str | Path] = None,
                 weights_dir: Optional[str] = None, max_inflight: int = 32, timeout: float = 600.0,
                 down_timeout: float = 60.0, probe_s: float = 1.0, workers: Iterable[str] = (),
                 weight_sync: str = "disk", sync: Optional[SyncSettings] = None, routing: str = "least_loaded",
                 partial_rollouts: bool = False, **client_options):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise UsageError("the fleet needs at least one rollout server URL (engine.urls)")
        mode_cls = WEIGHT_SYNCS.get(weight_sync)
        self.down_timeout, self.probe_s, self._route = down_timeout, probe_s, ROUTINGS.get(routing)
        self._servers = []
        workers = list(workers)
        self._ask_routers = not workers  # the workers behind routers are asked again before each sync
        self._client_args = (timeout, client_options, max_inflight)
        targets, worker_urls = discover_fleet(urls, workers, timeout, **client_options)
        for client, is_router in targets:
            pool = ThreadPoolExecutor(max_inflight, thread_name_prefix=f"rollout-{client.url}")
            self._servers.append(_Server(client, max_inflight, pool, is_router=is_router))
        self._routed = any(s.is_router for s in self._servers)
        by_url = {s.client.url: s for s in self._servers}
        self._workers = [by_url.get(url) or self._worker(url) for url in worker_urls]
        self._restore = None  # restore(clients, each): the current weights to these workers (a revival)
        self._weights_lock = threading.RLock()  # a weight sync and a revival never interleave
        self._prober: Optional[threading.Thread] = None
        self._closed = False
        self._cond = threading.Condition()
        self._version = 0
        self._pauses = 0  # generation pauses begun: a request sent before one and aborted was aborted by it
        self.partial_rollouts = partial_rollouts
        self.tokens_generated = 0
        self.tokens_discarded = 0  # generated by requests that were aborted and sent again whole
        self.tokens_continued = 0  # generated by aborted requests and kept (partial_rollouts)
        self.template = Path(checkpoint) if checkpoint is not None else None
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="opd-sao-weights-"))
        # a directory of our own goes at close(), or when the engine is collected or the process exits unclosed
        self._remove_weights_dir = weakref.finalize(self, shutil.rmtree, self.weights_dir, True) \
            if weights_dir is None else None
        settings = sync or SyncSettings()
        settings.template, settings.weights_dir = self.template, self.weights_dir
        self._mode = mode_cls(settings)
        if checkpoint is not None:
            self.load_weights(checkpoint, 0)

    @property
    def version(self) -> int:
        return self._version

    @property
    def urls(self) -> list[str]:
        return [s.client.url for s in self._servers]

    @property
    def stats(self) -> dict[str, dict]:
        """Per server (and worker behind a router): alive, requests and tokens served, requests sent again after
        a failure, revivals."""
        with self._cond:
            return {s.client.url: {"alive": s.alive, "requests": s.requests, "tokens": s.tokens,
                                   "requeued": s.requeued, "revived": s.revived, "inflight": s.inflight,
                                   "load": s.load}
                    for s in self._generators()}

    @property
    def rejoins(self) -> int:
        with self._cond:
            return sum(s.revived for s in self._servers) + sum(
                w.revived for w in self._workers if all(w is not s for s in self._servers))

    @property
    def workers(self) -> list[str]:
        """The servers that hold weights (the URLs themselves unless they are routers)."""
        return [s.client.url for s in self._workers]

    def _worker(self, url: str) -> _Server:
        """A worker that is not one of the URLs: behind a router it generates too (the requests the router cannot
        forward whole, `_targets`), else it is for control only."""
        timeout, options, max_inflight = self._client_args
        client = SGLangClient(url, timeout, **options)
        if not self._routed:
            return _Server(client)
        return _Server(client, max_inflight, ThreadPoolExecutor(max_inflight, thread_name_prefix=f"rollout-{url}"))

    def _generators(self) -> list[_Server]:
        """Every server that generates: the URLs, then the workers behind routers."""
        return self._servers + [w for w in self._workers if w.slots and all(w is not s for s in self._servers)]

    def _pick(self, servers: list[_Server]) -> _Server:
        return self._route(servers, self._generators())

    def _targets(self, request: Optional[GenerationRequest]) -> list[_Server]:
        """The live servers `request` may go to (None: any request). Behind a router, a request at top_p < 1
        goes to a worker directly: it asks `return_sampling_mask`, which sglang-router 0.3.2 drops when it
        forwards (its workers would sample the nucleus but return no renormalised logprobs)."""
        servers = self._alive()
        if not self._routed:
            return servers
        direct = [w for w in self._workers if w.alive and w.slots]
        if request is None:
            return servers + [w for w in direct if all(w is not s for s in servers)]
        return direct if request.params.top_p < 1 else servers

    def _free(self, request: Optional[GenerationRequest]) -> bool:
        return any(s.inflight < s.slots for s in self._targets(request))

    def _alive(self) -> list[_Server]:
        """The live servers (a router only while a worker is alive); none while all are down (they may come
        back). RuntimeError once every server, or every worker, has been down for down_timeout seconds."""
        now = time.monotonic()
        for fleet, what in ((self._servers, "rollout server"), (self._workers, "rollout worker")):
            if fleet and not any(s.alive for s in fleet) and now - max(s.down_since for s in fleet) > self.down_timeout:
                raise RuntimeError(f"every {what} is down (for {self.down_timeout:.0f} s): "
                                   f"{', '.join(s.client.url for s in fleet)}")
        workers_alive = any(w.alive for w in self._workers)
        return [s for s in self._servers if s.alive and (workers_alive or not s.is_router)]

    def _failed(self, server: _Server, err: ServerDown) -> None:
        """A call failed after its retries: the server is dead only if its /health fails too."""
        if not server.client.health():
            self._mark_down(server, err)

    def _mark_down(self, server: _Server, err: BaseException) -> None:
        with self._cond:
            if server.alive:
                server.alive, server.down_since = False, time.monotonic()
                log.warning("taking %s out of the fleet: %s", server.client.url, err)
                if self._prober is None:
                    self._prober = threading.Thread(target=self._probe_dead, daemon=True, name="rollout-prober")
                    self._prober.start()
            self._cond.notify_all()

    def _probe_dead(self) -> None:
        """While a server or worker is dead: probe its /health every probe_s; one that answers gets the
        current weights (a worker) and rejoins."""
        while True:
            with self._cond:
                dead = [s for s in self._servers if not s.alive]
                dead += [w for w in self._workers if not w.alive and all(w is not s for s in self._servers)]
                if not dead or self._closed:
                    self._prober = None
                    return
            for server in dead:
                if server.client.health():
                    self._revive(server)
            time.sleep(self.probe_s)

    def _revive(self, server: _Server) -> None:
        with self._weights_lock:
            if any(server is w for w in self._workers) and self._restore is not None:
                # a collective mode sends to a whole group: the live workers get the same weights again
                members = self._live_workers() + [server] if self._mode.collective else [server]
                try:
                    if all(server is not w for w in self._restore(members)):
                        return
                except (ServerDown, ServerError, RuntimeError) as err:
                    log.warning("%s answers /health but could not be given the weights: %s", server.client.url, err)
                    return
            with self._cond:
                server.alive = True
                server.revived += 1
                self._cond.notify_all()
        log.warning("%s is back in the fleet (weight_version %s)", server.client.url, self._version)

    # --- generation ------------------------------------------------------------------------------------

    def generate(self, requests: Iterable[Optional[GenerationRequest]], on_result: ResultCallback) -> None:
        pending = iter(requests)
        call = _Call(on_result, wake=getattr(pending, "notify", lambda: None))
        exhausted = False
        while True:
            request = None
            with self._cond:
                while True:
                    if call.error is not None:
                        raise call.error
                    if exhausted and not call.retry and not call.outstanding:
                        return
                    if call.retry and self._free(call.retry[0]):
                        request = call.retry.popleft()
                        break
                    if not call.retry and not exhausted and self._free(None):
                        break
                    self._cond.wait(0.05)
            if request is None:
                try:
                    request = next(pending)
                except StopIteration:
                    exhausted = True
                    continue
                if request is None:  # a RequestFeed: until a request is put or one of ours comes back (_finished)
                    pending.wait()
                    continue
            self._dispatch(request, call)

    def _dispatch(self, request: GenerationRequest, call: _Call) -> None:
        est = request.est_tokens or request.params.max_new_tokens
        with self._cond:
            free = [s for s in self._targets(request) if s.inflight < s.slots]
            if not free:  # none of its own is free (or they died) since generate() looked: it waits first in line
                call.retry.appendleft(request)
                return
            server = self._pick(free)
            server.inflight += 1
            server.load += est
            call.outstanding += 1
            pauses = self._pauses
        future = server.pool.submit(server.client.generate, request)
        future.add_done_callback(lambda f: self._finished(f, server, request, est, call, pauses))

    def _finished(self, future: Future, server: _Server, request: GenerationRequest, est: int, call: _Call,
                  pauses: int) -> None:
        err = future.exception()
        if self._worker_lost(server, err):
            err = Aborted(str(err))  # the router is alive; a worker behind it failed the request
        elif isinstance(err, ServerDown):
            self._failed(server, err)
        with self._cond:
            server.inflight -= 1
            server.load -= est
            # an abort by a weight sync's pause is no failed send: the request is sent again, on the new weights
            paused = isinstance(err, Aborted) and pauses != self._pauses
            failed_sends = call.failed_sends.pop(id(request), 0) + (err is not None and not paused)
            if isinstance(err, (ServerDown, Aborted)) and failed_sends < MAX_SENDS:  # not lost: sent again
                log.info("%s did not complete a request, sent again: %s", server.client.url, err)
                server.requeued += 1
                request = self._resend(request, err, call)
                call.failed_sends[id(request)] = failed_sends
                call.retry.appendleft(request)
            elif isinstance(err, (ServerDown, Aborted)):
                call.error = call.error or RuntimeError(f"a request failed on {failed_sends} sends; the last: {err}")
            elif err is not None:
                call.error = call.error or err
            else:
                result = future.result()
                server.requests += 1
                server.tokens += len(result.token_ids)
                self.tokens_generated += len(result.token_ids)
                if id(request) in call.prefixes:
                    result = _joined(*call.prefixes.pop(id(request)), result)
            if err is not None:
                call.outstanding -= 1
                self._cond.notify_all()
        if err is not None:
            call.wake()
            return
        try:
            with call.callback_lock:  # the caller's callback never runs twice at once
                call.on_result(result)
        except BaseException as cb_err:  # surfaced by generate() in the caller's thread
            with self._cond:
                call.error = call.error or cb_err
        finally:
            with self._cond:
                call.outstanding -= 1
                self._cond.notify_all()
            call.wake()

    def _resend(self, request: GenerationRequest, err: BaseException, call: _Call) -> GenerationRequest:
        """(Holding _cond.) What is sent again for a request that did not complete: with partial_rollouts and an
        abort that returned tokens, a continuation (the prompt and every token kept so far, the rest of the
        budget); else the request itself, and the tokens the abort returned are thrown away."""
        partial = err.partial if isinstance(err, Aborted) else None
        tokens = len(partial.token_ids) if partial is not None else 0
        if not (self.partial_rollouts and tokens):
            self.tokens_discarded += tokens
            return request
        self.tokens_continued += tokens
        original, kept = call.prefixes.pop(id(request), (request, None))
        kept = partial if kept is None else _joined(original, kept, partial)
        budget = original.params.max_new_tokens - len(kept.token_ids)
        continuation = GenerationRequest(list(original.prompt_ids) + list(kept.token_ids),
                                         replace(original.params, max_new_tokens=budget), original.tag,
                                         max(0, original.est_tokens - len(kept.token_ids)),
                                         stop_check=original.stop_check)
        call.prefixes[id(continuation)] = (original, kept)
        return continuation

    def _worker_lost(self, server: _Server, err: Optional[BaseException]) -> bool:
        """A router answered with a 5xx even after the client's retries (sglang-router's 500, its own retries
        disabled or spent, for a request whose worker died): the router is alive, so it is not
        health-checked and never declared dead for it; its workers are, and the dead ones are taken out (the
        prober brings them back). The request is sent again like any failed send (MAX_SENDS)."""
        if not (server.is_router and isinstance(err, (ServerDown, ServerError)) and err.status >= 500):
            return False
        for worker in self._live_workers():
            if not worker.client.health():
                self._mark_down(worker, err)
        return True

    # --- weights ---------------------------------------------------------------------------------------

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Every live worker gets the weights (as the weight-sync mode sends them) and confirms `version`; one
        that cannot be reached is taken out, and gets them when it comes back."""
        with self._weights_lock:
            self._reread_routers()
            self._sync(lambda workers: self._push(lambda clients, each: self._mode.push(
                state_dict, version, clients, each), version, workers, self._mode.pauses))
            self._version = version

    def load_weights(self, path: str | Path, version: int) -> None:
        """Every live worker gets the HF checkpoint at `path` as `version`, as the weight-sync mode sends a checkpoint
        (`WeightSyncMode.push_checkpoint`)."""
        with self._weights_lock:
            self._reread_routers()
            self._sync(lambda workers: self._push(lambda clients, each: self._mode.push_checkpoint(
                path, version, clients, each), version, workers, self._mode.pauses))
            self._version = version

    def _reread_routers(self) -> None:
        """With the workers asked from the routers (engine.workers empty): ask again, before a sync. A worker a
        router added joins the fleet (and gets this sync's weights); one it removed leaves. A router that does
        not answer keeps the list as it was."""
        routers = [s for s in self._servers if s.is_router and s.alive]
        if not self._ask_routers or not routers:
            return
        timeout, options, _ = self._client_args
        urls = [s.client.url for s in self._servers if not s.is_router]
        for router in routers:
            try:
                urls += [SGLangClient(url, timeout, **options).url for url in router.client.router_workers() or []]
            except (ServerDown, ServerError):
                return
        current = {w.client.url: w for w in self._workers}
        urls = list(dict.fromkeys(urls))
        if urls == list(current) or len(urls) == len(self._servers) - len(routers):  # none behind: keep them
            return
        log.warning("the routers' workers changed: %s (were %s)", ", ".join(urls), ", ".join(current))
        with self._cond:
            self._workers = [current.get(url) or self._worker(url) for url in urls]
        for url in set(current) - set(urls):  # what it still runs finishes
            if current[url].pool is not None and all(current[url] is not s for s in self._servers):
                current[url].pool.shutdown(wait=False)

    def _sync(self, restore) -> None:
        """`restore(workers)` gives workers the new weights: now to the live ones, later to one that comes
        back. With none live the weights wait for a revival (an error once down for down_timeout)."""
        self._restore = restore
        workers = self._live_workers()
        if workers:
            restore(workers)
        with self._cond:
            self._alive()

    def _live_workers(self) -> list[_Server]:
        with self._cond:
            return [w for w in self._workers if w.alive]

    def _push(self, send, version: int, workers: list[_Server], pause: bool = False) -> list[_Server]:
        """`send(clients, each)` loads the weights on `workers` (with `pause`, while their generation is
        paused); each one that did must then report `version` (one that no longer answers is taken out).
        Returns those workers. A failed collective (a worker died mid-sync) is tried once more with the workers
        that still answer /health."""
        by_client = {id(w.client): w for w in workers}
        try:
            with self._paused([w.client for w in workers], pause):
                done = send([w.client for w in workers], self._each)
        except RuntimeError as err:
            if isinstance(err, ServerError):
                raise
            survivors = [w for w in workers if w.client.health()]
            for worker in workers:
                if worker not in survivors:
                    self._mark_down(worker, ServerDown(f"{worker.client.url} died during a weight sync: {err}"))
            if survivors == workers or not survivors:
                raise
            self._mode.forget()
            return self._push(send, version, survivors, pause)
        confirmed = []
        for client in done:
            try:
                reported = client.weight_version()
            except ServerDown as err:  # loaded, then died before confirming: out, as in the sync itself
                self._mark_down(by_client[id(client)], err)
                continue
            if reported != str(version):
                raise ServerError(f"rollout server {client.url} reports weight_version {reported!r} "
                                  f"after loading version {version}")
            confirmed.append(by_client[id(client)])
        return confirmed

    @contextmanager
    def _paused(self, clients: list[SGLangClient], pause: bool):
        """Generation paused on `clients` while the block runs: SGLang's `/pause_generation` in mode abort, then
        `/continue_generation`. Mode abort, not retract: a retracted request resumes on the new weights after
        the sync, one trajectory sampled by two versions and labelled with the last; an aborted one is sent
        again whole (`_finished`), and never sees a half-updated model between two buckets. Each pause
        answers once its worker runs nothing, so no bucket waits for a generation to drain."""
        if not pause:
            yield
            return
        with self._cond:
            self._pauses += 1
        paused = {}
        self._each(lambda c: paused.__setitem__(c.url, c.pause_generation(self._mode.settings.drain_timeout_s)),
                   clients)
        try:
            yield
        finally:
            self._each(lambda c: c.continue_generation(), [c for c in clients if paused.get(c.url)])

    def _each(self, update, clients: list[SGLangClient], during=None) -> list[SGLangClient]:
        """`update(client)` on `clients` in parallel (while `during()` runs: a broadcast they receive); returns
        the clients that completed it (one that stopped answering is taken out of the fleet). A worker that
        refuses the call raises at once: `during` would otherwise wait for it until the group's timeout."""
        servers = {id(s.client): s for s in self._workers}

        def run(client: SGLangClient) -> bool:
            try:
                update(client)
            except ServerDown as err:
                self._mark_down(servers[id(client)], err)
                return False
            return True

        pool = ThreadPoolExecutor(max(1, len(clients)) + 1)
        try:
            futures = [pool.submit(run, c) for c in clients]
            side = [pool.submit(during)] if during is not None else []
            wait(futures + side, return_when=FIRST_EXCEPTION)
            for future in futures + side:
                if future.done() and future.exception() is not None:
                    raise future.exception()
            return [c for c, future in zip(clients, futures) if future.result()]
        finally:
            pool.shutdown(wait=False)

    # --- teacher scoring -------------------------------------------------------------------------------

    def score(self, input_ids: list[int], start: int, top_k: int = 0) -> PromptLogprobs:
        """Prompt logprobs from the least-loaded live server (another one if it is down), sent at most
        MAX_SENDS times like a generation request."""
        sends = 0
        while True:
            with self._cond:
                alive = self._alive()
                if not alive:
                    self._cond.wait(0.05)
                    continue
                server = self._pick(alive)
            try:
                return server.client.score(input_ids, start, top_k)
            except (ServerDown, ServerError) as err:
                if not self._worker_lost(server, err):
                    if isinstance(err, ServerError):
                        raise
                    self._failed(server, err)
                sends += 1
                if sends >= MAX_SENDS:
                    raise RuntimeError(f"a scoring request failed on {sends} sends; the last: {err}") from err

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self._mode.close([w.client for w in self._live_workers()])
        for server in self._generators():
            server.pool.shutdown(wait=False)
        if self._remove_weights_dir is not None:
            self._remove_weights_dir()
