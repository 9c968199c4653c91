"""A weight-sync mode: how a new policy version travels from the trainer to the rollout workers.

One registered class per mode holds both ends: the client side (`push`, run by the fleet in the trainer's
process for every live worker) and the server side (`routes`: the endpoints `opd-sao serve` binds to the
mode's handlers, which load into a `WeightTarget`). A new mode is one file in this package: it registers
itself with `@WEIGHT_SYNCS.register(name)` and `engine.weight_sync: name` picks it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Protocol

import torch
from pydantic import BaseModel

from opd_sao.registry import NoOptions, Registry, parse_options

from ..http import SGLangClient

# the dtypes a weight may travel in (the served model casts to its own); others (float64, integers, bool,
# complex) are refused rather than silently cast
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GROUP_TIMEOUT_S = 60.0  # a weight update group not formed in this time fails instead of hanging
BROADCAST_TIMEOUT_S = 300.0  # one bucket's broadcast (the workers receive at once: generation is paused)
DRAIN_TIMEOUT_S = 120.0  # /pause_generation: the running requests aborted and gone
BUCKET_BYTES = 256 << 20  # tensors travel in buckets of at most this many bytes (one tensor may exceed it)


class WeightSyncRefused(ValueError):
    """A server-side weight call this server cannot honour: answered 400 with `success: false`."""


@dataclass
class SyncSettings:
    """What the client side of a mode is given (from EngineConfig)."""

    template: Optional[Path] = None  # the checkpoint whose config and tokenizer files a disk sync copies
    weights_dir: Optional[Path] = None  # where disk syncs write (the workers must read it)
    address: Optional[str] = None  # distributed: this process's address as the workers reach it (None: the
    # address on the route to the first worker)
    bucket_bytes: int = BUCKET_BYTES
    group_timeout_s: float = GROUP_TIMEOUT_S  # distributed: forming the group
    broadcast_timeout_s: float = BROADCAST_TIMEOUT_S  # distributed: each bucket's broadcast
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # every mode that pauses: /pause_generation's answer
    options: dict[str, Any] = field(default_factory=dict)  # engine.weight_sync_options: the mode's `Options`


class WeightTarget(Protocol):
    """What a server offers a mode's server side (`opd_sao.engines.server.RolloutServer`)."""

    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every weight of the served model's state dict (tied ones under each name): its shape and dtype."""

    def install(self, state: dict[str, torch.Tensor], weight_version: Optional[str]) -> None:
        """Swap these weights in once the requests in flight have finished."""

    def session_open(self) -> bool:
        """Whether a weight-update session (`/begin_weight_update`) is open."""

    def load_checkpoint(self, path: str) -> dict[str, torch.Tensor]:
        """The state dict of an HF checkpoint directory the server may read (else WeightSyncRefused)."""


# each(update, clients, during=None) -> the clients that completed update(client): the fleet's parallel
# runner (one that stopped answering is taken out of the fleet and left out of the result)
Each = Callable[..., list[SGLangClient]]


class WeightSyncMode(ABC):
    """Both ends of one way to sync weights. Client-side instances live in the fleet; serve makes one
    instance per mode for its server-side handlers (any state, e.g. joined groups, is kept on it)."""

    name: ClassVar[str]
    routes: ClassVar[dict[str, str]] = {}  # serve: endpoint path -> the name of this class's handler method
    collective: ClassVar[bool] = False  # a push reaches all its workers at once (a worker that comes back gets
    # the weights with every live one)
    pauses: ClassVar[bool] = True  # the fleet pauses generation around a push (`/pause_generation` mode abort ...
    # `/continue_generation`): SGLang takes its update lock per call, so requests would run between two buckets

    Options: ClassVar[type[BaseModel]] = NoOptions  # its own settings (engine.weight_sync_options), validated
    # before any work (`parse_options`) and read as `self.options`; the server side gets the defaults

    def __init__(self, settings: Optional[SyncSettings] = None):
        self.settings = settings or SyncSettings()
        self.options = self.parse_options(self.settings.options)

    @classmethod
    def parse_options(cls, options: Optional[dict]) -> BaseModel:
        """`engine.weight_sync_options` validated by this mode's `Options` (UsageError naming a bad key)."""
        return parse_options(cls.Options, options, f"engine.weight_sync {cls.name!r}: weight_sync_options")

    @abstractmethod
    def push(self, state_dict: dict[str, torch.Tensor], version: int, clients: list[SGLangClient],
             each: Each) -> list[SGLangClient]:
        """Client side: load `state_dict` as weight_version str(version) on `clients`; returns the clients
        that did (the fleet then checks each one's reported weight_version)."""

    def push_checkpoint(self, checkpoint: str | Path, version: int, clients: list[SGLangClient],
                        each: Each) -> list[SGLangClient]:
        """Client side: the HF checkpoint directory `checkpoint` as version `version` (the start weights). Default:
        its tensors, pushed as every sync (no filesystem shared with the workers); a mode whose workers read
        checkpoints themselves sends the path instead."""
        from opd_sao.checkpoints import load_causal_lm

        return self.push(load_causal_lm(checkpoint).state_dict(), version, clients, each)

    def close(self, clients: list[SGLangClient]) -> None:
        """Client side: release what the mode holds on the live `clients` (e.g. a process group)."""

    def forget(self) -> None:
        """Client side: the worker set changed (one died or came back); state tied to it is made again."""


WEIGHT_SYNCS: Registry[type[WeightSyncMode]] = Registry("weight sync mode")


def untied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies, each storage once: tied weights (the model's config re-ties them) are dropped."""
    tensors, stored = {}, set()
    for name, tensor in state_dict.items():
        if tensor.numel() and tensor.data_ptr() in stored:
            continue
        stored.add(tensor.data_ptr())
        tensors[name] = tensor.detach().cpu().contiguous()
    return tensors


def buckets(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors in order, grouped into buckets of one dtype and at most `max_bytes` (a larger tensor alone):
    one dtype per bucket keeps every tensor's byte offset aligned in a flattened bucket."""
    out, current, size = [], [], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and (size + nbytes > max_bytes or tensor.dtype != current[-1][1].dtype):
            out.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        out.append(current)
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_incoming(target: WeightTarget, shapes: dict[str, tuple], dtypes: dict[str, torch.dtype], source: str) -> None:
    """Server side, before anything is received or loaded: every name is a parameter of the served model
    with its shape, and every dtype a float one. A sync may carry any subset (buckets; tied weights once)."""
    expected = target.expected_weights()
    unknown = [k for k in shapes if k not in expected]
    if unknown:
        raise WeightSyncRefused(f"{source}: {unknown[0]!r} is not a parameter of the served model")
    wrong = [k for k in shapes if tuple(shapes[k]) != tuple(expected[k][0])]
    if wrong:
        raise WeightSyncRefused(f"{source}: {wrong[0]!r} has shape {list(shapes[wrong[0]])}, the served model's is "
                                f"{list(expected[wrong[0]][0])}")
    bad = [k for k in dtypes if dtypes[k] not in WIRE_DTYPES.values()]
    if bad:
        raise WeightSyncRefused(f"{source}: {bad[0]!r} is {dtype_name(dtypes[bad[0]])}; weights travel as one of "
                                f"{sorted(WIRE_DTYPES)}")


def check_finite(state: dict[str, torch.Tensor], source: str) -> None:
    """Server side, before loading: non-finite weights would make every later generation fail."""
    for name, tensor in state.items():
        if not bool(torch.isfinite(tensor).all()):
            raise WeightSyncRefused(f"{source}: {name!r} has non-finite values (NaN or inf); nothing was loaded")


def weight_version(body: dict) -> Optional[str]:
    """The request's weight_version: None, or a short printable ASCII string."""
    version = body.get("weight_version")
    if version is None:
        return None
    if not isinstance(version, (str, int)) or isinstance(version, bool) or not str(version).isascii() \
            or not str(version).isprintable() or len(str(version)) > 128:
        raise WeightSyncRefused(f"weight_version must be a short printable ASCII string, got {version!r}")
    return str(version)
