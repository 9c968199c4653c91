"""Peak memory, step time and achieved FLOP/s of SFT, SAO policy, OPD top-p and critic steps at a real vocabulary.

The model is a Qwen2-architecture causal LM at a tiny hidden size (64, 2 layers) with Qwen2.5's padded
vocabulary (151,936), so the lm head is almost all of the work, as it is for small students at real
vocabularies. "chunked" is the trainer's path (`opd_sao.model.modeling.sequence_logprobs`: hidden states,
then the lm head a vocabulary chunk at a time, recomputed in the backward, and only at the positions
the loss reads: the response, three quarters of each sequence here); "naive" is the model's own
forward, which materialises [B, T, V] float32 logits (`full_logits=True`). Each (step, method) runs in
its own child process, so its peak RSS growth is its own; the two methods alternate within one run.

The `opd_top_p` kind is an OPD step at granularity top_p (p 0.95) from a random-init teacher (the
nucleus would be most of the vocabulary) with the nucleus capped at `opd.max_support` (256): teacher
scoring (`opd_sao.teachers.scoring.score_rows`), the cache's padded support, the student's support logprobs and
the divergence's backward; chunked only (there is no naive OPD path). The `critic` kind is the trainer's
critic step (`ValueModel`, frozen fused (sdpa) attention, value loss, backward, AdamW); it has no lm head.
`--vocab 384` gives the tiny model's vocabulary for comparison.

Every chunked step also reports its achieved FLOP/s against the machine's matmul rate measured in the
same child, in CPU time (robust to other load). SFT, policy, OPD: the lm head's matmuls (the work at
this vocabulary) against a plain `torch.matmul` of the lm head's shape, both as written (`h @ w.T`, which
faults in a fresh [N, V] result each call: `share_of_matmul`) and into a preallocated output (the
arithmetic rate, the stricter reference: `share_of_matmul_out`); a chunked SFT/policy step does
4 x 2NHV (forward, and the backward's recomputation, grad-hidden and grad-weight), an OPD step 1 x 2NHV
for the teacher plus 4 x 2NHV for the student. Critic: every matmul of the step (decoder and value-head
linears, attention scores and values, forward and backward), recorded at the aten level from the same
step with eager attention (the fused kernel does the same products inside one call; the full T x T
score matrix is counted, as PaLM's model-FLOPs utilisation counts it), over the fused step's CPU time,
against the same matmuls replayed alone. `--threads 1` takes the measure without a second thread
spinning at each barrier while the OS runs other jobs (on a loaded 2-core machine that spinning is CPU
time, and a chunked step has many more barriers than one plain matmul). Speed runs (`--methods
chunked`) use the default allocator, as `opd-sao run` does; a naive-vs-chunked memory comparison runs
with a 128 KiB malloc mmap threshold (`child_env`).

    python benchmarks/vocab_memory.py            # batch 8 x sequence 512 (the issue's setting)
    python benchmarks/vocab_memory.py --quick    # batch 2 x sequence 128

Prints one JSON object on its last line: per step kind and method, peak RSS growth (MB), the median
step time (wall s) and CPU time (s, user + system of the process: steadier than wall time on a shared
machine), the chunked/naive ratios, and the achieved GFLOP/s per CPU-second vs the matmul rate's.
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
MAX_SUPPORT = 256
LM_HEAD_MATMULS = {"sft": 4, "sao_policy": 4, "opd_top_p": 5}  # 2NHV-FLOP lm-head matmuls per step (see above)
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm")  # the aten ops that every matmul of the models comes down to
CRITIC_REPEATS = 5  # a critic step is ~0.1 CPU-s: one timed step is at the mercy of other jobs, so the median of 5


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def matmul_gflops_per_cpu_s(rows: int, vocab: int) -> tuple[float, float]:
    """A plain matmul of the lm head's shape ([rows, H] @ [H, V]) in GFLOP per CPU-second, two ways: `h @ w.T`
    as written (each call faults in a fresh [rows, V] result: gigabytes), and into one preallocated output
    (the arithmetic rate: the stricter reference)."""
    import torch

    h, w = torch.randn(rows, HIDDEN), torch.randn(vocab, HIDDEN)
    out, n, flop = h @ w.T, 3, 2 * rows * HIDDEN * vocab  # warm-up, and the output the second way reuses
    c0 = time.process_time()
    for _ in range(n):
        h @ w.T
    plain = n * flop / (time.process_time() - c0) / 1e9
    c0 = time.process_time()
    for _ in range(n):
        torch.matmul(h, w.T, out=out)
    return plain, n * flop / (time.process_time() - c0) / 1e9


def _matmul_flops(op: str, shapes: list) -> int:
    """2 x multiply-adds of one recorded mm / addmm / bmm / baddbmm call (its last two operands' shapes)."""
    a, b = shapes[-2], shapes[-1]
    return 2 * (a[0] if op.endswith("bmm") else 1) * a[-2] * a[-1] * b[-1]


def recorded_matmuls(step) -> tuple[list, float]:
    """Run `step` once, recording every matmul aten call (op, operand shapes); return them and their GFLOP."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in MATMUL_OPS:
                calls.append((name, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    with Record():
        step()
    return calls, sum(_matmul_flops(op, shapes) for op, shapes in calls) / 1e9


def replayed_gflops_per_cpu_s(calls: list) -> float:
    """The same matmuls alone, on fresh contiguous operands: the machine's rate for exactly this work."""
    import torch

    ops = [(getattr(torch.ops.aten, op).default, [torch.randn(shape) for shape in shapes]) for op, shapes in calls]
    times = []
    for _ in range(1 + CRITIC_REPEATS):  # a warm-up, then the median pass
        c0 = time.process_time()
        for func, args in ops:
            func(*args)
        times.append(time.process_time() - c0)
    return sum(_matmul_flops(op, shapes) for op, shapes in calls) / statistics.median(times[1:]) / 1e9


def measure(kind: str, method: str, batch: int, seq: int, repeats: int, vocab: int = VOCAB, threads: int = 2) -> dict:
    """In the child: build the model, run one warm-up and `repeats` timed steps; peak RSS growth and times."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from opd_sao import algorithms as A
    from opd_sao.model.modeling import hidden_states, lm_head, sequence_logprobs, support_logprobs
    from opd_sao.teachers.scoring import score_rows

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * seq,
                         tie_word_embeddings=True)
    if kind == "critic":  # the trainer's critic: the backbone with fused attention, frozen attention, a value head
        from transformers import Qwen2Model

        from opd_sao.trainers.critic import ValueModel

        config._attn_implementation = "sdpa"
        model = ValueModel(Qwen2Model(config), HIDDEN).train()
        model.freeze_attention()
    else:
        model = Qwen2ForCausalLM(config).train()
    teacher = Qwen2ForCausalLM(config).eval() if kind == "opd_top_p" else None
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.float32)
    loss_mask[:, seq // 4:] = 1  # the response: everything after a prompt of a quarter of the sequence
    rollout_logp = -torch.rand(batch, seq, generator=g) * 5 * loss_mask
    advantages = torch.randn(batch, seq, generator=g) * loss_mask
    full = method == "naive"

    b, t = loss_mask.bool().nonzero(as_tuple=True)
    extra: dict = {}

    def opd_loss() -> torch.Tensor:
        with torch.no_grad():
            weight, _ = lm_head(teacher)
            scored = score_rows(hidden_states(teacher, ids, mask)[b, t - 1], weight, None, ids[b, t],
                                granularity="top_p", p=0.95, max_support=MAX_SUPPORT)
        lens = scored.row_len
        width, n = int(lens.max()), len(lens)
        col = torch.arange(width).expand(n, -1)
        support = col < lens.unsqueeze(1)
        flat = torch.zeros((n, width), dtype=torch.long)
        t_raw = torch.zeros((n, width))
        flat[support], t_raw[support] = scored.ids, scored.logp
        extra.update(support_mean=float(lens.float().mean()), cap_hit_rate=float((lens >= MAX_SUPPORT).float().mean()))
        t_logp = A.renormalize_support(t_raw, support, scored.tail_mass)
        weight, _ = lm_head(model)
        s_logp, s_tail, _ = support_logprobs(hidden_states(model, ids, mask)[b, t - 1], weight, None, flat, support)
        return A.truncated_divergence(s_logp, t_logp, support, s_tail, kind="forward_kl").mean()

    def step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        if kind == "critic":
            loss, _ = A.value_loss(model(ids, mask), advantages, loss_mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return time.perf_counter() - t0, time.process_time() - c0
        if kind == "opd_top_p":
            loss = opd_loss()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return time.perf_counter() - t0, time.process_time() - c0
        # chunked: the trainer's path, the lm head only at the answer's / actions' positions (`only`);
        # naive: the model's full forward, [B, T, V] logits
        logp = sequence_logprobs(model, ids, mask, 1.0, full_logits=full, only=None if full else loss_mask)
        if kind == "sft":
            loss = -(logp * loss_mask).sum() / loss_mask.sum()
        else:
            loss, _ = A.sao_policy_loss(logp, rollout_logp, advantages, loss_mask, 0.3, 5.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0, time.process_time() - c0

    base = _peak_mb()
    if kind == "critic":
        repeats = max(repeats, CRITIC_REPEATS)
    step()  # warm-up: optimizer state, allocator
    times = [step() for _ in range(repeats)]
    out = {"peak_mb": round(_peak_mb() - base, 1), "step_s": round(statistics.median(s for s, _ in times), 3),
           "cpu_s": round(statistics.median(c for _, c in times), 3), **extra}
    if kind == "critic":  # no lm head: the step's own matmuls (recorded) against the same matmuls alone
        model.backbone.set_attn_implementation("eager")  # so the attention products are separate, recordable calls
        calls, gflop = recorded_matmuls(step)
        out["matmul_gflop"] = round(gflop, 2)
        out["model_gflops_per_cpu_s"] = round(gflop / out["cpu_s"], 2)
        out["matmul_gflops_per_cpu_s"] = round(replayed_gflops_per_cpu_s(calls), 2)
        out["share_of_matmul"] = round(out["model_gflops_per_cpu_s"] / out["matmul_gflops_per_cpu_s"], 3)
    elif method == "chunked":  # the lm head's achieved FLOP/s against a plain matmul of its shape
        rows = int(loss_mask.sum())  # the positions the lm head runs on
        flops = LM_HEAD_MATMULS[kind] * 2 * rows * HIDDEN * vocab
        out["lm_head_gflops_per_cpu_s"] = round(flops / out["cpu_s"] / 1e9, 2)
        plain, arithmetic = matmul_gflops_per_cpu_s(rows, vocab)
        out["matmul_gflops_per_cpu_s"] = round(plain, 2)
        out["share_of_matmul"] = round(out["lm_head_gflops_per_cpu_s"] / plain, 3)
        out["matmul_out_gflops_per_cpu_s"] = round(arithmetic, 2)
        out["share_of_matmul_out"] = round(out["lm_head_gflops_per_cpu_s"] / arithmetic, 3)
    return out


def child_env(compare_memory: bool) -> dict:
    """The naive-vs-chunked memory comparison runs with a 128 KiB malloc mmap threshold, so freed blocks go back
    to the OS and peak RSS is what the step needs, not what glibc kept; the speed figures (--methods chunked)
    run with the default allocator, as `opd-sao run` does (the threshold page-faults every chunk buffer)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    return {**env, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)} if compare_memory else env


def run_child(kind: str, method: str, batch: int, seq: int, repeats: int, vocab: int, threads: int,
              compare_memory: bool) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, method, "--batch", str(batch), "--seq", str(seq),
                          "--threads", str(threads),
                          "--repeats", str(repeats), "--vocab", str(vocab)], capture_output=True, text=True,
                         env=child_env(compare_memory))
    if out.returncode:
        raise SystemExit(f"{kind}/{method} child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 2 x sequence 128, one timed step")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per child (median)")
    parser.add_argument("--kinds", default="sft,sao_policy,opd_top_p,critic",
                        help="comma-separated step kinds to measure")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (384: the tiny model's)")
    parser.add_argument("--methods", default="naive,chunked", help="comma-separated: naive, chunked")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads per child (1: no idle threads spinning at barriers on a loaded machine)")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.repeats = 2, 128, 1
    if args.child:
        print(json.dumps(measure(*args.child, args.batch, args.seq, args.repeats, args.vocab, args.threads)))
        return
    results: dict = {}
    for kind in args.kinds.split(","):
        methods = ["chunked"] if kind in ("opd_top_p", "critic") else args.methods.split(",")
        for method in methods:
            results.setdefault(kind, {})[method] = run_child(kind, method, args.batch, args.seq, args.repeats,
                                                             args.vocab, args.threads,
                                                             compare_memory="naive" in args.methods)
            print(f"{kind:10s} {method:8s} {results[kind][method]}", flush=True)
        r = results[kind]
        if "naive" in r and "chunked" in r:
            r["memory_ratio"] = round(r["chunked"]["peak_mb"] / max(r["naive"]["peak_mb"], 1e-9), 3)
            r["time_ratio"] = round(r["chunked"]["step_s"] / max(r["naive"]["step_s"], 1e-9), 3)
            r["cpu_time_ratio"] = round(r["chunked"]["cpu_s"] / max(r["naive"]["cpu_s"], 1e-9), 3)
    print(json.dumps({"benchmark": "vocab_memory", "vocab": args.vocab, "hidden": HIDDEN, "batch": args.batch,
                      "seq": args.seq, "repeats": args.repeats, "threads": args.threads,
                      "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                      "results": results}))


if __name__ == "__main__":
    main()
