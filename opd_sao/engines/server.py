"""`opd-sao serve CHECKPOINT --port PORT`: the embedded engine behind SGLang's native HTTP API.

Concurrent `/generate` requests join one EmbeddedEngine continuous batch: a decode thread runs the
engine, HTTP threads only queue requests and wait. Weight updates (from disk, from tensors in the request,
or broadcast over a weight update group) keep SGLang's semantics: the swap waits until the requests in
flight have finished (new ones wait meanwhile), so every response was sampled entirely by the
`weight_version` it reports. Serves the subset of the API that opd-sao, sglang-router and SGLang's
RuntimeEndpoint use (see docs/scale_out.md) and rejects, with a 400, what it does not implement.

No request can harm another (docs/reliability.md): every field is checked (type, finite, in range, prompt
plus max_new_tokens within the model's positions, max_new_tokens under the server's cap) before it reaches
the engine; a request that still fails in the batch gets the error alone; a request whose client hung up
leaves the batch; malformed HTTP (bad Content-Length, oversized or chunked bodies) gets a 4xx and a closed
connection.
"""
from __future__ import annotations

import itertools
import json
import math
import queue
import select
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple, Optional
from urllib.parse import urlsplit

import torch

from opd_sao.checkpoints import load_causal_lm, load_tokenizer
from opd_sao.devices import resolve_device
from opd_sao.engines.base import GenerationRequest, GenerationResult, SamplingParams
from opd_sao.engines.embedded import EmbeddedEngine
from opd_sao.engines.weight_sync import WEIGHT_SYNCS, SyncSettings, WeightSyncRefused
from opd_sao.modeling import forward_logits

# sampling_params keys accepted only at these (SGLang default) values: text-only or unimplemented options
NEUTRAL_PARAMS = {"top_k": (-1, None), "min_p": (0, 0.0, None), "n": (1, None), "frequency_penalty": (0, 0.0, None),
                  "presence_penalty": (0, 0.0, None), "repetition_penalty": (1, 1.0, None), "stop": (None, [], ""),
                  "min_new_tokens": (0, None), "regex": (None,), "json_schema": (None,), "ebnf": (None,),
                  "structural_tag": (None,), "stop_regex": (None, [], "")}
TEXT_ONLY_PARAMS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
SAMPLING_PARAMS = {"temperature", "top_p", "max_new_tokens", "ignore_eos", "stop_token_ids"}
# /generate fields besides the prompt and sampling_params: implemented, bookkeeping that changes nothing
# (what sglang-router adds to every request), and SGLang options accepted only at their defaults
GENERATE_FIELDS = {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                   "return_text_in_logprobs", "rid"}
BOOKKEEPING_FIELDS = {"log_metrics", "no_logs", "custom_labels"}
DEFAULT_ONLY_FIELDS = {"stream": (False, None), "return_hidden_states": (False, None), "return_bytes": (False, None),
                       "return_entropy": (False, None), "return_routed_experts": (False, None),
                       "background": (False, None), "input_embeds": (None,), "image_data": (None,),
                       "video_data": (None,), "audio_data": (None,), "modalities": (None,), "lora_path": (None,),
                       "lora_id": (None,), "session_params": (None,), "custom_logit_processor": (None,),
                       "token_ids_logprob": (None,), "data_parallel_rank": (None,), "bootstrap_host": (None,),
                       "bootstrap_port": (None,), "bootstrap_room": (None,)}
WEIGHT_PATHS = {"/begin_weight_update", "/end_weight_update"} | {
    path for name in WEIGHT_SYNCS.names() for path in WEIGHT_SYNCS.get(name).routes}
MIN_TEMPERATURE = 1e-4  # below it logits / T overflows float32 for large logits (SGLang treats it as greedy)
MAX_NEW_TOKENS = 8192  # the default of `--max-new-tokens`
# the default of `--max-body-mb`: a 1M-token prompt as JSON is about 8 MB; /update_weights_from_tensor
# carries the weights as base64 (4/3 of their bytes), so 256 MiB takes a model of about 190 MB
MAX_BODY_BYTES = 256 << 20
LISTEN_BACKLOG = 1024  # connections the kernel queues before accept (the socketserver default, 5, resets bursts)
IDLE_TIMEOUT_S = 300.0  # a connection silent this long (mid-request or idle keep-alive) is closed
CLIENT_POLL_S = 0.1  # how often a waiting request checks that its client is still connected


class BadRequest(ValueError):
    """A request this server cannot honour; answered with HTTP 400 and the message."""


class HTTPError(Exception):
    """A malformed HTTP request (framing, size): answered with `status`, then the connection is closed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ClientGone(Exception):
    """The client closed its connection while its request waited: the request was cancelled."""


class _Prompt(NamedTuple):
    """One prompt of a /generate request with its options, every one checked."""

    ids: list[int]
    params: SamplingParams
    return_logprob: bool
    start: int
    top_k: int
    rid: object


class _Waiter:
    def __init__(self):
        self.event = threading.Event()
        self.result: Optional[GenerationResult] = None
        self.error: Optional[Exception] = None


def _integer(name: str, value, low: int, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise BadRequest(f"{name} must be an integer in [{low}, {'inf' if high is None else high}], got {value!r}")
    return value


def _number(name: str, value, low: float, high: float, *, low_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if low_open else value >= low) and value <= high
    if not ok:
        raise BadRequest(f"{name} must be a finite number in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")
    return float(value)


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}")
    return value


class RolloutServer:
    """The API's behaviour, independent of HTTP."""

    def __init__(self, checkpoint: str | Path, *, max_batch: int = 32, seed: int = 0, dtype: str = "float32",
                 weight_version: str = "default", max_new_tokens: int = MAX_NEW_TOKENS,
                 device: Optional[str] = None, group_timeout_s: float = 60.0):
        self.checkpoint, self.dtype = str(checkpoint), dtype
        self.tokenizer = load_tokenizer(checkpoint)
        self.engine = EmbeddedEngine(load_causal_lm(checkpoint, dtype, resolve_device(device)),
                                     eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id,
                                     max_batch=max_batch, seed=seed)
        self.vocab_size = self.engine.model.get_input_embeddings().num_embeddings
        self.max_positions: Optional[int] = getattr(self.engine.model.config, "max_position_embeddings", None)
        self.max_new_tokens = max_new_tokens
        self.weight_version = weight_version
        self._queue: "queue.SimpleQueue[GenerationRequest]" = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._inflight = 0
        self._tokens_inflight = 0  # prompt + max_new_tokens of the requests in flight (/get_load)
        self._session = False  # a weight-update session is open
        settings = SyncSettings(group_timeout_s=group_timeout_s)
        self.weight_syncs = {name: WEIGHT_SYNCS.get(name)(settings) for name in WEIGHT_SYNCS.names()}
        self._updating = False
        self._update_lock = threading.Lock()
        self._ids = itertools.count()
        self._crash: Optional[BaseException] = None
        threading.Thread(target=self._decode_loop, daemon=True, name="decode").start()

    def _decode_loop(self) -> None:
        def pull():
            while True:
                try:
                    yield self._queue.get_nowait()
                except queue.Empty:
                    yield None

        def done(result: GenerationResult) -> None:
            waiter: _Waiter = result.request.tag
            waiter.result = result
            waiter.event.set()

        def failed(request: GenerationRequest, err: Exception) -> None:  # this request alone
            request.tag.error = err
            request.tag.event.set()

        try:
            self.engine.generate(pull(), done, on_error=failed)
        except BaseException as err:  # a bug outside any one request: answered as HTTP 500, /health 503
            self._crash = err

    @contextmanager
    def _admitted(self, tokens: int = 0):
        """A request in flight: a weight update waits for it, and it waits for a pending update."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._inflight += 1
            self._tokens_inflight += tokens
        try:
            yield self.weight_version
        finally:
            with self._cond:
                self._inflight -= 1
                self._tokens_inflight -= tokens
                self._cond.notify_all()

    @property
    def crashed(self) -> bool:
        return self._crash is not None

    # --- endpoints -------------------------------------------------------------------------------------

    def model_info(self) -> dict:
        return {"model_path": self.checkpoint, "tokenizer_path": self.checkpoint, "is_generation": True,
                "weight_version": self.weight_version}

    def server_info(self) -> dict:
        """SGLang's /get_server_info, the part sglang-router and clients read: model, limits, version."""
        return {**self.model_info(), "served_model_name": self.checkpoint, "dtype": self.dtype,
                "max_running_requests": self.engine.max_batch, "tp_size": 1, "dp_size": 1,
                "skip_tokenizer_init": False, "version": "opd-sao serve",
                "tokens_generated": self.engine.tokens_generated}  # ours: what a balance benchmark counts

    def load(self) -> list[dict]:
        """SGLang's /get_load (one data-parallel rank): sglang-router's power_of_two policy reads num_tokens."""
        with self._cond:
            return [{"dp_rank": 0, "num_reqs": self._inflight, "num_waiting_reqs": 0,
                     "num_tokens": self._tokens_inflight}]

    def generate(self, body: dict, client_gone=lambda: False) -> dict | list[dict]:
        """One prompt, or a batch (a list of `text`s or of `input_ids` lists) answered with a list as SGLang
        does: every prompt of a batch is checked before any of it runs, then they join the continuous batch
        together. `client_gone()` says the client hung up: the request is then cancelled (ClientGone)."""
        _check_generate_fields(body, self.checkpoint)
        prompts, batched = self._input_ids(body)
        text_in_logprobs = _flag("return_text_in_logprobs", body.get("return_text_in_logprobs", False))
        if not batched:
            prompt = self._prompt(body, prompts[0], body.get("sampling_params"), body.get("rid"))
            return self._generate_one(prompt, text_in_logprobs, client_gone)
        params, rids = (_per_prompt(name, body.get(name), len(prompts)) for name in ("sampling_params", "rid"))
        batch = [self._prompt(body, ids, sp, rid) for ids, sp, rid in zip(prompts, params, rids)]
        with ThreadPoolExecutor(min(len(batch), self.engine.max_batch), thread_name_prefix="batch") as pool:
            return list(pool.map(lambda prompt: self._generate_one(prompt, text_in_logprobs, client_gone), batch))

    def _generate_one(self, prompt: _Prompt, text_in_logprobs: bool, client_gone) -> dict:
        t0 = time.perf_counter()
        ids, params = prompt.ids, prompt.params
        with self._admitted(len(ids) + params.max_new_tokens) as version:
            meta = {"id": str(prompt.rid or next(self._ids)), "prompt_tokens": len(ids), "cached_tokens": 0,
                    "weight_version": version}
            if prompt.return_logprob and prompt.start >= 0:
                meta.update(self._prompt_logprobs(ids, prompt.start, prompt.top_k))
            output, logprobs, finish = [], [], {"type": "length", "length": 0}
            if params.max_new_tokens:
                result = self._sample(GenerationRequest(ids, params, tag=_Waiter()), client_gone)
                output, logprobs = result.token_ids, result.logprobs
                finish = ({"type": "stop", "matched": output[-1]} if result.finish_reason == "stop"
                          else {"type": "length", "length": params.max_new_tokens})
        meta.update(finish_reason=finish, completion_tokens=len(output), e2e_latency=time.perf_counter() - t0)
        if prompt.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, output)]
            if text_in_logprobs:
                self._add_token_texts(meta)
        return {"text": self.tokenizer.decode(output), "output_ids": output, "meta_info": meta}

    # --- weights: the weight-sync modes' server sides (opd_sao/engines/weight_sync/) load into this --------

    def expected_weights(self) -> dict:
        return {k: (tuple(v.shape), v.dtype) for k, v in self.engine.model.state_dict().items()}

    def load_checkpoint(self, path: str) -> dict[str, torch.Tensor]:
        if not (Path(path) / "config.json").is_file():
            raise WeightSyncRefused(f"model_path {path!r} is not an HF model directory")
        try:
            return load_causal_lm(path, self.dtype).state_dict()
        except Exception as err:  # noqa: BLE001 (a broken checkpoint is the request's fault)
            raise WeightSyncRefused(f"{path} could not be loaded: {type(err).__name__}: {err}") from None

    def session_open(self) -> bool:
        return self._session

    def begin_weight_update(self, body: dict) -> dict:
        with self._update_lock:
            if self._session:
                raise WeightSyncRefused("a weight-update session is already open; call end_weight_update() first")
            self._session = True
        return {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict) -> dict:
        with self._update_lock:
            if not self._session:
                raise WeightSyncRefused("no weight-update session is open; call begin_weight_update() first")
            self._session = False
        return {"success": True, "message": "Success"}

    def install(self, state: dict[str, torch.Tensor], version) -> None:
        """Swap weights in once the requests in flight have finished (new ones wait meanwhile)."""
        version = self.weight_version if version is None else version
        with self._update_lock:
            with self._cond:
                self._updating = True
                self._cond.wait_for(lambda: self._inflight == 0)
            try:
                self.engine.update_weights(state, int(version) if version.isdigit() else self.engine.version)
                self.weight_version = version
            finally:
                with self._cond:
                    self._updating = False
                    self._cond.notify_all()

    # --- helpers ---------------------------------------------------------------------------------------

    def _input_ids(self, body: dict) -> tuple[list[list[int]], bool]:
        """Each prompt's token ids, and whether the request is a batch: `input_ids` (a list of ids, or a list
        of such lists) or `text` (a string or a list of strings, tokenized with the tokenizer's defaults, as
        SGLang does)."""
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("send exactly one of text and input_ids")
        if text is not None:
            if not isinstance(text, str) and not (isinstance(text, list) and text
                                                  and all(isinstance(t, str) for t in text)):
                raise BadRequest("text must be a string or a non-empty list of strings")
            batched = isinstance(text, list)
            prompts = [self.tokenizer.encode(t) for t in (text if batched else [text])]
            if not all(prompts):
                raise BadRequest("text must not be empty")
            return prompts, batched
        batched = isinstance(ids, list) and bool(ids) and all(isinstance(p, list) for p in ids)
        for prompt in ids if batched else [ids]:
            if not isinstance(prompt, list) or not prompt \
                    or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise BadRequest("input_ids must be a non-empty list of token ids, or a list of such lists")
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise BadRequest(f"input_ids must be in [0, {self.vocab_size})")
        return ids if batched else [ids], batched

    def _prompt(self, body: dict, ids: list[int], sampling, rid) -> _Prompt:
        """One prompt with its sampling_params and logprob options, checked against the model and the caps."""
        params = self._sampling_params({} if sampling is None else sampling)
        self._check_length(ids, params.max_new_tokens)
        return _Prompt(ids, params, *self._logprob_options(body, ids, params), rid)

    def _sampling_params(self, sp) -> SamplingParams:
        if not isinstance(sp, dict):
            raise BadRequest(f"sampling_params must be a JSON object, got {type(sp).__name__}")
        for key, value in sp.items():
            if key not in SAMPLING_PARAMS | set(NEUTRAL_PARAMS) | TEXT_ONLY_PARAMS:
                raise BadRequest(f"sampling_params.{key} is not supported by opd-sao serve")
            if key in NEUTRAL_PARAMS and value not in NEUTRAL_PARAMS[key]:
                raise BadRequest(f"sampling_params.{key}={value!r} is not supported by opd-sao serve")
            if key == "stop_token_ids" and (not isinstance(value, (list, type(None)))
                                            or not all(t in self.engine.stop_ids for t in value or [])):
                raise BadRequest("stop_token_ids other than the model's eos ids are not supported by opd-sao serve")
        temperature = _number("sampling_params.temperature", sp.get("temperature", 1.0), MIN_TEMPERATURE, math.inf)
        top_p = _number("sampling_params.top_p", sp.get("top_p", 1.0), 0.0, 1.0, low_open=True)
        max_new_tokens = _integer("sampling_params.max_new_tokens",
                                  sp.get("max_new_tokens", min(128, self.max_new_tokens)), 0)
        if max_new_tokens > self.max_new_tokens:
            raise BadRequest(f"sampling_params.max_new_tokens {max_new_tokens} is over this server's cap "
                             f"(--max-new-tokens {self.max_new_tokens})")
        return SamplingParams(temperature, top_p, max_new_tokens,
                              _flag("sampling_params.ignore_eos", sp.get("ignore_eos", False)))

    def _check_length(self, ids: list[int], max_new_tokens: int) -> None:
        """The prompt and every token to generate must fit the model's positions."""
        if self.max_positions is None:
            return
        if len(ids) > self.max_positions:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the model has {self.max_positions} positions")
        if len(ids) + max_new_tokens > self.max_positions:
            raise BadRequest(f"the prompt ({len(ids)} tokens) + sampling_params.max_new_tokens ({max_new_tokens}) "
                             f"exceed the model's {self.max_positions} positions")

    def _logprob_options(self, body: dict, ids: list[int], params: SamplingParams) -> tuple[bool, int, int]:
        """(return_logprob, logprob_start_len, top_logprobs_num), checked against the prompt."""
        return_logprob = _flag("return_logprob", body.get("return_logprob", False))
        start = _integer("logprob_start_len", body.get("logprob_start_len", -1), -1, len(ids) - 1)
        top_k = _integer("top_logprobs_num", body.get("top_logprobs_num", 0), 0, self.vocab_size)
        if top_k and params.max_new_tokens:
            raise BadRequest("top_logprobs_num for generated tokens is not supported by opd-sao serve "
                             "(prompt scoring with max_new_tokens 0 is)")
        return return_logprob, start, top_k

    def _add_token_texts(self, meta: dict) -> None:
        """return_text_in_logprobs: each [logprob, token_id, null] entry gets the token's text."""
        for key in ("output_token_logprobs", "input_token_logprobs"):
            for entry in meta.get(key) or []:
                entry[2] = self.tokenizer.decode([entry[1]])
        for top in meta.get("input_top_logprobs") or []:
            for entry in top or []:
                entry[2] = self.tokenizer.decode([entry[1]])

    def _sample(self, request: GenerationRequest, client_gone) -> GenerationResult:
        """Queue the request and wait for it; cancel it if the client hangs up meanwhile."""
        self._queue.put(request)
        waiter: _Waiter = request.tag
        while not waiter.event.wait(CLIENT_POLL_S):
            if self._crash is not None:
                raise RuntimeError(f"the decode loop crashed: {self._crash!r}")
            if client_gone():
                request.cancelled = True
                raise ClientGone()
        if waiter.error is not None:
            raise RuntimeError(f"this request failed in the engine: {type(waiter.error).__name__}: {waiter.error}")
        return waiter.result

    @torch.no_grad()
    def _prompt_logprobs(self, ids: list[int], start: int, top_k: int) -> dict:
        """SGLang's input logprobs (temperature 1): entry i is token start+i given the tokens before it."""
        x = torch.tensor([ids], device=self.engine.device)
        logp = torch.log_softmax(forward_logits(self.engine.model, x, torch.ones_like(x))[0].float(), dim=-1)
        out = {"input_token_logprobs": [[None if t == 0 else float(logp[t - 1, ids[t]]), ids[t], None]
                                        for t in range(start, len(ids))]}
        if top_k:
            tops = []
            for t in range(start, len(ids)):
                if t == 0:
                    tops.append(None)
                    continue
                values, indices = logp[t - 1].topk(min(top_k, logp.shape[-1]))
                tops.append([[float(v), int(i), None] for v, i in zip(values, indices)])
            out["input_top_logprobs"] = tops
        return out


def _check_generate_fields(body: dict, served_model: str) -> None:
    """Every /generate field is implemented, bookkeeping, or at SGLang's default: none is silently ignored."""
    for key, value in body.items():
        if key in GENERATE_FIELDS or key in BOOKKEEPING_FIELDS:
            continue
        if key == "model":
            if value not in (None, served_model):
                raise BadRequest(f"model {value!r}: this server serves {served_model!r}")
        elif key not in DEFAULT_ONLY_FIELDS:
            raise BadRequest(f"{key} is not supported by opd-sao serve")
        elif value not in DEFAULT_ONLY_FIELDS[key]:
            raise BadRequest(f"{key}={value!r} is not supported by opd-sao serve")


def _per_prompt(name: str, value, n: int) -> list:
    """A batch's field: one value for every prompt, or a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise BadRequest(f"{name} has {len(value)} entries for {n} prompts")
    return value


def _check_update_fields(body: dict) -> None:
    if body.get("abort_all_requests"):
        raise BadRequest("abort_all_requests is not supported by opd-sao serve (updates wait for requests)")


def _routes(app: RolloutServer) -> dict:
    """(method, path) -> handler(body) for every endpoint but /generate (which watches its client)."""
    return {("GET", "/get_model_info"): lambda _: app.model_info(),
            ("GET", "/model_info"): lambda _: app.model_info(),
            ("GET", "/get_server_info"): lambda _: app.server_info(),
            ("GET", "/server_info"): lambda _: app.server_info(),
            ("GET", "/get_load"): lambda _: app.load(),
            ("POST", "/begin_weight_update"): app.begin_weight_update,
            ("POST", "/end_weight_update"): app.end_weight_update,
            **{("POST", path): _weight_route(app, mode, handler) for mode in app.weight_syncs.values()
               for path, handler in mode.routes.items()}}


def _weight_route(app: RolloutServer, mode, handler: str):
    """A weight-sync mode's server-side handler, bound to this server as its WeightTarget."""
    def route(body: dict) -> dict:
        _check_update_fields(body)
        return getattr(mode, handler)(body, app)

    return route


def _handler(app: RolloutServer, max_body_bytes: int = MAX_BODY_BYTES):
    routes = _routes(app)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client slot reuses its connection
        timeout = IDLE_TIMEOUT_S  # a slow or silent client cannot hold a thread forever

        def log_message(self, *args) -> None:  # one line per request would drown the logs
            pass

        def _send(self, status: int, body) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _read_body(self) -> bytes:
            """The body, framed by a plain Content-Length (no chunked encoding), at most max_body_bytes."""
            if self.headers.get("Transfer-Encoding"):
                raise HTTPError(411, "send the body with a Content-Length (chunked transfer is not supported)")
            length = self.headers.get("Content-Length")
            if length is None:
                return b""
            if not (length.isascii() and length.isdigit()):
                raise HTTPError(400, f"Content-Length must be a non-negative integer, got {length!r}")
            if int(length) > max_body_bytes:
                raise HTTPError(413, f"the body ({length} bytes) is over this server's limit "
                                     f"(--max-body-mb {max_body_bytes >> 20})")
            raw = self.rfile.read(int(length))
            if len(raw) < int(length):
                raise ClientGone()
            return raw

        @staticmethod
        def _json_object(raw: bytes) -> dict:
            try:
                body = json.loads(raw) if raw else {}
            except (ValueError, RecursionError) as err:
                raise BadRequest(f"the body is not JSON: {err}") from None
            if not isinstance(body, dict):
                raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
            return body

        def _client_gone(self) -> bool:
            """The client closed its connection (readable, with nothing to read) or reset it."""
            poller = select.poll()
            poller.register(self.connection, select.POLLIN)
            try:
                return bool(poller.poll(0)) and not self.connection.recv(1, socket.MSG_PEEK)
            except OSError:
                return True

        def _route(self, method: str) -> None:
            try:
                status, body = self._answer(method, urlsplit(self.path).path)
            except ClientGone:
                self.close_connection = True
                return
            try:
                self._send(status, body)
            except OSError:  # the client went away while we answered
                self.close_connection = True

        def _answer(self, method: str, path: str) -> tuple[int, object]:
            try:
                body = self._json_object(self._read_body())
                if path in ("/health", "/health_generate"):
                    return 503 if app.crashed else 200, None
                if path == "/flush_cache":  # the embedded engine keeps no prefix cache
                    return 200, None
                if path == "/generate" and method == "POST":
                    return 200, app.generate(body, self._client_gone)
                if (method, path) in routes:
                    return 200, routes[method, path](body)
                return 404, {"error": {"message": f"no endpoint {method} {path}"}}
            except HTTPError as err:
                self.close_connection = True  # the stream's framing is lost: nothing more can be read from it
                return err.status, {"error": {"message": str(err)}}
            except (BadRequest, WeightSyncRefused) as err:
                failed = path in WEIGHT_PATHS
                return 400, {"success": False, "message": str(err)} if failed else {"error": {"message": str(err)}}
            except ClientGone:
                raise
            except Exception as err:  # noqa: BLE001 (a server answers, it does not die)
                return 500, {"error": {"message": f"{type(err).__name__}: {err}"}}

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG  # a burst of connections waits for accept instead of being reset
    daemon_threads = True


def serve(args) -> int:
    if not (Path(args.checkpoint) / "config.json").is_file():
        raise ValueError(f"checkpoint {args.checkpoint!r} is not an HF model directory (no config.json)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_new_tokens < 1 or args.max_body_mb < 1:
        raise ValueError("--max-new-tokens and --max-body-mb must be at least 1")
    app = RolloutServer(args.checkpoint, max_batch=args.max_batch, seed=args.seed, dtype=args.dtype,
                        weight_version=args.weight_version, max_new_tokens=args.max_new_tokens, device=args.device,
                        group_timeout_s=args.group_timeout_s)
    httpd = _HTTPServer((args.host, args.port), _handler(app, args.max_body_mb << 20))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"opd-sao serve: {args.checkpoint} on http://{args.host}:{httpd.server_port} "
          f"(weight_version {app.weight_version})", flush=True)
    try:
        httpd.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        httpd.server_close()
    return 0
