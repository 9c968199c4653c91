"""What pausing generation around a weight sync costs in rollout throughput (#42).

One `opd-sao serve` worker (forked, one torch thread) generates a stream of 32-token rollouts (8 at a time)
for `--seconds`; the trainer's side syncs perturbed weights (tensor mode, 8 buckets) every `--every` seconds.
Three runs over the same worker: no syncs (the ceiling), syncs that pause generation (the default:
`/pause_generation` mode abort, the buckets, `/continue_generation`; the running requests are aborted and
sent again), and syncs without the pause (each bucket waits for the running requests to finish, and
requests admitted between two buckets sample from mixed weights: the old behaviour, for comparison only).
Reported per run: completed tokens per second, the syncs' median wall time, requests sent again.

    python benchmarks/sync_pause.py [--quick] [--seconds S] [--every S]

The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from rollout_scaling import fork_servers  # benchmarks/ is the script's directory

from opd_sao.config import TinyModelConfig

SHAPE = TinyModelConfig(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2)
BUCKETS = 8


def run(fleet, state, seconds: float, every: float, sync: bool) -> dict:
    """Generate for `seconds`, syncing every `every` seconds if `sync`; completed tokens/s and sync times."""
    from opd_sao.engines.base import GenerationRequest, SamplingParams

    results, stop, syncs = [], threading.Event(), []
    url = fleet.urls[0]
    requeued = fleet.stats[url]["requeued"]

    def requests_():
        i = 0
        while not stop.is_set():
            i += 1
            yield GenerationRequest([1 + i % 7, 2, 3], SamplingParams(max_new_tokens=32, ignore_eos=True))

    runner = threading.Thread(target=fleet.generate, args=(requests_(), results.append), daemon=True)
    t0 = time.perf_counter()
    runner.start()
    version = fleet.version
    while time.perf_counter() - t0 < seconds:
        time.sleep(every)
        if sync:
            version += 1
            start = time.perf_counter()
            fleet.update_weights(state, version)
            syncs.append(time.perf_counter() - start)
    tokens = sum(len(r.token_ids) for r in results)
    elapsed = time.perf_counter() - t0
    stop.set()
    runner.join(120)
    return {"tokens_per_s": round(tokens / elapsed, 1), "syncs": len(syncs),
            "sync_median_s": round(statistics.median(syncs), 4) if syncs else None,
            "requests_sent_again": fleet.stats[url]["requeued"] - requeued}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 s per run (under a minute in all)")
    parser.add_argument("--seconds", type=float, help="each run's length (default 30, quick 8)")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between syncs")
    args = parser.parse_args(argv)
    seconds = args.seconds or (8.0 if args.quick else 30.0)
    load_before = os.getloadavg()[0]
    (url, proc, conn), = fork_servers(1)  # forked before this process runs any torch op
    try:
        from launchers import wait_until_healthy  # tests/ helpers, on the path through rollout_scaling

        from opd_sao.checkpoints import build_tiny_model, load_causal_lm
        from opd_sao.engines.fleet import Fleet
        from opd_sao.engines.weight_sync import SyncSettings
        from opd_sao.engines.weight_sync.base import buckets, untied
        from opd_sao.engines.weight_sync.tensor import TensorSync
        from opd_sao.envs import ENVIRONMENTS

        with tempfile.TemporaryDirectory(prefix="sync-pause-") as tmp:
            model_dir = build_tiny_model(Path(tmp) / "model", ENVIRONMENTS.get("arithmetic")().corpus(300), SHAPE, 0)
            conn.send(str(model_dir))
            wait_until_healthy(url, proc.is_alive)
            state = {k: v * 1.01 for k, v in load_causal_lm(model_dir).state_dict().items()}
            size = 512
            while len(buckets(untied(state), size)) > BUCKETS:
                size += 512
            fleet = Fleet([url], max_inflight=8, weight_sync="tensor", sync=SyncSettings(bucket_bytes=size))
            fleet.update_weights(state, 0)
            rows = {"no_sync": run(fleet, state, seconds, args.every, sync=False),
                    "pause": run(fleet, state, seconds, args.every, sync=True)}
            TensorSync.pauses = False
            try:
                rows["no_pause"] = run(fleet, state, seconds, args.every, sync=True)
            finally:
                TensorSync.pauses = True
            fleet.close()
    finally:
        proc.kill()
        proc.join()
    report = {"benchmark": "sync_pause", "quick": args.quick, "cpu_cores": os.cpu_count(),
              "load_avg_before": round(load_before, 2), "seconds": seconds, "sync_every_s": args.every,
              "buckets": BUCKETS, "torch_threads_per_server": 1, "results": rows}
    for name, row in rows.items():
        print(f"{name:>8}: {row['tokens_per_s']:8.1f} tokens/s  {row['syncs']} syncs, median "
              f"{row['sync_median_s']} s, {row['requests_sent_again']} requests sent again")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
