"""SAO's asynchronous single-rollout loop vs synchronous group batching, same model and engine.

Response lengths are drawn from a lognormal (p99/p50 ~ 10, as in agentic tasks) and forced with
ignore_eos, so both modes generate the same length distribution. Synchronous mode: G=8 rollouts per
prompt, a step waits for the whole batch, generation and training alternate. Asynchronous mode:
one rollout per prompt, continuous batching, training overlapped with generation.

Prints one JSON object on its last line: samples/s and trainer busy fraction for each mode, and the ratio.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from opd_sao.checkpoints import build_tiny_model, load_causal_lm, load_tokenizer
from opd_sao.config import AlgoConfig, RolloutConfig, TinyModelConfig, TrainerConfig
from opd_sao.engines import EmbeddedEngine
from opd_sao.engines.base import SamplingParams
from opd_sao.envs import ENVIRONMENTS
from opd_sao.io.tracking import MetricsLogger
from opd_sao.rl.learner import Learner, needs_critic
from opd_sao.rl.loop import RLLoop
from opd_sao.rl.rollout import Episode
from opd_sao.trainers import TorchTrainer

SIGMA = math.log(10) / 2.326  # p99 / p50 = 10 for a lognormal


def run_mode(model_dir: Path, out: Path, *, asynchronous: bool, steps: int, batch: int, median_len: int,
             max_len: int, seed: int) -> dict:
    tok = load_tokenizer(model_dir)
    env_cls = ENVIRONMENTS.get("arithmetic")
    tasks = itertools.cycle(env_cls().make_tasks("train", 500, seed=seed))
    rng = random.Random(seed)
    group_size = 1 if asynchronous else 8
    algo = "sao"  # the same learner in both modes: only the loop differs
    groups = itertools.count()

    def make_episodes():
        task, group = next(tasks), next(groups)
        episodes = []
        for _ in range(group_size):
            length = max(1, min(max_len, round(rng.lognormvariate(math.log(median_len), SIGMA))))
            params = SamplingParams(max_new_tokens=length, ignore_eos=True)
            episodes.append(Episode(env_cls(), task, tok, params, domain="arithmetic", max_turns=1,
                                    max_context_tokens=max_len + 32, group=group))
        return episodes

    engine = EmbeddedEngine(load_causal_lm(model_dir), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                            max_batch=batch, seed=seed)
    cfg = TrainerConfig(train_batch_size=batch, critic_warmup_steps=0)
    learner = Learner(TorchTrainer(model_dir, cfg, with_critic=needs_critic(algo)), algo, AlgoConfig(),
                      critic_steps=cfg.critic_steps, critic_warmup_steps=0)
    rollout = RolloutConfig(asynchronous=asynchronous, group_size=group_size, max_staleness=4)
    loop = RLLoop(engine=engine, learner=learner, make_episodes=make_episodes, rollout=rollout,
                  train_batch_size=batch, pad_id=tok.pad_token_id,
                  logger=MetricsLogger(out / f"{asynchronous}.jsonl", stage=algo), trained_log=out / f"{asynchronous}_trained.jsonl")
    t0 = time.perf_counter()
    history = loop.run(steps)
    wall = time.perf_counter() - t0
    idle = sum(h["trainer_idle_s"] for h in history)
    return {
        "mode": "async_single_rollout" if asynchronous else "sync_group_g8",
        "samples_per_s": steps * batch / wall,
        "trainer_busy_fraction": 1 - idle / wall,
        "rollout_tokens_per_s": engine.tokens_generated / wall,
        "wall_s": wall,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="finish in under a minute")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--median-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the loop's two threads share the cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = 6 if args.quick else args.steps
    max_len = args.median_len * 20
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        texts = []
        for name in ENVIRONMENTS.names():
            texts.extend(ENVIRONMENTS.get(name)().corpus(300))
        model_dir = build_tiny_model(tmp / "model", texts, TinyModelConfig(), seed=0)
        sync = run_mode(model_dir, tmp, asynchronous=False, steps=steps, batch=args.batch,
                        median_len=args.median_len, max_len=max_len, seed=0)
        asyn = run_mode(model_dir, tmp, asynchronous=True, steps=steps, batch=args.batch,
                        median_len=args.median_len, max_len=max_len, seed=0)
    result = {
        "benchmark": "async_vs_sync",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, CPU only",
        "length_distribution": {"kind": "lognormal", "median": args.median_len, "p99_over_p50": 10, "max": max_len},
        "batch": args.batch,
        "sync": sync,
        "async": asyn,
        "samples_per_s_ratio": asyn["samples_per_s"] / sync["samples_per_s"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
