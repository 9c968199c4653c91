"""Rollout throughput with 1, 2 and 4 local `opd-sao serve` servers behind the load-aware router, and
opd-sao's router against sglang-router's policies over 3 servers.

Starts the servers once (one torch thread each, so a server is one core's worth of work), then drives
the same workload through a Fleet over the first 1, 2 and 4 of them: prompts of the arithmetic domain,
a mix of long and short responses with fixed lengths (ignore_eos). Reports generated tokens/s and
samples/s per fleet size. Servers scale only as far as free cores do: the JSON says how many the
machine has and its load when the benchmark started.

Routing comparison (`--routers`): heavy-tailed response lengths (Pareto, clipped) over the first 3
servers, through opd-sao's router (which is given each request's length as its estimate) and through
sglang-router with each policy (which sees only the requests; opd-sao's client then sends everything to
the router URL). Per router: samples/s, tokens each worker generated and the mean tokens it held in flight
(sampled from /get_load), and their max/min across workers.

    python benchmarks/rollout_scaling.py [--quick] [--servers 1,2,4] [--requests N]
                                         [--routers opd-sao,round_robin,cache_aware,power_of_two]

The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from opd_sao.checkpoints import build_tiny_model, encode_text, load_tokenizer
from opd_sao.config import TinyModelConfig
from opd_sao.engines.base import GenerationRequest, SamplingParams
from opd_sao.engines.fleet import Fleet
from opd_sao.engines.server import MAX_BODY_BYTES, MAX_NEW_TOKENS, serve
from opd_sao.envs import ENVIRONMENTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from launchers import free_port, start_sglang_router, wait_until_healthy  # tests/ helpers

SERVER_BATCH = 16  # sequences each server decodes together; also the router's slots per server


def fork_servers(n: int) -> list[tuple[str, multiprocessing.Process, object]]:
    """n server processes forked before this process runs any torch op (so no thread pool is copied);
    each waits for the checkpoint path, then runs `opd-sao serve`'s code. Forking skips the seconds of
    imports a fresh `opd-sao serve` spends, which on 2 cores would dominate a quick run."""
    ctx = multiprocessing.get_context("fork")
    servers = []
    for i in range(n):
        port = free_port()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve_when_told, args=(child, port, i), daemon=True)
        proc.start()
        servers.append((f"http://127.0.0.1:{port}", proc, parent))
    return servers


def _serve_when_told(conn, port: int, seed: int) -> None:
    checkpoint = conn.recv()
    serve(argparse.Namespace(checkpoint=checkpoint, port=port, host="127.0.0.1", max_batch=SERVER_BATCH,
                             dtype="float32", seed=seed, threads=1, weight_version="default",
                             max_new_tokens=MAX_NEW_TOKENS, max_body_mb=MAX_BODY_BYTES >> 20, device="cpu",
                             group_timeout_s=60.0, api_key=None, admin_api_key=None, weights_root=None))


def workload(tokenizer, n: int, long: int, short: int) -> list[GenerationRequest]:
    """Every fourth response is long: the case load-aware routing is for."""
    tasks = itertools.cycle(ENVIRONMENTS.get("arithmetic")().make_tasks("train", n, seed=0))
    out = []
    for i, task in zip(range(n), tasks):
        length = long if i % 4 == 0 else short
        prompt = encode_text(tokenizer, task["prompt"])
        out.append(GenerationRequest(prompt, SamplingParams(max_new_tokens=length, ignore_eos=True), est_tokens=length))
    return out


def heavy_tailed(tokenizer, n: int, short: int, longest: int, seed: int = 0) -> list[GenerationRequest]:
    """Response lengths short * Pareto(alpha 1.2), clipped to `longest`: most short, a few very long."""
    rng = random.Random(seed)
    tasks = itertools.cycle(ENVIRONMENTS.get("arithmetic")().make_tasks("train", n, seed=seed))
    out = []
    for _, task in zip(range(n), tasks):
        length = min(longest, int(short * rng.paretovariate(1.2)))
        prompt = encode_text(tokenizer, task["prompt"])
        out.append(GenerationRequest(prompt, SamplingParams(max_new_tokens=length, ignore_eos=True), est_tokens=length))
    return out


class WorkerMeter:
    """Per worker: tokens generated (serve's /get_server_info) and tokens in flight (/get_load, sampled)."""

    def __init__(self, urls: list[str], every_s: float = 0.05):
        self.urls, self.every_s = urls, every_s
        self.samples = {u: [] for u in urls}
        self._stop = threading.Event()

    def _generated(self) -> list[int]:
        return [requests.get(u + "/get_server_info").json()["tokens_generated"] for u in self.urls]

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            for u in self.urls:
                self.samples[u].append(requests.get(u + "/get_load").json()[0]["num_tokens"])

    def __enter__(self):
        self._start = self._generated()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.tokens = [after - before for after, before in zip(self._generated(), self._start)]
        self.inflight = [sum(s) / max(1, len(s)) for s in self.samples.values()]

    def report(self) -> dict:
        ratio = lambda xs: round(max(xs) / min(xs), 2) if min(xs) > 0 else None
        return {"tokens_per_worker": self.tokens, "tokens_max_min": ratio(self.tokens),
                "mean_inflight_tokens_per_worker": [round(x, 1) for x in self.inflight],
                "inflight_max_min": ratio(self.inflight)}


def compare_routers(urls: list[str], model: Path, workload_: list[GenerationRequest], names: list[str]) -> list[dict]:
    """The same workload through opd-sao's router over `urls` and through sglang-router per policy."""
    rows = []
    for name in names:
        proc = None
        if name == "opd-sao":
            engine = Fleet(urls, checkpoint=model, max_inflight=SERVER_BATCH)
        else:
            router_url, proc = start_sglang_router(urls, "--policy", name)
            engine = Fleet(router_url, checkpoint=model, max_inflight=SERVER_BATCH * len(urls))
        try:
            engine.generate_all(workload_[:SERVER_BATCH])  # warm-up
            with WorkerMeter(urls) as meter:
                t0 = time.perf_counter()
                results = engine.generate_all(workload_)
                wall = time.perf_counter() - t0
        finally:
            engine.close()
            if proc is not None:
                proc.kill()
                proc.wait()
        tokens = sum(len(r.token_ids) for r in results)
        rows.append({"router": name, "wall_s": round(wall, 3), "samples_per_s": round(len(results) / wall, 2),
                     "tokens_per_s": round(tokens / wall, 1), **meter.report()})
    return rows


def measure(router: Fleet, requests_: list[GenerationRequest]) -> dict:
    router.generate_all(requests_[:SERVER_BATCH])  # warm-up: first-batch allocations on every server
    before = [s["requests"] for s in router.stats.values()]
    t0 = time.perf_counter()
    results = router.generate_all(requests_)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "samples_per_s": round(len(results) / wall, 2),
            "requests_per_server": [s["requests"] - b for s, b in zip(router.stats.values(), before)]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload (under a minute)")
    parser.add_argument("--servers", default="1,2,4", help="fleet sizes to measure")
    parser.add_argument("--requests", type=int, help="requests per fleet size (default 768, quick 192)")
    parser.add_argument("--routers", default="opd-sao,round_robin,cache_aware,power_of_two",
                        help="routers to compare over 3 servers (sglang-router policies need `pip install "
                             "sglang-router`); empty: skip the comparison")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.servers.split(",")]
    routers = [r for r in args.routers.split(",") if r]
    n_requests = args.requests or (192 if args.quick else 768)
    long, short = (32, 8) if args.quick else (64, 16)
    load_before = os.getloadavg()[0]
    servers = fork_servers(max(sizes + [3] if routers else sizes))
    try:
        with tempfile.TemporaryDirectory(prefix="rollout-scaling-") as tmp:
            texts = ENVIRONMENTS.get("arithmetic")().corpus(500)
            model = build_tiny_model(Path(tmp) / "tiny", texts, TinyModelConfig(), seed=0)
            tokenizer = load_tokenizer(model)
            for _, _, conn in servers:
                conn.send(str(model))
            for url, proc, _ in servers:
                wait_until_healthy(url, proc.is_alive)
            rows = []
            for n in sizes:
                router = Fleet([url for url, _, _ in servers[:n]], checkpoint=model, max_inflight=SERVER_BATCH)
                rows.append({"servers": n, **measure(router, workload(tokenizer, n_requests, long, short))})
                router.close()
            comparison = compare_routers([url for url, _, _ in servers[:3]], model,
                                         heavy_tailed(tokenizer, n_requests, short, 8 * long), routers)
    finally:
        for _, proc, _ in servers:
            proc.kill()
            proc.join()
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = round(row["tokens_per_s"] / base, 2)
    report = {"benchmark": "rollout_scaling", "quick": args.quick, "cpu_cores": os.cpu_count(),
              "load_avg_before": round(load_before, 2), "torch_threads_per_server": 1,
              "server_batch": SERVER_BATCH, "requests": n_requests, "response_tokens": [long, short],
              "results": rows, "routing": {"servers": 3, "lengths": f"{short} * Pareto(1.2), at most {8 * long}",
                                           "results": comparison}}
    for row in rows:
        print(f"{row['servers']} server(s): {row['tokens_per_s']:8.1f} tokens/s  {row['samples_per_s']:7.2f} samples/s"
              f"  x{row['speedup']}  requests per server {row['requests_per_server']}")
    for row in comparison:
        print(f"{row['router']:>13}: {row['samples_per_s']:7.2f} samples/s  tokens per worker {row['tokens_per_worker']}"
              f" (max/min {row['tokens_max_min']})  mean in flight {row['mean_inflight_tokens_per_worker']}"
              f" (max/min {row['inflight_max_min']})")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
