"""The `opd-sao` command line."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _cmd_run(args) -> int:
    from .config import load_config
    from .pipeline import default_run_dir, run_pipeline

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir or cfg.run_dir or default_run_dir(args.config))
    if int(os.environ.get("RANK", "0")) > 0:  # a further rank of a DeepSpeed launch: rank 0 runs the pipeline
        from .trainers.deepspeed_backend import follow

        return follow(cfg)
    summary = run_pipeline(cfg, run_dir, log=lambda msg: print(msg, flush=True))
    print(f"\nrun finished: {run_dir}\n  summary: {run_dir / 'summary.json'}")
    for stage in summary["stages"]:
        print(f"  {stage['name']:<12} {stage['kind']:<10} before {json.dumps(stage['eval_before'])} "
              f"after {json.dumps(stage['eval_after'])}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opd-sao", description=__doc__)
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher's
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a staged post-training pipeline from a YAML config")
    run.add_argument("config")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.policy_lr=1e-5 stages.reasoning.steps=5")
    run.add_argument("--run-dir", help="run directory (default: runs/<timestamp>-<config name>)")
    run.set_defaults(func=_cmd_run)
    from .audit import add_audit_parser

    add_audit_parser(sub)
    from .server import add_serve_parser

    add_serve_parser(sub)
    return parser


USER_ERRORS = (ValueError, KeyError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    from .gate import GateFailure

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "run" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except USER_ERRORS as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"opd-sao {args.command}: error: {message}", file=sys.stderr)
        return 2
    except GateFailure as err:  # a stage stopped by its consistency gate: the report, not a traceback
        print(f"opd-sao {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
