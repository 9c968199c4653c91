"""Peak memory of one SAO step and one OPD step against sequence length, with and without micro-batches and
gradient checkpointing, beside the memory model's prediction (opd_sao.memory.step_memory, docs/scale_out.md).

The student is a randomly initialised Qwen2-architecture model (default: Qwen2.5-0.5B's shape, 494M parameters,
vocabulary 151,936, tied embeddings; `--quick`: a 4-layer, hidden-128 one on the same vocabulary). A batch is
`--batch` trajectories of `seq` tokens (a 32-token prompt, the rest action tokens). Variants:

    plain   the whole batch in one forward and backward
    micro   trainer.micro_batch_size 1 (gradients accumulated over the trajectories)
    ckpt    trainer.gradient_checkpointing
    both    micro-batches and checkpointing

Every point runs in a fresh child process with glibc's mmap threshold at 128 KiB, so freed buffers go back to
the OS and the peak is what the step needs. The child takes its RSS before loading anything (the Python, torch
and transformers runtime), builds the trainer (torch backend, float32, sdpa attention), resets its RSS
high-water mark (VmHWM, `/proc/self/clear_refs`: loading's transients are not the step's) and runs two steps
(the first allocates AdamW's moments; the second is a steady-state step); the measurement is the high-water
mark of the two: SAO through `Learner` (policy and critic), OPD through `OPDLearner` at top_k 16 with an
in-process teacher of the student's shape scored into a logit cache. Prediction = that runtime RSS +
`step_memory(...)["peak"]`. A point the model predicts over `--limit-gb` is not run (reported as skipped).

    python benchmarks/memory_scaling.py            # seq 512 .. 8192, batch 2, every variant
    python benchmarks/memory_scaling.py --quick    # the small model, seq 256 .. 1024, plain and both
    python benchmarks/memory_scaling.py --device cuda   # on a GPU: CUDA's peak allocated bytes, not RSS

With `--device cuda` (scripts/gpu_check.sh) the measurement is `torch.cuda.max_memory_allocated` after the
load (reset there) and the prediction the model's peak alone (no runtime RSS on the device); pass the GPU's
size as `--limit-gb` (e.g. 130 on a 141 GB H200) so that no point is skipped for this machine's RAM.

The last line is one JSON object: every point (measured and predicted MB, error), and the checks: with both on,
growth at most linear in tokens (no step between consecutive lengths more than 10% above the first slope's,
give or take 1% of the first peak) and under
half of the plain step's at 4,096 (when both were run), and the share of points predicted within 25%.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opd_sao.memory import ModelShape, step_memory

FULL = dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151_936)  # Qwen2.5-0.5B
QUICK = dict(layers=4, hidden=128, intermediate=512, heads=4, kv_heads=2, vocab=151_936)
VARIANTS = {"plain": (None, False), "micro": (1, False), "ckpt": (None, True), "both": (1, True)}
PROMPT = 32
TOP_K = 16
MB = 2**20
GPU_GB, GPUS = 80, 8
PLAN_TOKENS = 8192  # tokens per micro-batch on a rank: one 8k sequence
# Qwen2.5 1.5B / 7B / 32B / 72B shapes (the 70B-class teacher)
SHAPES = {
    "1.5B": ModelShape(28, 1536, 8960, 12, 2, 151_936, tied=True),
    "7B": ModelShape(28, 3584, 18944, 28, 4, 152_064, tied=False),
    "32B": ModelShape(64, 5120, 27648, 40, 8, 152_064, tied=False),
    "70B": ModelShape(80, 8192, 29568, 64, 8, 152_064, tied=False),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Start the RSS high-water mark (VmHWM) afresh at the current RSS (Linux >= 4.0), so that the peak is the
    steps', not the loading's (from_pretrained briefly holds a random init and the file's tensors at once)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def build_model(out: Path, shape: dict) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").is_file():
        return out
    config = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], tie_word_embeddings=True,
                         max_position_embeddings=32768)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def trajectories(batch: int, seq: int, vocab: int):
    import math

    import numpy as np

    from opd_sao.trajectory import Trajectory

    rng = np.random.default_rng(seq)
    n = seq - PROMPT
    logp = [-math.log(vocab)] * n  # a random-init model is near uniform: DIS ratios near 1, nothing masked
    return [Trajectory(traj_id=f"t{i}", domain="d", prompt_ids=rng.integers(0, 150_000, PROMPT).tolist(),
                       token_ids=rng.integers(0, 150_000, n).tolist(), action_mask=[1] * n, rollout_logp=logp,
                       versions=[0] * n, rewards=[0.0] * (n - 1) + [float(i % 2)]) for i in range(batch)]


def child(point: dict) -> dict:
    """One point in this (fresh) process: runtime RSS, then two steps; the RSS high-water."""
    import torch

    torch.set_num_threads(point["threads"])
    cuda = point["device"].startswith("cuda")
    runtime = 0 if cuda else rss_bytes()
    from opd_sao.config import AlgoConfig, OPDConfig, TrainerConfig
    from opd_sao.trainers import TorchTrainer
    from opd_sao.trajectory import collate

    micro, ckpt = VARIANTS[point["variant"]]
    extra = {"micro_batch_size": micro} if micro else {}
    if ckpt:
        extra["gradient_checkpointing"] = True
    trainer = TrainerConfig(train_batch_size=point["batch"], critic_steps=1, critic_warmup_steps=0,
                            device=point["device"], **extra)
    model_dir, work = Path(point["model"]), Path(point["work"])
    batch = collate(trajectories(point["batch"], point["seq"], point["vocab"]), 0)
    if point["kind"] == "sao":
        from opd_sao.rl.learner import Learner

        backend = TorchTrainer(model_dir, trainer, with_critic=True, attn_implementation="sdpa")
        learner = Learner(backend, "sao", AlgoConfig(), critic_steps=1, critic_warmup_steps=0)
        close = None
    else:
        from opd_sao.checkpoints import checkpoint_hash
        from opd_sao.rl.distill import OPDLearner
        from opd_sao.teachers import Prefetcher, TeacherSet, TeacherTargets
        from opd_sao.teachers.base import TeacherSpec

        spec = TeacherSpec(name="t", kind="in_process", checkpoint=model_dir, domains=("d",), granularity="top_k",
                           k=TOP_K, p=None, checkpoint_hash=checkpoint_hash(model_dir), vocab_size=point["vocab"],
                           tokenizer_hash="benchmark", device=point["device"])
        registry = TeacherSet([spec], score_batch_size=1)
        prefetcher = Prefetcher(registry.build_all(), local_dir=work / "tier", max_resident=1, enabled=False)
        targets = TeacherTargets(registry, prefetcher, work / "cache")
        backend = TorchTrainer(model_dir, trainer, with_critic=False, attn_implementation="sdpa")
        learner = OPDLearner(backend, OPDConfig(teachers=[{"name": "t", "checkpoint": str(model_dir),
                                                           "domains": ["d"]}], top_k=TOP_K), AlgoConfig(), targets)
        close = prefetcher.close
    if cuda:
        torch.cuda.synchronize()
        loaded = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        loaded = rss_bytes()
        reset_peak()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        learner.step(batch, 1.0)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else peak_bytes()
    if close:
        close()
    return {"runtime_bytes": runtime, "loaded_bytes": loaded, "peak_bytes": peak,
            "step_s": [round(t, 2) for t in times]}


def predicted(point: dict, shape: ModelShape) -> float:
    micro, ckpt = VARIANTS[point["variant"]]
    tokens = point["seq"] * (micro or point["batch"])
    return step_memory(shape, tokens, checkpointing=ckpt, critic=point["kind"] == "sao",
                       teacher=shape if point["kind"] == "opd" else None, teacher_bytes=4)["peak"]


def run_point(point: dict, timeout: int, script: str = __file__) -> dict:
    """`script --child POINT` in a fresh process (glibc's mmap threshold low: freed buffers go back to the OS); its
    last stdout line, or {"error": ...}."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    try:
        out = subprocess.run([sys.executable, script, "--child", json.dumps(point)], capture_output=True, text=True,
                             env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
        return {"error": f"exit {out.returncode}: {tail}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def linear_at_most(points: list[tuple[int, float]]) -> bool:
    """No increase between consecutive (tokens, bytes) points more than 10% above the first slope's, give or
    take 1% of the first peak (RSS noise: a flat profile is linear too)."""
    slope = max((points[1][1] - points[0][1]) / (points[1][0] - points[0][0]), 0)
    return all(b2 - b1 <= 1.1 * slope * (t2 - t1) + 0.01 * points[0][1]
               for (t1, b1), (t2, b2) in zip(points, points[1:]))


def plan() -> None:
    """What fits on 8 x 80 GB (bf16 mixed precision, checkpointing on, one 8k-token micro-batch per rank), per ZeRO
    stage: GB per rank of an SAO step (policy + critic) and of an OPD step with a 7B and a 70B teacher (in-process,
    bf16, sharded with the weights under ZeRO-3)."""
    print("| student | step | ZeRO-0 | ZeRO-1 | ZeRO-2 | ZeRO-3 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for student in ("1.5B", "7B", "32B"):
        for step, kwargs in (("SAO (policy + critic)", {"critic": True}), ("OPD, 7B teacher", {"teacher": SHAPES["7B"]}),
                             ("OPD, 70B teacher", {"teacher": SHAPES["70B"]})):
            cells = []
            for zero in range(4):
                gb = step_memory(SHAPES[student], PLAN_TOKENS, checkpointing=True, world=GPUS, zero=zero,
                                 precision="bfloat16", **kwargs)["peak"] / 1e9
                cells.append(f"{gb:.0f}" + ("" if gb <= GPU_GB else " (no)"))
            print(f"| {student} ({SHAPES[student].params / 1e9:.2f}B) | {step} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--plan", action="store_true", help="print the memory model's 8 x 80 GB table and exit")
    parser.add_argument("--seqs", type=int, nargs="+")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS))
    parser.add_argument("--kinds", nargs="+", default=["sao", "opd"], choices=["sao", "opd"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N (peak allocated CUDA bytes)")
    parser.add_argument("--limit-gb", type=float, default=20.0, help="skip points predicted above this")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per point")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.plan:
        plan()
        return
    dims = QUICK if args.quick else FULL
    seqs = args.seqs or ([256, 512, 1024] if args.quick else [512, 1024, 2048, 4096, 8192])
    variants = args.variants or (["plain", "both"] if args.quick else list(VARIANTS))
    shape = ModelShape(dims["layers"], dims["hidden"], dims["intermediate"], dims["heads"], dims["kv_heads"],
                       dims["vocab"])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "model", dims))
        for kind in args.kinds:
            for seq in seqs:
                for variant in variants:
                    point = {"kind": kind, "seq": seq, "variant": variant, "batch": args.batch, "model": model,
                             "vocab": dims["vocab"], "threads": args.threads, "device": args.device,
                             "work": str(Path(tmp) / f"{kind}-{seq}-{variant}")}
                    model_bytes = predicted(point, shape)
                    row = {k: point[k] for k in ("kind", "seq", "variant")}
                    if model_bytes > args.limit_gb * 2**30:
                        row.update(skipped=f"predicted {model_bytes / 2**30:.1f} GB > --limit-gb {args.limit_gb}")
                    else:
                        result = run_point(point, args.timeout)
                        if "error" in result:
                            row.update(error=result["error"])
                        else:
                            pred = result["runtime_bytes"] + model_bytes
                            row.update(measured_mb=round(result["peak_bytes"] / MB), predicted_mb=round(pred / MB),
                                       runtime_mb=round(result["runtime_bytes"] / MB),
                                       loaded_mb=round(result["loaded_bytes"] / MB),
                                       error_pct=round(100 * (pred / result["peak_bytes"] - 1), 1),
                                       step_s=result["step_s"])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    measured = [r for r in rows if "measured_mb" in r]
    checks = {}
    for kind in args.kinds:
        both = [(r["seq"], r["measured_mb"]) for r in measured if r["kind"] == kind and r["variant"] == "both"]
        at = {r["variant"]: r["measured_mb"] for r in measured if r["kind"] == kind and r["seq"] == 4096}
        checks[kind] = {"both_at_most_linear": linear_at_most(both) if len(both) > 1 else None,
                        "both_under_half_of_plain_at_4096": at["both"] < at["plain"] / 2
                        if {"both", "plain"} <= set(at) else None}
    within = [abs(r["error_pct"]) <= 25 for r in measured]
    print("| step | seq | variant | measured MB | predicted MB | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "measured_mb" in r:
            print(f"| {r['kind']} | {r['seq']} | {r['variant']} | {r['measured_mb']} | {r['predicted_mb']} | "
                  f"{r['error_pct']:+.1f}% |")
        else:
            print(f"| {r['kind']} | {r['seq']} | {r['variant']} | {r.get('skipped') or r.get('error')} | | |")
    print(json.dumps({"model": {**dims, "params": shape.params}, "batch": args.batch, "device": args.device,
                      "points": rows,
                      "checks": checks, "within_25pct": f"{sum(within)}/{len(within)}"}))


if __name__ == "__main__":
    main()
