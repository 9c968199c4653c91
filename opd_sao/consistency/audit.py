"""`opd-sao audit`: the consistency checker on demand, for a checkpoint and an engine (docs/design.md §5).

Generates a prompt set with the engine, recomputes every sampled token's logprob with the checkpoint
loaded as the trainer loads it (float32), and writes `audit.json` and `audit.png` (histogram of
|delta logp| and drift by response position). Exit status 1 when over threshold, for scripts and CI.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from opd_sao.config import AlgoConfig, GateConfig
from opd_sao.errors import UsageError
from opd_sao.io.files import write_json

PROMPT_ENV = "prompts-file"


def add_audit_parser(sub, environment) -> None:
    """`opd-sao audit`; `environment(name)` (the application's environment lookup) resolves `--env`."""
    gate, sao = GateConfig(), AlgoConfig()
    p = sub.add_parser("audit", help="measure train/inference logprob drift of a checkpoint against an engine")
    p.add_argument("checkpoint", help="an HF-format checkpoint directory (e.g. runs/<run>/stages/<stage>/checkpoint)")
    p.add_argument("--engine", default="embedded", help="'embedded' (in-process) or the URL of a rollout server")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic mode: fp32; the checker scores each sequence alone (batch-invariant) against "
                        "the engine's sampled logprobs, and the engine's own recomputation alone is reported beside "
                        "them (sampler_drift)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="embedded engine dtype")
    p.add_argument("--device", default="auto", help="where the embedded engine and the checker run: auto (cuda when "
                   "available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--out", help="output directory (default: <checkpoint>/../audit)")
    p.add_argument("--env", default="arithmetic", help="environment whose eval prompts are used (default: arithmetic)")
    p.add_argument("--env-options", default="{}", help="--env's options as a JSON object (as validate-env's --options)")
    p.add_argument("--prompts-file", help="a text file with one prompt per line, or a .jsonl file of prompts (JSON "
                                          "strings, or objects with a \"prompt\"; multi-line), instead of --env's")
    p.add_argument("--prompts", type=int, default=32, help="number of prompts (default: 32)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--prompt-format", choices=["raw", "chat"], default="raw",
                   help="raw text prompts, or the tokenizer's chat template (default: raw)")
    p.add_argument("--system-prompt", help="chat format: the system message (default: the template's own)")
    p.add_argument("--threshold-mean", type=float, default=gate.mean_abs_diff, help="max mean |delta logp|")
    p.add_argument("--threshold-p99", type=float, default=gate.p99_abs_diff, help="max p99 |delta logp|")
    p.add_argument("--eps-low", type=float, default=sao.eps_low, help="DIS lower bound for mask_fraction")
    p.add_argument("--eps-high", type=float, default=sao.eps_high, help="DIS upper bound for mask_fraction")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_audit, environment=environment)


class PromptFileEnv:
    """One-turn episodes on the lines of a prompts file (no reward: the audit only needs generations)."""

    def __init__(self, prompts: list[str]):
        self.prompts = prompts

    def make_tasks(self, split: str, n: int, seed: int) -> list[dict]:
        return [{"id": f"prompt-{i}", "prompt": p} for i, p in enumerate(self.prompts[:n])]

    def reset(self, task: dict) -> str:
        return task["prompt"]

    def where(self, task: dict) -> str:
        """The prompt's line, for a one-line error about it (a prompt too long for the model)."""
        return f"prompts file line {int(task['id'].removeprefix('prompt-')) + 1}"

    def step(self, action: str) -> tuple[str, float, bool]:
        return "", 0.0, True


def json_options(text: str, flag: str = "--options") -> dict:
    """A JSON-object command-line argument, or a one-line error naming the flag."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{flag} is not valid JSON: {err}") from None
    if not isinstance(options, dict):
        raise UsageError(f"{flag} must be a JSON object (got {text!r})")
    return options


def read_prompts(path: Path) -> list[str]:
    """The prompts of a --prompts-file: one per line, or (.jsonl) a JSON string or {"prompt": ...} per line."""
    if not path.is_file():
        raise FileNotFoundError(f"--prompts-file {str(path)!r} does not exist")
    lines = [line for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            raise UsageError(f"--prompts-file {str(path)!r}: line {number} is not JSON") from None
        prompt = row.get("prompt") if isinstance(row, dict) else row
        if not isinstance(prompt, str) or not prompt.strip():
            raise UsageError(f"--prompts-file {str(path)!r}: line {number} is neither a string nor an object with "
                             f"a non-empty \"prompt\" string")
        prompts.append(prompt)
    return prompts


def _env_factory(args):
    if args.prompts_file:
        prompts = read_prompts(Path(args.prompts_file))
        if not prompts:
            raise UsageError(f"--prompts-file {args.prompts_file!r} has no prompts")
        return PROMPT_ENV, lambda: PromptFileEnv(prompts)
    env_cls, options = args.environment(args.env), json_options(args.env_options, "--env-options")
    env_cls.check_options(options)
    return args.env, lambda: env_cls(**options)


def _engine(args, checkpoint: Path, tokenizer):
    from opd_sao.config import EngineConfig
    from opd_sao.engines import build_engine

    if args.engine == "embedded":
        cfg = EngineConfig(kind="embedded", dtype=args.dtype, deterministic=args.deterministic, device=args.device)
    elif args.engine.startswith(("http://", "https://")):
        cfg = EngineConfig(kind="http", urls=[args.engine])
    else:
        raise UsageError(f"--engine must be 'embedded' or an http(s):// URL (got {args.engine!r})")
    try:
        return build_engine(cfg, checkpoint, tokenizer, seed=args.seed)
    except NotImplementedError:
        raise UsageError(f"--engine {args.engine}: no HTTP rollout engine is available in this installation "
                         "(opd_sao/engines/http.py); use --engine embedded") from None


def run_audit(args) -> dict:
    """Generate, check, diagnose when over threshold; write audit.json and audit.png; return audit.json's data."""
    import torch

    from opd_sao.checkpoints import load_causal_lm, load_tokenizer
    from opd_sao.config import RolloutConfig
    from opd_sao.consistency.check import check, sampler_drift
    from opd_sao.consistency.gate import diagnose, over_threshold, probe_episodes
    from opd_sao.devices import resolve_device
    from opd_sao.rl.rollout import run_episodes

    checkpoint = Path(args.checkpoint)
    resolve_device(args.device)  # a device this machine lacks stops here, in one line
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint {str(checkpoint)!r} is not an HF-format model directory (no config.json)")
    if args.deterministic and args.dtype != "float32":
        raise UsageError("--deterministic needs --dtype float32")
    if args.deterministic and args.engine != "embedded":
        raise UsageError("--deterministic is a mode of the embedded engine; rollout servers have none")
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise UsageError("--prompts and --max-new-tokens must be at least 1")
    out = Path(args.out) if args.out else checkpoint.parent / "audit"
    domain, env_factory = _env_factory(args)
    tokenizer = load_tokenizer(checkpoint)
    rollout = RolloutConfig(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                            prompt_format=args.prompt_format, system_prompt=args.system_prompt)
    engine = _engine(args, checkpoint, tokenizer)
    try:
        episodes = probe_episodes(env_factory, tokenizer, rollout, domain=domain, n=args.prompts, seed=args.seed)
        with torch.no_grad():
            trajs = run_episodes(engine, episodes)
        trainer = load_causal_lm(checkpoint, "float32", resolve_device(args.device))
        report = check(trajs, trainer, version=engine.version, eps_low=args.eps_low, eps_high=args.eps_high,
                       alone=args.deterministic)
        reasons = over_threshold(report, args.threshold_mean, args.threshold_p99)
        data = {"checkpoint": str(checkpoint), "engine": args.engine, "engine_dtype": args.dtype,
                "deterministic": args.deterministic, "prompts": len(trajs),
                "prompt_source": args.prompts_file or domain,
                "distinct_prompts": len({episode.task["id"] for episode in episodes}),
                "temperature": args.temperature, "top_p": args.top_p, "prompt_format": args.prompt_format,
                "thresholds": {"mean_abs_diff": args.threshold_mean, "p99_abs_diff": args.threshold_p99},
                "passed": not reasons, "reasons": reasons, **report.to_dict()}
        drift = sampler_drift(trajs)
        if drift is not None:
            data["sampler_drift"] = drift
        if reasons:
            data["diagnosis"] = asdict(diagnose(report, trainer, engine, mean_abs_diff=args.threshold_mean,
                                                p99_abs_diff=args.threshold_p99,
                                                engine_dtype=args.dtype if args.engine == "embedded" else None))
    finally:
        engine.close()
    out.mkdir(parents=True, exist_ok=True)
    if report.tokens:
        plot(report, out / "audit.png")
        data["plot"] = str(out / "audit.png")
    write_json(out / "audit.json", data)
    data["out"] = str(out)
    return data


def plot(report, path: Path) -> None:
    """Left: histogram of |delta logp| (log scale; exact zeros counted in the title). Right: drift by position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    diffs = report.abs_diff.double().numpy()
    nonzero = diffs[diffs > 0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if len(nonzero):
        bins = np.logspace(np.log10(nonzero.min()), np.log10(max(nonzero.max(), nonzero.min() * 10)), 40)
        left.hist(nonzero, bins=bins)
        left.set_xscale("log")
    else:
        left.text(0.5, 0.5, "every token bitwise equal", ha="center", transform=left.transAxes)
    left.set_xlabel("|logp_trainer - logp_rollout| (nats)")
    left.set_ylabel("tokens")
    left.set_title(f"{report.tokens} tokens, {len(diffs) - len(nonzero)} bitwise equal; "
                   f"mean {report.mean_abs_diff:.2g}, p99 {report.p99_abs_diff:.2g}", fontsize=9)
    rows = report.drift_by_position
    labels = [f"{r['start']}" if r["end"] - r["start"] == 1 else f"{r['start']}-{r['end'] - 1}" for r in rows]
    x = np.arange(len(rows))
    right.plot(x, [r["mean_abs_diff"] for r in rows], marker="o", label="mean")
    right.plot(x, [r["max_abs_diff"] for r in rows], marker="^", label="max")
    right.set_xticks(x, labels)
    if any(r["max_abs_diff"] > 0 for r in rows):
        right.set_yscale("log")
    right.set_xlabel("response position")
    right.set_ylabel("|delta logp| (nats)")
    right.set_title("drift by position", fontsize=9)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cmd_audit(args) -> int:
    data = run_audit(args)
    status = "passed" if data["passed"] else "FAILED"
    numbers = "no tokens"
    if data["tokens"]:
        numbers = (f"mean |dlogp| {data['mean_abs_diff']:.3g}, p99 {data['p99_abs_diff']:.3g}, "
                   f"max {data['max_abs_diff']:.3g}, k3 KL {data['k3_kl']:.3g}, "
                   f"DIS mask {100 * data['mask_fraction']:.2f}%")
    print(f"audit {status}: {data['tokens']} tokens from {data['prompts']} prompts: {numbers}")
    if data["distinct_prompts"] < data["prompts"]:
        print(f"  note: only {data['distinct_prompts']} distinct prompts, repeated to reach --prompts {data['prompts']}")
    if not data["passed"]:
        diagnosis = data.get("diagnosis", {})
        print(f"  over threshold: {'; '.join(data['reasons'])}")
        print(f"  likely cause: {diagnosis.get('cause')}: {diagnosis.get('explanation')}")
    print(f"  report: {Path(data['out']) / 'audit.json'}")
    return 0 if data["passed"] else 1

