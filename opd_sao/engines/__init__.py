from .base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from .embedded import EmbeddedEngine

__all__ = ["GenerationRequest", "GenerationResult", "RolloutEngine", "SamplingParams", "EmbeddedEngine"]


def build_engine(cfg, checkpoint, tokenizer, seed: int) -> RolloutEngine:
    """The rollout engine a config asks for, loaded with `checkpoint` at policy version 0."""
    if cfg.kind == "embedded":
        from ..models import load_causal_lm

        return EmbeddedEngine(load_causal_lm(checkpoint, cfg.dtype), eos_id=tokenizer.eos_token_id,
                              pad_id=tokenizer.pad_token_id, max_batch=cfg.max_batch, seed=seed,
                              deterministic=cfg.deterministic)
    raise NotImplementedError(f"engine kind {cfg.kind!r} is not available yet")
