"""What SAO's critic costs on a real model: peak memory and time of one learner step, SAO against GRPO-DIS (the same
policy loss without a critic), on SmolLM2-135M-Instruct (`opd-sao models fetch smollm2 DIR`), with the critic's
cheaper variants beside them.

    grpo_dis          no critic: one policy forward + backward
    sao               critic (full backbone copy, attention frozen), K=2 critic passes, then the policy
    sao_minibatches   the K=2 critic updates on K mini-batches of the batch (trainer.critic_minibatches)
    sao_k1            K=1 (one critic pass; what K costs)
    sao_top6          K=2, the critic training the last 6 decoder layers' feed-forward blocks only
                      (trainer.critic_trained_layers: its backward stops there)

A batch is `--batch` rollouts of the model's own chat-formatted prompts and its own sampled answers
(`--new-tokens` each, generated once with the embedded engine and reused by every variant), with the rollout
logprobs the engine reported, so the DIS masks are what a run sees. Every variant runs in a fresh child process
(benchmarks/memory_scaling.py's measurement: RSS high-water mark reset after loading, glibc's mmap threshold low)
for `--steps` learner steps after one warm-up step; time is the child's CPU seconds per step (user + system, all
threads) and wall seconds per step. Peak memory is the high-water mark over the steps minus nothing: the whole
process (model, optimizer moments, activations).

    python benchmarks/critic_cost.py --model models/smollm2             # batch 8, 64 new tokens, 3 steps
    python benchmarks/critic_cost.py --model models/smollm2 --quick     # batch 4, 32 new tokens, 1 step

`--gradient-checkpointing` runs every variant under trainer.gradient_checkpointing (a 7B run's setting);
`--transformers-forward` under trainer.own_forward false (transformers' forward: no frozen-prefix reuse, which is
what checkpointing meant before opd-sao's forward checkpointed itself).

The last line is one JSON object: per variant {peak_mb, loaded_mb, cpu_s_per_step, wall_s_per_step}, and the
ratios to grpo_dis side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from memory_scaling import peak_bytes, reset_peak, rss_bytes, run_point  # the same measurement

VARIANTS = {"grpo_dis": ("grpo_dis", {}), "sao": ("sao", {}),
            "sao_minibatches": ("sao", {"critic_minibatches": True}), "sao_k1": ("sao", {"critic_steps": 1}),
            "sao_top6": ("sao", {"critic_trained_layers": 6})}
PROMPTS = ["What is {a} + {b}?", "Write one sentence about the number {a}.", "Compute {a} times {b}.",
           "Name a word that rhymes with cat and count to {b}."]
MB = 2**20


def rollouts(model_dir: Path, batch: int, new_tokens: int, out: Path) -> None:
    """The model's own answers to chat-formatted prompts, with the engine's logprobs (written once, JSON)."""
    import torch
    from transformers import AutoTokenizer

    from opd_sao.checkpoints import load_causal_lm
    from opd_sao.engines.base import GenerationRequest, SamplingParams
    from opd_sao.engines.embedded import EmbeddedEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_causal_lm(model_dir, device=torch.device("cpu"), attn_implementation="sdpa")
    engine = EmbeddedEngine(model, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, max_batch=batch, seed=0)
    requests = []
    for i in range(batch):
        text = PROMPTS[i % len(PROMPTS)].format(a=17 + 3 * i, b=5 + i)
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        requests.append(GenerationRequest(prompt_ids=list(ids), tag=i,
                                          params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True)))
    results = {}
    with torch.no_grad():
        engine.generate(requests, lambda r: results.__setitem__(r.request.tag, r))
    rows = [{"prompt_ids": requests[i].prompt_ids, "token_ids": list(results[i].token_ids),
             "logp": list(results[i].logprobs)} for i in range(batch)]
    out.write_text(json.dumps(rows))


def child(point: dict) -> dict:
    import torch

    torch.set_num_threads(point["threads"])
    from opd_sao.config import AlgoConfig, TrainerConfig
    from opd_sao.rl.learner import Learner
    from opd_sao.trainers import TorchTrainer
    from opd_sao.trajectory import Trajectory, collate

    algo, extra = VARIANTS[point["variant"]]
    rows = json.loads(Path(point["rollouts"]).read_text())
    trajs = [Trajectory(traj_id=f"t{i}", domain="d", prompt_ids=r["prompt_ids"], token_ids=r["token_ids"],
                        action_mask=[1] * len(r["token_ids"]), rollout_logp=r["logp"],
                        versions=[0] * len(r["token_ids"]),
                        rewards=[0.0] * (len(r["token_ids"]) - 1) + [float(i % 2)]) for i, r in enumerate(rows)]
    batch = collate(trajs, 0)
    cfg = TrainerConfig(train_batch_size=len(trajs), critic_warmup_steps=0, policy_lr=1e-6, critic_lr=1e-5,
                        gradient_checkpointing=point["checkpointing"],
                        own_forward=False if point["transformers_forward"] else None, **{"critic_steps": 2, **extra})
    backend = TorchTrainer(point["model"], cfg, with_critic=algo == "sao", attn_implementation="sdpa")
    learner = Learner(backend, algo, AlgoConfig(), critic_steps=cfg.critic_steps, critic_warmup_steps=0,
                      critic_minibatches=cfg.critic_minibatches)
    learner.step(batch, 1.0)  # warm-up: AdamW's moments allocated
    loaded = rss_bytes()
    reset_peak()
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(point["steps"]):
        learner.step(batch, 1.0)
    cpu1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall0
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"peak_mb": round(peak_bytes() / MB), "loaded_mb": round(loaded / MB),
            "cpu_s_per_step": round(cpu / point["steps"], 2), "wall_s_per_step": round(wall / point["steps"], 2),
            "tokens": int(batch.action_mask.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an HF directory (opd-sao models fetch smollm2 DIR)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default="/tmp/critic_cost")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, grpo_dis always included")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="every variant under it")
    parser.add_argument("--transformers-forward", action="store_true", help="every variant with own_forward false")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if not args.model:
        parser.error("--model DIR is required (opd-sao models fetch smollm2 DIR)")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)} (known: {', '.join(VARIANTS)})")
    batch = args.batch or (4 if args.quick else 8)
    new_tokens = args.new_tokens or (32 if args.quick else 64)
    steps = args.steps or (1 if args.quick else 3)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"rollouts-{batch}-{new_tokens}.json"
    if not data.is_file():
        rollouts(Path(args.model), batch, new_tokens, data)
    results = {}
    for variant in dict.fromkeys(["grpo_dis", *args.variants.split(",")]):
        point = {"variant": variant, "model": str(Path(args.model).resolve()), "rollouts": str(data),
                 "steps": steps, "threads": args.threads, "checkpointing": args.gradient_checkpointing,
                 "transformers_forward": args.transformers_forward}
        results[variant] = run_point(point, timeout=3600, script=__file__)
        print(variant, results[variant], flush=True)
    base = results["grpo_dis"]
    ratios = {v: {k: round(r[k] / base[k], 2) for k in ("peak_mb", "cpu_s_per_step", "wall_s_per_step")}
              for v, r in results.items() if "error" not in r and "error" not in base}
    print(json.dumps({"model": args.model, "batch": batch, "new_tokens": new_tokens, "steps": steps,
                      "threads": args.threads, "gradient_checkpointing": args.gradient_checkpointing,
                      "transformers_forward": args.transformers_forward,
                      "load_avg_1m": os.getloadavg()[0], "results": results,
                      "ratio_to_grpo_dis": ratios}))


if __name__ == "__main__":
    main()
