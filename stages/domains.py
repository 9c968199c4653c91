"""A domain as a multi-domain stage (OPD, SFT) sees it: the environment with the options, episode lengths
and evaluation settings of the stage of the run that trains on it.

Per domain, episodes use the environment options, rollout lengths (max_new_tokens, max_turns,
max_context_tokens), compaction and prompt format of the first other-kind stage whose `env` is that domain, if there is one, else the
asking stage's own; temperature and top_p are always the asking stage's. Without an asking stage (the
pipeline's per-stage evaluation), everything comes from the first stage that trains on the domain.
"""
from __future__ import annotations

from typing import Optional

from opd_sao.config import EvalConfig, RolloutConfig, StageConfig
from opd_sao.errors import UsageError

from .envs import ENVIRONMENTS

EPISODE_FIELDS = ("max_new_tokens", "max_turns", "max_context_tokens", "compaction", "compaction_budget",
                  "compaction_instruction", "prompt_format", "system_prompt")


class Domain:
    """Its environment factory, episode settings and evaluation settings."""

    def __init__(self, name: str, own: Optional[StageConfig], stages: list[StageConfig],
                 device: Optional[str] = None):
        """`device`: the run's, for environments that run a model (`reads_device`, e.g. a reward-model judge)."""
        source = next((s for s in stages if s.env == name and (own is None or s.kind != own.kind)), None)
        if source is None and own is None:
            raise UsageError(f"no stage trains on domain {name!r}")
        env_cls = ENVIRONMENTS.get(name)  # raises for an unknown environment, naming the registered ones
        self.name, self.source = name, source.name if source else None
        options = dict(source.env_options) if source else {}
        if device is not None and env_cls.reads_device:
            options.setdefault("device", device)
        self.factory = lambda: env_cls(**options)
        base = source.rollout if source else own.rollout
        sampling = (own or source).rollout
        self.rollout = RolloutConfig(**{**sampling.model_dump(), **{f: getattr(base, f) for f in EPISODE_FIELDS}})
        self.eval_rollout: RolloutConfig = base  # what the pipeline's Evaluator uses for this domain
        self.eval_cfg: EvalConfig = source.eval if source else own.eval
