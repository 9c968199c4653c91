"""A domain as a multi-domain stage (OPD, SFT) sees it: the environment with the options, episode lengths
and evaluation settings of the stage of the run that trains on it, or of the OPD teacher that teaches it.

Per domain, episodes use the environment options, rollout lengths (max_new_tokens, max_turns,
max_context_tokens), compaction and prompt format of the first other-kind stage whose `env` is that domain, if there
is one, else the asking stage's own; an OPD stage's teacher of the domain overrides each of these it sets
(`env_options`, `rollout`, `eval`: an explicit setting wins), so OPD runs on datasets no earlier stage trains on.
Temperature and top_p are always the asking stage's. Without an asking stage (the pipeline's per-stage evaluation),
everything comes from the first stage that trains on the domain.
"""
from __future__ import annotations

from typing import Optional

from opd_sao.config import EPISODE_FIELDS, EvalConfig, RolloutConfig, StageConfig
from opd_sao.envs import ENVIRONMENTS
from opd_sao.errors import UsageError


def _overlay(base, override):
    """`base` with the fields `override` sets (None: base itself), validated as a whole."""
    if override is None:
        return base
    return type(base)(**{**base.model_dump(), **override.model_dump(include=override.model_fields_set)})


class Domain:
    """Its environment factory, episode settings and evaluation settings."""

    def __init__(self, name: str, own: Optional[StageConfig], stages: list[StageConfig],
                 device: Optional[str] = None):
        """`device`: the run's, for environments that run a model (`reads_device`, e.g. a reward-model judge)."""
        source = next((s for s in stages if s.env == name and (own is None or s.kind != own.kind)), None)
        if source is None and own is None:
            raise UsageError(f"no stage trains on domain {name!r}")
        teacher = next((t for t in own.opd.teachers if name in t.domains), None) if own is not None else None
        self.env_cls = env_cls = ENVIRONMENTS.get(name)  # raises for an unknown environment, naming the registered ones
        self.name, self.source = name, source.name if source else None
        if teacher is not None and teacher.env_options is not None:
            self.options = dict(teacher.env_options)
        else:
            self.options = dict(source.env_options) if source else {}
        options = dict(self.options)
        if device is not None and env_cls.reads_device:
            options.setdefault("device", device)
        self.factory = lambda: env_cls(**options)
        base = _overlay(source.rollout if source else own.rollout, teacher and teacher.rollout)
        sampling = (own or source).rollout
        self.rollout = RolloutConfig(**{**sampling.model_dump(), **{f: getattr(base, f) for f in EPISODE_FIELDS}})
        self.eval_rollout: RolloutConfig = base  # what the pipeline's Evaluator uses for this domain
        self.eval_cfg: EvalConfig = _overlay(source.eval if source else own.eval, teacher and teacher.eval)

    def check(self, seed: int) -> None:
        """Raise ValueError (saying what is wrong) unless the environment takes these options and has train and eval
        tasks: found before any work, not when the stage starts; on the environment built for its prompts alone
        (`Environment.for_prompts`: the chat env's reward model is neither trained nor loaded)."""
        self.env_cls.check_options(self.options)
        env = self.env_cls.for_prompts(self.options)
        for split in ("train", "eval"):
            if not env.make_tasks(split, 1, seed):
                given = "its env_options" if self.options else "no env_options"
                raise UsageError(f"environment {self.name!r} has no {split} tasks with {given} (an OPD teacher's "
                                 f"`env_options:` or an earlier stage with `env: {self.name}` gives them)")
