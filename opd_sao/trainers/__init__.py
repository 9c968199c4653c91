from .base import TrainerBackend
from .torch_backend import TorchTrainer

__all__ = ["TrainerBackend", "TorchTrainer"]


def build_backend(cfg, checkpoint, *, with_critic: bool, critic_from=None, attn_implementation: str = "eager",
                  total_steps=None) -> TrainerBackend:
    """`critic_from`: a critic saved by `export_critic` to start from instead of the policy's backbone;
    `attn_implementation`: model.attn_implementation (the embedded engine's too); `total_steps`: the stage's
    policy steps (where a cosine lr schedule ends)."""
    kwargs = dict(with_critic=with_critic, critic_from=critic_from, attn_implementation=attn_implementation,
                  total_steps=total_steps)
    if cfg.backend == "torch":
        return TorchTrainer(checkpoint, cfg, **kwargs)
    if cfg.backend == "deepspeed":
        from .deepspeed_backend import DeepSpeedTrainer

        return DeepSpeedTrainer(checkpoint, cfg, **kwargs)
    raise NotImplementedError(f"trainer backend {cfg.backend!r} is not available yet")
