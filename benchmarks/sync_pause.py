"""What pausing generation around a weight sync costs in rollout throughput (#42).

One `opd-sao serve` worker (forked, one torch thread) generates a stream of 32-token rollouts (8 at a time)
while the trainer's side syncs perturbed weights (tensor mode, 8 buckets) `--syncs` times, every `--every` seconds.
Four runs over the same worker: no syncs (the ceiling, as long), syncs that pause generation (the default:
`/pause_generation` mode abort, the buckets, `/continue_generation`; the running requests are aborted and
sent again whole), the same with engine.partial_rollouts (an aborted request continues from the tokens it had),
and syncs without the pause (each bucket waits for the running requests to finish, and requests admitted
between two buckets sample from mixed weights: the old behaviour, for comparison only). Reported per run:
completed tokens and trajectories per second, the syncs' median wall time, requests sent again, and tokens
thrown away (aborted and sent again whole) and kept (continued) per sync.

    python benchmarks/sync_pause.py [--quick] [--syncs N] [--every S]

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


def run(fleet, state, syncs_n: int, every: float, sync: bool) -> dict:
    """Generate for syncs_n * every seconds, syncing every `every` seconds if `sync`; completed tokens and
    trajectories per second, sync times, the tokens aborts threw away or kept."""
    from opd_sao.engines.base import GenerationRequest, SamplingParams

    results, stop, syncs = [], threading.Event(), []
    url = fleet.urls[0]
    requeued, discarded, continued = fleet.stats[url]["requeued"], fleet.tokens_discarded, fleet.tokens_continued

    def requests_():
        i = 0
        while not stop.is_set():
            i += 1
            yield GenerationRequest([1 + i % 7, 2, 3], SamplingParams(max_new_tokens=32, ignore_eos=True))

    runner = threading.Thread(target=fleet.generate, args=(requests_(), results.append), daemon=True)
    t0 = time.perf_counter()
    runner.start()
    version = fleet.version
    for _ in range(syncs_n):
        time.sleep(every)
        if sync:
            version += 1
            start = time.perf_counter()
            fleet.update_weights(state, version)
            syncs.append(time.perf_counter() - start)
    done = list(results)
    tokens = sum(len(r.token_ids) for r in done)
    elapsed = time.perf_counter() - t0
    stop.set()
    runner.join(120)
    per_sync = max(1, len(syncs))
    return {"tokens_per_s": round(tokens / elapsed, 1), "trajectories_per_s": round(len(done) / elapsed, 2),
            "syncs": len(syncs), "sync_median_s": round(statistics.median(syncs), 4) if syncs else None,
            "requests_sent_again": fleet.stats[url]["requeued"] - requeued,
            "tokens_thrown_away_per_sync": round((fleet.tokens_discarded - discarded) / per_sync, 1),
            "tokens_kept_per_sync": round((fleet.tokens_continued - continued) / per_sync, 1),
            "mixed_version_trajectories": sum(len(set(r.versions)) > 1 for r in done)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 syncs per run (about a minute in all)")
    parser.add_argument("--syncs", type=int, help="syncs per run (default 15, quick 4)")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between syncs")
    args = parser.parse_args(argv)
    syncs_n = args.syncs or (4 if args.quick else 15)
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
            rows = {"no_sync": run(fleet, state, syncs_n, args.every, sync=False),
                    "pause": run(fleet, state, syncs_n, args.every, sync=True)}
            fleet.partial_rollouts = True
            rows["pause_partial"] = run(fleet, state, syncs_n, args.every, sync=True)
            fleet.partial_rollouts = False
            TensorSync.pauses = False
            try:
                rows["no_pause"] = run(fleet, state, syncs_n, args.every, sync=True)
            finally:
                TensorSync.pauses = True
            fleet.close()
    finally:
        proc.kill()
        proc.join()
    report = {"benchmark": "sync_pause", "quick": args.quick, "cpu_cores": os.cpu_count(),
              "load_avg_before": round(load_before, 2), "syncs": syncs_n, "sync_every_s": args.every,
              "buckets": BUCKETS, "torch_threads_per_server": 1, "results": rows}
    for name, row in rows.items():
        print(f"{name:>13}: {row['tokens_per_s']:8.1f} tokens/s {row['trajectories_per_s']:6.2f} traj/s  "
              f"{row['syncs']} syncs, median {row['sync_median_s']} s, {row['requests_sent_again']} sent again, "
              f"{row['tokens_thrown_away_per_sync']} tokens thrown away / {row['tokens_kept_per_sync']} kept per sync")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
