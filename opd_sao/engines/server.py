"""`opd-sao serve CHECKPOINT --port PORT`: the embedded engine behind SGLang's native HTTP API (and its
OpenAI-compatible routes), on the stack SGLang itself uses: FastAPI + uvicorn, pydantic request models.

Concurrent `/generate` requests join one EmbeddedEngine continuous batch: a decode thread runs the
engine, request threads only queue requests and wait. Weight updates (from disk, from tensors in the request,
or broadcast over a weight update group) keep SGLang 0.5.23's semantics: tensor and distributed updates only
inside a `/begin_weight_update` ... `/end_weight_update` session; the swap waits until the requests in flight
have finished (new ones wait meanwhile), so every response was sampled entirely by the `weight_version` it
reports. Logprobs as SGLang reports them: `output_token_logprobs` under softmax(logits / T) over the whole
vocabulary (`return_sampling_mask` adds the top-p/top-k renormalised `output_token_sampling_logprobs`),
`input_token_logprobs[0]` None. Serves the subset of the API that opd-sao, sglang-router, SGLang's
RuntimeEndpoint and OpenAI clients use (see docs/scale_out.md) and rejects, with a 400, what it does not
implement.

No request can harm another (docs/reliability.md): every field is checked (type, finite, in range, prompt
plus max_new_tokens within the model's positions, max_new_tokens under the server's cap) before it reaches
the engine; a request that still fails in the batch gets the error alone (and /health turns 503 until a
generation succeeds again); a request whose client hung up leaves the batch; oversized or chunked bodies get
a 4xx. Weight routes need the admin key (SGLang's `--admin-api-key`, else `--api-key`); a server started
without either takes them from loopback clients only, and loads checkpoints only under `--weights-root`.
"""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import logging
import re
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, NamedTuple, Optional, Union

import anyio
import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from opd_sao.checkpoints import load_causal_lm, load_tokenizer
from opd_sao.devices import resolve_device
from opd_sao.engines.base import GenerationRequest, GenerationResult, RequestFeed, SamplingParams
from opd_sao.engines.embedded import EmbeddedEngine
from opd_sao.engines.weight_sync import WEIGHT_SYNCS, SyncSettings, WeightSyncRefused
from opd_sao.errors import UsageError
from opd_sao.io.files import inside
from opd_sao.model.modeling import forward_logits

log = logging.getLogger("opd_sao.engines.server")

# sampling_params keys accepted only at these (SGLang default) values: unimplemented options
NEUTRAL_PARAMS = {"min_p": (0, 0.0, None), "n": (1, None), "frequency_penalty": (0, 0.0, None),
                  "presence_penalty": (0, 0.0, None), "repetition_penalty": (1, 1.0, None),
                  "min_new_tokens": (0, None), "regex": (None,), "json_schema": (None,), "ebnf": (None,),
                  "structural_tag": (None,), "stop_regex": (None, [], "")}
# SGLang's ADMIN_OPTIONAL routes among serve's: the weight-sync modes', the session's, pause/continue/abort,
# /flush_cache
ADMIN_PATHS = {"/begin_weight_update", "/end_weight_update", "/flush_cache", "/pause_generation",
               "/continue_generation", "/abort_request"} | {
    path for name in WEIGHT_SYNCS.names() for path in WEIGHT_SYNCS.get(name).routes}
SAMPLING_EPS = 1e-6  # SGLang's: a temperature below it is greedy (temperature 1, top_k 1)
MAX_NEW_TOKENS = 8192  # the default of `--max-new-tokens`
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default sampling_params.max_new_tokens
OPENAI_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# the default of `--max-body-mb`: a 1M-token prompt as JSON is about 8 MB; /update_weights_from_tensor
# carries a bucket as base64 (4/3 of its bytes), so 512 MiB takes the largest default bucket (256 MiB: 342 MiB
# of base64) and any tensor up to about 380 MiB (a larger one travels alone: raise --max-body-mb)
MAX_BODY_BYTES = 512 << 20
MAX_PATH_CHARS = 4096  # PATH_MAX: a longer model_path is a 400, never an OSError
GROUP_TIMEOUT_S = 60.0  # the default of `--group-timeout-s`
MAX_NAME_CHARS = 256  # rid
LISTEN_BACKLOG = 1024  # connections the kernel queues before accept (a burst waits instead of being reset)
IDLE_TIMEOUT_S = 300  # an idle keep-alive connection is closed after this long
CLIENT_POLL_S = 0.1  # how often a waiting request checks that its client is still connected
REQUEST_THREADS = 1024  # requests waiting at once (each waits in a thread while the engine decodes)


class BadRequest(ValueError):
    """A request this server cannot honour; answered with HTTP 400 and the message."""


class ClientGone(Exception):
    """The client closed its connection while its request waited: the request was cancelled."""


# --- request models (SGLang's io_struct names; every field typed, unknown fields refused) ------------------

class _Strict(BaseModel):
    """Exact JSON types (no "1" for 1, no 1 for true), finite numbers, no unknown field."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SamplingParamsInput(_Strict):
    """SGLang's sampling_params: the implemented keys, and the others (NEUTRAL_PARAMS) at their defaults only."""

    temperature: Optional[float] = Field(None, ge=0)  # below SAMPLING_EPS: greedy
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = None  # -1 (all) or >= 1
    max_new_tokens: Optional[int] = Field(None, ge=0)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    sampling_seed: Optional[int] = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1)  # the draws depend on it alone
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    min_p: Any = None
    n: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    min_new_tokens: Any = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    stop_regex: Any = None

    @model_validator(mode="after")
    def _defaults_only(self):
        for key, allowed in NEUTRAL_PARAMS.items():
            value = getattr(self, key)
            if value not in allowed or isinstance(value, bool):
                raise ValueError(f"{key}={value!r} is not supported by opd-sao serve")
        if self.top_k is not None and self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        return self


class GenerateReqInput(_Strict):
    """SGLang's /generate body: one prompt or a batch (prompts as `text` or `input_ids`; a batch's
    sampling_params and rid may be one for all or a list of one per prompt; checked per prompt). A top-level
    key it does not know is ignored, as SGLang's FastAPI app ignores it (sampling_params keys stay checked)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    rid: Any = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0)
    return_text_in_logprobs: bool = False
    return_sampling_mask: bool = False  # adds output_token_sampling_logprobs (the sampled support's)
    sampling_logprobs_mode: Optional[Literal["selected"]] = None  # "support" is not implemented
    model: Optional[str] = None
    log_metrics: Any = None  # bookkeeping that changes nothing (what sglang-router adds to every request)
    no_logs: Any = None
    custom_labels: Any = None
    # SGLang options accepted at their defaults only
    stream: Literal[False] = False
    return_hidden_states: Literal[False] = False
    return_bytes: Literal[False] = False
    return_entropy: Literal[False] = False
    return_routed_experts: Literal[False] = False
    background: Literal[False] = False
    input_embeds: None = None
    image_data: None = None
    video_data: None = None
    audio_data: None = None
    modalities: None = None
    lora_path: None = None
    lora_id: None = None
    session_params: None = None
    custom_logit_processor: None = None
    token_ids_logprob: None = None
    data_parallel_rank: None = None
    bootstrap_host: None = None
    bootstrap_port: None = None
    bootstrap_room: None = None


class PauseGenerationReqInput(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"
    rid: Any = None  # SGLang's BaseReq fields, unused here
    http_worker_ipc: Any = None


class ContinueGenerationReqInput(_Strict):
    torch_empty_cache: bool = True  # CUDA's allocator cache; nothing to do here
    rid: Any = None
    http_worker_ipc: Any = None


class AbortReqInput(_Strict):
    rid: str = ""
    abort_all: bool = False
    finished_reason: Any = None  # SGLang's other AbortReq fields, unused here
    abort_message: Optional[str] = None
    weight_versions: Any = None
    http_worker_ipc: Any = None


class BeginWeightUpdateReqInput(_Strict):
    selector: Literal["target", "all"] = "all"
    rid: Any = None


class EndWeightUpdateReqInput(_Strict):
    rid: Any = None


class _OpenAIReq(BaseModel):
    """The OpenAI fields serve implements; the others at their defaults only (unknown ones, e.g. `user`,
    are ignored as OpenAI's servers do)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=0)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = None  # SGLang's extension
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None  # SGLang's extension
    ignore_eos: bool = False  # SGLang's extension
    skip_special_tokens: bool = True  # SGLang's extension
    n: Literal[1] = 1
    stream: Literal[False] = False
    logprobs: Optional[Literal[False]] = None
    echo: Literal[False] = False
    frequency_penalty: Literal[0] = 0
    presence_penalty: Literal[0] = 0


class CompletionRequest(_OpenAIReq):
    prompt: Union[str, list[int]]
    max_tokens: Optional[int] = Field(OPENAI_MAX_TOKENS, ge=0)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: Optional[str] = None


class ChatCompletionRequest(_OpenAIReq):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    top_logprobs: Optional[Literal[0]] = None


def validated(model: type[BaseModel], body: dict, prefix: str = "") -> Any:
    """`body` as `model`, or BadRequest naming the first bad field (dotted, under `prefix`)."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(part) for part in (prefix, *first["loc"]) if part != "")
        message = first["msg"].removeprefix("Value error, ")
        value = first.get("input")
        shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
        raise BadRequest(f"{loc or 'the body'}: {message} (got {shown[:80]})") from None


class _Prompt(NamedTuple):
    """One prompt of a /generate request with its options, every one checked."""

    ids: list[int]
    params: SamplingParams
    return_logprob: bool
    start: int
    top_k: int
    sampling_mask: bool
    text: "_TextOptions"
    rid: object


class _TextOptions(NamedTuple):
    """How the output ids become text: special tokens, stop strings (trimmed unless no_stop_trim)."""

    skip_special_tokens: bool
    stop: tuple[str, ...]
    no_stop_trim: bool


class _Waiter:
    def __init__(self, rid: str):
        self.rid = rid
        self.event = threading.Event()
        self.result: Optional[GenerationResult] = None
        self.error: Optional[Exception] = None
        self.request: Optional[GenerationRequest] = None  # once queued for the engine
        self.aborted = False  # by /abort_request or /pause_generation: answered with finish_reason abort
        self.partial: Optional[GenerationResult] = None  # an aborted request's tokens so far (the engine's)


class _Abort(Exception):
    """The request was aborted before it finished (answered 200 with finish_reason abort and the tokens it had
    generated, as SGLang); `partial` is None if it never reached the engine."""

    def __init__(self, partial: Optional[GenerationResult] = None):
        super().__init__()
        self.partial = partial


def _integer_version(version: str) -> Optional[int]:
    """The policy version a weight_version names ("12"), None for any other text (ASCII digits only: "²"
    is a digit to str.isdigit but not to int)."""
    return int(version) if re.fullmatch(r"[0-9]{1,18}", version) else None


def _under(path: Path, roots: list[Path]) -> bool:
    """Whether `path`, every symlink resolved, lies under one of `roots` (`io.files.inside`)."""
    for root in roots:
        try:
            inside(root, path)
            return True
        except UsageError:
            pass
    return False


class RolloutServer:
    """The API's behaviour, independent of HTTP: every endpoint takes the request's JSON object and returns
    the answer's, or raises BadRequest."""

    def __init__(self, checkpoint: str | Path, *, max_batch: int = 32, seed: int = 0, dtype: str = "float32",
                 weight_version: str = "default", max_new_tokens: int = MAX_NEW_TOKENS,
                 device: Optional[str] = None, weights_roots: Optional[list[str | Path]] = None,
                 group_timeout_s: float = GROUP_TIMEOUT_S):
        self.checkpoint, self.dtype = str(checkpoint), dtype
        self.tokenizer = load_tokenizer(checkpoint)
        self.engine = EmbeddedEngine(load_causal_lm(checkpoint, dtype, resolve_device(device)),
                                     eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id,
                                     max_batch=max_batch, seed=seed)
        self.vocab_size = self.engine.model.get_input_embeddings().num_embeddings
        self.max_positions: Optional[int] = getattr(self.engine.model.config, "max_position_embeddings", None)
        self.max_new_tokens = max_new_tokens
        self.weight_version = weight_version
        roots = weights_roots or [Path(checkpoint).resolve().parent, tempfile.gettempdir()]
        self.weights_roots = [Path(root).resolve() for root in roots]
        self._feed = RequestFeed()  # never closed: the decode loop lives as long as the server
        self._cond = threading.Condition()
        self._inflight = 0
        self._tokens_inflight = 0  # prompt + max_new_tokens of the requests in flight (/get_load)
        self._running: dict[int, _Waiter] = {}  # the requests in flight (/abort_request)
        self._paused = False  # /pause_generation ... /continue_generation: new requests wait
        self._session = False  # a /begin_weight_update ... /end_weight_update session is open
        settings = SyncSettings(group_timeout_s=group_timeout_s)  # each mode's server side keeps its state
        self.weight_syncs = {name: WEIGHT_SYNCS.get(name)(settings) for name in WEIGHT_SYNCS.names()}
        self._updating = False
        self._update_lock = threading.Lock()
        self._crash: Optional[BaseException] = None
        self._failing: Optional[str] = None  # the engine's last error, until a generation succeeds again
        threading.Thread(target=self._decode_loop, daemon=True, name="decode").start()

    def _decode_loop(self) -> None:
        def done(result: GenerationResult) -> None:
            waiter: _Waiter = result.request.tag
            waiter.result = result
            waiter.event.set()

        def failed(request: GenerationRequest, err: Exception) -> None:  # this request alone
            request.tag.error = err
            request.tag.event.set()

        def cancelled(partial: GenerationResult) -> None:  # it left the batch: what it had generated
            partial.request.tag.partial = partial
            partial.request.tag.event.set()

        try:
            self.engine.generate(self._feed, done, on_error=failed, on_cancel=cancelled)
        except BaseException as err:  # a bug outside any one request: answered as HTTP 500, /health 503
            self._crash = err

    @contextmanager
    def _admitted(self, waiter: _Waiter, tokens: int = 0):
        """A request in flight: a weight update waits for it, and it waits for a pending update or a pause."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating and not self._paused)
            self._inflight += 1
            self._tokens_inflight += tokens
            self._running[id(waiter)] = waiter
        try:
            yield self.weight_version
        finally:
            with self._cond:
                self._inflight -= 1
                self._tokens_inflight -= tokens
                del self._running[id(waiter)]
                self._cond.notify_all()

    @property
    def healthy(self) -> bool:
        """False once the decode loop died, and while generation fails (e.g. after non-finite weights)."""
        return not self.crashed and not self.failing

    @property
    def crashed(self) -> bool:
        return self._crash is not None

    @property
    def failing(self) -> bool:
        return self._failing is not None

    # --- endpoints -------------------------------------------------------------------------------------

    def model_info(self, _body: Optional[dict] = None) -> dict:
        return {"model_path": self.checkpoint, "tokenizer_path": self.checkpoint, "served_model_name": self.checkpoint,
                "is_generation": True, "weight_version": self.weight_version,
                "model_type": getattr(self.engine.model.config, "model_type", None),
                "architectures": getattr(self.engine.model.config, "architectures", None)}

    def server_info(self, _body: Optional[dict] = None) -> dict:
        """SGLang's /get_server_info, the part sglang-router and clients read: model, limits, version."""
        return {**self.model_info(), "dtype": self.dtype,
                "max_running_requests": self.engine.max_batch, "tp_size": 1, "dp_size": 1,
                "skip_tokenizer_init": False, "version": "opd-sao serve",
                "tokens_generated": self.engine.tokens_generated}  # ours: what a balance benchmark counts

    def load(self, _body: Optional[dict] = None) -> list[dict]:
        """SGLang's /get_load (one data-parallel rank): sglang-router's power_of_two policy reads num_tokens."""
        with self._cond:
            return [{"dp_rank": 0, "num_reqs": self._inflight, "num_waiting_reqs": 0,
                     "num_tokens": self._tokens_inflight}]

    def loads(self, _body: Optional[dict] = None) -> dict:
        """SGLang's /v1/loads (JSON, the core section of its one data-parallel rank)."""
        with self._cond:
            running, tokens = self._inflight, self._tokens_inflight
        return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": "opd-sao serve",
                "accelerator": None, "num_accelerators": 1,
                "loads": [{"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0,
                           "num_used_tokens": tokens, "max_running_requests": self.engine.max_batch}]}

    def pause_generation(self, body: dict) -> dict:
        """SGLang's /pause_generation: new requests wait until /continue_generation. Mode abort (SGLang's
        default) answers the running ones with finish_reason abort and returns once none runs; weight updates
        then load at once. Modes retract and in_place (the running requests resume after the pause, on the new
        weights) are not implemented: 400."""
        mode = validated(PauseGenerationReqInput, body).mode
        if mode != "abort":
            raise BadRequest(f"pause mode {mode!r} is not implemented by opd-sao serve: use 'abort' (the requests "
                             "running are answered with finish_reason abort, to be sent again)")
        with self._cond:
            self._paused = True
            self._abort(lambda waiter: True)
            self._cond.wait_for(lambda: self._inflight == 0)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict) -> dict:
        validated(ContinueGenerationReqInput, body)
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def flush_cache(self, timeout_s: float = 0.0) -> bool:
        """SGLang's /flush_cache rule (its scheduler's `flush_cache`, `SchedulerFlushWrapper`): refused while a
        request runs (one held by a pause or an update is not running yet), after waiting up to `timeout_s` for none
        to; the embedded engine keeps no cache, so there is nothing else to do."""
        with self._cond:
            return self._cond.wait_for(lambda: self._inflight == 0, timeout=timeout_s)

    def abort_request(self, body: dict) -> None:
        """SGLang's /abort_request: the running requests whose rid starts with `rid` (all with `abort_all`)
        answer with finish_reason abort; an empty rid without abort_all, or one not running, does nothing."""
        req = validated(AbortReqInput, body)
        with self._cond:
            if req.abort_all or req.rid:
                self._abort(lambda waiter: req.abort_all or waiter.rid.startswith(req.rid))

    def _abort(self, which) -> None:
        """(Holding _cond.) Abort the running requests `which(waiter)` picks: each leaves the batch at the
        engine's next step, and its caller answers with the tokens it had (SGLang's scheduler, too, finishes an
        aborted running request at its next step and answers with its output so far); one not handed to the
        engine yet answers at once."""
        for waiter in self._running.values():
            if which(waiter) and waiter.result is None:
                waiter.aborted = True
                if waiter.request is not None:
                    waiter.request.cancelled = True
                else:
                    waiter.event.set()

    def generate(self, body: dict, client_gone=lambda: False) -> dict | list[dict]:
        """One prompt, or a batch (a list of `text`s or of `input_ids` lists) answered with a list as SGLang
        does: every prompt of a batch is checked before any of it runs, then they join the continuous batch
        together. `client_gone()` says the client hung up: the request is then cancelled (ClientGone)."""
        req = validated(GenerateReqInput, body)
        if req.model not in (None, self.checkpoint):
            raise BadRequest(f"model {req.model!r}: this server serves {self.checkpoint!r}")
        prompts, batched = self._input_ids(req)
        if not batched:
            return self._generate_one(self._prompt(req, prompts[0], req.sampling_params, req.rid),
                                      req.return_text_in_logprobs, client_gone)
        params, rids = (_per_prompt(name, getattr(req, name), len(prompts)) for name in ("sampling_params", "rid"))
        batch = [self._prompt(req, ids, sp, rid) for ids, sp, rid in zip(prompts, params, rids)]
        with ThreadPoolExecutor(min(len(batch), self.engine.max_batch), thread_name_prefix="batch") as pool:
            return list(pool.map(lambda p: self._generate_one(p, req.return_text_in_logprobs, client_gone), batch))

    def health_generate(self) -> None:
        """SGLang's /health_generate: one greedy token from a one-token prompt (BOS: a real prompt's first
        token, where SGLang sends id 0, often padding); raises if generation fails."""
        if self._paused:  # SGLang's skips the generation while the server has requests; a paused one waits
            return
        first = next((t for t in (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id) if t is not None), 0)
        prompt = self._prompt(GenerateReqInput(), [first], {"max_new_tokens": 1, "temperature": 0.0}, None)
        self._generate_one(prompt, False, lambda: False)

    def _generate_one(self, prompt: _Prompt, text_in_logprobs: bool, client_gone) -> dict:
        t0 = time.perf_counter()
        ids, params = prompt.ids, prompt.params
        waiter = _Waiter(str(prompt.rid or uuid.uuid4().hex))
        with self._admitted(waiter, len(ids) + params.max_new_tokens) as version:
            meta = {"id": waiter.rid, "prompt_tokens": len(ids), "cached_tokens": 0, "weight_version": version}
            if prompt.return_logprob:
                meta.update(self._prompt_logprobs(ids, prompt.start, prompt.top_k))
            output, result, aborted = [], None, None
            try:
                if params.max_new_tokens:
                    stop_check = _stop_check(self.tokenizer, prompt.text) if prompt.text.stop else None
                    result = self._sample(GenerationRequest(ids, params, tag=waiter, stop_check=stop_check),
                                          client_gone)
                    output = result.token_ids
            except _Abort as abort:  # SGLang's answer: 200, finish_reason abort, the output so far (a client may
                # keep it and continue from prompt + output: partial rollouts)
                aborted, result = abort, abort.partial
                output = result.token_ids if result is not None else []
            if prompt.return_logprob and prompt.top_k and not aborted:
                meta["output_top_logprobs"] = self._output_top_logprobs(ids, output, params.temperature, prompt.top_k)
        if aborted:
            text = self.tokenizer.decode(output, skip_special_tokens=prompt.text.skip_special_tokens)
            finish = {"type": "abort", "message": None if result is not None else "Abort in waiting queue"}
        else:
            text, finish = self._finish(output, result, prompt)
        meta.update(finish_reason=finish, completion_tokens=len(output), e2e_latency=time.perf_counter() - t0)
        if prompt.return_logprob:
            vocab = result.vocab_logprobs if result else []
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(vocab, output)]
            meta["output_token_logprobs_length"] = len(output)
            if text_in_logprobs:
                self._add_token_texts(meta)
        if prompt.sampling_mask:  # the sampled token's logprob under the distribution it was sampled from
            meta["output_token_sampling_logprobs"] = list(result.logprobs) if result else []
        return {"text": text, "output_ids": output, "meta_info": meta}

    def _finish(self, output: list[int], result: Optional[GenerationResult], prompt: _Prompt) -> tuple[str, dict]:
        """The response text and SGLang's finish_reason: a stop token (eos or stop_token_ids) or string matched,
        else the length; a matched stop string is cut from the text unless no_stop_trim."""
        text = self.tokenizer.decode(output, skip_special_tokens=prompt.text.skip_special_tokens)
        if result is None or result.finish_reason != "stop":
            return text, {"type": "length", "length": prompt.params.max_new_tokens}
        last, params = output[-1], prompt.params
        if not params.ignore_eos and (last in self.engine.stop_ids or last in params.stop_token_ids):
            return text, {"type": "stop", "matched": last}
        matched = min((s for s in prompt.text.stop if s in text), key=text.find, default=None)
        if matched is None or prompt.text.no_stop_trim:  # None: the tail decoded apart matched, the whole not
            return text, {"type": "stop", "matched": matched}
        return text[:text.find(matched)], {"type": "stop", "matched": matched}

    # --- weights: the weight-sync modes' server sides (opd_sao/engines/weight_sync/) load into this --------

    def expected_weights(self) -> dict:
        return {k: (tuple(v.shape), v.dtype) for k, v in self.engine.model.state_dict().items()}

    def load_checkpoint(self, path: str) -> dict[str, torch.Tensor]:
        """An HF checkpoint under --weights-root (symlinks and `..` resolved first, of the directory and of every
        file in it: a `model.safetensors` linking out is refused too), else WeightSyncRefused."""
        if len(path) > MAX_PATH_CHARS:
            raise WeightSyncRefused(f"model_path has {len(path)} characters (at most {MAX_PATH_CHARS})")
        try:
            resolved = Path(path).resolve()  # the directory actually read
            is_model = (resolved / "config.json").is_file()
        except (OSError, ValueError) as err:  # a name too long, a NUL byte
            raise WeightSyncRefused(f"model_path is not a usable path: {type(err).__name__}: {err}") from None
        if not _under(resolved, self.weights_roots):
            raise WeightSyncRefused(f"model_path {str(resolved)[:200]!r} is outside this server's --weights-root "
                                    f"({', '.join(map(str, self.weights_roots))})")
        if not is_model:
            raise WeightSyncRefused(f"model_path {path[:200]!r} is not an HF model directory")
        try:
            escaping = next((f for f in resolved.rglob("*") if not _under(f, self.weights_roots)), None)
        except (OSError, RuntimeError) as err:  # a symlink loop, an unreadable subdirectory
            raise WeightSyncRefused(f"model_path {path[:200]!r} cannot be listed: {type(err).__name__}: {err}") from None
        if escaping is not None:
            raise WeightSyncRefused(f"{str(escaping)[:200]!r} in model_path leads outside this server's --weights-root "
                                    f"(to {str(escaping.resolve())[:200]!r})")
        try:
            return load_causal_lm(resolved, self.dtype).state_dict()
        except Exception as err:  # a broken checkpoint is the request's fault
            raise WeightSyncRefused(f"{resolved} could not be loaded: {type(err).__name__}: {err}") from None

    def session_open(self) -> bool:
        return self._session

    def begin_weight_update(self, body: dict) -> dict:
        """Open SGLang 0.5.23's weight-update session: tensor and distributed updates run only inside one."""
        validated(BeginWeightUpdateReqInput, body)
        with self._update_lock:
            if self._session:
                raise WeightSyncRefused("a weight-update session is already open; call end_weight_update() first")
            self._session = True
        return {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict) -> dict:
        validated(EndWeightUpdateReqInput, body)
        with self._update_lock:
            if not self._session:
                raise WeightSyncRefused("no weight-update session is open; call begin_weight_update() first")
            self._session = False
        return {"success": True, "message": "Success"}

    def install(self, state: dict[str, torch.Tensor], weight_version: Optional[str]) -> None:
        """Swap weights in once the requests in flight have finished (new ones wait meanwhile)."""
        version = weight_version if weight_version is not None else self.weight_version
        number = _integer_version(version)
        with self._update_lock:
            with self._cond:
                self._updating = True
                self._cond.wait_for(lambda: self._inflight == 0)
            try:
                self.engine.update_weights(state, self.engine.version if number is None else number)
                self.weight_version = version
                self._failing = None  # new weights: generation is not known to fail with them
            finally:
                with self._cond:
                    self._updating = False
                    self._cond.notify_all()

    # --- OpenAI-compatible -----------------------------------------------------------------------------

    def models(self, _body: Optional[dict] = None) -> dict:
        return {"object": "list", "data": [{"id": self.checkpoint, "object": "model", "created": 0,
                                            "owned_by": "opd-sao", "root": self.checkpoint,
                                            "max_model_len": self.max_positions}]}

    def completions(self, body: dict, client_gone=lambda: False) -> dict:
        """/v1/completions: one prompt (text or token ids), one choice, no streaming."""
        req = validated(CompletionRequest, body)
        answer = self._openai_generate(req, {"text" if isinstance(req.prompt, str) else "input_ids": req.prompt},
                                       req.max_tokens, client_gone)
        return self._openai_answer(req, answer, "text_completion", {"text": answer["text"]})

    def chat_completions(self, body: dict, client_gone=lambda: False) -> dict:
        """/v1/chat/completions: the messages through the tokenizer's chat template, one choice."""
        req = validated(ChatCompletionRequest, body)
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("this model's tokenizer has no chat template: use /v1/completions")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        answer = self._openai_generate(req, {"input_ids": ids}, max_tokens, client_gone)
        return self._openai_answer(req, answer, "chat.completion",
                                   {"message": {"role": "assistant", "content": answer["text"]}})

    def _openai_generate(self, req: _OpenAIReq, prompt: dict, max_tokens: Optional[int], client_gone) -> dict:
        sampling = {k: v for k, v in {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                                       "stop": req.stop, "stop_token_ids": req.stop_token_ids,
                                       "max_new_tokens": max_tokens}.items() if v is not None}
        sampling.update(ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens)
        return self.generate({**prompt, "sampling_params": sampling}, client_gone)

    def _openai_answer(self, req: _OpenAIReq, answer: dict, kind: str, choice: dict) -> dict:
        meta = answer["meta_info"]
        finish = meta["finish_reason"]
        return {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{meta['id']}", "object": kind,
                "created": int(time.time()), "model": req.model or self.checkpoint,
                "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish["type"],
                             "matched_stop": finish.get("matched")}],
                "usage": {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
                          "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]}}

    # --- helpers ---------------------------------------------------------------------------------------

    def _input_ids(self, req: GenerateReqInput) -> tuple[list[list[int]], bool]:
        """Each prompt's token ids, and whether the request is a batch: `input_ids` (a list of ids, or a list
        of such lists) or `text` (a string or a list of strings, tokenized with the tokenizer's defaults, as
        SGLang does)."""
        text, ids = req.text, req.input_ids
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

    def _prompt(self, req: GenerateReqInput, ids: list[int], sampling, rid) -> _Prompt:
        """One prompt with its sampling_params and logprob options, checked against the model and the caps."""
        if sampling is not None and not isinstance(sampling, dict):
            raise BadRequest(f"sampling_params must be a JSON object, got {type(sampling).__name__}")
        sp = validated(SamplingParamsInput, sampling or {}, "sampling_params")
        params = self._sampling_params(sp)
        self._check_length(ids, params.max_new_tokens)
        if rid is not None and not (isinstance(rid, str) and len(rid) <= MAX_NAME_CHARS):
            raise BadRequest(f"rid must be a string of at most {MAX_NAME_CHARS} characters")
        stop = (sp.stop,) if isinstance(sp.stop, str) else tuple(sp.stop or ())
        if not all(stop):
            raise BadRequest("sampling_params.stop strings must not be empty")
        return _Prompt(ids, params, *self._logprob_options(req, ids, params), req.return_sampling_mask,
                       _TextOptions(sp.skip_special_tokens, stop, sp.no_stop_trim), rid)

    def _sampling_params(self, sp: SamplingParamsInput) -> SamplingParams:
        temperature = 1.0 if sp.temperature is None else sp.temperature
        top_k = -1 if sp.top_k is None else sp.top_k
        if temperature < SAMPLING_EPS:  # greedy, as SGLang: temperature 1, the most likely token only
            temperature, top_k = 1.0, 1
        max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, self.max_new_tokens) if sp.max_new_tokens is None \
            else sp.max_new_tokens
        if max_new_tokens > self.max_new_tokens:
            raise BadRequest(f"sampling_params.max_new_tokens {max_new_tokens} is over this server's cap "
                             f"(--max-new-tokens {self.max_new_tokens})")
        stop_ids = tuple(sp.stop_token_ids or ())
        if any(not 0 <= t < self.vocab_size for t in stop_ids):
            raise BadRequest(f"sampling_params.stop_token_ids must be in [0, {self.vocab_size})")
        return SamplingParams(temperature, 1.0 if sp.top_p is None else sp.top_p, max_new_tokens, sp.ignore_eos,
                              top_k, stop_ids, sp.sampling_seed)

    def _check_length(self, ids: list[int], max_new_tokens: int) -> None:
        """The prompt and every token to generate must fit the model's positions."""
        if self.max_positions is None:
            return
        if len(ids) > self.max_positions:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the model has {self.max_positions} positions")
        if len(ids) + max_new_tokens > self.max_positions:
            raise BadRequest(f"the prompt ({len(ids)} tokens) + sampling_params.max_new_tokens ({max_new_tokens}) "
                             f"exceed the model's {self.max_positions} positions")

    def _logprob_options(self, req: GenerateReqInput, ids: list[int], params: SamplingParams) -> tuple[bool, int, int]:
        """(return_logprob, logprob_start_len, top_logprobs_num), checked against the prompt. As in SGLang,
        logprob_start_len -1 means no prompt positions (len(ids)), and len(ids) is allowed (none either)."""
        if not -1 <= req.logprob_start_len <= len(ids):
            raise BadRequest(f"logprob_start_len must be in [-1, {len(ids)}] (the prompt's length), "
                             f"got {req.logprob_start_len}")
        if req.top_logprobs_num > self.vocab_size:
            raise BadRequest(f"top_logprobs_num must be at most the vocabulary ({self.vocab_size})")
        start = len(ids) if req.logprob_start_len == -1 else req.logprob_start_len
        return req.return_logprob, start, req.top_logprobs_num

    def _add_token_texts(self, meta: dict) -> None:
        """return_text_in_logprobs: each [logprob, token_id, null] entry gets the token's text."""
        for key in ("output_token_logprobs", "input_token_logprobs"):
            for entry in meta.get(key) or []:
                entry[2] = self.tokenizer.decode([entry[1]])
        for top in (meta.get("input_top_logprobs") or []) + (meta.get("output_top_logprobs") or []):
            for entry in top or []:
                entry[2] = self.tokenizer.decode([entry[1]])

    def _sample(self, request: GenerationRequest, client_gone) -> GenerationResult:
        """Queue the request and wait for it; cancel it if the client hangs up meanwhile (ClientGone) or it is
        aborted (_Abort)."""
        waiter: _Waiter = request.tag
        with self._cond:
            if waiter.aborted:
                raise _Abort()
            waiter.request = request
        self._feed.put(request)
        while not waiter.event.wait(CLIENT_POLL_S):
            if self._crash is not None:
                raise RuntimeError(f"the decode loop crashed: {self._crash!r}")
            if client_gone():
                request.cancelled = True
                raise ClientGone()
        if waiter.result is None and waiter.aborted:
            raise _Abort(waiter.partial)
        if waiter.error is not None:
            self._failing = f"{type(waiter.error).__name__}: {waiter.error}"
            raise RuntimeError(f"this request failed in the engine: {self._failing}")
        self._failing = None
        return waiter.result

    @torch.no_grad()
    def _prompt_logprobs(self, ids: list[int], start: int, top_k: int) -> dict:
        """SGLang's input logprobs (temperature 1) from position `start`: entry j is [logprob of token start+j
        given the tokens before it, that token, text]; entry 0 is always None, whatever `start` (SGLang computes
        the logits from position `start` on, so the token at `start` itself is never predicted). Top-k the same:
        entry 0 None, entry j the k best next tokens at position start+j-1."""
        out = {"input_token_logprobs": [], **({"input_top_logprobs": []} if top_k else {})}
        if start >= len(ids):
            return out
        x = torch.tensor([ids], device=self.engine.device)
        logp = torch.log_softmax(forward_logits(self.engine.model, x, torch.ones_like(x))[0].float(), dim=-1)
        if not bool(torch.isfinite(logp[start:-1]).all()):
            self._failing = "the model's logits are not finite"
            raise RuntimeError(f"scoring failed: {self._failing}")
        self._failing = None
        out["input_token_logprobs"] = [[None if t == start else float(logp[t - 1, ids[t]]), ids[t], None]
                                       for t in range(start, len(ids))]
        if top_k:
            out["input_top_logprobs"] = [None] + _top_entries(logp[start:len(ids) - 1], top_k)
        return out

    @torch.no_grad()
    def _output_top_logprobs(self, ids: list[int], output: list[int], temperature: float, top_k: int) -> list:
        """SGLang's output_top_logprobs: per generated token, the k best of log softmax(logits / T) at its
        position, recomputed over prompt + output (the weights that sampled it: updates wait for this request)."""
        if not output:
            return []
        x = torch.tensor([ids + output], device=self.engine.device)
        logits = forward_logits(self.engine.model, x, torch.ones_like(x))[0, len(ids) - 1:-1].float()
        return _top_entries(torch.log_softmax(logits / temperature, dim=-1), top_k)


def _top_entries(logp: torch.Tensor, k: int) -> list[list[list]]:
    """Each row's k best [logprob, token id, null], SGLang's top-logprob entries."""
    values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [[[v, i, None] for v, i in zip(vs, js)] for vs, js in zip(values.tolist(), indices.tolist())]


def _stop_check(tokenizer, text: _TextOptions):
    """The engine's per-token test for stop strings: the decoded tail of the output contains one (a stop
    string of n characters ends within the last n + 8 tokens: no token is empty for long)."""
    window = max(len(s) for s in text.stop) + 8

    def stopped(token_ids: list[int]) -> bool:
        tail = tokenizer.decode(token_ids[-window:], skip_special_tokens=text.skip_special_tokens)
        return any(s in tail for s in text.stop)

    return stopped


def _per_prompt(name: str, value, n: int) -> list:
    """A batch's field: one value for every prompt, or a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise BadRequest(f"{name} has {len(value)} entries for {n} prompts")
    return value


# --- HTTP ---------------------------------------------------------------------------------------------------

def _json(status: int, body) -> Response:
    """orjson, as SGLang answers: a non-finite float is written null, never a bare NaN (invalid JSON)."""
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def is_loopback(host: Optional[str]) -> bool:
    """The TCP peer is this machine's loopback (127.0.0.0/8, ::1, or IPv4-mapped 127.x): what counts is the
    connection's address, never a header a client could write (X-Forwarded-For)."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def admin_decision(path: str, authorization: Optional[str], client_host: Optional[str], *,
                   api_key: Optional[str], admin_api_key: Optional[str]) -> Optional[int]:
    """None to let the request through, else the refusal's status. SGLang's rules (utils/auth.py): /health*
    is open; admin routes (ADMIN_OPTIONAL: weight updates, /flush_cache) take the admin key if set, else the
    API key if set; other routes take the API key if set. And opd-sao's: with neither key, admin routes are
    refused (403) to any client that is not on loopback."""
    if path.startswith("/health"):
        return None

    def bearer(expected: str) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), expected.encode())

    if path in ADMIN_PATHS:
        if admin_api_key or api_key:
            return None if bearer(admin_api_key or api_key) else 401
        return None if is_loopback(client_host) else 403
    return None if not api_key or bearer(api_key) else 401


class _Guard:
    """ASGI middleware in front of every route: bodies framed by a Content-Length within the limit (chunked:
    411, over --max-body-mb: 413, each with the connection closed), then the keys (admin_decision)."""

    def __init__(self, app, *, max_body_bytes: int, api_key: Optional[str], admin_api_key: Optional[str]):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.api_key, self.admin_api_key = api_key, admin_api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope["headers"]}
        refusal = None
        length = headers.get(b"content-length")
        if headers.get(b"transfer-encoding"):
            refusal = 411, "send the body with a Content-Length (chunked transfer is not supported)"
        elif length is not None and int(length) > self.max_body_bytes:  # h11 let only digits through
            refusal = 413, (f"the body ({int(length)} bytes) is over this server's limit "
                            f"(--max-body-mb {self.max_body_bytes >> 20})")
        else:
            authorization = headers.get(b"authorization", b"").decode("latin-1") or None
            status = admin_decision(scope["path"], authorization, (scope.get("client") or (None,))[0],
                                    api_key=self.api_key, admin_api_key=self.admin_api_key)
            if status is not None:  # SGLang's shape: {"error": "Unauthorized"} or {"error": "Forbidden"}
                refusal = status, ({"error": "Forbidden", "message": "admin routes (weight updates, /flush_cache) "
                                    "from a non-loopback client need the server to be started with --admin-api-key"}
                                   if status == 403 else {"error": "Unauthorized"})
        if refusal is None:
            return await self.app(scope, receive, send)
        body = orjson.dumps(refusal[1] if isinstance(refusal[1], dict) else {"error": {"message": refusal[1]}})
        await send({"type": "http.response.start", "status": refusal[0],
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def _body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}  # Python's parser: NaN is read, then refused by name
    except (ValueError, RecursionError) as err:
        raise BadRequest(f"the body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    if SURROGATE_BYTES.search(raw):  # only then can a decoded string hold one: large bodies are not walked
        _refuse_lone_surrogates(body)
    return body


SURROGATE_BYTES = re.compile(rb"\\[uU][dD][89a-fA-F]|\xed[\xa0-\xbf]")  # an escaped or raw UTF-16 surrogate
SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_lone_surrogates(body: dict) -> None:
    """BadRequest naming the field of a string (or key) holding a lone surrogate (`"\\ud800"`): Python's JSON parser
    accepts one, and no tokenizer or UTF-8 writer does (it was a 500). Pairs were joined when parsed."""
    stack: list[tuple[str, Any]] = [("body", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if SURROGATE.search(key):
                    raise BadRequest(f"a key of {where} holds a lone surrogate: not valid Unicode")
                stack.append((key if where == "body" else f"{where}.{key}", item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str) and SURROGATE.search(value):
            raise BadRequest(f"{where} holds a lone surrogate (U+{ord(SURROGATE.search(value)[0]):04X}): "
                             f"not valid Unicode")


def build_app(server: RolloutServer, *,  # noqa: C901  a flat list of routes, each branch one route's binding
              max_body_bytes: int = MAX_BODY_BYTES, api_key: Optional[str] = None,
              admin_api_key: Optional[str] = None) -> "_Guard":
    """The routes, each a thin binding of a RolloutServer endpoint (run in a thread: they block)."""
    app = FastAPI(title="opd-sao serve", docs_url=None, redoc_url=None, openapi_url=None)
    limiter = anyio.CapacityLimiter(REQUEST_THREADS)

    async def answer(request: Request, handler, *, weight: bool = False, watch: bool = False) -> Response:
        """Run `handler(body)` (with `client_gone` when `watch`): 200, 400 (SGLang's {"success": false,
        "message"} on weight routes), 500 for a failure of the server's own."""
        gone, watcher = threading.Event(), None
        try:
            body = await _body(request)  # read before watching: the watcher reads the connection's next message
            watcher = asyncio.create_task(_watch(request, gone)) if watch else None
            call = (lambda: handler(body, gone.is_set)) if watch else (lambda: handler(body))
            return _json(200, await anyio.to_thread.run_sync(call, limiter=limiter))
        except (BadRequest, WeightSyncRefused) as err:
            return _json(400, {"success": False, "message": str(err)} if weight else {"error": {"message": str(err)}})
        except ClientGone:
            return Response(status_code=499)
        except Exception as err:  # a server answers, it does not die
            return _json(500, {"error": {"message": f"{type(err).__name__}: {err}"}})
        finally:
            if watcher is not None:
                watcher.cancel()

    def weight_route(path: str, handler) -> None:
        async def endpoint(request: Request) -> Response:
            return await answer(request, handler, weight=True)

        app.add_api_route(path, endpoint, methods=["POST"])

    for path, handler in weight_handlers(server).items():
        weight_route(path, handler)

    async def health(request: Request) -> Response:
        """/health_generate generates a token (SGLang's); /health answers at once from the last outcome."""
        if request.url.path == "/health_generate":
            try:
                await anyio.to_thread.run_sync(server.health_generate, limiter=limiter)
            except Exception:  # the answer is the status
                pass
        return Response(status_code=200 if server.healthy else 503)

    app.add_api_route("/health", health, methods=["GET", "POST"])
    app.add_api_route("/health_generate", health, methods=["GET", "POST"])

    def info_route(path: str, handler, methods=("GET",), warn: Optional[str] = None) -> None:
        async def endpoint(request: Request) -> Response:
            if warn:
                log.warning("Endpoint '%s' is deprecated and will be removed in a future version. "
                            "Please use '%s' instead.", path, warn)
            return await answer(request, handler)

        app.add_api_route(path, endpoint, methods=list(methods))

    info_route("/model_info", server.model_info)
    info_route("/get_model_info", server.model_info, warn="/model_info")  # SGLang keeps the old name, warning
    info_route("/server_info", server.server_info)
    info_route("/get_server_info", server.server_info, warn="/server_info")
    info_route("/get_load", server.load)
    info_route("/v1/loads", server.loads)
    info_route("/v1/models", server.models)
    info_route("/pause_generation", server.pause_generation, methods=("POST",))
    info_route("/continue_generation", server.continue_generation, methods=("POST",))

    async def abort_request(request: Request) -> Response:
        answer_ = await answer(request, server.abort_request)
        return Response(status_code=200) if answer_.status_code == 200 else answer_  # SGLang's: an empty 200

    app.add_api_route("/abort_request", abort_request, methods=["POST"])

    async def flush_cache(request: Request) -> Response:  # SGLang's answers: text, 200 or 400
        try:
            timeout_s = float(request.query_params.get("timeout", 0.0))
        except ValueError:
            timeout_s = -1.0
        if not timeout_s >= 0:
            return _json(422, {"detail": [{"loc": ["query", "timeout"], "msg": "a number >= 0"}]})
        if not await anyio.to_thread.run_sync(server.flush_cache, timeout_s, limiter=limiter):
            return Response("Timed out waiting for idle state." if timeout_s else "Flush cache failed.\n", status_code=400)
        return Response("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                        "waiting requests, the operation will not be performed.)\n", status_code=200)

    app.add_api_route("/flush_cache", flush_cache, methods=["GET", "POST"])

    def generation_route(path: str, handler) -> None:
        async def endpoint(request: Request) -> Response:
            return await answer(request, handler, watch=True)

        app.add_api_route(path, endpoint, methods=["POST", "PUT"] if path == "/generate" else ["POST"])

    generation_route("/generate", server.generate)
    generation_route("/v1/completions", server.completions)
    generation_route("/v1/chat/completions", server.chat_completions)
    return _Guard(app, max_body_bytes=max_body_bytes, api_key=api_key, admin_api_key=admin_api_key)


def weight_handlers(server: RolloutServer) -> dict:
    """path -> handler(body) of every weight route: the session's, and each weight-sync mode's server side
    bound to this server as its WeightTarget."""
    def bound(mode, handler: str):
        def route(body: dict) -> dict:
            if body.get("abort_all_requests"):
                raise BadRequest("abort_all_requests is not supported by opd-sao serve (updates wait for requests)")
            return getattr(mode, handler)(body, server)

        return route

    return {"/begin_weight_update": server.begin_weight_update, "/end_weight_update": server.end_weight_update,
            **{path: bound(mode, handler) for mode in server.weight_syncs.values()
               for path, handler in mode.routes.items()}}


async def _watch(request: Request, gone: threading.Event) -> None:
    """Set `gone` when the client disconnects (its request is then cancelled)."""
    while not await request.is_disconnected():
        await asyncio.sleep(CLIENT_POLL_S)
    gone.set()


def serve(args, listening: socket.socket) -> int:
    """`opd-sao serve` on `listening`, the socket the CLI bound after checking every argument (cli._serve_socket:
    a bad argument or a port in use is one line at once, before this module imports torch)."""
    import uvicorn

    roots = [Path(root) for root in args.weights_root or []]
    if args.threads:
        torch.set_num_threads(args.threads)
    server = RolloutServer(args.checkpoint, max_batch=args.max_batch, seed=args.seed, dtype=args.dtype,
                           weight_version=args.weight_version, max_new_tokens=args.max_new_tokens,
                           device=args.device, weights_roots=roots or None, group_timeout_s=args.group_timeout_s)
    app = build_app(server, max_body_bytes=args.max_body_mb << 20, api_key=args.api_key,
                    admin_api_key=args.admin_api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, http="h11", log_level="warning",
                            timeout_keep_alive=IDLE_TIMEOUT_S, backlog=LISTEN_BACKLOG, access_log=False)
    uv = uvicorn.Server(config)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    open_to = "loopback only" if is_loopback(args.host) else \
        ("weight routes need the admin key" if args.admin_api_key or args.api_key
         else "weight routes from loopback clients only (no --admin-api-key)")
    print(f"opd-sao serve: {args.checkpoint} on http://{args.host}:{args.port} "
          f"(weight_version {server.weight_version}; {open_to})", flush=True)
    try:
        uv.run(sockets=[listening])
    except KeyboardInterrupt:
        pass
    except SystemExit as stop:  # SIGTERM's exit(0), or uvicorn's exit(1) when it cannot start
        return stop.code if isinstance(stop.code, int) else 1
    return 0
