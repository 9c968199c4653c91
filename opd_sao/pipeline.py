"""Runs a config's stages in order and writes the run directory (see README, "Run directory")."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import yaml

from opd_sao.checkpoints import build_tiny_model, load_tokenizer
from opd_sao.runs.evaluation import evaluate
from opd_sao.runs.files import write_json
from opd_sao.runs.report import forgetting, write_report
from opd_sao.runs.tracking import start_wandb

from .config import RunConfig


def default_run_dir(config_path: str | Path) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{Path(config_path).stem}"


def eval_domains(cfg: RunConfig) -> dict[str, object]:
    """Every environment an RL stage trains on is a domain evaluated after every stage."""
    domains = {}
    for stage in cfg.stages:
        if stage.env and stage.env not in domains:
            domains[stage.env] = stage
    if cfg.eval_domains:
        missing = set(cfg.eval_domains) - set(domains)
        if missing:
            raise ValueError(f"eval_domains {sorted(missing)} are not the env of any stage ({sorted(domains)})")
        domains = {d: domains[d] for d in cfg.eval_domains}
    return domains


def ensure_base_model(cfg: RunConfig, run_dir: Path) -> Path:
    if cfg.model.path != "tiny":
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.path {str(path)!r} is not an HF-format model directory (no config.json)")
        return path
    from stages.envs import ENVIRONMENTS

    texts = []
    for name in ENVIRONMENTS.names():  # every domain, so later stages' text tokenizes well too
        texts.extend(ENVIRONMENTS.get(name)().corpus())
    for stage in cfg.stages:  # and every configured domain whose texts come from its options (a data file)
        env_cls = ENVIRONMENTS.get(stage.env) if stage.env else None
        if env_cls is not None and env_cls.corpus_from_options:
            texts.extend(env_cls(**stage.env_options).corpus())
    return build_tiny_model(run_dir / "base_model", texts, cfg.model.tiny, cfg.seed)


class Evaluator:
    """Scores checkpoints on every domain, remembering results so a checkpoint is scored once."""

    def __init__(self, cfg: RunConfig, tokenizer):
        from stages.domains import Domain

        self.cfg, self.tokenizer = cfg, tokenizer
        self.domains = {name: Domain(name, None, cfg.stages, cfg.device) for name in eval_domains(cfg)}
        self._seen: dict[str, dict[str, float]] = {}

    def __call__(self, checkpoint: Path) -> dict[str, float]:
        key = str(Path(checkpoint).resolve())
        if key not in self._seen:
            self._seen[key] = {
                name: round(evaluate(checkpoint, d.factory, self.tokenizer, domain=name, rollout=d.eval_rollout,
                                     eval_cfg=d.eval_cfg, seed=self.cfg.seed, device=self.cfg.engine_device), 4)
                for name, d in self.domains.items()
            }
        return self._seen[key]


def run_pipeline(cfg: RunConfig, run_dir: Path, *, log=print, resume: bool = False) -> dict:
    """Run every stage in order; with `resume`, skip completed stages and continue the interrupted one."""
    from stages import STAGES, RunContext, discover

    discover()
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    for stage in cfg.stages:  # unknown kinds and configs a kind cannot run fail before any work starts
        STAGES.get(stage.kind).check(stage)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    base = ensure_base_model(cfg, run_dir)
    tokenizer = load_tokenizer(base)
    wandb_run = start_wandb(cfg.logging.wandb_project, run_dir, cfg.model_dump(mode="json"), cfg.logging.wandb)
    ctx = RunContext(cfg=cfg, run_dir=run_dir, base_checkpoint=base, tokenizer=tokenizer, wandb_run=wandb_run,
                     resume=resume)
    evaluator = Evaluator(cfg, tokenizer)
    summary = {"run_dir": str(run_dir), "base_model": str(base), "stages": []}
    if resume and (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
        for entry in summary["stages"]:
            ctx.checkpoints[entry["name"]] = Path(entry["checkpoint"])
    done = set(ctx.checkpoints)
    try:
        for stage_cfg in cfg.stages:
            if stage_cfg.name in done:
                log(f"[{stage_cfg.name}] already complete, skipped")
                continue
            t0 = time.perf_counter()
            log(f"[{stage_cfg.name}] {stage_cfg.kind} stage starting")
            result = STAGES.get(stage_cfg.kind)(stage_cfg, ctx).run()
            entry = {
                "name": stage_cfg.name,
                "kind": stage_cfg.kind,
                "eval_before": evaluator(result.start_checkpoint or ctx.resolve_checkpoint(stage_cfg.init_from)),
                "eval_after": evaluator(result.checkpoint),
                "checkpoint": str(result.checkpoint),
                **result.summary,
                "wall_s": round(time.perf_counter() - t0, 1),
            }
            ctx.checkpoints[stage_cfg.name] = result.checkpoint
            write_json(ctx.stage_dir(stage_cfg.name) / "summary.json", entry)
            summary["stages"].append(entry)
            write_json(run_dir / "summary.json", summary)
            log(f"[{stage_cfg.name}] done in {entry['wall_s']}s: eval before {entry['eval_before']} "
                f"after {entry['eval_after']}")
    finally:
        if wandb_run is not None:
            wandb_run.finish()
    summary["forgetting"] = forgetting(summary)
    write_json(run_dir / "summary.json", summary)
    summary["report"] = str(write_report(run_dir))
    return summary
