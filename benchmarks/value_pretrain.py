"""Value pre-training vs a cold critic: configs/reasoning.yaml's SAO stage, its first policy steps, several seeds.

One SFT warm start (the config's own) makes the start policy; every arm then runs the reasoning stage from
that same checkpoint for `--steps` steps, per seed:

  off     a fresh critic (zero value head) and the config's critic warm-up steps (5)
  on      value pre-training (`critic_pretrain: {rollouts, steps}`) and the same warm-up
  on_w0   value pre-training instead of the warm-up (critic_warmup_steps 0)

Reported per arm (mean and per seed): the critic's explained variance at the first policy step (measured
before that step's critic update, as the learner logs it), the train reward per block of 10 steps and
over all steps, held-out accuracy after the stage, and the wall time (stage total, and of it the
pre-training's rollouts and fit). Prints one JSON object on its last line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from opd_sao.app.pipeline import run_pipeline
from opd_sao.config import load_config

REASONING = Path(__file__).resolve().parents[1] / "configs" / "reasoning.yaml"
QUIET = ["logging.wandb=false", "logging.progress=false"]


def warm_start(out: Path) -> Path:
    """The config's SFT warm start, alone (0 RL steps): the start policy every arm shares."""
    summary = run_pipeline(load_config(REASONING, ["stages.reasoning.steps=0", *QUIET]), out, log=lambda m: None)
    return Path(summary["stages"][0]["checkpoint"])


def run_arm(start: Path, arm: str, seed: int, steps: int, rollouts: int, fit_steps: int, out: Path) -> dict:
    overrides = [f"model.path={start}", f"seed={seed}", f"stages.reasoning.steps={steps}",
                 "stages.reasoning.sft.steps=0", *QUIET]
    if arm != "off":
        overrides += [f"stages.reasoning.critic_pretrain.rollouts={rollouts}",
                      f"stages.reasoning.critic_pretrain.steps={fit_steps}"]
    if arm == "on_w0":
        overrides.append("trainer.critic_warmup_steps=0")
    cfg = load_config(REASONING, overrides)
    run_dir = out / f"{arm}-{seed}"
    stage = run_pipeline(cfg, run_dir, log=lambda m: None)["stages"][0]
    rows = [json.loads(line) for line in (run_dir / "stages" / "reasoning" / "metrics.jsonl").read_text().splitlines()]
    first_policy = next(r for r in rows if not r["critic_warmup"])
    rewards = [r["reward_mean"] for r in rows]
    pretrain = stage.get("critic_pretrain", {})
    return {
        "explained_variance_first_policy_step": round(first_policy["explained_variance"], 4),
        "value_loss_first_policy_step": round(first_policy["value_loss"], 4),
        "reward_by_10_steps": [round(statistics.fmean(rewards[i:i + 10]), 4) for i in range(0, len(rewards), 10)],
        "reward_mean": round(statistics.fmean(rewards), 4),
        "eval_before": stage["eval_before"]["arithmetic"], "eval_after": stage["eval_after"]["arithmetic"],
        "wall_s": stage["wall_s"],
        "pretrain_s": round(pretrain.get("rollout_s", 0.0) + pretrain.get("fit_s", 0.0), 2),
        "pretrain_explained_variance_last": pretrain.get("explained_variance_last"),
    }


def summarise(per_seed: dict[int, dict]) -> dict:
    runs = list(per_seed.values())
    mean = lambda key: round(statistics.fmean(r[key] for r in runs), 4)
    curve = [round(statistics.fmean(r["reward_by_10_steps"][i] for r in runs), 4)
             for i in range(len(runs[0]["reward_by_10_steps"]))]
    return {"explained_variance_first_policy_step": mean("explained_variance_first_policy_step"),
            "reward_by_10_steps": curve, "reward_mean": mean("reward_mean"), "eval_after": mean("eval_after"),
            "wall_s": mean("wall_s"), "pretrain_s": mean("pretrain_s"), "per_seed": per_seed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one seed, 10 steps, a small pre-training")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rollouts", type=int, default=512, help="critic_pretrain.rollouts")
    parser.add_argument("--fit-steps", type=int, default=50, help="critic_pretrain.steps")
    parser.add_argument("--arms", nargs="+", default=["off", "on", "on_w0"])
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds, args.rollouts, args.fit_steps = 10, [0], 128, 10
    with tempfile.TemporaryDirectory() as tmp:
        start = warm_start(Path(tmp) / "warm")
        results = {arm: summarise({seed: run_arm(start, arm, seed, args.steps, args.rollouts, args.fit_steps,
                                                 Path(tmp)) for seed in args.seeds})
                   for arm in args.arms}
    print(json.dumps({"benchmark": "value_pretrain", "steps": args.steps, "seeds": args.seeds,
                      "critic_pretrain": {"rollouts": args.rollouts, "steps": args.fit_steps}, **results}))


if __name__ == "__main__":
    main()
