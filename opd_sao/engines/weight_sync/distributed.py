"""`distributed`: the weights broadcast from the trainer over a weight update group, as SGLang 0.5.23
forms and reads it.

The group: the trainer is rank 0 and hosts the rendezvous store on a free port (listening on every interface),
which the workers reach at `engine.weight_sync_address` (default: this machine's address on the route to the
first worker; a loopback one with a worker on another host is refused in one line); each worker joins through `/init_weights_update_group` with `rank_offset`, and SGLang places its
tensor-parallel rank r at `rank_offset + r`, so the world is 1 + the sum of the workers' `tp_size` (read
from `/server_info`) and several workers share one group. Both ends form it as SGLang's
`init_custom_process_group` does: the store (a `tcp://` rendezvous on the workers), `PrefixStore(group_name)`,
then torch's `_new_process_group_helper`, which adds its own key prefixes. NCCL when the trainer's weights
are on CUDA, gloo on CPU. Timeouts by phase: the group forms within `engine.weight_sync_timeout_s` (a worker
that cannot join, e.g. at an address it cannot reach, stops the run in one line before the first step), each
bucket's broadcast within `engine.weight_sync_broadcast_timeout_s`; the fleet pauses generation first
(`engine.weight_sync_drain_timeout_s`), so a worker receives at once instead of after its generations drain.

A sync, inside a weight-update session: one `/update_weights_from_distributed` per bucket (one dtype, at
most `engine.weight_sync_bucket_mb`) with `load_format: "flattened_bucket"`, while the trainer broadcasts
that bucket as one flattened uint8 tensor; only the last sets `weight_version`. The group is kept while the
same workers are live and made again when they change.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from opd_sao.errors import UsageError

from ..http import ServerDown, ServerError
from .base import (
    WEIGHT_SYNCS,
    WIRE_DTYPES,
    WeightSyncMode,
    WeightSyncRefused,
    buckets,
    check_finite,
    check_incoming,
    dtype_name,
    untied,
    weight_version,
)

BACKENDS = ("gloo", "nccl")


def _resolve(future: Future, fn, *args) -> None:
    """fn(*args) into `future` (its result or its exception)."""
    try:
        future.set_result(fn(*args))
    except BaseException as err:  # the caller's result() raises it
        future.set_exception(err)


def new_group(store, rank: int, world_size: int, group_name: str, backend: str, timeout: datetime.timedelta):
    """A process group outside the default one on `store`, formed as SGLang's init_custom_process_group forms
    it (blocks until all `world_size` ranks joined, or `timeout`)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def init_custom_process_group(*, backend: str, init_method: str, timeout: datetime.timedelta, world_size: int,
                              rank: int, group_name: str):
    """Server side: join the group at `init_method` (tcp://host:port) as SGLang's function of this name does
    (same keywords, so tests plug SGLang's own in)."""
    from torch.distributed.distributed_c10d import rendezvous

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return new_group(store, rank, world_size, group_name, backend, timeout)


def receive(group, names: list[str], dtypes: list[str], shapes: list[list[int]], load_format: Optional[str],
            device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Server side: the broadcast of one request's tensors from rank 0, as SGLang receives it (one flattened
    uint8 bucket, or one broadcast per tensor)."""
    dtypes_ = [WIRE_DTYPES[d] for d in dtypes]
    if load_format == "flattened_bucket":
        sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, dtypes_)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=group)
        out, offset = [], 0
        for name, dtype, shape, size in zip(names, dtypes_, shapes, sizes):
            out.append((name, flat[offset:offset + size].view(dtype).reshape(shape)))
            offset += size
        return out
    out = [(name, torch.empty(shape, dtype=dtype, device=device)) for name, dtype, shape in zip(names, dtypes_, shapes)]
    for _, tensor in out:
        dist.broadcast(tensor, src=0, group=group)
    return out


def _bucket(named: list[tuple[str, torch.Tensor]]) -> tuple[dict, torch.Tensor]:
    """(the request's names/dtypes/shapes, the flattened uint8 tensor that is broadcast)."""
    meta = {"names": [n for n, _ in named], "dtypes": [dtype_name(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}
    return meta, torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])


@WEIGHT_SYNCS.register("distributed")
class DistributedSync(WeightSyncMode):
    name = "distributed"
    routes = {"/init_weights_update_group": "serve_init", "/update_weights_from_distributed": "serve_update",
              "/destroy_weights_update_group": "serve_destroy"}
    collective = True
    init_group = staticmethod(init_custom_process_group)  # server side (tests plug SGLang's in)
    receive = staticmethod(receive)  # server side

    def __init__(self, settings=None):
        super().__init__(settings)
        self._group: Optional[tuple] = None  # client: (member urls, backend, name, group, store)
        self._made = 0
        self.groups: dict[str, object] = {}  # server: joined groups by name

    # --- client side -----------------------------------------------------------------------------------

    def push(self, state_dict, version, clients, each):
        device = next(iter(state_dict.values())).device
        backend = "nccl" if device.type == "cuda" else "gloo"
        parts = [_bucket(b) for b in buckets(untied(state_dict), self.settings.bucket_bytes)]  # CPU copies
        name, group = self._group_for(clients, backend)
        sessions = {}

        def begin(client):
            sessions[client.url] = client.begin_weight_update()

        live = each(begin, clients)
        try:
            for i, (meta, flat) in enumerate(parts):
                last = i == len(parts) - 1
                payload = {**meta, "group_name": name, "load_format": "flattened_bucket",
                           "weight_version": str(version) if last else None, "flush_cache": last}
                live = each(lambda c: c.weight_call("/update_weights_from_distributed", payload, retries=0,
                                                    timeout=self.settings.broadcast_timeout_s + 30), live,
                            during=lambda: dist.broadcast(flat.to(device), src=0, group=group))
        finally:
            each(lambda c: c.end_weight_update(), [c for c in live if sessions.get(c.url)])
        return live

    def _group_for(self, clients, backend: str):
        members = [c.url for c in clients]
        if self._group is not None and self._group[:2] == (members, backend):
            return self._group[2], self._group[3]
        self.forget()
        self._made += 1
        name, timeout = f"opd-sao-weights-{os.getpid()}-{self._made}", self.settings.group_timeout_s
        address = master_address(self.settings.address, [c.url for c in clients])
        offsets, world = [], 1
        for client in clients:
            offsets.append(world)
            world += client.tp_size()
        # the store listens on every interface; this process, its rank 0, reaches it on loopback
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        # rank 0 joins on a daemon thread, not the pool: a join that never completes (a worker that cannot reach
        # the store) must not hold the interpreter's exit, which joins every pool thread
        joined: Future = Future()
        threading.Thread(target=_resolve, name="weight-group-join", daemon=True, args=(
            joined, new_group, store, 0, world, name, backend,
            datetime.timedelta(seconds=self.settings.broadcast_timeout_s))).start()
        pool = ThreadPoolExecutor(len(clients))
        try:  # the group's own timeout bounds each collective on it: every bucket's broadcast
            joins = [pool.submit(c.weight_call, "/init_weights_update_group", {
                "master_address": address, "master_port": store.port, "rank_offset": offset,
                "world_size": world, "group_name": name, "backend": backend}, 0, timeout + 30)
                for c, offset in zip(clients, offsets)]
            for client, join in zip(clients, joins):
                try:
                    join.result()
                except (ServerError, ServerDown) as err:
                    if isinstance(err, ServerError) and err.status != 400 or isinstance(err, ServerDown) and err.status:
                        raise
                    raise UsageError(f"rollout worker {client.url} could not join the weight update group at "
                                     f"{address}:{store.port} within {timeout:.0f} s "
                                     f"({str(err).splitlines()[0][-200:]}): set engine.weight_sync_address to this "
                                     "machine's address as the workers reach it") from None
            group = joined.result()
        finally:
            pool.shutdown(wait=False)
        self._group = (members, backend, name, group, store, list(clients))
        return name, group

    def forget(self) -> None:
        if self._group is not None:
            self.close(self._group[5])

    def close(self, clients) -> None:
        if self._group is None:
            return
        members, name, group, self._group = self._group[0], self._group[2], self._group[3], None
        for client in clients:
            if client.url in members:
                try:
                    client.weight_call("/destroy_weights_update_group", {"group_name": name}, retries=0)
                except (ConnectionError, RuntimeError):  # a worker that died with the group has nothing to leave
                    pass
        dist.destroy_process_group(group)

    # --- server side -----------------------------------------------------------------------------------

    def serve_init(self, body: dict, target) -> dict:
        name = _group_name(body)
        address = body.get("master_address")
        if not isinstance(address, str) or not address or len(address) > 255:
            raise WeightSyncRefused(f"master_address must be a host name or address, got {address!r}")
        port = _integer(body, "master_port", 1, 65535)
        world = _integer(body, "world_size", 2, 1 << 16)
        rank = _integer(body, "rank_offset", 1, world - 1)  # rank 0 is the trainer; this server is TP 1
        backend = body.get("backend", "nccl")  # SGLang's default
        if backend not in BACKENDS:
            raise WeightSyncRefused(f"backend {backend!r}: use gloo or nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            raise WeightSyncRefused("backend nccl needs CUDA, which this server does not have: use gloo")
        if name in self.groups:
            raise WeightSyncRefused(f"weight update group {name!r} already exists on this server")
        try:
            group = self.init_group(backend=backend, init_method=f"tcp://{address}:{port}",
                                    timeout=datetime.timedelta(seconds=self.settings.group_timeout_s),
                                    world_size=world, rank=rank, group_name=name)
        except Exception as err:  # torch raises several types for an unreachable store
            raise WeightSyncRefused(f"Failed to initialize custom process group: {type(err).__name__}: "
                                    f"{str(err).splitlines()[0][:200] if str(err) else ''}") from None
        self.groups[name] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def serve_update(self, body: dict, target) -> dict:
        if not target.session_open():
            raise WeightSyncRefused("update_weights_from_distributed must run in a weight-update session, between "
                                    "begin_weight_update() and end_weight_update()")
        name = _group_name(body)
        if name not in self.groups:
            raise WeightSyncRefused(f"no weight update group {name!r}: call /init_weights_update_group first")
        load_format = body.get("load_format")
        if load_format not in (None, "flattened_bucket"):
            raise WeightSyncRefused(f"load_format {load_format!r}: use null or 'flattened_bucket'")
        version = weight_version(body)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not all(isinstance(v, list) for v in (names, dtypes, shapes)) or not names \
                or not len(names) == len(dtypes) == len(shapes):
            raise WeightSyncRefused("names, dtypes and shapes must be non-empty lists of one length")
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise WeightSyncRefused("names must be distinct parameter names")
        unknown = [d for d in dtypes if not isinstance(d, str) or d not in WIRE_DTYPES]
        if unknown:
            raise WeightSyncRefused(f"dtype {unknown[0]!r}: weights travel as one of {sorted(WIRE_DTYPES)}")
        if not all(isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
                   for s in shapes):
            raise WeightSyncRefused("each shape must be a list of non-negative integers")
        # checked before receiving: a refused request must not consume the broadcast
        check_incoming(target, dict(zip(names, shapes)), {n: WIRE_DTYPES[d] for n, d in zip(names, dtypes)},
                       "names, dtypes and shapes")
        try:
            state = dict(self.receive(self.groups[name], names, dtypes, shapes, load_format))
        except Exception as err:  # a failed collective: the trainer or the group is gone
            raise WeightSyncRefused(f"Failed to receive weights: {type(err).__name__}: {str(err)[:200]}") from None
        check_finite(state, "the broadcast weights")
        target.install(state, version)
        return {"success": True, "message": "Succeeded to update parameter online."}

    def serve_destroy(self, body: dict, target) -> dict:
        name = _group_name(body)
        group = self.groups.pop(name, None)
        if group is None:
            raise WeightSyncRefused("The group to be destroyed does not exist.")
        dist.destroy_process_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}


def master_address(configured: Optional[str], worker_urls: list[str]) -> str:
    """The address the workers join the group at: `configured`, else this machine's address on its route to the
    first worker (loopback for a worker on this host). A loopback address with a worker elsewhere is refused."""
    remote = [(url, urlsplit(url).hostname or "") for url in worker_urls]
    remote = [(url, host) for url, host in remote if not _loopback(host)]
    if configured is None:
        if not remote:
            return "127.0.0.1"
        url, host = remote[0]
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:  # a UDP connect picks the route and sends nothing
                probe.connect((host, 9))
            except OSError as err:
                raise UsageError(f"no route to rollout worker {url} to find this machine's address for weight_sync "
                                 f"distributed ({err.strerror or err}): set engine.weight_sync_address") from None
            return probe.getsockname()[0]
    if _loopback(configured) and remote:
        raise UsageError(f"engine.weight_sync_address {configured} is loopback, which rollout worker {remote[0][0]} "
                         "cannot reach: set it to this machine's address as the workers reach it (or leave it "
                         "unset to use the address on the route to them)")
    return configured


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _group_name(body: dict) -> str:
    name = body.get("group_name", "weight_update_group")
    if not isinstance(name, str) or not name or len(name) > 128 or not name.isprintable():
        raise WeightSyncRefused(f"group_name must be a short non-empty string, got {name!r}")
    return name


def _integer(body: dict, key: str, low: int, high: int) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise WeightSyncRefused(f"{key} must be an integer in [{low}, {high}], got {value!r}")
    return value
