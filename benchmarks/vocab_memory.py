"""Peak memory and step time of an SFT step and an SAO policy step at a real vocabulary: chunked vs naive.

The model is a Qwen2-architecture causal LM at a tiny hidden size (64, 2 layers) with Qwen2.5's padded
vocabulary (151,936), so the lm head is almost all of the work, as it is for small students at real
vocabularies. "chunked" is the trainer's path (`opd_sao.modeling.sequence_logprobs`: hidden states,
then the lm head a vocabulary chunk at a time, recomputed in the backward); "naive" is the model's own
forward, which materialises [B, T, V] float32 logits (`full_logits=True`). Each (step, method) runs in
its own child process, so its peak RSS growth is its own; the two methods alternate within one run.

    python benchmarks/vocab_memory.py            # batch 8 x sequence 512 (the issue's setting)
    python benchmarks/vocab_memory.py --quick    # batch 2 x sequence 128

Prints one JSON object on its last line: per step kind and method, peak RSS growth (MB), the median
step time (wall s) and CPU time (s, user + system of the process: steadier than wall time on a shared
machine), and the chunked/naive ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

VOCAB = 151_936
HIDDEN = 64


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(kind: str, method: str, batch: int, seq: int, repeats: int) -> dict:
    """In the child: build the model, run one warm-up and `repeats` timed steps; peak RSS growth and times."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from opd_sao import algorithms as A
    from opd_sao.modeling import sequence_logprobs

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * seq,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.float32)
    loss_mask[:, seq // 4:] = 1  # the response: everything after a prompt of a quarter of the sequence
    rollout_logp = -torch.rand(batch, seq, generator=g) * 5 * loss_mask
    advantages = torch.randn(batch, seq, generator=g) * loss_mask
    full = method == "naive"

    def step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        logp = sequence_logprobs(model, ids, mask, 1.0, full_logits=full)
        if kind == "sft":
            loss = -(logp * loss_mask).sum() / loss_mask.sum()
        else:
            loss, _ = A.sao_policy_loss(logp, rollout_logp, advantages, loss_mask, 0.3, 5.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0, time.process_time() - c0

    base = _peak_mb()
    step()  # warm-up: optimizer state, allocator
    times = [step() for _ in range(repeats)]
    return {"peak_mb": round(_peak_mb() - base, 1), "step_s": round(statistics.median(t for t, _ in times), 3),
            "cpu_s": round(statistics.median(c for _, c in times), 3)}


def run_child(kind: str, method: str, batch: int, seq: int, repeats: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, method, "--batch", str(batch), "--seq", str(seq),
                          "--repeats", str(repeats)], capture_output=True, text=True,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    if out.returncode:
        raise SystemExit(f"{kind}/{method} child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 2 x sequence 128, one timed step")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per child (median)")
    parser.add_argument("--kinds", default="sft,sao_policy", help="comma-separated step kinds to measure")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.repeats = 2, 128, 1
    if args.child:
        print(json.dumps(measure(*args.child, args.batch, args.seq, args.repeats)))
        return
    results: dict = {}
    for kind in args.kinds.split(","):
        for method in ("naive", "chunked"):
            results.setdefault(kind, {})[method] = run_child(kind, method, args.batch, args.seq, args.repeats)
            print(f"{kind:10s} {method:8s} {results[kind][method]}", flush=True)
        r = results[kind]
        r["memory_ratio"] = round(r["chunked"]["peak_mb"] / max(r["naive"]["peak_mb"], 1e-9), 3)
        r["time_ratio"] = round(r["chunked"]["step_s"] / max(r["naive"]["step_s"], 1e-9), 3)
        r["cpu_time_ratio"] = round(r["chunked"]["cpu_s"] / max(r["naive"]["cpu_s"], 1e-9), 3)
    print(json.dumps({"benchmark": "vocab_memory", "vocab": VOCAB, "hidden": HIDDEN, "batch": args.batch,
                      "seq": args.seq, "repeats": args.repeats, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                      "results": results}))


if __name__ == "__main__":
    main()
