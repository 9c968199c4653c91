"""Rollouts and teacher scoring on servers that speak SGLang's native HTTP API.

`SGLangClient` uses SGLang's documented fields exactly: `/generate` with `input_ids`, `sampling_params`,
`return_logprob` (plus `logprob_start_len` and `top_logprobs_num` for prompt scoring) and the response's
`meta_info` (`output_token_logprobs`, `finish_reason`, `weight_version`); `/update_weights_from_disk`
with `model_path` and `weight_version`; `/get_model_info`, `/flush_cache`, `/health`. `opd-sao serve`
answers the same API, so a fleet of our servers and a fleet of SGLang servers are interchangeable.

`HTTPEngine` is a RolloutEngine over one server; `router.Router` spreads over several. Policy versions
travel as SGLang's `weight_version` string: a weight sync loads the weights with `weight_version=str(v)`
(from disk, as tensors in the request, or by broadcast over a weight update group: `weight_transfer`)
and is confirmed by `/get_model_info`; every result's tokens carry the version the server reported.

Generation and control are separate: a URL may be an external router (sglang-router), which generation
goes through, while weight syncs, version checks and health checks go to the workers behind it (listed,
or asked from the router's `/workers`). A token's version is the one its worker reported, so the
staleness bound holds per worker.

Faults: the client retries transient errors (connection refused or reset, timeouts, HTTP 502/503/504) with
exponential backoff; a request that still fails is sent again (at most MAX_SENDS times), and its server is
declared dead only if its `/health` fails too. A router that answers with an error is alive: its workers
are health-checked instead, and the dead ones taken out. A dead server's or worker's `/health` is probed in
the background; once it answers, a worker is given the current weights back, and either rejoins. A run
fails only when every server, or every worker, has been down for `down_timeout` seconds.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import requests
import torch
from safetensors.torch import save_file

from .base import GenerationRequest, GenerationResult, ResultCallback, RolloutEngine
from .weight_transfer import TENSOR_FORMAT, broadcast, dtype_name, host_store, join_group, pack_tensors, untied

log = logging.getLogger(__name__)

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
TRANSIENT_STATUS = frozenset({502, 503, 504})  # a proxy or an overloaded server: worth another try
# and from a router: sglang-router answers 500 when the worker it chose failed (its retries disabled or spent)
ROUTER_TRANSIENT_STATUS = TRANSIENT_STATUS | {500}
MAX_SENDS = 5  # a request that fails this many sends (timeouts, aborts, dying servers) fails the run


class ServerDown(ConnectionError):
    """The server did not answer (refused, reset, timed out, 502/503/504), even after the client's retries.
    `status`: the HTTP status it last answered with, 0 if it did not answer at all."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class ServerError(RuntimeError):
    """The server answered, but with an error: a request or setup problem, not a dead server."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class Aborted(RuntimeError):
    """The server aborted the request (finish_reason abort); it is sent again."""


@dataclass
class PromptLogprobs:
    """Teacher scores for positions start..L-1: each token's logprob given the tokens before it, and the
    top-k alternatives at that position (temperature 1)."""

    token_logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class SGLangClient:
    """One server's native API. Thread-safe: each thread keeps its own keep-alive session."""

    def __init__(self, url: str, timeout: float = 600.0, connect_timeout: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.2):
        self.url = url.rstrip("/")
        self.timeout = (connect_timeout, timeout)
        self.retries, self.backoff_s = retries, backoff_s
        self.transient = TRANSIENT_STATUS  # statuses tried again (a router's: ROUTER_TRANSIENT_STATUS)
        self._local = threading.local()

    def _call(self, method: str, path: str, payload: Optional[dict] = None, timeout=None,
              retries: Optional[int] = None) -> requests.Response:
        """One API call; transient failures are tried again `retries` times, waiting backoff_s, 2x, 4x, ..."""
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        attempts = 1 + (self.retries if retries is None else retries)
        failure: Optional[ServerDown] = None
        for attempt in range(attempts):
            if attempt:
                log.info("%s, sent again in %.1f s", failure, self.backoff_s * 2 ** (attempt - 1))
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = session.request(method, self.url + path, json=payload, timeout=timeout or self.timeout)
            except requests.ReadTimeout as err:  # no retry: another `timeout` would be spent the same way
                raise ServerDown(f"rollout server {self.url} did not answer {path} within {timeout or self.timeout} s"
                                 ) from err
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as err:
                failure = ServerDown(f"rollout server {self.url} did not answer {path} ({type(err).__name__}, "
                                     f"{attempt + 1} tries)")
                failure.__cause__ = err
                continue
            if response.status_code in self.transient:
                failure = ServerDown(f"rollout server {self.url} answered {path} with HTTP {response.status_code} "
                                     f"({attempt + 1} tries): {response.text[:200]}", response.status_code)
                continue
            if response.status_code != 200:
                raise ServerError(f"rollout server {self.url} answered {path} with HTTP {response.status_code}: "
                                  f"{response.text[:500]}", response.status_code)
            return response
        raise failure

    def health(self) -> bool:
        try:
            self._call("GET", "/health", timeout=(self.timeout[0], 10.0), retries=0)
            return True
        except (ServerDown, ServerError):
            return False

    def model_info(self) -> dict:
        return self._call("GET", "/get_model_info").json()

    def weight_version(self) -> str:
        return str(self.model_info().get("weight_version"))

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache")

    def router_workers(self) -> Optional[list[str]]:
        """The worker URLs if this is a router (sglang-router's `/workers`, older ones' `/list_workers`),
        else None (a server answers 404)."""
        for path, key in (("/workers", "workers"), ("/list_workers", "urls")):
            try:
                listed = self._call("GET", path, timeout=(self.timeout[0], 10.0)).json().get(key)
            except ServerError:
                continue
            return [w["url"] if isinstance(w, dict) else w for w in listed or []]
        return None

    def update_weights_from_disk(self, model_path: str | Path, weight_version: str) -> None:
        self._weight_call("/update_weights_from_disk", {"model_path": str(model_path), "weight_version": weight_version})

    def update_weights_from_tensor(self, packed: str, weight_version: str) -> None:
        """`packed`: `weight_transfer.pack_tensors(state_dict)` (base64 safetensors, one tensor-parallel rank)."""
        self._weight_call("/update_weights_from_tensor", {"serialized_named_tensors": [packed],
                                                          "load_format": TENSOR_FORMAT, "weight_version": weight_version})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "gloo") -> None:
        self._weight_call("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, retries=0)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, weight_version: str) -> None:
        """Not retried: a second request would wait for a broadcast that never comes."""
        self._weight_call("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "weight_version": weight_version}, retries=0)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._weight_call("/destroy_weights_update_group", {"group_name": group_name})

    def _weight_call(self, path: str, payload: dict, retries: Optional[int] = None) -> None:
        body = self._call("POST", path, payload, retries=retries).json()
        if not body.get("success"):
            raise ServerError(f"rollout server {self.url} failed {path}: {body.get('message')}")

    def generate(self, request: GenerationRequest) -> GenerationResult:
        params = request.params
        payload = {
            "input_ids": list(request.prompt_ids),
            "sampling_params": {"temperature": params.temperature, "top_p": params.top_p,
                                "max_new_tokens": params.max_new_tokens, "ignore_eos": params.ignore_eos},
            "return_logprob": True,
        }
        meta = self._call("POST", "/generate", payload).json()["meta_info"]
        finish = meta["finish_reason"]["type"]
        if finish == "abort":
            raise Aborted(f"rollout server {self.url} aborted a request: {meta['finish_reason'].get('message')}")
        pairs = meta["output_token_logprobs"]  # [logprob, token_id, text or null] per generated token
        version = self._parse_version(meta.get("weight_version"))
        return GenerationResult(request, [int(p[1]) for p in pairs], [float(p[0]) for p in pairs],
                                [version] * len(pairs), finish)

    def score(self, input_ids: list[int], start: int, top_k: int) -> PromptLogprobs:
        """Prompt logprobs of input_ids[start:] (no generation): SGLang's prefill-only request."""
        if not 1 <= start < len(input_ids):
            raise ValueError(f"score: start must be in [1, {len(input_ids)}) (position 0 has no logprob), got {start}")
        payload = {"input_ids": list(input_ids), "sampling_params": {"max_new_tokens": 0},
                   "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": top_k}
        meta = self._call("POST", "/generate", payload).json()["meta_info"]
        tops = meta.get("input_top_logprobs") or [[] for _ in meta["input_token_logprobs"]]
        return PromptLogprobs([float(p[0]) for p in meta["input_token_logprobs"]],
                              [[int(t[1]) for t in top] for top in tops],
                              [[float(t[0]) for t in top] for top in tops])

    def _parse_version(self, reported) -> int:
        try:
            return int(reported)
        except (TypeError, ValueError):
            raise ServerError(f"rollout server {self.url} reports weight_version {reported!r}, not a policy "
                              "version: load weights through the engine first (it starts at version 0)") from None


def publish_checkpoint(state_dict: dict[str, torch.Tensor], template: str | Path, out_dir: Path) -> Path:
    """An HF directory a server can load: the template's config and tokenizer files with these weights."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in Path(template).iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_FILES):
            shutil.copy2(item, tmp / item.name)
    save_file(untied(state_dict), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def wait_until_healthy(url: str, is_alive, timeout_s: float = 180.0, poll_s: float = 0.2) -> None:
    """Block until the server at `url` answers /health; RuntimeError if `is_alive()` turns False (the process
    died) or `timeout_s` passes first. For whoever starts servers (tests, benchmarks, launch scripts)."""
    client, deadline = SGLangClient(url, timeout=1.0), time.monotonic() + timeout_s
    while not client.health():
        if not is_alive():
            raise RuntimeError(f"rollout server {url} exited before answering /health")
        if time.monotonic() > deadline:
            raise RuntimeError(f"rollout server {url} did not answer /health within {timeout_s:.0f} s")
        time.sleep(poll_s)


def start_sglang_router(worker_urls: list[str], *args: str, timeout_s: float = 60.0):
    """sglang-router (`pip install sglang-router`) on a free loopback port in front of `worker_urls`, with
    extra CLI `args`; returns (url, process) once it has registered every worker. For tests and benchmarks."""
    import socket
    import subprocess
    import sys

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "error", "--prometheus-port", str(free_port()),  # two routers: two metrics ports
           "--worker-urls", *worker_urls, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url, lambda: proc.poll() is None, timeout_s=timeout_s)
    client, deadline = SGLangClient(url, timeout=10.0), time.monotonic() + timeout_s
    while len(client.router_workers() or []) < len(worker_urls):
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sglang-router at {url} did not register {worker_urls} within {timeout_s:.0f} s")
        time.sleep(0.2)
    return url, proc


def discover_fleet(urls: Iterable[str], workers: Iterable[str] = (), timeout: float = 600.0):
    """Check a fleet before any work: every URL answers /health, and each router (a URL that answers
    /workers) has workers, `workers` if listed, else those it reports. Returns ([(client, is_router)] per
    URL, the worker URLs weight syncs go to: the URLs that are servers, then the routers' workers)."""
    targets, listed, discovered = [], [SGLangClient(u, timeout).url for u in workers], []
    for url in urls:
        client = SGLangClient(url, timeout)
        if not client.health():
            raise ValueError(f"rollout server {client.url} is not answering /health")
        behind = client.router_workers()
        if behind is not None and not (listed or behind):
            raise ValueError(f"engine.urls: {client.url} is a router with no workers registered and engine.workers "
                             "is empty: weight syncs need the workers' URLs")
        if behind is not None:
            client.transient = ROUTER_TRANSIENT_STATUS
        discovered += behind or []
        targets.append((client, behind is not None))
    servers = [client.url for client, is_router in targets if not is_router]
    for url in listed or discovered:
        if url not in servers and not SGLangClient(url, timeout).health():
            raise ValueError(f"rollout worker {url} is not answering /health")
    return targets, list(dict.fromkeys(servers + (listed or discovered)))


@dataclass
class _Server:
    client: SGLangClient
    slots: int = 0  # generation slots (0: a worker behind a router, used for control only)
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
    retry: deque = field(default_factory=deque)
    outstanding: int = 0
    error: Optional[BaseException] = None
    callback_lock: threading.Lock = field(default_factory=threading.Lock)
    failed_sends: dict = field(default_factory=dict)  # id(request) -> failed sends, while it waits to be sent again


class HTTPEngine(RolloutEngine):
    """Continuous batching on one SGLang-API server: up to `max_inflight` requests in flight at once.

    `checkpoint` is what the server must hold at policy version 0 (loaded at start); its config and
    tokenizer files are the template for every disk weight sync, written under `weights_dir` (a directory
    the servers can read; default a temporary one). `weight_sync` picks how weights travel: "disk",
    "tensor" (in the HTTP request) or "distributed" (broadcast from a group this process hosts at
    `sync_address`). If the URL is a router, `workers` (default: asked from the router) receive them.
    With every server (or worker) dead, generation waits up to `down_timeout` seconds for one to come back,
    probing each `probe_s`.
    """

    def __init__(self, url: str, *, checkpoint: Optional[str | Path] = None, weights_dir: Optional[str] = None,
                 max_inflight: int = 32, timeout: float = 600.0, down_timeout: float = 60.0, probe_s: float = 1.0,
                 workers: Iterable[str] = (), weight_sync: str = "disk", sync_address: str = "127.0.0.1"):
        self._setup([url], checkpoint=checkpoint, weights_dir=weights_dir, max_inflight=max_inflight,
                    timeout=timeout, down_timeout=down_timeout, probe_s=probe_s, workers=workers,
                    weight_sync=weight_sync, sync_address=sync_address)

    def _setup(self, urls: list[str], *, checkpoint, weights_dir, max_inflight: int, timeout: float,
               down_timeout: float = 60.0, probe_s: float = 1.0, workers: Iterable[str] = (),
               weight_sync: str = "disk", sync_address: str = "127.0.0.1") -> None:
        if weight_sync not in ("disk", "tensor", "distributed"):
            raise ValueError(f"weight_sync {weight_sync!r}: use disk, tensor or distributed")
        self.down_timeout, self.probe_s = down_timeout, probe_s
        self._servers = []
        targets, worker_urls = discover_fleet(urls, workers, timeout)
        for client, is_router in targets:
            pool = ThreadPoolExecutor(max_inflight, thread_name_prefix=f"rollout-{client.url}")
            self._servers.append(_Server(client, max_inflight, pool, is_router=is_router))
        by_url = {s.client.url: s for s in self._servers}
        self._workers = [by_url.get(url) or _Server(SGLangClient(url, timeout)) for url in worker_urls]
        self._weight_sync, self._sync_address = weight_sync, sync_address
        self._group: Optional[tuple] = None  # distributed sync: (name, members, process group, store)
        self._groups_made = 0
        self._restore = None  # restore(workers): the current weights to these workers (a revival)
        self._weights_lock = threading.RLock()  # a weight sync and a revival never interleave
        self._prober: Optional[threading.Thread] = None
        self._closed = False
        self._cond = threading.Condition()
        self._version = 0
        self.tokens_generated = 0
        self.template = Path(checkpoint) if checkpoint is not None else None
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="opd-sao-weights-"))
        # a directory of our own goes at close(), or when the engine is collected or the process exits unclosed
        self._remove_weights_dir = weakref.finalize(self, shutil.rmtree, self.weights_dir, True) \
            if weights_dir is None else None
        if checkpoint is not None and weight_sync == "disk":
            self.load_weights(checkpoint, 0)
        elif checkpoint is not None:  # the start weights travel like every sync: no shared filesystem needed
            from opd_sao.checkpoints import load_causal_lm

            self.update_weights(load_causal_lm(checkpoint).state_dict(), 0)

    @property
    def version(self) -> int:
        return self._version

    @property
    def urls(self) -> list[str]:
        return [s.client.url for s in self._servers]

    @property
    def stats(self) -> dict[str, dict]:
        """Per server: alive, requests and tokens served, requests sent again after a failure, revivals."""
        with self._cond:
            return {s.client.url: {"alive": s.alive, "requests": s.requests, "tokens": s.tokens,
                                   "requeued": s.requeued, "revived": s.revived, "inflight": s.inflight,
                                   "load": s.load}
                    for s in self._servers}

    @property
    def rejoins(self) -> int:
        with self._cond:
            return sum(s.revived for s in self._servers) + sum(
                w.revived for w in self._workers if all(w is not s for s in self._servers))

    @property
    def workers(self) -> list[str]:
        """The servers that hold weights (the URLs themselves unless they are routers)."""
        return [s.client.url for s in self._workers]

    def _pick(self, servers: list[_Server]) -> _Server:
        return servers[0]

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
                # a broadcast goes to a whole group: the live workers are sent the same weights again
                members = self._live_workers() + [server] if self._weight_sync == "distributed" else [server]
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
        call = _Call(on_result)
        pending = iter(requests)
        exhausted = False
        while True:
            request = None
            with self._cond:
                while True:
                    if call.error is not None:
                        raise call.error
                    if exhausted and not call.retry and not call.outstanding:
                        return
                    free = [s for s in self._alive() if s.inflight < s.slots]
                    if free and call.retry:
                        request = call.retry.popleft()
                        break
                    if free and not exhausted:
                        break
                    self._cond.wait(0.05)
            if request is None:
                try:
                    request = next(pending)
                except StopIteration:
                    exhausted = True
                    continue
                if request is None:
                    time.sleep(0.002)
                    continue
            self._dispatch(request, call)

    def _dispatch(self, request: GenerationRequest, call: _Call) -> None:
        est = request.est_tokens or request.params.max_new_tokens
        with self._cond:
            alive = self._alive()
            if not alive:  # it died since generate() saw it free: wait for one in the retry queue
                call.retry.appendleft(request)
                return
            server = self._pick([s for s in alive if s.inflight < s.slots] or alive)
            server.inflight += 1
            server.load += est
            call.outstanding += 1
        future = server.pool.submit(server.client.generate, request)
        future.add_done_callback(lambda f: self._finished(f, server, request, est, call))

    def _finished(self, future: Future, server: _Server, request: GenerationRequest, est: int, call: _Call) -> None:
        err = future.exception()
        if self._worker_lost(server, err):
            err = Aborted(str(err))  # the router is alive; a worker behind it failed the request
        elif isinstance(err, ServerDown):
            self._failed(server, err)
        with self._cond:
            server.inflight -= 1
            server.load -= est
            failed_sends = call.failed_sends.pop(id(request), 0) + (err is not None)
            if isinstance(err, (ServerDown, Aborted)) and failed_sends < MAX_SENDS:  # not lost: sent again
                log.info("%s did not complete a request, sent again: %s", server.client.url, err)
                server.requeued += 1
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
            if err is not None:
                call.outstanding -= 1
                self._cond.notify_all()
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
        """Every live worker gets the weights (as `weight_sync` says) and confirms `version`; one that cannot
        be reached is taken out, and gets them when it comes back."""
        with self._weights_lock:
            if self._weight_sync == "tensor":
                packed = pack_tensors(state_dict)
                self._sync(lambda workers: self._on_workers(
                    lambda w: w.client.update_weights_from_tensor(packed, str(version)), version, workers))
            elif self._weight_sync == "distributed":
                snapshot = {k: v.clone() for k, v in untied(state_dict).items()}  # for a worker that comes back
                self._sync(lambda workers: self._broadcast_weights(snapshot, version, workers))
            else:
                if self.template is None:
                    raise ValueError("this engine was built without its checkpoint, which disk weight syncs need "
                                     "as a template")
                path = publish_checkpoint(state_dict, self.template, self.weights_dir / f"v{version}")
                self.load_weights(path, version)
                for old in self.weights_dir.glob("v*"):
                    if old != path:
                        shutil.rmtree(old, ignore_errors=True)
            self._version = version

    def load_weights(self, path: str | Path, version: int) -> None:
        """Every live worker loads the checkpoint at `path` as `version` and reports it back."""
        resolved = str(Path(path).resolve())
        with self._weights_lock:
            self._sync(lambda workers: self._on_workers(
                lambda w: w.client.update_weights_from_disk(resolved, str(version)), version, workers))
            self._version = version

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

    def _on_workers(self, update, version: int, workers: list[_Server], during=None) -> list[_Server]:
        """`update(worker)` on `workers` in parallel (while `during()` runs here), then each worker's
        weight_version checked; returns the workers that confirmed it (one that stopped answering is taken
        out)."""

        def run(worker: _Server) -> bool:
            try:
                update(worker)
                reported = worker.client.weight_version()
            except ServerDown as err:
                self._mark_down(worker, err)
                return False
            if reported != str(version):
                raise ServerError(f"rollout server {worker.client.url} reports weight_version {reported!r} "
                                  f"after loading version {version}")
            return True

        with ThreadPoolExecutor(len(workers)) as pool:
            futures = [pool.submit(run, w) for w in workers]
            if during is not None:
                during()
            return [w for w, future in zip(workers, futures) if future.result()]

    def _broadcast_weights(self, tensors: dict[str, torch.Tensor], version: int,
                           workers: list[_Server]) -> list[_Server]:
        """SGLang's update_weights_from_distributed: each worker is told the names, dtypes and shapes while
        this process broadcasts the tensors, in that order, as rank 0 of the weight update group of these
        workers (made again when they change, e.g. after a worker died or came back)."""
        names = list(tensors)
        dtypes = [dtype_name(t.dtype) for t in tensors.values()]
        shapes = [list(t.shape) for t in tensors.values()]
        group_name, group = self._weight_group(workers)
        try:
            return self._on_workers(
                lambda w: w.client.update_weights_from_distributed(names, dtypes, shapes, group_name, str(version)),
                version, workers, during=lambda: [broadcast(group, t) for t in tensors.values()])
        except RuntimeError:  # a collective failed: a worker died mid-broadcast; once more, with the others
            survivors = [w for w in workers if w.client.health()]
            for worker in workers:
                if worker not in survivors:
                    self._mark_down(worker, ServerDown(f"{worker.client.url} died during a weight broadcast"))
            if survivors == workers or not survivors:
                raise
            return self._broadcast_weights(tensors, version, survivors)

    def _weight_group(self, workers: list[_Server]) -> tuple[str, object]:
        if self._group is not None and self._group[1] == workers:
            return self._group[0], self._group[2]
        self._drop_group()
        self._groups_made += 1
        name, world = f"opd-sao-weights-{self._groups_made}", len(workers) + 1
        store = host_store(self._sync_address, world)
        with ThreadPoolExecutor(len(workers)) as pool:
            joins = [pool.submit(w.client.init_weights_update_group, self._sync_address, store.port, rank, world, name)
                     for rank, w in enumerate(workers, start=1)]
            group = join_group(store, 0, world, name)
            for future in joins:
                future.result()
        self._group = (name, workers, group, store)
        return name, group

    def _drop_group(self) -> None:
        if self._group is None:
            return
        name, members = self._group[0], self._group[1]
        self._group = None
        for worker in members:
            if worker.alive:
                try:
                    worker.client.destroy_weights_update_group(name)
                except (ServerDown, ServerError) as err:
                    log.warning("%s could not leave weight update group %s: %s", worker.client.url, name, err)

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
        self._drop_group()
        for server in self._servers:
            server.pool.shutdown(wait=False)
        if self._remove_weights_dir is not None:
            self._remove_weights_dir()
