"""SAO vs GRPO under forced staleness: configs/reasoning.yaml (the reasoning stage alone) with a slowed trainer.

The trainer sleeps `--slowdown` seconds per step, so the rollout worker runs up to `max_staleness`
policy versions ahead and most trajectories are trained on off-policy. Prints one JSON object on
its last line: per algorithm, held-out accuracy before/after RL, mean staleness, and the reward
curve's first and last quarter.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from opd_sao.app.pipeline import run_pipeline
from opd_sao.config import load_config

REASONING = Path(__file__).resolve().parents[1] / "configs" / "reasoning.yaml"


def run_algo(algo: str, steps: int, slowdown: float, max_staleness: int, out: Path) -> dict:
    overrides = [f"algo={algo}", f"trainer.slowdown_s={slowdown}", f"stages.reasoning.steps={steps}",
                 f"stages.reasoning.rollout.max_staleness={max_staleness}", "logging.wandb=false",
                 "logging.progress=false"]
    summary = run_pipeline(load_config(REASONING, overrides), out / algo, log=lambda m: None)
    stage = summary["stages"][0]
    return {
        "eval_before": stage["eval_before"]["arithmetic"],
        "eval_after": stage["eval_after"]["arithmetic"],
        "staleness_mean": stage["train"]["staleness_mean"],
        "dropped_stale": stage["train"]["dropped_stale"],
        "reward_first_quarter": stage["train"]["reward_first_quarter"],
        "reward_last_quarter": stage["train"]["reward_last_quarter"],
        "mask_fraction_mean": stage["train"]["mask_fraction_mean"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--slowdown", type=float, default=0.1)
    parser.add_argument("--max-staleness", type=int, default=4)
    args = parser.parse_args()
    steps = 20 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        results = {algo: run_algo(algo, steps, args.slowdown, args.max_staleness, Path(tmp))
                   for algo in ("sao", "grpo")}
    print(json.dumps({"benchmark": "staleness", "steps": steps, "slowdown_s": args.slowdown,
                      "max_staleness": args.max_staleness, **results}))


if __name__ == "__main__":
    main()
