"""`opd-sao serve CHECKPOINT --port PORT`: the embedded engine behind SGLang's native HTTP API.

Concurrent `/generate` requests join one EmbeddedEngine continuous batch: a decode thread runs the
engine, HTTP threads only queue requests and wait. Weight updates (from disk, from tensors in the request,
or broadcast over a weight update group) keep SGLang's semantics: the swap waits until the requests in
flight have finished (new ones wait meanwhile), so every response was sampled entirely by the
`weight_version` it reports. Serves the subset of the API that opd-sao, sglang-router and SGLang's
RuntimeEndpoint use (see docs/scale_out.md) and rejects, with a 400, what it does not implement.
"""
from __future__ import annotations

import itertools
import json
import queue
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

import torch

from opd_sao.checkpoints import load_causal_lm, load_tokenizer
from opd_sao.engines.base import GenerationRequest, GenerationResult, SamplingParams
from opd_sao.engines.embedded import EmbeddedEngine
from opd_sao.engines.weight_transfer import (DTYPES, TENSOR_FORMAT, broadcast, connect_store, join_group,
                                             unpack_tensors, untied)
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
WEIGHT_PATHS = {"/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
                "/update_weights_from_distributed", "/destroy_weights_update_group"}


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
        self._tokens_inflight = 0  # prompt + max_new_tokens of the requests in flight (/get_load)
        self._groups: dict[str, tuple] = {}  # weight update groups joined: name -> (process group, store)
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

    def generate(self, body: dict) -> dict | list[dict]:
        """One prompt, or a batch (a list of `text`s or of `input_ids` lists), answered with a list as SGLang
        does; the batch's prompts join the continuous batch together."""
        _check_generate_fields(body, self.checkpoint)
        prompts, batched = self._prompts(body)
        if not batched:
            return self._generate_one({**body, "input_ids": prompts[0]})
        params, rids = body.get("sampling_params") or {}, body.get("rid")
        for name, value in (("sampling_params", params), ("rid", rids)):
            if isinstance(value, list) and len(value) != len(prompts):
                raise BadRequest(f"{name} has {len(value)} entries for {len(prompts)} prompts")
        bodies = [{**body, "input_ids": ids, "sampling_params": params[i] if isinstance(params, list) else params,
                   "rid": rids[i] if isinstance(rids, list) else None} for i, ids in enumerate(prompts)]
        for one in bodies:  # refuse a bad batch before any of it runs
            self._sampling_params(one["sampling_params"])
        with ThreadPoolExecutor(len(bodies), thread_name_prefix="batch") as pool:
            return list(pool.map(self._generate_one, bodies))

    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        """Token ids of each prompt (`text` is tokenized as SGLang does: the tokenizer's defaults), and
        whether the request was a batch."""
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("send exactly one of text and input_ids")
        if text is not None:
            if isinstance(text, str):
                return [self.tokenizer.encode(text)], False
            if not isinstance(text, list) or not text or not all(isinstance(t, str) for t in text):
                raise BadRequest("text must be a string or a non-empty list of strings")
            return [self.tokenizer.encode(t) for t in text], True
        if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
            return ids, True
        return [ids], False

    def _generate_one(self, body: dict) -> dict:
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
        with self._admitted(len(ids) + params.max_new_tokens) as version:
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
            if body.get("return_text_in_logprobs"):
                self._add_token_texts(meta)
        return {"text": self.tokenizer.decode(output), "output_ids": output, "meta_info": meta}

    def update_weights_from_disk(self, body: dict) -> dict:
        path = body.get("model_path")
        if not path or not (Path(path) / "config.json").is_file():
            raise BadRequest(f"model_path {path!r} is not an HF model directory")
        _check_update_fields(body)
        state = load_causal_lm(path, self.dtype).state_dict()
        self._check_weight_shapes({k: v.shape for k, v in state.items()}, path)
        return self._install_weights(state, body)

    def update_weights_from_tensor(self, body: dict) -> dict:
        """The weights in the request: one entry of base64 safetensors bytes (one tensor-parallel rank)."""
        _check_update_fields(body)
        if body.get("load_format") != TENSOR_FORMAT:
            raise BadRequest(f"load_format {body.get('load_format')!r}: opd-sao serve takes serialized_named_tensors "
                             f"as base64 safetensors (load_format {TENSOR_FORMAT!r}), not pickled tensors")
        shards = body.get("serialized_named_tensors")
        if not isinstance(shards, list) or len(shards) != 1 or not isinstance(shards[0], str):
            raise BadRequest("serialized_named_tensors must be a list of one string (one tensor-parallel rank)")
        try:
            state = unpack_tensors(shards[0])
        except Exception as err:  # noqa: BLE001 (whatever the parser says, the request is bad)
            raise BadRequest(f"serialized_named_tensors[0] is not base64 safetensors: {err}") from None
        self._check_weight_shapes({k: v.shape for k, v in state.items()}, "serialized_named_tensors")
        return self._install_weights(state, body)

    def init_weights_update_group(self, body: dict) -> dict:
        """Join the trainer's weight broadcast group at rank `rank_offset` (blocks until every rank joined)."""
        name = body.get("group_name") or "weight_update_group"
        if body.get("backend", "gloo") != "gloo":
            raise BadRequest(f"backend {body.get('backend')!r}: opd-sao serve runs on CPU, use gloo")
        if name in self._groups:
            raise BadRequest(f"weight update group {name!r} already exists on this server")
        try:
            address, port = str(body["master_address"]), int(body["master_port"])
            rank, world = int(body["rank_offset"]), int(body["world_size"])
        except KeyError as err:
            raise BadRequest(f"init_weights_update_group needs {err.args[0]}") from None
        if not 0 < rank < world:
            raise BadRequest(f"rank_offset {rank} must be in [1, world_size {world}) (rank 0 is the trainer)")
        store = connect_store(address, port, world)
        self._groups[name] = (join_group(store, rank, world, name), store)
        return {"success": True, "message": f"joined weight update group {name!r} as rank {rank} of {world}"}

    def update_weights_from_distributed(self, body: dict) -> dict:
        """Receive every named tensor by broadcast from rank 0 (validated first: a refused request must not
        leave the trainer waiting in a collective), then swap them in like a disk update."""
        _check_update_fields(body)
        name = body.get("group_name") or "weight_update_group"
        if name not in self._groups:
            raise BadRequest(f"no weight update group {name!r}: call /init_weights_update_group first")
        if body.get("load_format") is not None:
            raise BadRequest(f"load_format {body['load_format']!r} is not supported by opd-sao serve")
        names, dtypes, shapes = body.get("names") or [], body.get("dtypes") or [], body.get("shapes") or []
        if not len(names) == len(dtypes) == len(shapes) or not names:
            raise BadRequest("names, dtypes and shapes must be non-empty lists of one length")
        unknown = [d for d in dtypes if d not in DTYPES]
        if unknown:
            raise BadRequest(f"dtype {unknown[0]!r} is not one of {sorted(DTYPES)}")
        self._check_weight_shapes(dict(zip(names, shapes)), "names and shapes")
        group = self._groups[name][0]
        state = {}
        for tensor_name, dtype, shape in zip(names, dtypes, shapes):
            state[tensor_name] = torch.empty(shape, dtype=DTYPES[dtype])
            broadcast(group, state[tensor_name])
        return self._install_weights(state, body)

    def destroy_weights_update_group(self, body: dict) -> dict:
        name = body.get("group_name") or "weight_update_group"
        if self._groups.pop(name, None) is None:
            raise BadRequest(f"no weight update group {name!r}")
        return {"success": True, "message": f"left weight update group {name!r}"}

    def _check_weight_shapes(self, shapes: dict, source: str) -> None:
        """Every parameter of the served model (tied ones once) with its shape, and nothing else."""
        current = self.engine.model.state_dict()
        wrong = [k for k in untied(current) if k not in shapes or tuple(shapes[k]) != tuple(current[k].shape)]
        wrong += sorted(k for k in shapes if k not in current)
        if wrong:
            raise BadRequest(f"{source} does not match the served model's parameters (first mismatch: {wrong[0]})")

    def _install_weights(self, state: dict[str, torch.Tensor], body: dict) -> dict:
        """Swap weights in once the requests in flight have finished (new ones wait meanwhile)."""
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
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise BadRequest("input_ids must be a non-empty list of token ids, or a list of such lists")
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

    def _add_token_texts(self, meta: dict) -> None:
        """return_text_in_logprobs: each [logprob, token_id, null] entry gets the token's text."""
        for key in ("output_token_logprobs", "input_token_logprobs"):
            for entry in meta.get(key) or []:
                entry[2] = self.tokenizer.decode([entry[1]])
        for top in meta.get("input_top_logprobs") or []:
            for entry in top or []:
                entry[2] = self.tokenizer.decode([entry[1]])

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


def _check_update_fields(body: dict) -> None:
    if body.get("abort_all_requests"):
        raise BadRequest("abort_all_requests is not supported by opd-sao serve (updates wait for requests)")


def _extra_routes(app: RolloutServer) -> dict:
    """(method, path) -> handler(body) for the endpoints beyond generation and disk weight loads."""
    return {("GET", "/get_server_info"): lambda _: app.server_info(),
            ("GET", "/server_info"): lambda _: app.server_info(),
            ("GET", "/get_load"): lambda _: app.load(),
            ("POST", "/update_weights_from_tensor"): app.update_weights_from_tensor,
            ("POST", "/init_weights_update_group"): app.init_weights_update_group,
            ("POST", "/update_weights_from_distributed"): app.update_weights_from_distributed,
            ("POST", "/destroy_weights_update_group"): app.destroy_weights_update_group}


def _handler(app: RolloutServer):
    extra = _extra_routes(app)

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
                elif (method, path) in extra:
                    self._send(200, extra[method, path](body))
                else:
                    self._send(404, {"error": {"message": f"no endpoint {method} {path}"}})
            except (BadRequest, json.JSONDecodeError, TypeError, ValueError) as err:
                failed = path in WEIGHT_PATHS
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
