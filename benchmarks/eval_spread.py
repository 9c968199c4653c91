"""How repeatable is the held-out evaluation? One checkpoint of a finished run scored on every domain under
several evaluation sampling seeds, at the run's samples per task.

The pipeline scores every checkpoint with the run's seed, so the same checkpoint always gets the same score
(the seed fixes the samples); what this measures is how far that score is from the checkpoint's expected score,
i.e. how much of a difference between two stages' scores (or a "best earlier" score picked from five) is the
sampling's. Two measures: the spread of the scores over the seeds, and, from each evaluation alone, the
standard error of its score from the variance between a task's samples (the task set is fixed, so only the
sampling is noise): sqrt(sum_i s_i^2 / k) / n for n tasks of k samples, s_i^2 task i's sample variance; the
same sum at k = 1 is the standard error of a one-sample-per-task evaluation.

With `--against STAGE` (or a checkpoint directory, e.g. a stage's start), each seed scores that checkpoint too, on the same keyed draws (common random
numbers: the evaluation keys every draw by seed, task, sample, turn and position), and reports the difference of the
two scores: its spread over the seeds and its standard error from the per-episode differences, beside the standard
error two independent evaluations would have (sqrt(se_a^2 + se_b^2)). The after-OPD / best-earlier criterion is such
a difference. Beside it, the standard error the pipeline reports (over tasks, each task's samples averaged
first: the task set's noise too), of each score and of the paired difference.

`--samples K` / `--greedy` replace the run's evaluation settings (greedy: one argmax answer per task, so only the
over-task standard errors exist).

    python benchmarks/eval_spread.py RUN_DIR [--stage warmup] [--against STAGE|DIR] [--seeds 3] [--quick]

`--quick`: one seed (the standard errors only). Prints one JSON object on its last line: per domain, the scores, their mean, standard
deviation and range, the standard errors (at the run's k and at k = 1) and the seconds the evaluations took.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Optional

from opd_sao.app.pipeline import eval_domains
from opd_sao.checkpoints import load_tokenizer
from opd_sao.config import load_config
from opd_sao.runs.evaluation import episode_rewards
from opd_sao.stages.domains import Domain


def standard_error(rewards: dict[str, list[float]], k: int) -> float:
    """The mean's standard error from within-task sample variances, for k samples per task."""
    variances = [statistics.variance(r) for r in rewards.values() if len(r) > 1]
    return (sum(variances) / k) ** 0.5 / len(variances)


def task_standard_error(rewards: dict[str, list[float]]) -> float:
    """The standard error over tasks of the task means (how the pipeline reports a score's)."""
    means = [statistics.fmean(r) for r in rewards.values()]
    return statistics.stdev(means) / math.sqrt(len(means))


def mean_reward(rewards: dict[str, list[float]]) -> float:
    return round(statistics.fmean(r for per_task in rewards.values() for r in per_task), 4)


def spread(run_dir: Path, stage: str, seeds: list[int], against: Optional[str] = None,
           eval_update: Optional[dict] = None) -> dict:
    cfg = load_config(run_dir / "config.yaml")
    base = run_dir / "base_model"  # written unless the run started from a model directory
    tokenizer = load_tokenizer(base if base.is_dir() else cfg.model.path)
    out = {}
    for name in eval_domains(cfg):
        d = Domain(name, None, cfg.stages, cfg.device)
        eval_cfg = d.eval_cfg.model_copy(update=eval_update or {})
        k = eval_cfg.samples_per_task
        if k < 2 and not eval_cfg.greedy:
            raise SystemExit(f"{name}: eval.samples_per_task is 1; a task's sample variance needs at least 2")

        def score(of: str, seed: int) -> dict[str, list[float]]:
            checkpoint = Path(of) if Path(of).is_dir() else run_dir / "stages" / of / "checkpoint"
            return episode_rewards(checkpoint, d.factory, tokenizer, domain=name,
                                   rollout=d.eval_rollout, eval_cfg=eval_cfg, seed=seed, device=cfg.engine_device,
                                   attn_implementation=cfg.model.attn_implementation)

        def sampling_error(rewards: dict[str, list[float]], k: int) -> Optional[float]:
            return None if eval_cfg.greedy else standard_error(rewards, k)

        def mean_of(values: list) -> Optional[float]:
            return None if None in values else round(statistics.fmean(values), 4)

        start, scores, errors, errors_1, task_errors = time.perf_counter(), [], [], [], []
        diffs, paired, apart, paired_tasks = [], [], [], []
        for seed in seeds:
            rewards = score(stage, seed)
            scores.append(mean_reward(rewards))
            errors.append(sampling_error(rewards, k))
            errors_1.append(sampling_error(rewards, 1))
            task_errors.append(task_standard_error(rewards))
            if against:
                other = score(against, seed)
                diffs.append(round(scores[-1] - mean_reward(other), 4))
                differences = {t: [a - b for a, b in zip(r, other[t])] for t, r in rewards.items()}
                paired.append(sampling_error(differences, k))
                paired_tasks.append(task_standard_error(differences))
                if errors[-1] is not None:
                    apart.append((errors[-1] ** 2 + standard_error(other, k) ** 2) ** 0.5)
        out[name] = {
            "tasks": len(rewards), "samples_per_task": k, "greedy": eval_cfg.greedy, "scores": scores,
            "mean": round(statistics.fmean(scores), 4),
            "stdev": round(statistics.stdev(scores), 4) if len(scores) > 1 else None,
            "range": round(max(scores) - min(scores), 4), "standard_error": mean_of(errors),
            "standard_error_one_sample": mean_of(errors_1), "task_standard_error": mean_of(task_errors),
            "wall_s": round(time.perf_counter() - start, 1)}
        if against:
            out[name]["difference"] = {
                "against": against, "scores": diffs, "stdev": round(statistics.stdev(diffs), 4) if len(diffs) > 1
                else None, "paired_standard_error": mean_of(paired),
                "independent_standard_error": mean_of(apart) if apart else None,
                "paired_task_standard_error": mean_of(paired_tasks)}
        print(name, out[name], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--stage", default="warmup", help="whose checkpoint (a finished stage of the run)")
    parser.add_argument("--against", help="a second stage (or checkpoint directory), scored on the same draws: the "
                        "difference's noise")
    parser.add_argument("--samples", type=int, help="samples per task at the eval temperature (default: the run's "
                        "eval setting)")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding, one answer per task")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one seed")
    args = parser.parse_args()
    seeds = list(range(100, 100 + (1 if args.quick else args.seeds)))  # none of them a quickstart run's seed
    if args.greedy and args.samples:
        raise SystemExit("--greedy and --samples: one answer per task, or several sampled ones")
    update = {"greedy": True, "samples_per_task": 1} if args.greedy else {}
    if args.samples:
        update = {"greedy": False, "samples_per_task": args.samples}
    print(json.dumps({"run_dir": str(args.run_dir), "stage": args.stage, "against": args.against, "seeds": seeds,
                      "domains": spread(args.run_dir, args.stage, seeds, args.against, update)}))


if __name__ == "__main__":
    main()
