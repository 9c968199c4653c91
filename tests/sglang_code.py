"""SGLang 0.5.23's own server-side Python, loaded from the installed `sglang` wheel (scripts/setup.sh installs it
with --no-deps) without importing its package, whose imports pull CUDA-only modules: the functions and classes
named here are parsed out of their modules' source with `ast` and run in a namespace of their own.

- `MultiprocessingSerializer`, `SafeUnpickler`: how a worker reads /update_weights_from_tensor's payload.
- `init_custom_process_group`: how a worker joins a weight update group.
- `FlattenedTensorBucket`: how a worker rebuilds a flattened bucket.
- `receive_weights_from_distributed`: how a worker's model runner receives one broadcast.
- `SchedulerLogprobResultProcessor._process_input_token_logprobs`: where prompt logprobs get their positions.
- `top_k_top_p_min_p_sampling_from_probs_torch`: the support SGLang's sampler draws from at top_k/top_p.
- the scheduler's sampling-mask check (`sampling_mask_refusal`): which top_k a return_sampling_mask request may have.
- the scheduler's /flush_cache (`flush_cache_succeeds`): refused while requests run or wait in its queue.
- the HTTP request models (`request_model(name)`): SGLang's msgspec structs, validated as its FastAPI app
  validates bodies (pydantic, through sglang.srt.utils.msgspec_utils); `GenerateReqInput` (a dataclass).
- the tokenizer manager's pause and model-update lock (`tokenizer_manager_class()`): its `RWLock`
  (utils/aio_rwlock.py), `pause_generation`, `continue_generation`, its weight-update methods, and the two
  statements of `generate_request` that admit a request.

The rules of that last piece a client can trip (SGLang 0.5.23, one tokenizer manager, dp 1):
- A /generate first waits on `is_pause_cond` until not paused, then holds the reader side of `model_update_lock`
  for its whole life (tokenizing, scheduling, answering). The lock prefers writers: once an update waits for it,
  requests sent after wait behind the update, though others still run.
- /update_weights_from_tensor, _from_distributed, _from_disk and /begin_weight_update, /end_weight_update read
  `is_pause` first. Paused: they run at once, without the lock (tensor and distributed holding `is_pause_cond`, so a
  /continue_generation waits for them). Not paused: they take the writer side, so they start only once every
  running request has finished (a 90 s generation delays the update, and a broadcast started alongside it, by
  90 s), and requests sent meanwhile wait. `abort_all_requests` aborts what runs first.
- /pause_generation mode `abort` (the default) sets `is_pause`, then, holding `is_pause_cond`, aborts every request
  and polls the lock each second until no request holds it: it answers once none runs (at least a second when
  one did), and waits for an update holding the writer side. Each aborted request is answered 200 with
  finish_reason {"type": "abort"} and the output it had. Modes `retract` and `in_place` go to the scheduler and
  answer at once: the running requests stay (retract frees their KV and recomputes it after the pause, on the new
  weights; in_place keeps the old weights' KV) and finish after /continue_generation.
- /continue_generation clears `is_pause` and wakes the waiting requests; not paused, it does nothing and answers
  200 as well. Neither route counts: two pauses need one continue.
"""
from __future__ import annotations

import ast
import base64
import binascii
import dataclasses
import enum
import importlib.util
import io
import os
import pickle
import sys
import threading
import types
import typing
from functools import lru_cache
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch


def installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


@lru_cache(None)
def _root() -> Path:
    return Path(importlib.util.find_spec("sglang").submodule_search_locations[0])


def _definitions(relative: str, names: set[str]) -> str:
    """The source of the top-level functions and classes `names` of sglang/`relative` (decorators included),
    in the file's order."""
    source = (_root() / relative).read_text()
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            found[node.name] = "\n".join(lines[first - 1:node.end_lineno])
    missing = names - set(found)
    if missing:
        raise LookupError(f"sglang/{relative} has no {sorted(missing)} (not SGLang 0.5.23?)")
    return "\n\n".join(found.values())


def _load(relative: str, names: set[str], namespace: dict) -> dict:
    """A module of its own (dataclasses look their module up) holding `namespace` and the definitions."""
    module = types.ModuleType("sglang_code." + relative.replace("/", ".").removesuffix(".py"))
    module.__dict__.update(namespace)
    sys.modules[module.__name__] = module
    exec(compile(_definitions(relative, names), f"sglang/{relative}", "exec"), module.__dict__)
    return module.__dict__


@lru_cache(None)
def common() -> dict:
    """sglang/srt/utils/common.py: MultiprocessingSerializer, SafeUnpickler, init_custom_process_group."""
    torch_release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return _load("srt/utils/common.py",
                 {"MultiprocessingSerializer", "SafeUnpickler", "_safe_load_torch_storage",
                  "init_custom_process_group"},
                 {"io": io, "pickle": pickle, "torch": torch, "ForkingPickler": ForkingPickler,
                  "pybase64": _pybase64(), "binascii": binascii, "torch_release": torch_release})


def _pybase64():
    try:
        import pybase64

        return pybase64
    except ImportError:  # the same calls, slower
        return base64


@lru_cache(None)
def tensor_bucket() -> dict:
    return _load("srt/weight_sync/tensor_bucket.py", {"FlattenedTensorMetadata", "FlattenedTensorBucket"},
                 {"dataclass": dataclasses.dataclass, "List": typing.List, "Tuple": typing.Tuple, "torch": torch})


def receive_weights_from_distributed(group, names, dtypes, shapes, load_format, device: str = "cpu"):
    """SGLang's model runner receiving one /update_weights_from_distributed broadcast (its WeightUpdater
    methods, run on a namespace holding the joined group)."""
    ns = _load("srt/model_executor/model_runner_components/weight_updater.py", {"WeightUpdater"},
               {"torch": torch, "FlattenedTensorBucket": tensor_bucket()["FlattenedTensorBucket"],
                "dataclass": dataclasses.dataclass, "field": dataclasses.field, **_typing()})
    cls = ns["WeightUpdater"]
    runner = types.SimpleNamespace(_model_update_group={"g": group}, device=device)
    runner._receive_bucketed_weights_from_distributed = types.MethodType(
        cls._receive_bucketed_weights_from_distributed, runner)
    return cls.receive_weights_from_distributed(runner, names=names, dtypes=dtypes, shapes=shapes, group_name="g",
                                                load_format=load_format)


def process_input_token_logprobs(raw_logprobs: list[float], input_ids: list[int], start: int, vocab_size: int):
    """SGLang's positions for prompt logprobs: `raw_logprobs[i]` is what its logits processor computes at
    position start+i (the logprob of token start+i+1 given the tokens up to start+i; the last one the
    first sampled token's); returns (input_token_logprobs_val, input_token_logprobs_idx) as the scheduler
    hands them to the tokenizer manager."""
    ns = _load("srt/managers/scheduler_components/logprob_result_processor.py",
               {"SchedulerLogprobResultProcessor"},
               {"dataclass": dataclasses.dataclass, "MIS_DELIMITER_TOKEN_ID": -1, **_typing()})
    # its self: the model config it reads, and a request that is not a multi-item scoring one
    processor = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=vocab_size),
                                      _uses_scoring_positions=lambda req: False)
    req = types.SimpleNamespace(logprob=types.SimpleNamespace(), origin_input_ids=input_ids, logprob_start_len=start)
    ns["SchedulerLogprobResultProcessor"]._process_input_token_logprobs(processor, req, list(raw_logprobs))
    return req.logprob.input_token_logprobs_val, req.logprob.input_token_logprobs_idx


def _typing() -> dict:
    return {name: getattr(typing, name) for name in ("Any", "Callable", "Dict", "List", "Literal", "Optional",
                                                     "Tuple", "Union", "TYPE_CHECKING")} | {
        "Annotated": typing.Annotated}


@lru_cache(None)
def _msgspec_utils():
    spec = importlib.util.spec_from_file_location("sglang_code_msgspec_utils", _root() / "srt/utils/msgspec_utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WEIGHT_REQUESTS = {"UpdateWeightFromDiskReqInput", "UpdateWeightsFromTensorReqInput",
                   "UpdateWeightsFromDistributedReqInput", "InitWeightsUpdateGroupReqInput",
                   "DestroyWeightsUpdateGroupReqInput", "BeginWeightUpdateReqInput", "EndWeightUpdateReqInput"}


@lru_cache(None)
def _io_struct() -> dict:
    import msgspec

    utils = _msgspec_utils()
    return _load("srt/managers/io_struct.py", {"BaseReq"} | WEIGHT_REQUESTS | {
        "GenerateReqInput", "PauseGenerationReqInput", "ContinueGenerationReqInput"},
                 {"msgspec": msgspec, "Base64Bytes": utils.Base64Bytes, "dataclass": dataclasses.dataclass,
                  "field": dataclasses.field, "msgspec_struct_pydantic_core_schema":
                      utils.msgspec_struct_pydantic_core_schema, **_typing()})


_STUBBING = threading.Lock()


@lru_cache(None)
def _sampling_params_class():
    """sglang/srt/sampling/sampling_params.py, whole, with its one import that needs the package (watermarking,
    which these tests never ask for) stubbed while it loads. Under a lock: the worker serves requests on several
    threads, and lru_cache lets two first calls run at once, so one could pop the stub while the other still
    imports (the real package then imports triton: an HTTP 500 seen once in a loaded suite)."""
    name = "sglang.srt.sampling.watermarking.core"
    stub = types.ModuleType(name)
    stub.WatermarkRequestConfig, stub.normalize_watermark_request = dict, lambda watermark: watermark
    with _STUBBING:
        saved = sys.modules.get(name)
        sys.modules[name] = stub
        try:
            spec = importlib.util.spec_from_file_location("sglang_code_sampling_params",
                                                          _root() / "srt/sampling/sampling_params.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            if saved is None:
                sys.modules.pop(name)
            else:
                sys.modules[name] = saved
    return module.SamplingParams


def verify_sampling_params(params: dict, vocab_size: int):
    """`params` as SGLang's scheduler takes a request's sampling_params: its SamplingParams, verified (ValueError if
    refused, e.g. a sampling_seed outside [-2**63, 2**63 - 1])."""
    sampling = _sampling_params_class()(**params)
    sampling.verify(vocab_size)
    return sampling


@lru_cache(None)
def _sampling_mask_rule():
    """The scheduler's sampling-mask check, as it stands in sglang/srt/managers/scheduler.py (inside
    `Scheduler._handle_generate_request`: the `if req.return_sampling_mask:` block that reads
    `sampling_mask_max_tokens`), compiled on its own as `rule(self, req)` with its line numbers."""
    relative = "srt/managers/scheduler.py"
    source = (_root() / relative).read_text()
    blocks = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.If)
              and ast.unparse(node.test) == "req.return_sampling_mask" and "sampling_mask_cap" in ast.unparse(node)]
    if len(blocks) != 1:
        raise LookupError(f"sglang/{relative} has {len(blocks)} sampling-mask top_k checks, not one (not SGLang 0.5.23?)")
    rule = ast.parse("def rule(self, req):\n    pass").body[0]
    rule.body = blocks
    module = ast.fix_missing_locations(ast.Module(body=[rule], type_ignores=[]))
    namespace = {"DisaggregationMode": enum.Enum("DisaggregationMode", "NULL PREFILL DECODE")}
    exec(compile(module, f"sglang/{relative}", "exec"), namespace)
    return namespace["rule"], namespace["DisaggregationMode"]


def sampling_mask_refusal(sampling, max_tokens: int = 4096):
    """What SGLang's scheduler answers a return_sampling_mask request sampling with `sampling` (its
    SamplingParams, as `verify_sampling_params` builds it) on a server launched with --sampling-mask-max-tokens
    `max_tokens` (its default 4096), not disaggregated: the message it aborts the request with (HTTP 400), or
    None if it takes the request. SGLang's own check, run on a scheduler holding just what it reads."""
    rule, modes = _sampling_mask_rule()
    refused = []
    scheduler = types.SimpleNamespace(disaggregation_mode=modes.NULL,
                                      server_args=types.SimpleNamespace(sampling_mask_max_tokens=max_tokens),
                                      _reject_sampling_mask_request=lambda req, message: refused.append(message))
    rule(scheduler, types.SimpleNamespace(return_sampling_mask=True, sampling_params=sampling))
    return refused[0] if refused else None


def flush_cache_succeeds(running: int, waiting: int = 0) -> bool:
    """What SGLang's scheduler answers /flush_cache (no timeout) with `running` requests in its batch and `waiting` in
    its queue: its `SchedulerFlushWrapper.handle` and `Scheduler.flush_cache` (a method parsed out of scheduler.py),
    on a scheduler holding just what they read (idle: `is_fully_idle`, reduced to the batch and the queue)."""
    import logging

    relative = "srt/managers/scheduler.py"
    source = (_root() / relative).read_text()
    [cls] = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Scheduler"]
    [method] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "flush_cache"]
    module = ast.Module(body=[method], type_ignores=[])
    namespace = {"logger": logging.getLogger("sglang_code"), "logging": logging,
                 "current_platform": types.SimpleNamespace(empty_cache=lambda: None)}
    exec(compile(module, f"sglang/{relative}", "exec"), namespace)
    nothing = types.SimpleNamespace(reset=lambda: None, clear=lambda: None, reset_aux_cache_allocator=lambda: None,
                                    reset_metrics=lambda: None, is_stats_logging_rank=False)
    batch = types.SimpleNamespace(reqs=[object()] * running)
    scheduler = types.SimpleNamespace(
        _engine_paused=False, running_batch=batch, waiting_queue=[object()] * waiting, draft_worker=None,
        tree_cache=nothing, req_to_token_pool=nothing, token_to_kv_pool_allocator=nothing, grammar_manager=nothing,
        metrics_reporter=nothing,
        is_fully_idle=lambda ignore_waiting=False: not batch.reqs and (ignore_waiting or not scheduler.waiting_queue))
    wrapper = _load("srt/managers/scheduler_components/flush_wrapper.py", {"SchedulerFlushWrapper"},
                    {"time": __import__("time"), "logging": logging, "Callable": typing.Callable,
                     "Optional": typing.Optional, "Tuple": typing.Tuple,
                     "FlushCacheReqInput": types.SimpleNamespace, "FlushCacheReqOutput": types.SimpleNamespace}
                    )["SchedulerFlushWrapper"]
    flush = wrapper(flush_cache=lambda: namespace["flush_cache"](scheduler), is_fully_idle=scheduler.is_fully_idle,
                    send_output=None)
    return flush.handle(types.SimpleNamespace(timeout_s=None)).success


def _class_subset(relative: str, name: str, methods: list[str]) -> ast.ClassDef:
    """Class `name` of sglang/`relative` holding only `methods` (decorators kept, bases dropped)."""
    [cls] = [n for n in ast.parse((_root() / relative).read_text()).body
             if isinstance(n, ast.ClassDef) and n.name == name]
    found = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    missing = set(methods) - set(found)
    if missing:
        raise LookupError(f"sglang/{relative}'s {name} has no {sorted(missing)} (not SGLang 0.5.23?)")
    return ast.ClassDef(name=name, bases=[], keywords=[], body=[found[m] for m in methods], decorator_list=[])


def _admission() -> ast.AsyncFunctionDef:
    """`async def admit(self, run)`: the two statements of TokenizerManager.generate_request that let a request in
    (wait while paused; then the reader side of the model-update lock), the second's body replaced by
    `return await run()` (the rest of the request: tokenizing, the scheduler, the answer)."""
    relative = "srt/managers/tokenizer_manager.py"
    [method] = _class_subset(relative, "TokenizerManager", ["generate_request"]).body
    pairs = [(body[i], body[i + 1]) for node in ast.walk(method) for field in ("body", "orelse", "finalbody")
             for body in [getattr(node, field, None)] if isinstance(body, list)
             for i in range(len(body) - 1) if isinstance(body[i], ast.AsyncWith) and isinstance(body[i + 1], ast.AsyncWith)
             and ast.unparse(body[i].items[0].context_expr) == "self.is_pause_cond"
             and ast.unparse(body[i + 1].items[0].context_expr) == "self.model_update_lock.reader_lock"]
    if len(pairs) != 1:
        raise LookupError(f"sglang/{relative}'s generate_request has {len(pairs)} pause-then-lock admissions, not one")
    wait, locked = pairs[0]
    locked = ast.copy_location(ast.AsyncWith(items=locked.items, body=ast.parse(
        "async def f():\n    return await run()").body[0].body), locked)
    admit = ast.parse("async def admit(self, run):\n    pass").body[0]
    admit.body = [wait, locked]
    return ast.copy_location(admit, method)


@lru_cache(None)
def tokenizer_manager_class():
    """SGLang's TokenizerManager cut down to its pause, continue and weight-update methods (and `admit`, see
    `_admission`), parsed out of tokenizer_manager.py and tokenizer_control_mixin.py. An instance needs its state
    (`model_update_lock`: an `RWLock`; `is_pause`; `is_pause_cond`) and the calls these methods make to the rest of
    SGLang: `abort_request(abort_all=...)`, `_async_dispatch_to_scheduler(obj)` (pause modes other than abort,
    continue), the `*_communicator(obj)` of each update (a list of results with success and message),
    `_wait_for_model_update_from_disk(obj)` ((success, message, paused requests)), `config_value(name)`,
    `_update_weight_version_if_provided(version)`, `auto_create_handle_loop()`, `mm_processor` (None)."""
    import __future__

    import asyncio
    import contextlib
    import logging

    lock = _load("srt/utils/aio_rwlock.py", {"RWLock", "_ReaderLock", "_WriterLock"}, {"asyncio": asyncio})
    merge = _class_subset("srt/managers/communicator.py", "FanOutCommunicator", ["merge_results"])
    manager = _class_subset("srt/managers/tokenizer_manager.py", "TokenizerManager",
                            ["pause_generation", "continue_generation", "update_weights_from_disk"])
    manager.body.append(_admission())
    control = _class_subset("srt/managers/tokenizer_control_mixin.py", "TokenizerControlMixin",
                            ["_weight_update_session_call", "begin_weight_update", "end_weight_update",
                             "update_weights_from_tensor", "update_weights_from_distributed"])
    namespace = {"asyncio": asyncio, "nullcontext": contextlib.nullcontext, "logger": logging.getLogger("sglang_code"),
                 "get_parallel": lambda: types.SimpleNamespace(dp_size=1, num_dp_ranks=1),
                 "normalize_serialized_named_tensor_payloads": lambda payloads: payloads}
    for cls, relative in ((merge, "communicator"), (manager, "tokenizer_manager"),
                          (control, "tokenizer_control_mixin")):
        module = ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[]))
        exec(compile(module, f"sglang/srt/managers/{relative}.py", "exec", flags=__future__.annotations.compiler_flag,
                     dont_inherit=True), namespace)
    return type("TokenizerManager", (namespace["TokenizerControlMixin"], namespace["TokenizerManager"]),
                {"RWLock": lock["RWLock"]})


def sampled_support(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N, V] the distribution SGLang's sampler draws from and reports under return_sampling_mask (its torch backend's
    `top_k_top_p_min_p_sampling_from_probs_torch`, filtered weights over their support mass as
    `Sampler._build_sampling_mask_output` divides them), back in vocabulary order; 0 outside the support."""
    ns = _load("srt/layers/sampler.py", {"top_k_top_p_min_p_sampling_from_probs_torch"},
               {"torch": torch, "Optional": typing.Optional})
    _, weights, ids, _ = ns["top_k_top_p_min_p_sampling_from_probs_torch"](
        probs.clone(), top_k, top_p, torch.zeros(len(probs)), False, None, None, return_filtered_probs=True)
    weights = weights / weights.sum(-1, keepdim=True)
    return torch.zeros_like(weights).scatter(-1, ids.long(), weights)


def validate_request(name: str, body: dict):
    """`body` as SGLang's FastAPI app parses it into request model `name` (pydantic; ValueError if refused)."""
    import pydantic

    cls = _io_struct()[name]
    if name == "GenerateReqInput":  # a dataclass, which FastAPI parses ignoring unknown keys (the fields
        # sglang-router adds: model, log_metrics, ...), as SGLang's contract gate does (sglang/api/v1/api_types.py)
        return cls(**{k: v for k, v in body.items() if k in {f.name for f in dataclasses.fields(cls)}})
    return pydantic.TypeAdapter(cls).validate_python(body)


def join_and_receive(port: int, world: int, rank: int, names, dtypes, shapes, out: Path) -> None:
    """A worker's tensor-parallel rank in its own process: joins the group "opd-sao-test" at 127.0.0.1:`port`
    with SGLang's init_custom_process_group, receives one flattened bucket as SGLang's model runner does,
    and saves what it got to `out`/rank{rank}.pt."""
    import datetime

    group = common()["init_custom_process_group"](
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", timeout=datetime.timedelta(seconds=120),
        world_size=world, rank=rank, group_name="opd-sao-test")
    got = receive_weights_from_distributed(group, names, dtypes, shapes, "flattened_bucket")
    torch.save({n: t.clone() for n, t in got}, out / f"rank{rank}.pt")
    # end here, as deepspeed_backend.shut_down ends a rank: gloo's threads can abort a finished process in interpreter
    # teardown ("terminate called without an active exception", exit -6; 1 of 5 fresh-clone runs), which a real
    # SGLang rank, living on, never meets
    torch.distributed.destroy_process_group(group)
    os._exit(0)


@lru_cache(None)
def auth() -> dict:
    """sglang/srt/utils/auth.py's pure decision (`decide_request_auth`, `AuthLevel`) and, read from
    entrypoints/http_server.py's route decorators, each path's auth level (NORMAL unless decorated)."""
    import enum
    import secrets

    ns = _load("srt/utils/auth.py", {"AuthDecision", "AuthLevel", "decide_request_auth"},
               {"secrets": secrets, "dataclass": dataclasses.dataclass, "Enum": enum.Enum, **_typing()})
    levels = {}
    for node in ast.walk(ast.parse((_root() / "srt/entrypoints/http_server.py").read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths = [d.args[0].value for d in node.decorator_list if isinstance(d, ast.Call)
                 and isinstance(d.func, ast.Attribute) and d.func.attr in ("get", "post", "api_route")
                 and d.args and isinstance(d.args[0], ast.Constant)]
        level = [d.args[0].attr for d in node.decorator_list if isinstance(d, ast.Call)
                 and getattr(d.func, "id", None) == "auth_level" and isinstance(d.args[0], ast.Attribute)]
        for path in paths:
            levels[path] = level[0] if level else "NORMAL"
    ns["levels"] = levels
    return ns
