"""`opd-sao serve` under a bounded loopback load loop of valid, invalid and abandoned requests.

`--concurrency` client threads (each request on a fresh connection, so bursts hit the listen backlog)
send `--requests` requests to one server: valid ones (sampling with logprobs, prompt scoring) and, in a
fixed seeded mix, the hostile and careless ones of docs/reliability.md (NaN or negative temperature, a
100,000-token prompt, non-object bodies, bad Content-Length, chunked bodies, ...), plus clients that hang
up mid-request. Meanwhile /health is polled every 0.1 s. Counts every answer by status, checks every valid
answer's content, and reports latency percentiles.

    python benchmarks/serve_load.py [--quick] [--url URL] [--requests N] [--concurrency C]

Without --url it builds a tiny model and starts `opd-sao serve` on loopback (--max-new-tokens 64). The
last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from launchers import free_port, wait_until_healthy  # tests/ helpers

SERVER_CAP = 64  # --max-new-tokens of the server this script starts


def _raw(url: str, head: str, body: bytes = b"", timeout: float = 60.0) -> int:
    """A hand-written HTTP request (framing no client library would send); the answer's status code."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("closed with no answer")
            answer += chunk
    return int(answer.split()[1])


def _hang_up(url: str, body: dict) -> None:
    """Send a long request and close the connection without reading the answer."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)


def _post(url: str, raw: str) -> requests.Response:
    return requests.post(url + "/generate", data=raw, headers={"Content-Type": "application/json"}, timeout=300)


def invalid_requests(url: str, prompt: list[int], vocab: int, cap: int) -> dict:
    """name -> a callable sending one invalid request, returning its status code."""
    p = json.dumps(prompt)

    def body(sampling: str, extra: str = "") -> str:
        return f'{{"input_ids": {p}, "sampling_params": {sampling}{extra}}}'

    head = "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    return {
        "temperature_nan": lambda: _post(url, body('{"temperature": NaN}')).status_code,
        "temperature_negative": lambda: _post(url, body('{"temperature": -0.5}')).status_code,
        "temperature_string": lambda: _post(url, body('{"temperature": "hot"}')).status_code,
        "top_p_zero": lambda: _post(url, body('{"top_p": 0}')).status_code,
        "prompt_100k_tokens": lambda: _post(url, json.dumps({"input_ids": [prompt[0]] + [5] * 99_999})).status_code,
        "max_new_tokens_over_cap": lambda: _post(url, body(f'{{"max_new_tokens": {cap + 1}}}')).status_code,
        "max_new_tokens_1e309": lambda: _post(url, body('{"max_new_tokens": 1e309}')).status_code,
        "top_logprobs_num_-5": lambda: _post(url, body('{"max_new_tokens": 0}', ', "return_logprob": true, '
                                                       '"logprob_start_len": 1, "top_logprobs_num": -5')).status_code,
        "token_out_of_vocab": lambda: _post(url, json.dumps({"input_ids": [vocab + 7]})).status_code,
        "unsupported_min_p": lambda: _post(url, body('{"min_p": 0.1}')).status_code,
        "body_list": lambda: _post(url, "[1, 2, 3]").status_code,
        "body_string": lambda: _post(url, '"input_ids"').status_code,
        "body_not_json": lambda: _post(url, "{input_ids: [1").status_code,
        "sampling_params_list": lambda: _post(url, body("[1]")).status_code,
        "content_length_abc": lambda: _raw(url, head + "Content-Length: abc\r\n", b"{}"),
        "content_length_-1": lambda: _raw(url, head + "Content-Length: -1\r\n", b"{}"),
        "content_length_huge": lambda: _raw(url, head + f"Content-Length: {10 ** 12}\r\n", b"{}"),
        "chunked_body": lambda: _raw(url, head + "Transfer-Encoding: chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n"),
    }


def valid_request(url: str, rng: random.Random, bos: int, vocab: int) -> tuple[int, bool]:
    """One valid request (sampling, or prompt scoring one time in four): (status, answer checked ok)."""
    prompt = [bos] + [rng.randrange(3, vocab) for _ in range(rng.randint(3, 24))]
    if rng.random() < 0.25:
        start, top = rng.randint(1, len(prompt) - 1), rng.randint(1, 5)
        response = requests.post(url + "/generate", json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": start, "top_logprobs_num": top}, timeout=300)
        if response.status_code != 200:
            return response.status_code, False
        meta = response.json()["meta_info"]
        tops = meta["input_top_logprobs"]  # SGLang's: entry 0 None (the token at start is never predicted)
        return 200, (len(meta["input_token_logprobs"]) == len(tops) == len(prompt) - start
                     and tops[0] is None and all(len(t) == top for t in tops[1:]))
    n, ignore_eos = rng.randint(1, 16), rng.random() < 0.5
    response = requests.post(url + "/generate", json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": n, "ignore_eos": ignore_eos,
                                                 "temperature": rng.choice([0.5, 1.0]), "top_p": rng.choice([0.9, 1.0])},
        "return_logprob": True}, timeout=300)
    if response.status_code != 200:
        return response.status_code, False
    out = response.json()
    ids, logprobs = out["output_ids"], out["meta_info"]["output_token_logprobs"]
    length_ok = len(ids) == n if ignore_eos else 1 <= len(ids) <= n
    return 200, length_ok and [t for _, t, _ in logprobs] == ids and all(lp <= 0 for lp, _, _ in logprobs)


def poll_health(url: str, stop: threading.Event, out: dict) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            ok = requests.get(url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            ok = False
        out["polls"] += 1
        out["failures"] += not ok
        out["max_latency_s"] = max(out["max_latency_s"], time.perf_counter() - t0)
        stop.wait(0.1)


def run_load(url: str, n_requests: int, concurrency: int, seed: int = 0, cap: int = SERVER_CAP) -> dict:
    info = requests.get(url + "/get_model_info", timeout=10).json()
    from opd_sao.checkpoints import load_tokenizer

    tokenizer = load_tokenizer(info["tokenizer_path"])
    bos, vocab = tokenizer.bos_token_id, len(tokenizer)
    invalid = invalid_requests(url, [bos, 5, 6, 7], vocab, cap)
    rng = random.Random(seed)
    names = sorted(invalid)
    # 60% valid, 35% invalid (every kind in turn), 5% clients that hang up
    plan = [("valid", None) if r < 0.6 else ("abandoned", None) if r < 0.65 else ("invalid", names[i % len(names)])
            for i, r in enumerate(rng.random() for _ in range(n_requests))]
    results: list[tuple[str, str, object, bool, float]] = [None] * n_requests  # kind, name, status, ok, latency

    def one(i: int) -> None:
        kind, name = plan[i]
        local = random.Random(seed * 100_003 + i)
        t0 = time.perf_counter()
        ok = False
        try:
            if kind == "valid":
                status, ok = valid_request(url, local, bos, vocab)
            elif kind == "invalid":
                status = invalid[name]()
                ok = 400 <= status < 500
            else:
                _hang_up(url, {"input_ids": [bos, 5, 6], "sampling_params": {"max_new_tokens": cap,
                                                                            "ignore_eos": True}})
                status, ok = "hung_up", True
        except (OSError, requests.RequestException) as err:
            status = type(err).__name__
        results[i] = (kind, name, status, ok, time.perf_counter() - t0)

    health = {"polls": 0, "failures": 0, "max_latency_s": 0.0}
    stop = threading.Event()
    poller = threading.Thread(target=poll_health, args=(url, stop, health), daemon=True)
    poller.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n_requests)))
    wall = time.perf_counter() - t0
    stop.set()
    poller.join()
    _, still_ok = valid_request(url, random.Random(seed), bos, vocab)  # serving after the storm

    def summary(kind: str) -> dict:
        rows = [r for r in results if r[0] == kind]
        lat = sorted(r[4] for r in rows)
        return {"sent": len(rows), "by_status": dict(Counter(str(r[2]) for r in rows)),
                "p50_s": round(statistics.median(lat), 3) if lat else None,
                "p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None, "rows": rows}

    valid, bad, gone = summary("valid"), summary("invalid"), summary("abandoned")
    valid["answered"] = sum(r[3] for r in valid.pop("rows"))
    bad_rows = bad.pop("rows")
    bad["4xx"] = sum(r[3] for r in bad_rows)
    bad["not_4xx"] = sorted({f"{r[1]}: {r[2]}" for r in bad_rows if not r[3]})
    gone.pop("rows")
    health["max_latency_s"] = round(health["max_latency_s"], 3)
    return {"requests": n_requests, "concurrency": concurrency, "wall_s": round(wall, 2),
            "requests_per_s": round(n_requests / wall, 1), "valid": valid, "invalid": bad,
            "abandoned": {"sent": gone["sent"]}, "health": health, "serving_after": still_ok}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="400 requests instead of 2,000")
    parser.add_argument("--url", help="an `opd-sao serve` already running (default: start one on a tiny model)")
    parser.add_argument("--requests", type=int, help="requests in all (default 2000, quick 400)")
    parser.add_argument("--concurrency", type=int, default=200, help="client threads sending at once")
    parser.add_argument("--max-batch", type=int, default=32, help="the started server's --max-batch")
    args = parser.parse_args(argv)
    n_requests = args.requests or (400 if args.quick else 2000)
    load_before = os.getloadavg()[0]
    server = None
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        url, cap = args.url, SERVER_CAP
        if url is None:
            from opd_sao.checkpoints import build_tiny_model
            from opd_sao.config import TinyModelConfig
            from opd_sao.envs import ENVIRONMENTS

            model = build_tiny_model(Path(tmp) / "tiny", ENVIRONMENTS.get("arithmetic")().corpus(500),
                                     TinyModelConfig(), seed=0)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            server = subprocess.Popen([sys.executable, "-m", "opd_sao.app.cli", "serve", str(model), "--port", str(port),
                                       "--max-batch", str(args.max_batch), "--max-new-tokens", str(cap)],
                                      cwd=ROOT, stdout=subprocess.DEVNULL)
        else:
            cap = None  # unknown: the over-cap case asks for more than any model has positions
        try:
            wait_until_healthy(url, lambda: server is None or server.poll() is None)
            report = run_load(url, n_requests, args.concurrency, cap=cap or 10 ** 7)
        finally:
            if server is not None:
                server.kill()
                server.wait()
    report = {"benchmark": "serve_load", "quick": args.quick, "cpu_cores": os.cpu_count(),
              "load_avg_before": round(load_before, 2), **report}
    v, b, h = report["valid"], report["invalid"], report["health"]
    print(f"valid {v['answered']}/{v['sent']} answered (p50 {v['p50_s']} s, p99 {v['p99_s']} s); "
          f"invalid {b['4xx']}/{b['sent']} 4xx; /health {h['polls'] - h['failures']}/{h['polls']} ok; "
          f"{report['requests_per_s']} requests/s")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
