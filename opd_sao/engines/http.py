"""One rollout worker's HTTP API, as SGLang 0.5.23 speaks it (`opd-sao serve` answers the same API).

`SGLangClient` uses SGLang's documented fields exactly: `/generate` with `input_ids`, `sampling_params`,
`return_logprob` (plus `logprob_start_len` and `top_logprobs_num` for prompt scoring, `return_sampling_mask`
for top-p) and the response's `meta_info`; `/model_info` (not its deprecated alias `/get_model_info`, which
logs a warning per call) for `weight_version`; `/server_info` for `tp_size`; `/health`, `/flush_cache`; the
weight-update session (`/begin_weight_update` ... `/end_weight_update`), `/pause_generation` (mode abort) and
`/continue_generation` around a bucketed sync, and the weight calls of each weight-sync mode (`weight_sync/`). An API key (`--api-key` / `--admin-api-key` on SGLang, the config's
`engine.api_key` / `engine.admin_api_key` or the environment's OPD_SAO_API_KEY / OPD_SAO_ADMIN_API_KEY
here) goes as `Authorization: Bearer`; weight calls, pause/continue and `/flush_cache` (SGLang's admin endpoints) send
the admin key when one is set.

Semantics the trainer depends on, as SGLang's source has them:
- `output_token_logprobs` are log softmax(logits / T) over the whole vocabulary, not renormalised to the
  top-p nucleus. With `top_p < 1` the client asks `return_sampling_mask` and records
  `meta_info.output_token_sampling_logprobs` (the renormalised value: the distribution actually sampled
  from); a server that does not return it is refused in one line. SGLang's scheduler takes such a request only
  at top_k 1 or 1 < top_k <= --sampling-mask-max-tokens (4096 by default; a missing top_k is 2^30 and refused
  with HTTP 400), so the client sends top_k `modeling.SAMPLING_MASK_TOP_K` (or the request's own, if smaller),
  the cut the trainer, the gate and the embedded engine apply to every top_p < 1 row (`nucleus_top_k`).
- Prompt scoring: SGLang's `input_token_logprobs[j]` pairs the token at `logprob_start_len + j` with its
  logprob given the tokens before it, and its first entry is always None (even past position 0), so
  `score` asks from `start - 1` and drops that entry.
- An aborted request answers 200 with `finish_reason.type == "abort"` (sent again by the fleet, `Aborted`);
  an abort with a status code answers that status: 5xx is retried like any transient failure, 4xx is the
  request's fault (`ServerError`).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Optional

import requests
import torch

from opd_sao.errors import UsageError
from opd_sao.model.modeling import nucleus_top_k

from .base import GenerationRequest, GenerationResult
from .retry import TRANSIENT_STATUS, retrying_session

API_KEY_ENV, ADMIN_API_KEY_ENV = "OPD_SAO_API_KEY", "OPD_SAO_ADMIN_API_KEY"


class ServerDown(ConnectionError):
    """The server did not answer (refused, reset, timed out, 502/503/504), even after the retries.
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
    """The server aborted the request (finish_reason abort); it is sent again. `partial`: the tokens it had
    generated (SGLang answers a running request's abort with them), None if the answer did not carry them."""

    def __init__(self, message: str, partial: Optional[GenerationResult] = None):
        super().__init__(message)
        self.partial = partial


@dataclass
class PromptLogprobs:
    """Scores for positions start..L-1: each token's logprob given the tokens before it, and the top-k
    alternatives at that position (temperature 1)."""

    token_logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class SGLangClient:
    """One server's native API. Thread-safe: each thread keeps its own keep-alive sessions."""

    def __init__(self, url: str, timeout: float = 600.0, connect_timeout: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.2, api_key: Optional[str] = None, admin_api_key: Optional[str] = None):
        self.url = url.rstrip("/")
        self.timeout = (connect_timeout, timeout)
        self.retries, self.backoff_s = retries, backoff_s
        self.transient = TRANSIENT_STATUS  # statuses tried again (a router's: retry.ROUTER_TRANSIENT_STATUS)
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self.admin_api_key = admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or self.api_key
        self._local = threading.local()
        self._tp_size: Optional[int] = None

    def _session(self, retries: int) -> requests.Session:
        sessions = self._local.__dict__.setdefault("sessions", {})
        key = (retries, self.transient)
        if key not in sessions:
            sessions[key] = retrying_session(retries, self.backoff_s, self.transient)
        return sessions[key]

    def _call(self, method: str, path: str, payload: Optional[dict] = None, timeout=None,
              retries: Optional[int] = None, admin: bool = False) -> requests.Response:
        """One API call under the retry policy (`retry.py`); the failure, if it still fails, as ServerDown
        (no answer, or a transient status) or ServerError (any other status)."""
        retries = self.retries if retries is None else retries
        key = self.admin_api_key if admin else self.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None
        timeout = timeout or self.timeout
        try:
            response = self._session(retries).request(method, self.url + path, json=payload, timeout=timeout,
                                                      headers=headers)
        except requests.ReadTimeout as err:
            raise ServerDown(f"rollout server {self.url} did not answer {path} within {timeout} s") from err
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as err:
            raise ServerDown(f"rollout server {self.url} did not answer {path} ({type(err).__name__}, "
                             f"{retries + 1} tries)") from err
        if response.status_code in self.transient:
            raise ServerDown(f"rollout server {self.url} answered {path} with HTTP {response.status_code} "
                             f"({retries + 1} tries): {response.text[:200]}", response.status_code)
        if response.status_code != 200:
            raise ServerError(f"rollout server {self.url} answered {path} with HTTP {response.status_code}: "
                              f"{response.text[:500]}", response.status_code)
        return response

    # --- state -----------------------------------------------------------------------------------------

    def health(self) -> bool:
        try:
            self._call("GET", "/health", timeout=(self.timeout[0], 10.0), retries=0)
            return True
        except (ServerDown, ServerError):
            return False

    def model_info(self) -> dict:
        return self._call("GET", "/model_info").json()

    def server_info(self) -> dict:
        """`/server_info` (`/get_server_info` on builds before it was renamed)."""
        try:
            return self._call("GET", "/server_info").json()
        except ServerError as err:
            if err.status != 404:
                raise
            return self._call("GET", "/get_server_info").json()

    def tp_size(self) -> int:
        """The worker's tensor-parallel ranks: one process-group rank each, one tensor payload each."""
        if self._tp_size is None:
            self._tp_size = int(self.server_info().get("tp_size") or 1)
        return self._tp_size

    def weight_version(self) -> str:
        return str(self.model_info().get("weight_version"))

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache", admin=True)  # an admin endpoint in SGLang 0.5.23

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

    # --- weights ---------------------------------------------------------------------------------------

    def weight_call(self, path: str, payload: dict, retries: Optional[int] = None, timeout=None) -> dict:
        """A weight endpoint (admin key): its answer, ServerError unless it reports success."""
        body = self._call("POST", path, payload, retries=retries, admin=True, timeout=timeout).json()
        if not body.get("success"):
            raise ServerError(f"rollout server {self.url} failed {path}: {body.get('message')}")
        return body

    def begin_weight_update(self) -> bool:
        """Open a weight-update session (SGLang 0.5.23 loads tensors only inside one). False if the server
        predates sessions (404): its weight calls then need none."""
        try:
            self.weight_call("/begin_weight_update", {})
        except ServerError as err:
            if err.status == 404:
                return False
            raise
        return True

    def end_weight_update(self) -> None:
        self.weight_call("/end_weight_update", {})

    def pause_generation(self, timeout: float) -> bool:
        """SGLang's `/pause_generation` in mode `abort`: the requests running are answered with finish_reason
        abort (the fleet sends them again) and new ones wait until `/continue_generation`; it answers once none
        runs (`timeout`: the drain). False if the server predates it (404): its updates then wait for a drain."""
        try:
            self._call("POST", "/pause_generation", {"mode": "abort"}, timeout=(self.timeout[0], timeout), admin=True)
        except ServerError as err:
            if err.status == 404:
                return False
            raise
        return True

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", {}, admin=True)

    # --- generation and scoring ------------------------------------------------------------------------

    def check_sampling_mask(self) -> None:
        """UsageError unless the server returns the renormalised top-p logprobs (`return_sampling_mask`) for a
        request SGLang's scheduler takes. Not through sglang-router 0.3.2, which drops return_sampling_mask when
        it forwards a /generate: the fleet asks its workers directly."""
        top_k = _top_k(0.9, -1)
        payload = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "top_p": 0.9, "top_k": top_k},
                   "return_logprob": True, "return_sampling_mask": True}
        try:
            meta = self._call("POST", "/generate", payload).json()["meta_info"]
        except ServerError as err:  # the server's own error, not a missing field: say it
            raise UsageError(f"rollout server {self.url} failed the top-p probe (one token from the prompt [0] at "
                             f"top_p 0.9, top_k {top_k} with return_sampling_mask): {err}") from None
        if "output_token_sampling_logprobs" in meta:
            return
        raise UsageError(f"rollout server {self.url} does not return output_token_sampling_logprobs for "
                         "return_sampling_mask (SGLang 0.5.23 does), which rollouts at top_p < 1 need: use "
                         "rollout.top_p 1 or such a server")

    def generate(self, request: GenerationRequest) -> GenerationResult:
        params = request.params
        nucleus = params.top_p < 1
        payload = {"input_ids": list(request.prompt_ids),
                   "sampling_params": {"temperature": params.temperature, "top_p": params.top_p,
                                       "max_new_tokens": params.max_new_tokens, "ignore_eos": params.ignore_eos},
                   "return_logprob": True}
        top_k = _top_k(params.top_p, params.top_k)
        if top_k >= 1:  # the request's own (1: greedy), cut at top_p < 1 to what SGLang's scheduler takes
            payload["sampling_params"]["top_k"] = top_k
        if params.sampling_seed is not None:  # SGLang honours it under --enable-deterministic-inference
            payload["sampling_params"]["sampling_seed"] = params.sampling_seed
        if nucleus:
            payload["return_sampling_mask"] = True
        meta = self._call("POST", "/generate", payload).json()["meta_info"]
        finish = meta["finish_reason"]["type"]
        if finish == "abort":
            message = f"rollout server {self.url} aborted a request: {meta['finish_reason'].get('message')}"
            try:
                partial = self._result(request, meta, finish)
            except (ServerError, KeyError, TypeError, ValueError):  # an abort without its output: nothing to keep
                partial = None
            raise Aborted(message, partial)
        return self._result(request, meta, finish)

    def _result(self, request: GenerationRequest, meta: dict, finish: str) -> GenerationResult:
        """The generated tokens of a /generate answer's meta_info, with the logprobs of what sampled them."""
        pairs = meta["output_token_logprobs"]  # [logprob, token_id, text or null] per generated token
        nucleus = request.params.top_p < 1
        logprobs = [float(p[0]) for p in pairs]
        if nucleus:
            sampled = meta.get("output_token_sampling_logprobs")
            if sampled is None or len(sampled) != len(pairs):
                raise ServerError(f"rollout server {self.url} did not return output_token_sampling_logprobs for "
                                  "return_sampling_mask (SGLang 0.5.23 does): top_p < 1 needs the renormalised "
                                  "logprobs; use top_p 1 or a newer server")
            logprobs = [float(v) for v in sampled]
        version = self._parse_version(meta.get("weight_version"))
        return GenerationResult(request, [int(p[1]) for p in pairs], logprobs, [version] * len(pairs), finish,
                                [float(p[0]) for p in pairs])

    def score(self, input_ids: list[int], start: int, top_k: int = 0) -> PromptLogprobs:
        """Prompt logprobs of input_ids[start:] and, with `top_k`, each position's top-k alternatives
        (temperature 1; no generation). SGLang's first returned entry is None wherever it starts, so the
        request starts one position earlier and that entry is dropped."""
        if not 1 <= start < len(input_ids):
            raise ValueError(f"score: start must be in [1, {len(input_ids)}) (position 0 has no logprob), got {start}")
        payload = {"input_ids": list(input_ids), "sampling_params": {"max_new_tokens": 0},
                   "return_logprob": True, "logprob_start_len": start - 1, "top_logprobs_num": top_k}
        meta = self._call("POST", "/generate", payload).json()["meta_info"]
        entries = meta["input_token_logprobs"][1:]
        tops = (meta.get("input_top_logprobs") or [])[1:] if top_k else [[] for _ in entries]
        tokens = input_ids[start:]
        if len(entries) != len(tokens) or len(tops) != len(tokens) or any(e[0] is None for e in entries) \
                or any(e[1] not in (t, 0) for e, t in zip(entries, tokens)):  # SGLang clips the last vocab id to 0
            raise ServerError(f"rollout server {self.url} scored positions that do not line up with the prompt "
                              f"(asked {len(tokens)} from logprob_start_len {start - 1}, got {len(entries) + 1} "
                              "entries): not SGLang's input_token_logprobs layout")
        return PromptLogprobs([float(e[0]) for e in entries], [[int(t[1]) for t in top] for top in tops],
                              [[float(t[0]) for t in top] for top in tops])

    def _parse_version(self, reported) -> int:
        try:
            return int(reported)
        except (TypeError, ValueError):
            raise ServerError(f"rollout server {self.url} reports weight_version {reported!r}, not a policy "
                              "version: load weights through the engine first (it starts at version 0)") from None


def _top_k(top_p: float, top_k: int) -> int:
    """The top_k a request samples with (< 1: none): its own, cut at top_p < 1 as `nucleus_top_k` cuts it."""
    return int(nucleus_top_k(torch.tensor([top_p]), torch.tensor([top_k]))[0])
