"""The run report: report.md with matplotlib plots (tables only where matplotlib is not installed, as on a GPU
machine set up offline by scripts/gpu_wheels.sh), from summary.json and the stages' logs.

The domain x stage table is the anti-forgetting evidence: every domain's held-out score after every
stage, the best any earlier stage reached, and what the last stage brought back.
"""
from __future__ import annotations

import json
from pathlib import Path

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    plt = None

from opd_sao.io.files import atomic_write
from opd_sao.io.tracking import read_jsonl

CURVES = [
    ("reward_mean", "reward"),
    ("value_loss", "value loss"),
    ("explained_variance", "explained variance"),
    ("mask_fraction", "DIS masked fraction"),
    ("staleness_mean", "staleness (versions)"),
]


def _after(stages: list[dict], i: int, field: str, domain: str):
    """Stage i's checkpoint's `field` ("eval_after" or "eval_after_error") on `domain`: its own, or for a domain it
    left unscored (eval_scope: reached), the next stage's "before" when that stage started from this checkpoint."""
    value = stages[i].get(field, {}).get(domain)
    checkpoint = stages[i].get("checkpoint")
    if value is None and checkpoint is not None and i + 1 < len(stages) \
            and stages[i + 1].get("start_checkpoint") == checkpoint:
        value = stages[i + 1].get(field.replace("after", "before"), {}).get(domain)
    return value


def checkpoint_scores(stages: list[dict], i: int, field: str = "eval_after") -> dict:
    """Stage i's checkpoint's `field` on every domain it has one for (see _after)."""
    domains = dict.fromkeys(d for s in stages for d in (*s.get("eval_before", {}), *s.get("eval_after", {})))
    found = {d: _after(stages, i, field, d) for d in domains}
    return {d: v for d, v in found.items() if v is not None}


def domain_table(summary: dict) -> tuple[list[str], list[str], dict[str, list[float]]]:
    """(column names, domains, domain -> scores): the start, then every stage's checkpoint (see _after)."""
    stages = summary["stages"]
    domains = sorted({d for s in stages for d in (*s["eval_before"], *s["eval_after"])})
    columns = ["start"] + [s["name"] for s in stages]
    rows = {d: [stages[0]["eval_before"].get(d)] + [_after(stages, i, "eval_after", d) for i in range(len(stages))]
            for d in domains}
    return columns, domains, rows


def forgetting(summary: dict) -> dict[str, dict[str, float]]:
    """Per domain: the best score before the last stage, the score before it, and after it."""
    columns, domains, rows = domain_table(summary)
    out = {}
    for d in domains:
        earlier = [v for v in rows[d][:-1] if v is not None]
        if len(earlier) < 2:
            continue
        out[d] = {"best_earlier": max(earlier), "before_last_stage": earlier[-1], "after_last_stage": rows[d][-1]}
    return out


def _save(fig, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _plot_curves(run_dir: Path, stages: list[dict], out: Path) -> None:
    fig, axes = plt.subplots(len(CURVES), 1, figsize=(9, 2.2 * len(CURVES)), sharex=True)
    offset = 0
    for stage in stages:
        records = read_jsonl(run_dir / "stages" / stage["name"] / "metrics.jsonl")
        steps = [offset + r["step"] for r in records]
        for ax, (key, label) in zip(axes, CURVES):
            values = [r.get(key) for r in records]
            if any(v is not None for v in values):
                ax.plot(steps, [v if v is not None else float("nan") for v in values], label=stage["name"])
            ax.set_ylabel(label, fontsize=8)
        offset += len(records)
        for ax in axes:
            ax.axvline(offset, color="grey", lw=0.5, ls=":")
    if axes[0].get_legend_handles_labels()[0]:  # an SFT-only run has no step curves
        axes[0].legend(fontsize=7, ncol=4)
    axes[-1].set_xlabel("train step (stages back to back)")
    _save(fig, out)


def _plot_domains(summary: dict, out: Path) -> None:
    columns, domains, rows = domain_table(summary)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for d in domains:
        ax.plot(columns, [v if v is not None else float("nan") for v in rows[d]], marker="o", label=d)
    ax.set_ylabel("held-out score")
    ax.set_title("every domain after every stage")
    if domains:  # a run that evaluated no domain has nothing to name
        ax.legend(fontsize=8)
    _save(fig, out)


def _plot_gates(summary: dict, out: Path) -> bool:
    gated = [s for s in summary["stages"] if s.get("gate", {}).get("mean_abs_diff") is not None]
    if not gated:
        return False
    fig, ax = plt.subplots(figsize=(8, 3))
    names = [s["name"] for s in gated]
    ax.bar(names, [s["gate"]["mean_abs_diff"] for s in gated], label="mean |delta logp|")
    ax.bar(names, [s["gate"]["p99_abs_diff"] for s in gated], alpha=0.4, label="p99 |delta logp|")
    ax.set_yscale("symlog", linthresh=1e-9)  # deterministic mode gives exact zeros
    ax.set_title("train/inference consistency gate (final check per stage)")
    ax.legend(fontsize=8)
    _save(fig, out)
    return True


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _errors(summary: dict, domain: str) -> list:
    """A domain's {"stderr", "n"} per column of domain_table (None where the run did not record one)."""
    stages = summary["stages"]
    return [stages[0].get("eval_before_error", {}).get(domain)] + [
        _after(stages, i, "eval_after_error", domain) for i in range(len(stages))]


def score_cell(value, error) -> str:
    """0.420 ± 0.030 (n=200): a score with its standard error over the tasks and their number."""
    if value is None or not error:
        return _fmt(value)
    spread = "" if error["stderr"] is None else f" ± {error['stderr']:.3f}"
    return f"{value:.3f}{spread} (n={error['n']})"


def _time_lines(summary: dict) -> list[str]:
    """Per stage: wall time, CPU time, seconds per phase (io/timing.py) and peak memory."""
    stages = [s for s in summary["stages"] if "phases_s" in s]
    if not stages:
        return []
    phases = sorted({p for s in stages for p in s["phases_s"]}, key=lambda p: -sum(s["phases_s"].get(p, 0)
                                                                                   for s in stages))
    cuda = any("peak_cuda_mb" in s for s in stages)
    head = ["stage", "wall s", "CPU s", *(f"{p} s" for p in phases), "other s", "peak RSS MB"] + (["peak CUDA MB"] if cuda else []) \
        + ["processes"]
    lines = ["", "## Time and memory per stage", "",
             "Seconds in each phase (the trainer thread's: generation is its wait for rollouts), the rest of the "
             "wall time (other: loading models, building engines, the data), the process's peak resident memory up "
             "to the stage's end" + (" and the stage's peak CUDA memory allocated" if cuda else "") + "; CPU: the "
             "process's and its ended children's CPU-seconds, which neither other jobs nor a stopped run inflate. A "
             "stage resumed after a kill adds up every process that worked on it (processes: how many), work redone "
             "after the last saved step included; its peak is the highest of theirs.", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for s in stages:
        spent = [s["phases_s"].get(p, 0.0) for p in phases]
        row = [s["name"], f"{s['wall_s']:.1f}", f"{s['cpu_s']:.0f}" if "cpu_s" in s else "-",
               *(f"{v:.1f}" for v in spent),
               f"{max(0.0, s['wall_s'] - sum(spent)):.1f}", f"{s.get('peak_rss_mb', 0):.0f}"]
        if cuda:
            row.append(f"{s['peak_cuda_mb']:.0f}" if "peak_cuda_mb" in s else "-")
        row.append(str(s.get("processes", 1)))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _schedule_lines(stage: dict) -> list[str]:
    """An OPD stage's per-domain schedule: each probe's held-out score, share of the teacher's, and rollout share."""
    schedule = stage.get("schedule")
    if not schedule or not schedule["probes"]:
        return []
    domains = list(schedule["rollouts"])
    ended = ("every domain reached the target" if schedule["ended"] == "target"
             else f"the budget ({schedule['budget_steps']} steps) was spent")
    lines = ["", f"## OPD schedule (stage {stage['name']})", "",
             f"Target {schedule['target']:.0%} of each teacher's score; probes every {schedule['probe_every']} steps; "
             f"the stage ended after {stage.get('steps', '-')} steps: {ended}. Each cell: held-out score "
             "(share of the teacher's), then the domain's share of the next rollouts.", "",
             "| probe at step | " + " | ".join(domains) + " |", "|---" * (len(domains) + 1) + "|",
             "| teacher | " + " | ".join(_fmt(schedule["teacher_scores"].get(d)) for d in domains) + " |"]
    for p in schedule["probes"]:
        lines.append(f"| {p['step']} | " + " | ".join(
            f"{_fmt(p['scores'][d])} ({p['recovered'][d]:.0%}), {p['shares'][d]:.0%}" for d in domains) + " |")
    lines.append("| rollouts drawn | " + " | ".join(str(schedule["rollouts"][d]) for d in domains) + " |")
    return lines


def write_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    plots = run_dir / "plots"
    if plt is not None:
        plots.mkdir(exist_ok=True)
        _plot_curves(run_dir, summary["stages"], plots / "training.png")
        _plot_domains(summary, plots / "domains.png")
        has_gates = _plot_gates(summary, plots / "gates.png")

    columns, domains, rows = domain_table(summary)
    lines = [f"# Run report: {run_dir.name}", "", "## Held-out score of every domain after every stage", "",
             "Each cell: the mean reward ± its standard error over the n eval tasks (a task's samples averaged "
             "first).", "",
             "| domain | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {d} | " + " | ".join(score_cell(v, e) for v, e in zip(rows[d], _errors(summary, d))) + " |"
              for d in domains]
    recovered = forgetting(summary)
    if recovered:
        last = summary["stages"][-1]["name"]
        lines += ["", f"## Forgetting and recovery (last stage: {last})", "",
                  "| domain | best earlier | before last stage | after last stage | forgotten | recovered |",
                  "|---|---|---|---|---|---|"]
        for d, r in recovered.items():
            lost = r["best_earlier"] - r["before_last_stage"]
            regained = r["after_last_stage"] - r["before_last_stage"]
            share = f"{regained / lost:.0%} ({regained:+.3f})" if lost > 1e-9 else f"nothing to recover ({regained:+.3f})"
            lines.append(f"| {d} | {_fmt(r['best_earlier'])} | {_fmt(r['before_last_stage'])} | "
                         f"{_fmt(r['after_last_stage'])} | {max(lost, 0.0):.3f} | {share} |")
    lines += ["", "## Stages", "", "| stage | kind | algo | steps | wall s | gate | resumed |", "|---|---|---|---|---|---|---|"]
    for s in summary["stages"]:
        gate = s.get("gate") or {}
        verdict = "-" if "passed" not in gate else ("passed" if gate["passed"] else "FAILED")
        resumed = s.get("resume", {}).get("from_step", "-")
        lines.append(f"| {s['name']} | {s['kind']} | {s.get('algo', '-')} | {s.get('steps', '-')} | "
                     f"{s.get('wall_s', '-')} | {verdict} | {resumed} |")
    lines += _time_lines(summary)
    for s in summary["stages"]:
        lines += _schedule_lines(s)
    if plt is None:
        lines += ["", "## Plots", "", "None: matplotlib is not installed."]
    else:
        lines += ["", "## Plots", "", "![domains](plots/domains.png)", "",
                  "![training: reward, value loss, explained variance, DIS masked fraction, staleness](plots/training.png)"]
        if has_gates:
            lines += ["", "![gates](plots/gates.png)"]
    report = run_dir / "report.md"
    atomic_write(report, "\n".join(lines) + "\n")
    return report
