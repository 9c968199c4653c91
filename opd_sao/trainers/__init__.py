from .base import TrainerBackend
from .torch_backend import TorchTrainer

__all__ = ["TrainerBackend", "TorchTrainer"]


def build_backend(cfg, checkpoint, *, with_critic: bool, critic_from=None) -> TrainerBackend:
    """`critic_from`: a critic saved by `export_critic` to start from instead of the policy's backbone."""
    if cfg.backend == "torch":
        return TorchTrainer(checkpoint, cfg, with_critic=with_critic, critic_from=critic_from)
    if cfg.backend == "deepspeed":
        from .deepspeed_backend import DeepSpeedTrainer

        return DeepSpeedTrainer(checkpoint, cfg, with_critic=with_critic, critic_from=critic_from)
    raise NotImplementedError(f"trainer backend {cfg.backend!r} is not available yet")
