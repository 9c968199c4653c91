"""Rollout throughput with 1, 2 and 4 local `opd-sao serve` servers behind the load-aware router.

Starts the servers once (one torch thread each, so a server is one core's worth of work), then drives
the same workload through a Router over the first 1, 2 and 4 of them: prompts of the arithmetic domain,
a mix of long and short responses with fixed lengths (ignore_eos). Reports generated tokens/s and
samples/s per fleet size. Servers scale only as far as free cores do: the JSON says how many the
machine has and its load when the benchmark started.

    python benchmarks/rollout_scaling.py [--quick] [--servers 1,2,4] [--requests N]

The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import socket
import tempfile
import time
from pathlib import Path

from opd_sao.checkpoints import build_tiny_model, encode_text, load_tokenizer
from opd_sao.config import TinyModelConfig
from opd_sao.engines.base import GenerationRequest, SamplingParams
from opd_sao.engines.http import wait_until_healthy
from opd_sao.engines.router import Router
from opd_sao.engines.server import serve
from stages.envs import ENVIRONMENTS

SERVER_BATCH = 16  # sequences each server decodes together; also the router's slots per server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fork_servers(n: int) -> list[tuple[str, multiprocessing.Process, object]]:
    """n server processes forked before this process runs any torch op (so no thread pool is copied);
    each waits for the checkpoint path, then runs `opd-sao serve`'s code. Forking skips the seconds of
    imports a fresh `opd-sao serve` spends, which on 2 cores would dominate a quick run."""
    ctx = multiprocessing.get_context("fork")
    servers = []
    for i in range(n):
        port = _free_port()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve_when_told, args=(child, port, i), daemon=True)
        proc.start()
        servers.append((f"http://127.0.0.1:{port}", proc, parent))
    return servers


def _serve_when_told(conn, port: int, seed: int) -> None:
    checkpoint = conn.recv()
    serve(argparse.Namespace(checkpoint=checkpoint, port=port, host="127.0.0.1", max_batch=SERVER_BATCH,
                             dtype="float32", seed=seed, threads=1, weight_version="default",
                             max_new_tokens=8192, max_body_mb=64))


def workload(tokenizer, n: int, long: int, short: int) -> list[GenerationRequest]:
    """Every fourth response is long: the case load-aware routing is for."""
    tasks = itertools.cycle(ENVIRONMENTS.get("arithmetic")().make_tasks("train", n, seed=0))
    out = []
    for i, task in zip(range(n), tasks):
        length = long if i % 4 == 0 else short
        prompt = encode_text(tokenizer, task["prompt"])
        out.append(GenerationRequest(prompt, SamplingParams(max_new_tokens=length, ignore_eos=True), est_tokens=length))
    return out


def measure(router: Router, requests_: list[GenerationRequest]) -> dict:
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
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.servers.split(",")]
    n_requests = args.requests or (192 if args.quick else 768)
    long, short = (32, 8) if args.quick else (64, 16)
    load_before = os.getloadavg()[0]
    servers = fork_servers(max(sizes))
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
                router = Router([url for url, _, _ in servers[:n]], checkpoint=model, max_inflight=SERVER_BATCH)
                rows.append({"servers": n, **measure(router, workload(tokenizer, n_requests, long, short))})
                router.close()
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
              "results": rows}
    for row in rows:
        print(f"{row['servers']} server(s): {row['tokens_per_s']:8.1f} tokens/s  {row['samples_per_s']:7.2f} samples/s"
              f"  x{row['speedup']}  requests per server {row['requests_per_server']}")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
