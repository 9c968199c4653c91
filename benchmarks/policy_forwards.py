"""The trainer's policy through both forwards: opd-sao's own (`opd_sao/model/llama_forward.py`, `trainer.own_forward:
true`) and transformers' (`trainer.own_forward: false`), side by side: the time of one scoring pass
(`modeling.sequence_logprobs` over the action tokens, no grad) and of one training pass (the same with its
backward), and how far the two forwards' logprobs and gradients drift apart.

The model is a randomly initialised Qwen2-architecture one (std `INIT_STD`; default: Qwen2.5-0.5B's shape, 494M parameters;
`--quick`: 4 layers, hidden 128, the same vocabulary), loaded twice from one set of weights (one copy kept on
transformers' forward), in train mode as the trainer holds it, with `--attn` attention. A batch is `--batch`
sequences of `--seq` tokens (a 32-token prompt, the rest action tokens). Each time is the median of `--repeats`
passes after one warm-up (CUDA synchronised around each).

    python benchmarks/policy_forwards.py --device cuda              # scripts/gpu_check.sh's `forwards` run
    python benchmarks/policy_forwards.py --device cpu --quick       # a dry check on a CPU

Drift: max and mean |logp_own - logp_transformers| over the action tokens, and the largest gradient difference
relative to the largest gradient entry (over all parameters). The last line is one JSON object with every row.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opd_sao.model import llama_forward
from opd_sao.model.modeling import sequence_logprobs

FULL = dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151_936)  # Qwen2.5-0.5B
QUICK = dict(layers=4, hidden=128, intermediate=512, heads=4, kv_heads=2, vocab=151_936)
PROMPT = 32
INIT_STD = 0.1  # weights' std: logits of std ~3 at hidden 896, a peaked distribution as a trained model's (0.02,
# the default, gives a near-uniform one whose logprobs sit at -log(vocab) and hide the forwards' differences)


def build(shape: dict, dtype: torch.dtype, device: str, attn: str):
    """(own, transformers'): the same weights twice, the second kept on transformers' forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], tie_word_embeddings=True,
                         max_position_embeddings=32768, attn_implementation=attn, initializer_range=INIT_STD)
    torch.manual_seed(0)
    own = Qwen2ForCausalLM(config).to(device=device, dtype=dtype).train()
    theirs = copy.deepcopy(own)
    llama_forward.use_own(own)  # on any device, as `trainer.own_forward: true` (unset: CPU only)
    llama_forward.keep_transformers(theirs)
    assert llama_forward.serves(own) and not llama_forward.serves(theirs), llama_forward.unsupported(own)
    return own, theirs


def timed(fn, device: str, repeats: int) -> tuple[float, object]:
    """Median seconds of `fn()` over `repeats` calls after a warm-up, and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def measure(model, ids, mask, only, device: str, repeats: int) -> dict:
    def score():
        with torch.no_grad():
            return sequence_logprobs(model, ids, mask, only=only)

    def train():
        model.zero_grad(set_to_none=True)
        logp = sequence_logprobs(model, ids, mask, only=only)
        logp.sum().backward()
        return logp.detach()

    score_s, logp = timed(score, device, repeats)
    train_s, _ = timed(train, device, repeats)
    grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
    return {"score_s": score_s, "train_s": train_s, "logp": logp.float(), "grads": grads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="4 layers, hidden 128 (a dry check on a CPU)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--batch", type=int, default=None, help="sequences (default: 8; --quick 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 1024; --quick 96)")
    ap.add_argument("--repeats", type=int, default=None, help="timed passes (default: 5; --quick 2)")
    args = ap.parse_args()
    shape = QUICK if args.quick else FULL
    batch, seq = args.batch or (2 if args.quick else 8), args.seq or (96 if args.quick else 1024)
    repeats = args.repeats or (2 if args.quick else 5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab"], (batch, seq), generator=g).to(args.device)
    mask = torch.ones_like(ids)
    only = torch.zeros_like(ids)
    only[:, PROMPT:] = 1
    actions = only[:, 1:].bool().nonzero(as_tuple=True)
    rows = []
    print(f"policy forwards on {args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}): "
          f"{shape['layers']} layers, hidden {shape['hidden']}, vocabulary {shape['vocab']}, {args.attn}, "
          f"batch {batch} x {seq} tokens ({PROMPT} prompt), median of {repeats}")
    print("| dtype | forward | score ms | train ms | max abs dlogp | mean abs dlogp | max grad diff (rel) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.dtypes:
        own, theirs = build(shape, getattr(torch, name), args.device, args.attn)
        results = {label: measure(model, ids, mask, only, args.device, repeats)
                   for label, model in (("own", own), ("transformers", theirs))}
        a, b = results["own"], results["transformers"]
        dlogp = (a["logp"][:, 1:][actions] - b["logp"][:, 1:][actions]).abs()
        top = max(float(g.abs().max()) for g in b["grads"].values()) or 1.0
        grad = max(float((a["grads"][n] - g).abs().max()) for n, g in b["grads"].items()) / top
        for label, r in results.items():
            drift = (f"{float(dlogp.max()):.2e} | {float(dlogp.mean()):.2e} | {grad:.2e}" if label == "own"
                     else "(reference) | | ")
            print(f"| {name} | {label} | {r['score_s'] * 1e3:.1f} | {r['train_s'] * 1e3:.1f} | {drift} |")
        rows.append({"dtype": name, "own_score_ms": a["score_s"] * 1e3, "own_train_ms": a["train_s"] * 1e3,
                     "transformers_score_ms": b["score_s"] * 1e3, "transformers_train_ms": b["train_s"] * 1e3,
                     "train_speedup": b["train_s"] / a["train_s"], "max_abs_dlogp": float(dlogp.max()),
                     "mean_abs_dlogp": float(dlogp.mean()), "max_rel_grad_diff": grad})
        del own, theirs, results
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(json.dumps({"device": args.device, "shape": shape, "batch": batch, "seq": seq, "attn": args.attn,
                      "rows": rows}))


if __name__ == "__main__":
    main()
