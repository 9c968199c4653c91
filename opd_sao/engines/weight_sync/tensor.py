"""`tensor`: the weights inside the HTTP request, in SGLang 0.5.23's `/update_weights_from_tensor` format.

Each request carries one bucket (at most `engine.weight_sync_bucket_mb`; one dtype) inside a weight-update
session. `serialized_named_tensors` holds one entry per tensor-parallel rank of the worker (each rank reads
its own index), each the base64 of a pickle that SGLang's `MultiprocessingSerializer.deserialize` (its
`SafeUnpickler`) reads: with `load_format` "flattened_bucket" a dict of one uint8 `flattened_tensor` and
`metadata` (name, shape, dtype, start_idx, end_idx, numel per tensor; plain namespaces, which the
unpickler allows), with `load_format` null a list of (name, tensor). The tensors are CPU tensors pickled
with their bytes (plain pickle, not SGLang's CUDA-IPC handles), so the payload crosses hosts; the worker
copies them to its device. Only the last bucket sets `weight_version` (and flushes the cache).

Serve's side reads the payload with a restricted unpickler of its own (`safe_loads`: tensors, storages as
weights-only `torch.load`, dtypes, sizes, plain containers and namespaces; nothing that runs code).
"""
from __future__ import annotations

import base64
import binascii
import io
import pickle
import types
from typing import Optional

import torch

from .base import (
    WEIGHT_SYNCS,
    WeightSyncMode,
    WeightSyncRefused,
    buckets,
    check_finite,
    check_incoming,
    untied,
    weight_version,
)

LOAD_FORMATS = (None, "flattened_bucket")


def serialize(named: list[tuple[str, torch.Tensor]], load_format: Optional[str]) -> str:
    """One bucket as SGLang's tensor payload (base64 of a pickle) for `load_format` (None or flattened_bucket)."""
    if load_format == "flattened_bucket":
        metadata, offset = [], 0
        for name, tensor in named:
            size = tensor.numel() * tensor.element_size()
            metadata.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                                  end_idx=offset + size, numel=size))
            offset += size
        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])
        obj = {"flattened_tensor": flat, "metadata": metadata}
    else:
        obj = [(name, tensor.clone()) for name, tensor in named]  # a clone pickles its own bytes, not a shared buffer
    return base64.b64encode(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def _storage(data: bytes):
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a tensor storage, got {type(storage).__name__}")
    return storage


class _Unpickler(pickle.Unpickler):
    ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
               ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"), ("torch", "Size"),
               ("collections", "OrderedDict"), ("types", "SimpleNamespace")}

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor payload")


def safe_loads(data: str):
    """A base64 tensor payload, unpickled without running anything but tensor and container rebuilds."""
    return _Unpickler(io.BytesIO(base64.b64decode(data, validate=True))).load()


def named_tensors(obj, load_format: Optional[str]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a deserialized payload, checked for shape (as SGLang reads them)."""
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or not isinstance(obj.get("flattened_tensor"), torch.Tensor) \
                or obj["flattened_tensor"].dtype != torch.uint8 or not isinstance(obj.get("metadata"), list):
            raise WeightSyncRefused("a flattened_bucket payload is a dict of a uint8 flattened_tensor and metadata")
        flat, out = obj["flattened_tensor"].reshape(-1), []
        for meta in obj["metadata"]:
            dtype, shape = getattr(meta, "dtype", None), getattr(meta, "shape", None)
            start, end = getattr(meta, "start_idx", None), getattr(meta, "end_idx", None)
            if not isinstance(dtype, torch.dtype) or not isinstance(shape, (torch.Size, tuple, list)) \
                    or not all(isinstance(v, int) for v in (start, end)) or not 0 <= start <= end <= flat.numel() \
                    or (end - start) != torch.Size(shape).numel() * dtype.itemsize or start % dtype.itemsize:
                raise WeightSyncRefused("flattened_bucket metadata does not describe its flattened_tensor")
            out.append((getattr(meta, "name", None), flat[start:end].view(dtype).reshape(shape)))
    else:
        out = obj if isinstance(obj, list) else []
        if not obj or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in out):
            raise WeightSyncRefused("a payload with load_format null is a non-empty list of (name, tensor) pairs")
    if not all(isinstance(name, str) for name, _ in out) or len({n for n, _ in out}) != len(out):
        raise WeightSyncRefused("the tensors' names must be distinct strings")
    return out


@WEIGHT_SYNCS.register("tensor")
class TensorSync(WeightSyncMode):
    name = "tensor"
    routes = {"/update_weights_from_tensor": "serve_update"}
    load_format = "flattened_bucket"  # or None: SGLang reads both
    deserialize = staticmethod(safe_loads)  # server side: payload string -> object (tests plug SGLang's in)

    def push(self, state_dict, version, clients, each):
        payloads = [serialize(bucket, self.load_format)
                    for bucket in buckets(untied(state_dict), self.settings.bucket_bytes)]

        def load(client):
            session = client.begin_weight_update()
            try:
                for i, data in enumerate(payloads):
                    last = i == len(payloads) - 1
                    client.weight_call("/update_weights_from_tensor", {
                        "serialized_named_tensors": [data] * client.tp_size(), "load_format": self.load_format,
                        "weight_version": str(version) if last else None, "flush_cache": last})
            finally:
                if session:
                    client.end_weight_update()

        return each(load, clients)

    def serve_update(self, body: dict, target) -> dict:
        if not target.session_open():
            raise WeightSyncRefused("update_weights_from_tensor must run in a weight-update session, between "
                                    "begin_weight_update() and end_weight_update()")
        load_format = body.get("load_format")
        if load_format not in LOAD_FORMATS:
            raise WeightSyncRefused(f"load_format {load_format!r}: use null or 'flattened_bucket'")
        version = weight_version(body)
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
            raise WeightSyncRefused("serialized_named_tensors must be a non-empty list of base64 strings, one per "
                                    "tensor-parallel rank")
        try:
            obj = self.deserialize(payloads[0])  # this server is tensor-parallel rank 0
        except (pickle.UnpicklingError, binascii.Error, ValueError, EOFError, RuntimeError, TypeError,
                AttributeError) as err:
            raise WeightSyncRefused(f"serialized_named_tensors[0] is not a tensor payload SGLang reads: "
                                    f"{type(err).__name__}: {str(err)[:200]}") from None
        state = dict(named_tensors(obj, load_format))
        check_incoming(target, {k: v.shape for k, v in state.items()}, {k: v.dtype for k, v in state.items()},
                       "serialized_named_tensors")
        check_finite(state, "serialized_named_tensors")
        target.install(state, version)
        return {"success": True, "message": "Success"}
