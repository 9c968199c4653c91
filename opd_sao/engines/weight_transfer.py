"""Weight syncs without the filesystem, both ends: tensors over HTTP and a process group for broadcasts.

- `update_weights_from_tensor`: the named tensors travel in the request as base64 safetensors bytes
  (`load_format: "safetensors"`): safe to parse (no pickle), readable on any host.
- `init_weights_update_group` / `update_weights_from_distributed`: SGLang's handshake. The trainer is
  rank 0 of a group of its own (a TCPStore it hosts; the default process group, e.g. DeepSpeed's, is
  untouched); each server joins at `rank_offset` and receives every tensor by broadcast from rank 0,
  in the order of the request's `names`. gloo on CPU here; the same calls with NCCL on GPUs.
"""
from __future__ import annotations

import base64
import datetime

import torch
import torch.distributed as dist
from safetensors.torch import load, save

TENSOR_FORMAT = "safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def untied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies, each storage once: tied weights (the model's config re-ties them) are dropped."""
    tensors, stored = {}, set()
    for name, tensor in state_dict.items():
        if tensor.numel() and tensor.data_ptr() in stored:
            continue
        stored.add(tensor.data_ptr())
        tensors[name] = tensor.detach().cpu().contiguous()
    return tensors


def pack_tensors(state_dict: dict[str, torch.Tensor]) -> str:
    return base64.b64encode(save(untied(state_dict))).decode("ascii")


def unpack_tensors(data: str) -> dict[str, torch.Tensor]:
    return load(base64.b64decode(data))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def host_store(address: str, world_size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """The trainer's rendezvous store, on a free port (`store.port`), for a group of `world_size` ranks."""
    return dist.TCPStore(address, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def connect_store(address: str, port: int, world_size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    return dist.TCPStore(address, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def join_group(store: dist.TCPStore, rank: int, world_size: int, group_name: str, backend: str = "gloo",
               timeout_s: float = 600.0) -> dist.ProcessGroup:
    """A process group outside the default one (blocks until all `world_size` ranks joined)."""
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=timeout_s))
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world_size)
    raise ValueError(f"weight update group backend {backend!r}: use gloo or nccl")


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()

