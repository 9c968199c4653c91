"""Online learning (docs/design.md §2.6b): SAO vs the running-mean baseline when the preferred chat style switches.

Runs configs/online_learning.yaml (the chat user's preferred style rotates cute -> chuunibyou ->
classical every `switch_every` trainer steps; reward = quality x style) once per algorithm and seed,
all from one shared SFT warm start, with the same learning rates, batch and seeds. Both go through
the same pipeline and RLLoop; only `algo` differs.

Steps to recover (opd_sao.envs.chat.steps_to_recover, the level and window from the chat stage's
env_options `recover_level` / `recover_window`): after a switch at step S, the number of steps until
the mean batch reward over the last `window` steps, all taken at or after S + settle, first reaches
`level` (settle = the stage's max_staleness: batches that may still hold rollouts scored under the old
preference). Each run's stage summary.json reports it per switch (`style_switches`); this script
collects those.
A run that does not recover before the next switch (or the end) is censored: it counts as the whole
phase length in the mean and is reported in `censored`.

Prints one JSON object on its last line; writes a plot of reward vs step (mean over seeds) to `--plot`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from opd_sao.app.pipeline import ensure_base_model, run_pipeline
from opd_sao.checkpoints import load_tokenizer
from opd_sao.config import load_config
from opd_sao.envs import ENVIRONMENTS
from opd_sao.envs.chat import ChatEnv, StyleSchedule, steps_to_recover
from opd_sao.io.tracking import read_jsonl
from opd_sao.supervised import run_sft, sft_examples

ROOT = Path(__file__).resolve().parents[1]
ALGOS = ("sao", "running_mean")


def rolling(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def warm_start(cfg, work: Path) -> Path:
    """The SFT checkpoint every run starts from (built once, so both algorithms start identical)."""
    stage = cfg.stages[0]
    base = ensure_base_model(cfg, work)
    tok = load_tokenizer(base)
    env_cls = ENVIRONMENTS.get(stage.env)
    examples = sft_examples(lambda: env_cls(**stage.env_options), tok, n=100_000, seed=cfg.seed)
    return run_sft(base, work / "sft", examples, tok, stage.sft, cfg.seed)


def run_one(config: Path, overrides: list[str], algo: str, seed: int, start: Path, out: Path) -> dict:
    """Reward per trainer step and the stage summary's per-switch recovery of one run."""
    name = load_config(config, overrides).stages[0].name
    cfg = load_config(config, overrides + [f"algo={algo}", f"seed={seed}", f"model.path={start}",
                                           f"stages.{name}.init_from=base", f"stages.{name}.sft.steps=0",
                                           "logging.wandb=false", "logging.progress=false"])
    run_pipeline(cfg, out, log=lambda m: None)
    stage_dir = out / "stages" / name
    return {"rewards": [r["reward_mean"] for r in read_jsonl(stage_dir / "metrics.jsonl")],
            "per_switch": json.loads((stage_dir / "summary.json").read_text())["style_switches"]["per_switch"]}


def analyse(results: dict[str, list[dict]], schedule: StyleSchedule, steps: int, level: float, window: int) -> dict:
    """Across seeds, per switch: each run's own steps to recover, their mean (censored = phase length)."""
    switches = schedule.switches(steps)
    bounds = switches + [steps]
    result = {}
    for algo, seed_runs in results.items():
        runs = [run["rewards"] for run in seed_runs]
        per_switch = {}
        for i, s in enumerate(switches):
            label = f"step {s}: {schedule.style_at(s - 1)} -> {schedule.style_at(s)}"
            phase = bounds[i + 1] - s
            per_seed = [run["per_switch"][i]["steps_to_recover"] for run in seed_runs]
            per_switch[label] = {
                "per_seed": per_seed,
                "mean": statistics.fmean(phase if k is None else k for k in per_seed),
                "censored": sum(k is None for k in per_seed),
                "reward_before": statistics.fmean(statistics.fmean(r[s - window: s]) for r in runs),
                "reward_phase_mean": statistics.fmean(statistics.fmean(r[s: bounds[i + 1]]) for r in runs),
            }
        mean_curve = [statistics.fmean(r[t] for r in runs) for t in range(steps)]
        result[algo] = {
            "steps_to_recover": per_switch,
            "mean_steps_to_recover": statistics.fmean(v["mean"] for v in per_switch.values()) if per_switch else None,
            "initial_steps_to_level": [steps_to_recover(r, 0, bounds[0], level, window) for r in runs],
            "reward_curve": [round(v, 4) for v in mean_curve],
        }
    return result


def plot(curves: dict[str, list[list[float]]], schedule: StyleSchedule, steps: int, level: float, window: int,
         out: Path) -> None:
    fig, ax = plt.subplots(figsize=(10, 4))
    for (algo, runs), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        mean = [statistics.fmean(r[t] for r in runs) for t in range(steps)]
        ax.plot(mean, color=color, alpha=0.25, linewidth=1)
        ax.plot(rolling(mean, window), color=color, linewidth=2,
                label=f"{algo} ({len(runs)} seed{'s' * (len(runs) > 1)}, {window}-step mean)")
    for s in schedule.switches(steps):
        ax.axvline(s, color="grey", linestyle="--", linewidth=1)
    for s in [0] + schedule.switches(steps):
        ax.text(s + 0.5, 1.02, schedule.style_at(s), fontsize=9, va="bottom")
    ax.axhline(level, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="trainer step", ylabel="batch reward (quality x style)", ylim=(0, 1.1), xlim=(0, steps))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="dotted config overrides applied to every run (both algorithms)")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "online_learning.yaml")
    parser.add_argument("--quick", action="store_true", help="a smoke run under a minute: 3 short phases, one seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--algos", nargs="+", choices=ALGOS, default=list(ALGOS),
                        help="which algorithms to run (default both; the verdict needs both)")
    parser.add_argument("--plot", type=Path, help="where the plot goes (default: docs/online_learning.png; with "
                                                  "--quick, online_learning_quick.png in the temp directory)")
    parser.add_argument("--keep", type=Path, help="keep the run directories here (default: a temporary directory)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; the tiny model gains nothing from more, and a busy CPU loses a lot")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = list(args.overrides)
    if args.quick:
        name = load_config(args.config).stages[0].name
        overrides += [f"stages.{name}.steps=24", f"stages.{name}.env_options.switch_every=8",
                      f"stages.{name}.sft.steps=100", f"stages.{name}.eval.num_tasks=8",
                      f"stages.{name}.eval.samples_per_task=1", f"stages.{name}.env_options.recover_window=3"]
        args.seeds = args.seeds[:1]
    if args.plot is None:  # a smoke run must not overwrite the documented plot
        args.plot = Path(tempfile.gettempdir()) / "online_learning_quick.png" if args.quick else \
            ROOT / "docs" / "online_learning.png"
    cfg = load_config(args.config, overrides)
    stage = cfg.stages[0]
    env = ChatEnv(**stage.env_options)  # the schedule, level and window every run's summary uses
    schedule, level, window = env.schedule, env.recover_level, env.recover_window
    if not schedule.switches(stage.steps):
        raise SystemExit(f"{args.config}: the chat stage's style never switches within {stage.steps} steps")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        start = warm_start(cfg, work / "warm_start")
        results = {algo: [run_one(args.config, overrides, algo, seed, start, work / f"{algo}-seed{seed}")
                          for seed in args.seeds] for algo in args.algos}
    result = analyse(results, schedule, stage.steps, level, window)
    plot({algo: [run["rewards"] for run in runs] for algo, runs in results.items()}, schedule, stage.steps, level,
         window, args.plot)
    means = {algo: result[algo]["mean_steps_to_recover"] for algo in args.algos}
    print(json.dumps({
        "benchmark": "online_learning", "config": str(args.config), "overrides": overrides, "seeds": args.seeds,
        "steps": stage.steps, "switch_every": schedule.switch_every, "train_batch_size": cfg.stage_trainer(stage).train_batch_size,
        "policy_lr": cfg.stage_trainer(stage).policy_lr, "level": level, "window": window,
        "sao_recovers_faster": means["sao"] < means["running_mean"] if len(means) == 2 else None, "plot": str(args.plot), "wall_s": round(time.perf_counter() - t0, 1),
        **result,
    }))


if __name__ == "__main__":
    main()
