"""A rollout worker that behaves as SGLang 0.5.23 does, for tests: `opd-sao serve` with SGLang's own code
plugged in where it runs on a CPU (tests/sglang_code.py loads it from the installed wheel):

- /update_weights_from_tensor's payload is read by SGLang's `MultiprocessingSerializer.deserialize`
  (its `SafeUnpickler`), not by serve's own restricted unpickler;
- /init_weights_update_group joins through SGLang's `init_custom_process_group`, and
  /update_weights_from_distributed receives through SGLang's model runner (`receive_weights_from_distributed`,
  its `FlattenedTensorBucket`);
- every weight call's body is parsed by SGLang's request model first (as its FastAPI app does), and every
  /generate body by its `GenerateReqInput` and every sampling_params by its `SamplingParams.verify`: a field
  SGLang would refuse fails the call (HTTP 500).

Usage: python tests/sglang_worker.py CHECKPOINT --port PORT [opd-sao serve options]
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


def plug_in_sglang() -> None:
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
            params = body.get("sampling_params") or {}
            for one in params if isinstance(params, list) else [params]:
                sglang_code.verify_sampling_params(one, self.vocab_size)
        return generate(self, body, *args, **kwargs)

    server.RolloutServer.generate = checked_generate


if __name__ == "__main__":
    plug_in_sglang()
    from opd_sao.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
