"""Does prefetch hide teacher loading? An OPD stage with 3 teachers, with and without prefetch.

Three teacher checkpoints (the tiny base model with different random perturbations: the benchmark measures
waiting, not distillation quality) teach three domains; every batch needs all three, and at most
`--max-resident` (default 2) may be in host memory, so teachers are evicted and reloaded every step.

The slow storage is simulated honestly: the prefetcher's copy step (source checkpoint -> local disk tier)
really reads and writes every byte and is throttled to `--bandwidth-mb-s`; loads from the local tier into
host memory run at full speed, as from a local NVMe disk. With prefetch off, the trainer thread copies and
loads a teacher when it first needs it and waits the whole time; with prefetch on, copies start at stage
start (while the first rollouts are generated) and the next teacher loads while the current one scores.

Prints one JSON object on its last line: per mode, the total prefetch stall (seconds the trainer waited for
a teacher), stall per step, copies, loads and evictions, and the fraction of the stall that prefetch hid.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from opd_sao.app.pipeline import run_pipeline
from opd_sao.checkpoints import (
    build_tiny_model,
    load_causal_lm,
    load_tokenizer,
    save_checkpoint,
)
from opd_sao.config import TinyModelConfig, parse_config

DOMAINS = ["digits_reverse", "digits_sort", "digits_copy"]


def make_teachers(root: Path, seed: int) -> tuple[Path, list[Path]]:
    from opd_sao.envs import ENVIRONMENTS

    texts = [text for name in ENVIRONMENTS.names() for text in ENVIRONMENTS.get(name)().corpus(500)]
    base = build_tiny_model(root / "base", texts, TinyModelConfig(), seed)
    tokenizer = load_tokenizer(base)
    teachers = []
    for i, domain in enumerate(DOMAINS):
        model = load_causal_lm(base)
        generator = torch.Generator().manual_seed(seed + i + 1)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        teachers.append(save_checkpoint(model, tokenizer, root / f"teacher_{domain}"))
    return base, teachers


def run(base: Path, teachers: list[Path], out: Path, *, prefetch: bool, steps: int, batch: int, bandwidth: float,
        max_resident: int, seed: int) -> dict:
    stage = {
        "name": "opd", "kind": "opd", "init_from": "base", "steps": steps, "domains": DOMAINS,
        "rollout": {"max_new_tokens": 6, "max_staleness": 2}, "eval": {"num_tasks": 8}, "gate": {"enabled": False},
        "opd": {"granularity": "top_k", "top_k": 16, "max_resident": max_resident, "prefetch": prefetch,
                "copy_bandwidth_mb_s": bandwidth,
                "teachers": [{"name": f"teacher_{d}", "checkpoint": str(t), "domains": [d]}
                             for d, t in zip(DOMAINS, teachers)]},
    }
    cfg = parse_config({"seed": seed, "model": {"path": str(base)}, "logging": {"wandb": False, "progress": False},
                        "trainer": {"train_batch_size": batch, "policy_lr": 1e-4}, "stages": [stage]})
    t0 = time.perf_counter()
    summary = run_pipeline(cfg, out, log=lambda m: None)
    wall = time.perf_counter() - t0
    entry = summary["stages"][0]
    stats = entry["prefetch"]
    metrics = [json.loads(line) for line in (out / "stages" / "opd" / "metrics.jsonl").read_text().splitlines()]
    stalls = [m["prefetch_stall_s"] for m in metrics]
    return {
        "prefetch": prefetch,
        "stall_s": round(stats["stall_s"], 4),
        "stall_s_per_step": round(sum(stalls) / len(stalls), 4),
        "stall_s_first_step": round(stalls[0], 4),
        "stall_s_later_steps": round(sum(stalls[1:]), 4),
        "teacher_copies": stats["copies"], "copy_s": stats["copy_s"], "copy_bytes": stats["copy_bytes"],
        "teacher_loads": stats["loads"], "load_s": stats["load_s"], "evictions": stats["evictions"],
        "resident_hits": stats["hits"], "misses": stats["misses"],
        "teacher_score_s": round(sum(m["teacher_score_s"] for m in metrics), 4),
        "steps": entry["steps"], "stage_wall_s": entry["wall_s"], "pipeline_wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few steps (about a minute per mode on 2 cores)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=24, help="trajectories per step (split over the 3 domains)")
    parser.add_argument("--bandwidth-mb-s", type=float, default=2.0, help="throttle of the copy to the disk tier")
    parser.add_argument("--max-resident", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    steps = 5 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, teachers = make_teachers(root, args.seed)
        size = sum(f.stat().st_size for f in teachers[0].rglob("*") if f.is_file())
        results = {}
        for prefetch in (False, True):
            name = "with_prefetch" if prefetch else "without_prefetch"
            results[name] = run(base, teachers, root / name, prefetch=prefetch, steps=steps, batch=args.batch,
                                bandwidth=args.bandwidth_mb_s, max_resident=args.max_resident, seed=args.seed)
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    off, on = results["without_prefetch"]["stall_s"], results["with_prefetch"]["stall_s"]
    print(json.dumps({
        "benchmark": "prefetch", "teachers": len(DOMAINS), "max_resident": args.max_resident, "steps": steps,
        "batch": args.batch, "copy_bandwidth_mb_s": args.bandwidth_mb_s, "checkpoint_bytes": size,
        "simulated_copy_s_per_teacher": round(size / (args.bandwidth_mb_s * 1e6), 3),
        **results, "stall_hidden_fraction": round(1 - on / off, 4) if off > 0 else None,
    }))


if __name__ == "__main__":
    main()
