"""Weight sync time vs model size: disk, tensor (in the HTTP request) and distributed (gloo broadcast).

For each model size, 2 `opd-sao serve` workers (forked, one torch thread each; the same code as the
CLI) hold the model; a Fleet over both syncs the same perturbed state dict with each method a
few times and reports the median wall time of `update_weights` (the write or serialization, the
transfer, the swap on both workers and the weight_version check). The distributed path's weight
update group is made once, at the engine's first sync, and not counted.

    python benchmarks/weight_sync.py [--quick] [--repeats N]

The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from rollout_scaling import fork_servers  # benchmarks/ is the script's directory

from opd_sao.config import TinyModelConfig

WORKERS = 2
SIZES = {  # name: (hidden, intermediate, layers, heads, kv heads)
    "h64-l2": (64, 192, 2, 4, 2),
    "h256-l4": (256, 768, 4, 4, 2),
    "h512-l8": (512, 1536, 8, 8, 4),
}
QUICK = ("h64-l2", "h256-l4")
METHODS = ("disk", "tensor", "distributed")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small models (under a minute)")
    parser.add_argument("--repeats", type=int, help="syncs per method and size (default 3)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else tuple(SIZES)
    repeats = args.repeats or 3
    load_before = os.getloadavg()[0]
    fleets = {name: fork_servers(WORKERS) for name in sizes}  # forked before this process runs any torch op
    rows = []
    try:
        from launchers import wait_until_healthy  # tests/ helpers, on the path through rollout_scaling

        from opd_sao.checkpoints import build_tiny_model, load_causal_lm
        from opd_sao.engines.fleet import Fleet
        from opd_sao.envs import ENVIRONMENTS

        texts = ENVIRONMENTS.get("arithmetic")().corpus(300)
        with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
            for name in sizes:
                hidden, inter, layers, heads, kv = SIZES[name]
                shape = TinyModelConfig(hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                                        num_heads=heads, num_kv_heads=kv)
                model_dir = build_tiny_model(Path(tmp) / name, texts, shape, seed=0)
                for _, _, conn in fleets[name]:
                    conn.send(str(model_dir))
                for url, proc, _ in fleets[name]:
                    wait_until_healthy(url, proc.is_alive)
                model = load_causal_lm(model_dir)
                state = {k: v * 1.01 for k, v in model.state_dict().items()}
                row = {"model": name, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                       "float32_mb": round(sum(p.numel() for p in model.parameters()) * 4 / 2**20, 1)}
                for method in METHODS:
                    engine = Fleet([url for url, _, _ in fleets[name]], checkpoint=model_dir, weight_sync=method,
                                   weights_dir=str(Path(tmp) / f"w-{name}-{method}"))
                    times = []
                    for version in range(1, repeats + 1):
                        t0 = time.perf_counter()
                        engine.update_weights(state, version)
                        times.append(time.perf_counter() - t0)
                    engine.close()
                    row[f"{method}_s"] = round(statistics.median(times), 4)
                rows.append(row)
                for _, proc, _ in fleets[name]:  # this size is done: free its cores and memory
                    proc.kill()
                    proc.join()
                del model, state
    finally:
        for fleet in fleets.values():
            for _, proc, _ in fleet:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    report = {"benchmark": "weight_sync", "quick": args.quick, "cpu_cores": os.cpu_count(),
              "load_avg_before": round(load_before, 2), "workers": WORKERS, "repeats": repeats,
              "torch_threads_per_server": 1, "results": rows}
    for row in rows:
        print(f"{row['model']:>8} {row['params_m']:7.2f}M params {row['float32_mb']:7.1f} MB   "
              + "  ".join(f"{m} {row[m + '_s']:.3f} s" for m in METHODS))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
