"""Rollouts and teacher scoring on servers that speak SGLang's native HTTP API.

`SGLangClient` uses SGLang's documented fields exactly: `/generate` with `input_ids`, `sampling_params`,
`return_logprob` (plus `logprob_start_len` and `top_logprobs_num` for prompt scoring) and the response's
`meta_info` (`output_token_logprobs`, `finish_reason`, `weight_version`); `/update_weights_from_disk`
with `model_path` and `weight_version`; `/get_model_info`, `/flush_cache`, `/health`. `opd-sao serve`
answers the same API, so a fleet of our servers and a fleet of SGLang servers are interchangeable.

`HTTPEngine` is a RolloutEngine over one server; `router.Router` spreads over several. Policy versions
travel as SGLang's `weight_version` string: a weight sync loads a checkpoint with `weight_version=str(v)`
and is confirmed by `/get_model_info`; every result's tokens carry the version the server reported.

Faults: the client retries transient errors (connection refused or reset, timeouts, HTTP 502/503/504) with
exponential backoff; a request that still fails is sent again, and its server is declared dead only if its
`/health` fails too. A dead server's `/health` is probed in the background; once it answers, the server is
given the current weights back and rejoins. A run fails only when every server has been down for
`down_timeout` seconds.
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

log = logging.getLogger(__name__)

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
TRANSIENT_STATUS = {502, 503, 504}  # a proxy or an overloaded server: worth another try
MAX_SENDS = 5  # a request that fails this many sends (timeouts, aborts, dying servers) fails the run


class ServerDown(ConnectionError):
    """The server did not answer (refused, reset, timed out, 502/503/504), even after the client's retries."""


class ServerError(RuntimeError):
    """The server answered, but with an error: a request or setup problem, not a dead server."""


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
        self._local = threading.local()

    def _call(self, method: str, path: str, payload: Optional[dict] = None, timeout=None,
              retries: Optional[int] = None) -> requests.Response:
        """One API call; transient failures are tried again `retries` times, waiting backoff_s, 2x, 4x, ..."""
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            if attempt:
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
            if response.status_code in TRANSIENT_STATUS:
                failure = ServerDown(f"rollout server {self.url} answered {path} with HTTP {response.status_code} "
                                     f"({attempt + 1} tries)")
                continue
            if response.status_code != 200:
                raise ServerError(f"rollout server {self.url} answered {path} with HTTP {response.status_code}: "
                                  f"{response.text[:500]}")
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

    def update_weights_from_disk(self, model_path: str | Path, weight_version: str) -> None:
        body = self._call("POST", "/update_weights_from_disk",
                          {"model_path": str(model_path), "weight_version": weight_version}).json()
        if not body.get("success"):
            raise ServerError(f"rollout server {self.url} could not load {model_path}: {body.get('message')}")

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
    tensors, stored = {}, set()
    for name, tensor in state_dict.items():
        if tensor.numel() and tensor.data_ptr() in stored:  # tied weights: the config re-ties them
            continue
        stored.add(tensor.data_ptr())
        tensors[name] = tensor.detach().cpu().contiguous()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
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


@dataclass
class _Server:
    client: SGLangClient
    slots: int
    pool: ThreadPoolExecutor
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
    tokenizer files are the template for every weight sync, written under `weights_dir` (a directory
    the servers can read; default a temporary one). With every server dead, generation waits up to
    `down_timeout` seconds for one to come back, probing each `probe_s`.
    """

    def __init__(self, url: str, *, checkpoint: Optional[str | Path] = None, weights_dir: Optional[str] = None,
                 max_inflight: int = 32, timeout: float = 600.0, down_timeout: float = 60.0, probe_s: float = 1.0):
        self._setup([url], checkpoint=checkpoint, weights_dir=weights_dir, max_inflight=max_inflight,
                    timeout=timeout, down_timeout=down_timeout, probe_s=probe_s)

    def _setup(self, urls: list[str], *, checkpoint, weights_dir, max_inflight: int, timeout: float,
               down_timeout: float, probe_s: float) -> None:
        self.down_timeout, self.probe_s = down_timeout, probe_s
        self._weights: Optional[Path] = None  # what every live server holds, as self._version
        self._weights_lock = threading.Lock()  # a weight sync and a revival never interleave
        self._prober: Optional[threading.Thread] = None
        self._closed = False
        self._servers = []
        for url in urls:
            client = SGLangClient(url, timeout)
            if not client.health():
                raise ValueError(f"rollout server {client.url} is not answering /health")
            pool = ThreadPoolExecutor(max_inflight, thread_name_prefix=f"rollout-{client.url}")
            self._servers.append(_Server(client, max_inflight, pool))
        self._cond = threading.Condition()
        self._version = 0
        self.tokens_generated = 0
        self.template = Path(checkpoint) if checkpoint is not None else None
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="opd-sao-weights-"))
        # a directory of our own goes at close(), or when the engine is collected or the process exits unclosed
        self._remove_weights_dir = weakref.finalize(self, shutil.rmtree, self.weights_dir, True) \
            if weights_dir is None else None
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
        """Per server: alive, requests and tokens served, requests sent again after a failure, revivals."""
        with self._cond:
            return {s.client.url: {"alive": s.alive, "requests": s.requests, "tokens": s.tokens,
                                   "requeued": s.requeued, "revived": s.revived, "inflight": s.inflight,
                                   "load": s.load}
                    for s in self._servers}

    def _pick(self, servers: list[_Server]) -> _Server:
        return servers[0]

    def _alive(self) -> list[_Server]:
        """The live servers; none while all are down (they may come back), RuntimeError once every one has
        been down for down_timeout seconds."""
        alive = [s for s in self._servers if s.alive]
        if not alive and time.monotonic() - max(s.down_since for s in self._servers) > self.down_timeout:
            raise RuntimeError(f"every rollout server is down (for {self.down_timeout:.0f} s): {', '.join(self.urls)}")
        return alive

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
        """While a server is dead: probe its /health every probe_s; one that answers gets the current weights
        and rejoins the fleet."""
        while True:
            with self._cond:
                dead = [s for s in self._servers if not s.alive]
                if not dead or self._closed:
                    self._prober = None
                    return
            for server in dead:
                if server.client.health():
                    self._revive(server)
            time.sleep(self.probe_s)

    def _revive(self, server: _Server) -> None:
        with self._weights_lock:
            try:
                if self._weights is not None:
                    server.client.update_weights_from_disk(str(self._weights), str(self._version))
                    reported = server.client.weight_version()
                    if reported != str(self._version):
                        raise ServerError(f"it reports weight_version {reported!r}, not {self._version}")
            except (ServerDown, ServerError) as err:
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
        if isinstance(err, ServerDown):
            self._failed(server, err)
        with self._cond:
            server.inflight -= 1
            server.load -= est
            failed_sends = call.failed_sends.pop(id(request), 0) + (err is not None)
            if isinstance(err, (ServerDown, Aborted)) and failed_sends < MAX_SENDS:  # not lost: sent again
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

    # --- weights ---------------------------------------------------------------------------------------

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Write the weights once as an HF checkpoint, have every live server load them, check the version."""
        if self.template is None:
            raise ValueError("this engine was built without its checkpoint, which weight syncs need as a template")
        path = publish_checkpoint(state_dict, self.template, self.weights_dir / f"v{version}")
        self.load_weights(path, version)
        for old in self.weights_dir.glob("v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)

    def load_weights(self, path: str | Path, version: int) -> None:
        """Every live server loads `path` as `version` and reports it back. One that cannot be reached is taken
        out (it does not hold these weights); a dead one gets them when it comes back."""
        path = Path(path).resolve()

        def load(server: _Server) -> None:
            try:
                server.client.update_weights_from_disk(str(path), str(version))
                reported = server.client.weight_version()
            except ServerDown as err:
                self._mark_down(server, err)
                return
            if reported != str(version):
                raise ServerError(f"rollout server {server.client.url} reports weight_version {reported!r} "
                                  f"after loading version {version}")

        with self._weights_lock:
            servers = self._alive()
            if servers:
                with ThreadPoolExecutor(len(servers)) as pool:
                    list(pool.map(load, servers))
            self._weights, self._version = path, version
        self._alive()

    # --- teacher scoring -------------------------------------------------------------------------------

    def score(self, input_ids: list[int], start: int, top_k: int = 0) -> PromptLogprobs:
        """Prompt logprobs from the least-loaded live server (another one if it is down)."""
        while True:
            with self._cond:
                alive = self._alive()
                if not alive:
                    self._cond.wait(0.05)
                    continue
                server = self._pick(alive)
            try:
                return server.client.score(input_ids, start, top_k)
            except ServerDown as err:
                self._failed(server, err)

    def close(self) -> None:
        with self._cond:
            self._closed = True
        for server in self._servers:
            server.pool.shutdown(wait=False)
        if self._remove_weights_dir is not None:
            self._remove_weights_dir()
