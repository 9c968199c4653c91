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


class ServerDown(ConnectionError):
    """The server did not answer (refused, reset, timed out): it is taken out of the fleet."""


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

    def __init__(self, url: str, timeout: float = 600.0, connect_timeout: float = 5.0):
        self.url = url.rstrip("/")
        self.timeout = (connect_timeout, timeout)
        self._local = threading.local()

    def _call(self, method: str, path: str, payload: Optional[dict] = None, timeout=None) -> requests.Response:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        try:
            response = session.request(method, self.url + path, json=payload, timeout=timeout or self.timeout)
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as err:
            raise ServerDown(f"rollout server {self.url} did not answer {path} ({type(err).__name__})") from err
        if response.status_code != 200:
            raise ServerError(f"rollout server {self.url} answered {path} with HTTP {response.status_code}: "
                              f"{response.text[:500]}", response.status_code)
        return response

    def health(self) -> bool:
        try:
            self._call("GET", "/health", timeout=(self.timeout[0], 10.0))
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
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, weight_version: str) -> None:
        self._weight_call("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "weight_version": weight_version})

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._weight_call("/destroy_weights_update_group", {"group_name": group_name})

    def _weight_call(self, path: str, payload: dict) -> None:
        body = self._call("POST", path, payload).json()
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
    inflight: int = 0  # requests sent, not answered
    load: int = 0  # their estimated tokens
    requests: int = 0
    tokens: int = 0
    requeued: int = 0


@dataclass
class _Call:
    """One generate() call's bookkeeping (several calls may share the engine: rollouts and gate probes)."""

    on_result: ResultCallback
    retry: deque = field(default_factory=deque)
    outstanding: int = 0
    error: Optional[BaseException] = None
    callback_lock: threading.Lock = field(default_factory=threading.Lock)


class HTTPEngine(RolloutEngine):
    """Continuous batching on one SGLang-API server: up to `max_inflight` requests in flight at once.

    `checkpoint` is what the server must hold at policy version 0 (loaded at start); its config and
    tokenizer files are the template for every disk weight sync, written under `weights_dir` (a directory
    the servers can read; default a temporary one). `weight_sync` picks how weights travel: "disk",
    "tensor" (in the HTTP request) or "distributed" (broadcast from a group this process hosts at
    `sync_address`). If the URL is a router, `workers` (default: asked from the router) receive them.
    """

    def __init__(self, url: str, *, checkpoint: Optional[str | Path] = None, weights_dir: Optional[str] = None,
                 max_inflight: int = 32, timeout: float = 600.0, workers: Iterable[str] = (),
                 weight_sync: str = "disk", sync_address: str = "127.0.0.1"):
        self._setup([url], checkpoint=checkpoint, weights_dir=weights_dir, max_inflight=max_inflight,
                    timeout=timeout, workers=workers, weight_sync=weight_sync, sync_address=sync_address)

    def _setup(self, urls: list[str], *, checkpoint, weights_dir, max_inflight: int, timeout: float,
               workers: Iterable[str] = (), weight_sync: str = "disk", sync_address: str = "127.0.0.1") -> None:
        if weight_sync not in ("disk", "tensor", "distributed"):
            raise ValueError(f"weight_sync {weight_sync!r}: use disk, tensor or distributed")
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
        """Per server: alive, requests and tokens served, requests re-queued after it died."""
        with self._cond:
            return {s.client.url: {"alive": s.alive, "requests": s.requests, "tokens": s.tokens,
                                   "requeued": s.requeued, "inflight": s.inflight, "load": s.load}
                    for s in self._servers}

    @property
    def workers(self) -> list[str]:
        """The servers that hold weights (the URLs themselves unless they are routers)."""
        return [s.client.url for s in self._workers]

    def _pick(self, servers: list[_Server]) -> _Server:
        return servers[0]

    def _alive(self) -> list[_Server]:
        alive = [s for s in self._servers if s.alive]
        if not alive:
            raise RuntimeError(f"every rollout server is down: {', '.join(self.urls)}")
        return alive

    def _mark_down(self, server: _Server, err: BaseException) -> None:
        with self._cond:
            if server.alive:
                server.alive = False
                log.warning("taking %s out of the fleet: %s", server.client.url, err)
            self._cond.notify_all()

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
            server = self._pick([s for s in alive if s.inflight < s.slots] or alive)
            server.inflight += 1
            server.load += est
            call.outstanding += 1
        future = server.pool.submit(server.client.generate, request)
        future.add_done_callback(lambda f: self._finished(f, server, request, est, call))

    def _finished(self, future: Future, server: _Server, request: GenerationRequest, est: int, call: _Call) -> None:
        err = future.exception()
        if isinstance(err, ServerDown):
            self._mark_down(server, err)
        elif self._worker_lost(server, err):
            err = Aborted(str(err))  # a worker behind the router died with the request: sent again
        with self._cond:
            server.inflight -= 1
            server.load -= est
            if isinstance(err, (ServerDown, Aborted)):  # not lost: sent again, to a live server
                log.info("%s did not complete a request, sent again: %s", server.client.url, err)
                server.requeued += 1
                call.retry.appendleft(request)
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
        """A router's 5xx while a worker behind it is down (what sglang-router answers, retries disabled or
        spent, for a request whose worker died): the request is not lost, it is sent again. With every
        worker down it is an error."""
        if not (server.is_router and isinstance(err, ServerError) and err.status >= 500):
            return False
        for worker in self._live_workers():
            if not worker.client.health():
                self._mark_down(worker, err)
        return bool(self._live_workers())

    # --- weights ---------------------------------------------------------------------------------------

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Every live worker gets the weights (as `weight_sync` says) and confirms `version`; a dead one is
        taken out."""
        if self._weight_sync == "tensor":
            packed = pack_tensors(state_dict)
            self._on_workers(lambda w: w.client.update_weights_from_tensor(packed, str(version)), version)
        elif self._weight_sync == "distributed":
            self._broadcast_weights(state_dict, version)
        else:
            if self.template is None:
                raise ValueError("this engine was built without its checkpoint, which disk weight syncs need as a "
                                 "template")
            path = publish_checkpoint(state_dict, self.template, self.weights_dir / f"v{version}")
            self.load_weights(path, version)
            for old in self.weights_dir.glob("v*"):
                if old != path:
                    shutil.rmtree(old, ignore_errors=True)
        self._version = version

    def load_weights(self, path: str | Path, version: int) -> None:
        """Every live worker loads the checkpoint at `path` as `version` and reports it back."""
        resolved = str(Path(path).resolve())
        self._on_workers(lambda w: w.client.update_weights_from_disk(resolved, str(version)), version)
        self._version = version

    def _live_workers(self) -> list[_Server]:
        with self._cond:
            return [w for w in self._workers if w.alive]

    def _on_workers(self, update, version: int, during=None) -> None:
        """`update(worker)` on every live worker in parallel (while `during()` runs here), then each worker's
        weight_version checked; a worker that stopped answering is taken out."""

        def run(worker: _Server) -> None:
            try:
                update(worker)
                reported = worker.client.weight_version()
            except ServerDown as err:
                self._mark_down(worker, err)
                return
            if reported != str(version):
                raise ServerError(f"rollout server {worker.client.url} reports weight_version {reported!r} "
                                  f"after loading version {version}")

        workers = self._live_workers()
        if not workers:
            raise RuntimeError(f"every rollout worker is down: {', '.join(self.workers)}")
        with ThreadPoolExecutor(len(workers)) as pool:
            futures = [pool.submit(run, w) for w in workers]
            if during is not None:
                during()
            for future in futures:
                future.result()
        if not self._live_workers():
            raise RuntimeError(f"every rollout worker is down: {', '.join(self.workers)}")

    def _broadcast_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """SGLang's update_weights_from_distributed: each worker is told the names, dtypes and shapes while
        this process broadcasts the tensors, in that order, as rank 0 of the weight update group (made
        again, with the survivors, after a worker died)."""
        tensors = untied(state_dict)
        names = list(tensors)
        dtypes = [dtype_name(t.dtype) for t in tensors.values()]
        shapes = [list(t.shape) for t in tensors.values()]
        group_name, group = self._weight_group()
        try:
            self._on_workers(lambda w: w.client.update_weights_from_distributed(names, dtypes, shapes, group_name,
                                                                                str(version)),
                             version, during=lambda: [broadcast(group, t) for t in tensors.values()])
        except RuntimeError:  # a collective failed: a worker died mid-broadcast; once more, with the others
            for worker in self._live_workers():
                if not worker.client.health():
                    self._mark_down(worker, ServerDown(f"{worker.client.url} died during a weight broadcast"))
            if self._group is not None and self._group[1] == self._live_workers():
                raise
            self._broadcast_weights(state_dict, version)

    def _weight_group(self) -> tuple[str, object]:
        workers = self._live_workers()
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
        """Prompt logprobs from the least-loaded live server (another one if it is down)."""
        while True:
            with self._cond:
                server = self._pick(self._alive())
            try:
                return server.client.score(input_ids, start, top_k)
            except ServerDown as err:
                self._mark_down(server, err)

    def close(self) -> None:
        self._drop_group()
        for server in self._servers:
            server.pool.shutdown(wait=False)
        if self._remove_weights_dir is not None:
            self._remove_weights_dir()
