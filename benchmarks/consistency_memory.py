"""Peak memory of the consistency checker's chunked logprobs vs the naive [T, V] computation.

Each method runs in a fresh subprocess that first allocates the inputs (final hidden states [T, H] and
an lm head [V, H]), reads its peak RSS, then computes the logprob of T target tokens; the figure is the
growth of the peak RSS (`ru_maxrss`) over that baseline. glibc's mmap threshold is pinned at 128 KiB in
the children, so every large tensor is its own mapping and is returned on free: otherwise the threshold
adapts upwards and freed chunks linger in the heap, adding 0-130 MiB of noise to the chunked figure.
Naive: logits = hidden @ W.T (a [T, V] fp32 tensor), log_softmax, gather. Chunked:
`opd_sao.model.modeling.token_logprobs`.

    python benchmarks/consistency_memory.py           # T=4096, V=151936 (Qwen's vocabulary)
    python benchmarks/consistency_memory.py --quick   # T=2048, same V

The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HIDDEN = 64  # a small hidden size: the lm head's activations, not the matmul, are what is measured


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(method: str, tokens: int, vocab: int) -> dict:
    """Runs in the child: the peak-RSS growth of one computation, its time and its logprobs."""
    import torch

    from opd_sao.model.modeling import token_logprobs

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=g)
    weight = torch.randn(vocab, HIDDEN, generator=g) / HIDDEN ** 0.5
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    temperature = torch.ones(tokens)
    base = _peak_mb()
    t0 = time.perf_counter()
    with torch.no_grad():
        if method == "naive":
            logp = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        else:
            logp = token_logprobs(hidden, weight, None, targets, temperature)
    seconds = time.perf_counter() - t0
    return {"peak_mb": round(_peak_mb() - base, 1), "seconds": round(seconds, 3), "logp": logp.tolist()}


def run_child(method: str, tokens: int, vocab: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", method, "--tokens", str(tokens), "--vocab", str(vocab)],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T=2048 instead of 4096")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = args.tokens or (2048 if args.quick else 4096)
    if args.child:
        print(json.dumps(measure(args.child, tokens, args.vocab)))
        return
    naive, chunked = run_child("naive", tokens, args.vocab), run_child("chunked", tokens, args.vocab)
    full_tv_mb = tokens * args.vocab * 4 / 2**20
    print(f"T={tokens} V={args.vocab} H={HIDDEN}: one [T, V] fp32 tensor is {full_tv_mb:.0f} MiB")
    for name, r in (("naive", naive), ("chunked", chunked)):
        print(f"  {name:<8} peak +{r['peak_mb']:>8.1f} MiB  {r['seconds']:.2f} s")
    print(json.dumps({
        "tokens": tokens, "vocab": args.vocab, "hidden": HIDDEN, "tv_fp32_mb": round(full_tv_mb, 1),
        "naive_peak_mb": naive["peak_mb"], "chunked_peak_mb": chunked["peak_mb"],
        "memory_ratio": round(naive["peak_mb"] / max(chunked["peak_mb"], 0.1), 1),
        "naive_s": naive["seconds"], "chunked_s": chunked["seconds"],
        "max_abs_logp_diff": max(abs(a - b) for a, b in zip(naive["logp"], chunked["logp"])),
    }))


if __name__ == "__main__":
    main()
