"""How repeatable is the held-out evaluation? One checkpoint of a finished run scored on every domain under
several evaluation sampling seeds, at the run's samples per task and at one sample per task.

The pipeline scores every checkpoint with the run's seed, so the same checkpoint always gets the same score
(the seed fixes the samples); what this measures is how far that score is from the checkpoint's expected score,
i.e. how much of a difference between two stages' scores (or a "best earlier" score picked from five) is the
sampling's. The spread over seeds is that noise.

    python benchmarks/eval_spread.py RUN_DIR [--stage warmup] [--seeds 4] [--quick]

`--quick`: two seeds. Prints one JSON object on its last line: per domain and setting, the scores, their mean,
standard deviation and range, and the seconds the evaluations took.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from opd_sao.checkpoints import load_tokenizer
from opd_sao.config import load_config
from opd_sao.pipeline import eval_domains
from opd_sao.runs.evaluation import evaluate
from stages.domains import Domain


def spread(run_dir: Path, stage: str, seeds: list[int]) -> dict:
    cfg = load_config(run_dir / "config.yaml")
    tokenizer = load_tokenizer(run_dir / "base_model")
    checkpoint = run_dir / "stages" / stage / "checkpoint"
    out = {}
    for name in eval_domains(cfg):
        d = Domain(name, None, cfg.stages, cfg.device)
        for label, eval_cfg in (("run", d.eval_cfg), ("one_sample", d.eval_cfg.model_copy(update={"samples_per_task": 1}))):
            start, scores = time.perf_counter(), []
            for seed in seeds:
                scores.append(round(evaluate(checkpoint, d.factory, tokenizer, domain=name, rollout=d.eval_rollout,
                                             eval_cfg=eval_cfg, seed=seed, device=cfg.engine_device,
                                             attn_implementation=cfg.model.attn_implementation), 4))
            out[f"{name}/{label}"] = {
                "samples_per_task": eval_cfg.samples_per_task, "scores": scores,
                "mean": round(statistics.fmean(scores), 4), "stdev": round(statistics.stdev(scores), 4),
                "range": round(max(scores) - min(scores), 4), "wall_s": round(time.perf_counter() - start, 1)}
            print(name, label, out[f"{name}/{label}"], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--stage", default="warmup", help="whose checkpoint (a finished stage of the run)")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="two seeds")
    args = parser.parse_args()
    seeds = list(range(100, 100 + (2 if args.quick else args.seeds)))  # none of them a quickstart run's seed
    print(json.dumps({"run_dir": str(args.run_dir), "stage": args.stage, "seeds": seeds,
                      "domains": spread(args.run_dir, args.stage, seeds)}))


if __name__ == "__main__":
    main()
