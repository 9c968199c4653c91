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
  request runs, and serve's own answer must agree.

Usage: python tests/sglang_worker.py CHECKPOINT --port PORT [--sampling-mask-max-tokens N] [opd-sao serve options]
"""
from __future__ import annotations

import sys
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


def _parsed_by_sglang(handler, model: str):
    def handle(self, body: dict, target):
        sglang_code.validate_request(model, body)  # pydantic's ValidationError: HTTP 500, the test fails
        return handler(self, body, target)

    return handle


def plug_in_sglang(sampling_mask_max_tokens: int = 4096) -> None:
    common = sglang_code.common()
    TensorSync.deserialize = staticmethod(common["MultiprocessingSerializer"].deserialize)
    DistributedSync.init_group = staticmethod(common["init_custom_process_group"])
    DistributedSync.receive = staticmethod(sglang_code.receive_weights_from_distributed)
    for name in WEIGHT_SYNCS.names():
        cls = WEIGHT_SYNCS.get(name)
        for path, handler in cls.routes.items():
            setattr(cls, handler, _parsed_by_sglang(getattr(cls, handler), REQUEST_MODELS[path]))
    from opd_sao.engines import server

    generate = server.RolloutServer.generate

    def checked_generate(self, body, *args, **kwargs):
        if isinstance(body, dict):
            sglang_code.validate_request("GenerateReqInput", body)
            params, masks = body.get("sampling_params") or {}, body.get("return_sampling_mask") or False
            params = params if isinstance(params, list) else [params]
            for one, mask in zip(params, masks if isinstance(masks, list) else [masks] * len(params)):
                sampling = sglang_code.verify_sampling_params(one, self.vocab_size)
                refused = mask and sglang_code.sampling_mask_refusal(sampling, sampling_mask_max_tokens)
                if refused:
                    raise server.BadRequest(refused)
        return generate(self, body, *args, **kwargs)

    server.RolloutServer.generate = checked_generate
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
