"""A rollout worker that behaves as SGLang 0.5.23 does, for tests: `opd-sao serve` with SGLang's own code
plugged in where it runs on a CPU (tests/sglang_code.py loads it from the installed wheel):

- /update_weights_from_tensor's payload is read by SGLang's `MultiprocessingSerializer.deserialize`
  (its `SafeUnpickler`), not by serve's own restricted unpickler;
- /init_weights_update_group joins through SGLang's `init_custom_process_group`, and
  /update_weights_from_distributed receives through SGLang's model runner (`receive_weights_from_distributed`,
  its `FlattenedTensorBucket`);
- every weight call's body is parsed by SGLang's request model first (as its FastAPI app does), and every
  /generate body by its `GenerateReqInput` and every sampling_params by its `SamplingParams.verify`: a field
  SGLang would refuse fails the call (HTTP 500);
- a /generate asking `return_sampling_mask` passes its scheduler's check (`sglang_code.sampling_mask_refusal`:
  top_k 1 or 1 < top_k <= --sampling-mask-max-tokens, 4096 unless given) or is refused with its message (HTTP 400,
  as SGLang aborts it);
- /flush_cache is answered by its scheduler's code (`sglang_code.flush_cache_succeeds`): refused (400) while a
  request runs, and serve's own answer must agree;
- its tokenizer manager's code (`sglang_code.tokenizer_manager_class`: the pause, the model-update lock, their
  rules in sglang_code's docstring) stands in front of serve: it admits each /generate, runs /pause_generation,
  /continue_generation and the weight updates, and where it calls SGLang's scheduler serve's own handler runs. A
  /generate it lets run that serve would hold (paused, or updating its weights) fails (HTTP 500). Its state is
  in /server_info's `sglang_tokenizer_manager` (for tests to order by).

Usage: python tests/sglang_worker.py CHECKPOINT --port PORT [--sampling-mask-max-tokens N] [opd-sao serve options]
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import sys
import threading
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang_code

from opd_sao.engines.weight_sync import WEIGHT_SYNCS
from opd_sao.engines.weight_sync.distributed import DistributedSync
from opd_sao.engines.weight_sync.tensor import TensorSync

REQUEST_MODELS = {"/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
                  "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
                  "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
                  "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
                  "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput"}


# the weight routes that SGLang's tokenizer manager runs under its pause and lock rules: path -> its method
UPDATES = {"/update_weights_from_disk": "update_weights_from_disk",
           "/update_weights_from_tensor": "update_weights_from_tensor",
           "/update_weights_from_distributed": "update_weights_from_distributed"}
SCHEDULER = contextvars.ContextVar("SCHEDULER")  # in a call's task: what its SGLang code reaches as its scheduler


class TokenizerManagerFront:
    """SGLang's tokenizer manager (its code) in front of one serve, on an event loop of its own. Where its code
    calls its scheduler, serve's own handler runs, on the HTTP request's thread, while that code waits inside its
    locks: a /generate holds the lock's reader side while serve generates, an update the writer side (unless
    paused) while serve loads."""

    def __init__(self, server):
        self.server, self.held = server, 0  # held: requests SGLang's code has not let in yet
        # weight updates by whether SGLang's manager was paused when they came: unpaused, its code takes the update
        # lock's writer side, which waits for every running generation to finish
        self.updates = {"paused": 0, "unpaused": 0}
        self._pausing = threading.Lock()  # SGLang's pause and serve's, then a continue: one at a time
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="sglang-tokenizer-manager").start()
        self.tm = self.call(self._manager())

    async def _manager(self):
        tm = sglang_code.tokenizer_manager_class()()
        tm.model_update_lock, tm.is_pause, tm.is_pause_cond, tm.mm_processor = \
            tm.RWLock(), False, asyncio.Condition(), None

        async def scheduler(obj):
            await SCHEDULER.get()()

        async def communicator(obj):
            await SCHEDULER.get()()
            return [types.SimpleNamespace(success=True, message="")]

        async def from_disk(obj):
            await SCHEDULER.get()()
            return True, "", 0

        tm._async_dispatch_to_scheduler, tm._wait_for_model_update_from_disk = scheduler, from_disk
        for name in (*UPDATES.values(), "begin_weight_update", "end_weight_update"):
            setattr(tm, f"{name}_communicator", communicator)
        tm.abort_request = self._abort
        tm.auto_create_handle_loop = lambda: None
        tm.config_value = lambda name: None  # load_format: serve's own default
        tm._update_weight_version_if_provided = lambda version: None  # serve keeps its own
        return tm

    def _abort(self, rid: str = "", abort_all: bool = False) -> None:
        """SGLang's abort, as its scheduler gets it: serve aborts what runs (the pause aborts all)."""
        assert abort_all and not rid
        with self.server._cond:
            self.server._abort(lambda waiter: True)

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def through(self, sglang, serve):
        """`serve()` run where SGLang's code `sglang(run)` reaches its scheduler (`run()`, or SCHEDULER's), inside
        its locks; serve's answer, or its error raised through SGLang's code."""
        entered, leave = concurrent.futures.Future(), []

        async def run():
            leave.append(self.loop.create_future())
            entered.set_result(None)
            await leave[0]

        async def task():
            SCHEDULER.set(run)
            return await sglang(run)

        done = asyncio.run_coroutine_threadsafe(task(), self.loop)
        concurrent.futures.wait([entered, done], return_when=concurrent.futures.FIRST_COMPLETED)
        if not entered.done():
            done.result()
            raise RuntimeError("SGLang's tokenizer manager answered without reaching its scheduler")
        try:
            answer = serve()
        except Exception as err:
            self.loop.call_soon_threadsafe(leave[0].set_exception, err)
            concurrent.futures.wait([done])
            raise
        self.loop.call_soon_threadsafe(leave[0].set_result, None)
        done.result()
        return answer

    def admitted(self, serve):
        """`serve()` once SGLang's tokenizer manager lets the request in (`admit`); serve must not hold it then."""
        async def admit(run):
            self.held += 1

            async def let_in():
                self.held -= 1
                await run()

            return await self.tm.admit(let_in)

        def checked():
            with self.server._cond:
                held_by = "paused" if self.server._paused else "updating its weights" if self.server._updating else None
            if held_by:
                raise RuntimeError(f"SGLang's tokenizer manager runs this request (not paused, no update holding its "
                                   f"lock); serve would hold it ({held_by})")  # HTTP 500
            return serve()

        return self.through(admit, checked)

    def pause(self, obj, serve):
        """Mode abort: SGLang's pause (aborting through serve until no request runs), then serve's own."""
        with self._pausing:
            self.call(self.tm.pause_generation(obj))
            return serve()

    def resume(self, obj, serve):
        with self._pausing:
            return self.through(lambda run: self.tm.continue_generation(obj), serve)

    def state(self) -> dict:
        async def read():
            lock = self.tm.model_update_lock
            return {"is_pause": self.tm.is_pause, "held": self.held, "readers": lock._readers,
                    "writer_active": lock._writer_active, "waiting_writers": lock._waiting_writers,
                    "updates": dict(self.updates)}

        return self.call(read())


def _parsed_by_sglang(handler, model: str, path: str):
    def handle(self, body: dict, target):
        obj = sglang_code.validate_request(model, body)  # pydantic's ValidationError: HTTP 500, the test fails
        if path not in UPDATES:
            return handler(self, body, target)
        front = target.sglang
        front.updates["paused" if front.tm.is_pause else "unpaused"] += 1
        return front.through(lambda run: getattr(front.tm, UPDATES[path])(obj), lambda: handler(self, body, target))

    return handle


def plug_in_sglang(sampling_mask_max_tokens: int = 4096) -> None:
    common = sglang_code.common()
    # every piece of SGLang's code a request runs is parsed and compiled here, before the first request: its
    # lru_caches let two first calls run at once on serve's threads, and CPython 3.11's ast constructors are not
    # safe across threads (an HTTP 500 "AST constructor recursion depth mismatch" under load, which cut short a
    # request test_sglang_pause_rules was holding)
    sglang_code.sampling_mask_refusal(sglang_code.verify_sampling_params({}, 2), sampling_mask_max_tokens)
    sglang_code.validate_request("GenerateReqInput", {"input_ids": [0]})
    TensorSync.deserialize = staticmethod(common["MultiprocessingSerializer"].deserialize)
    DistributedSync.init_group = staticmethod(common["init_custom_process_group"])
    DistributedSync.receive = staticmethod(sglang_code.receive_weights_from_distributed)
    for name in WEIGHT_SYNCS.names():
        cls = WEIGHT_SYNCS.get(name)
        for path, handler in cls.routes.items():
            setattr(cls, handler, _parsed_by_sglang(getattr(cls, handler), REQUEST_MODELS[path], path))
    from opd_sao.engines import server

    generate = server.RolloutServer.generate

    def checked_generate(self, body, *args, **kwargs):
        if not isinstance(body, dict):
            return generate(self, body, *args, **kwargs)
        sglang_code.validate_request("GenerateReqInput", body)

        def scheduled():  # SGLang's tokenizer and scheduler checks, once its tokenizer manager let it in
            params, masks = body.get("sampling_params") or {}, body.get("return_sampling_mask") or False
            params = params if isinstance(params, list) else [params]
            for one, mask in zip(params, masks if isinstance(masks, list) else [masks] * len(params)):
                sampling = sglang_code.verify_sampling_params(one, self.vocab_size)
                refused = mask and sglang_code.sampling_mask_refusal(sampling, sampling_mask_max_tokens)
                if refused:
                    raise server.BadRequest(refused)
            return generate(self, body, *args, **kwargs)

        return self.sglang.admitted(scheduled)

    server.RolloutServer.generate = checked_generate
    _plug_in_tokenizer_manager(server)
    flush = server.RolloutServer.flush_cache

    def checked_flush(self, timeout_s: float = 0.0) -> bool:
        """/flush_cache without a timeout as SGLang's scheduler answers it (its code), checked against serve's."""
        if timeout_s:
            return flush(self, timeout_s)
        with self._cond:
            ours, sglang = flush(self, 0.0), sglang_code.flush_cache_succeeds(self._inflight)
        if ours != sglang:
            raise RuntimeError(f"serve answers /flush_cache {ours}, SGLang's scheduler {sglang}")  # HTTP 500
        return sglang
    server.RolloutServer.flush_cache = checked_flush


def _plug_in_tokenizer_manager(server) -> None:
    """Each RolloutServer with SGLang's tokenizer manager in front (`.sglang`): pause, continue, the session's
    begin/end and /server_info go through it (the weight routes: `_parsed_by_sglang`; /generate: `plug_in_sglang`)."""
    cls = server.RolloutServer
    init, pause, resume, info = cls.__init__, cls.pause_generation, cls.continue_generation, cls.server_info

    def with_front(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.sglang = TokenizerManagerFront(self)

    def pause_generation(self, body):
        obj = sglang_code.validate_request("PauseGenerationReqInput", body)
        if obj.mode != "abort":  # serve refuses retract and in_place (400); were it to take one, SGLang's manager
            return pause(self, body)  # would not be paused, and the next /generate fails as held by serve alone
        return self.sglang.pause(obj, lambda: pause(self, body))

    def continue_generation(self, body):
        obj = sglang_code.validate_request("ContinueGenerationReqInput", body)
        return self.sglang.resume(obj, lambda: resume(self, body))

    def session_call(name):
        serve_call = getattr(cls, name)

        def call(self, body):
            obj = sglang_code.validate_request(SESSION_MODELS[name], body)
            return self.sglang.through(lambda run: getattr(self.sglang.tm, name)(obj), lambda: serve_call(self, body))

        return call

    cls.__init__, cls.pause_generation, cls.continue_generation = with_front, pause_generation, continue_generation
    for name in SESSION_MODELS:
        setattr(cls, name, session_call(name))
    cls.server_info = lambda self, body=None: {**info(self, body), "sglang_tokenizer_manager": self.sglang.state()}


SESSION_MODELS = {"begin_weight_update": "BeginWeightUpdateReqInput", "end_weight_update": "EndWeightUpdateReqInput"}


if __name__ == "__main__":
    args = sys.argv[1:]
    cap = 4096
    if "--sampling-mask-max-tokens" in args:  # SGLang's launch flag, not serve's
        at = args.index("--sampling-mask-max-tokens")
        cap = int(args[at + 1])
        del args[at:at + 2]
    plug_in_sglang(cap)
    from opd_sao.app.cli import main

    sys.exit(main(["serve", *args]))
