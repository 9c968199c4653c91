"""`opd-sao serve CHECKPOINT --port PORT`: the embedded engine behind SGLang's native HTTP API.

Concurrent `/generate` requests join one EmbeddedEngine continuous batch: a decode thread runs the
engine, HTTP threads only queue requests and wait. Weight updates keep SGLang's semantics: an
`/update_weights_from_disk` waits until the requests in flight have finished (new ones wait meanwhile),
so every response was sampled entirely by the `weight_version` it reports. Serves the subset of the API
that opd-sao uses (see docs/scale_out.md) and rejects, with a 400, what it does not implement.
"""
from __future__ import annotations

import itertools
import json
import queue
import signal
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

import torch

from opd_sao.checkpoints import load_causal_lm, load_tokenizer
from opd_sao.engines.base import GenerationRequest, GenerationResult, SamplingParams
from opd_sao.engines.embedded import EmbeddedEngine
from opd_sao.modeling import forward_logits

# sampling_params keys accepted only at these (SGLang default) values: text-only or unimplemented options
NEUTRAL_PARAMS = {"top_k": (-1, None), "min_p": (0, 0.0, None), "n": (1, None), "frequency_penalty": (0, 0.0, None),
                  "presence_penalty": (0, 0.0, None), "repetition_penalty": (1, 1.0, None), "stop": (None, [], "")}
TEXT_ONLY_PARAMS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
SAMPLING_PARAMS = {"temperature", "top_p", "max_new_tokens", "ignore_eos", "stop_token_ids"}


class BadRequest(ValueError):
    """A request this server cannot honour; answered with HTTP 400 and the message."""


class _Waiter:
    def __init__(self):
        self.event = threading.Event()
        self.result: Optional[GenerationResult] = None


class RolloutServer:
    """The API's behaviour, independent of HTTP."""

    def __init__(self, checkpoint: str | Path, *, max_batch: int = 32, seed: int = 0, dtype: str = "float32",
                 weight_version: str = "default"):
        self.checkpoint, self.dtype = str(checkpoint), dtype
        self.tokenizer = load_tokenizer(checkpoint)
        self.engine = EmbeddedEngine(load_causal_lm(checkpoint, dtype), eos_id=self.tokenizer.eos_token_id,
                                     pad_id=self.tokenizer.pad_token_id, max_batch=max_batch, seed=seed)
        self.vocab_size = self.engine.model.get_input_embeddings().num_embeddings
        self.weight_version = weight_version
        self._queue: "queue.SimpleQueue[GenerationRequest]" = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._inflight = 0
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

        try:
            self.engine.generate(pull(), done)
        except BaseException as err:  # answered as HTTP 500 by every waiting request
            self._crash = err

    @contextmanager
    def _admitted(self):
        """A request in flight: a weight update waits for it, and it waits for a pending update."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._inflight += 1
        try:
            yield self.weight_version
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    @property
    def crashed(self) -> bool:
        return self._crash is not None

    # --- endpoints -------------------------------------------------------------------------------------

    def model_info(self) -> dict:
        return {"model_path": self.checkpoint, "tokenizer_path": self.checkpoint, "is_generation": True,
                "weight_version": self.weight_version}

    def generate(self, body: dict) -> dict:
        t0 = time.perf_counter()
        ids = self._input_ids(body)
        params = self._sampling_params(body.get("sampling_params") or {})
        return_logprob = bool(body.get("return_logprob", False))
        start = int(body.get("logprob_start_len", -1))
        top_k = int(body.get("top_logprobs_num", 0))
        if top_k and params.max_new_tokens:
            raise BadRequest("top_logprobs_num for generated tokens is not supported by opd-sao serve "
                             "(prompt scoring with max_new_tokens 0 is)")
        if start >= len(ids):
            raise BadRequest(f"logprob_start_len {start} is past the prompt ({len(ids)} tokens)")
        with self._admitted() as version:
            meta = {"id": str(body.get("rid") or next(self._ids)), "prompt_tokens": len(ids), "cached_tokens": 0,
                    "weight_version": version}
            if return_logprob and start >= 0:
                meta.update(self._prompt_logprobs(ids, start, top_k))
            output, logprobs, finish = [], [], {"type": "length", "length": 0}
            if params.max_new_tokens:
                result = self._sample(GenerationRequest(ids, params, tag=_Waiter()))
                output, logprobs = result.token_ids, result.logprobs
                finish = ({"type": "stop", "matched": self.tokenizer.eos_token_id} if result.finish_reason == "stop"
                          else {"type": "length", "length": params.max_new_tokens})
        meta.update(finish_reason=finish, completion_tokens=len(output), e2e_latency=time.perf_counter() - t0)
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, output)]
        return {"text": self.tokenizer.decode(output), "output_ids": output, "meta_info": meta}

    def update_weights_from_disk(self, body: dict) -> dict:
        path = body.get("model_path")
        if not path or not (Path(path) / "config.json").is_file():
            raise BadRequest(f"model_path {path!r} is not an HF model directory")
        if body.get("abort_all_requests"):
            raise BadRequest("abort_all_requests is not supported by opd-sao serve (updates wait for requests)")
        state = load_causal_lm(path, self.dtype).state_dict()
        current = self.engine.model.state_dict()
        wrong = [k for k in current if k not in state or state[k].shape != current[k].shape]
        if wrong or len(state) != len(current):
            raise BadRequest(f"{path} does not match the served model's parameters (first mismatch: "
                             f"{(wrong or sorted(set(state) - set(current)))[0]})")
        version = str(body["weight_version"]) if body.get("weight_version") is not None else self.weight_version
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
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    # --- helpers ---------------------------------------------------------------------------------------

    def _input_ids(self, body: dict) -> list[int]:
        ids = body.get("input_ids")
        if ids is None:
            raise BadRequest("send input_ids: opd-sao serve does not tokenize text")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise BadRequest("input_ids must be one non-empty list of token ids (batched requests are not supported)")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise BadRequest(f"input_ids must be in [0, {self.vocab_size})")
        return ids

    def _sampling_params(self, sp: dict) -> SamplingParams:
        for key, value in sp.items():
            if key not in SAMPLING_PARAMS | set(NEUTRAL_PARAMS) | TEXT_ONLY_PARAMS:
                raise BadRequest(f"sampling_params.{key} is not supported by opd-sao serve")
            if key in NEUTRAL_PARAMS and value not in NEUTRAL_PARAMS[key]:
                raise BadRequest(f"sampling_params.{key}={value!r} is not supported by opd-sao serve")
            if key == "stop_token_ids" and not set(value or []) <= {self.tokenizer.eos_token_id}:
                raise BadRequest("stop_token_ids other than the model's eos are not supported by opd-sao serve")
        temperature, top_p = float(sp.get("temperature", 1.0)), float(sp.get("top_p", 1.0))
        max_new_tokens = int(sp.get("max_new_tokens", 128))
        if temperature <= 0:
            raise BadRequest("temperature must be > 0 (greedy decoding is not supported by opd-sao serve)")
        if not 0 < top_p <= 1 or max_new_tokens < 0:
            raise BadRequest("need 0 < top_p <= 1 and max_new_tokens >= 0")
        return SamplingParams(temperature, top_p, max_new_tokens, bool(sp.get("ignore_eos", False)))

    def _sample(self, request: GenerationRequest) -> GenerationResult:
        self._queue.put(request)
        while not request.tag.event.wait(1.0):
            if self._crash is not None:
                raise RuntimeError(f"the decode loop crashed: {self._crash!r}")
        return request.tag.result

    @torch.no_grad()
    def _prompt_logprobs(self, ids: list[int], start: int, top_k: int) -> dict:
        """SGLang's input logprobs (temperature 1): entry i is token start+i given the tokens before it."""
        x = torch.tensor([ids])
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


def _handler(app: RolloutServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client slot reuses its connection

        def log_message(self, *args) -> None:  # one line per request would drown the logs
            pass

        def _send(self, status: int, body) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            path = urlsplit(self.path).path
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
                if path in ("/health", "/health_generate"):
                    self._send(503 if app.crashed else 200, None)
                elif path in ("/get_model_info", "/model_info") and method == "GET":
                    self._send(200, app.model_info())
                elif path == "/flush_cache":  # the embedded engine keeps no prefix cache
                    self._send(200, None)
                elif path == "/generate" and method == "POST":
                    self._send(200, app.generate(body))
                elif path == "/update_weights_from_disk" and method == "POST":
                    self._send(200, app.update_weights_from_disk(body))
                else:
                    self._send(404, {"error": {"message": f"no endpoint {method} {path}"}})
            except (BadRequest, json.JSONDecodeError, TypeError, ValueError) as err:
                failed = path == "/update_weights_from_disk"
                self._send(400, {"success": False, "message": str(err)} if failed else {"error": {"message": str(err)}})
            except Exception as err:  # noqa: BLE001 (a server answers, it does not die)
                self._send(500, {"error": {"message": f"{type(err).__name__}: {err}"}})

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

    return Handler


def serve(args) -> int:
    if not (Path(args.checkpoint) / "config.json").is_file():
        raise ValueError(f"checkpoint {args.checkpoint!r} is not an HF model directory (no config.json)")
    if args.threads:
        torch.set_num_threads(args.threads)
    app = RolloutServer(args.checkpoint, max_batch=args.max_batch, seed=args.seed, dtype=args.dtype,
                        weight_version=args.weight_version)
    httpd = ThreadingHTTPServer((args.host, args.port), _handler(app))
    httpd.daemon_threads = True
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
