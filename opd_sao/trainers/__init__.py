from .base import TrainerBackend
from .torch_backend import TorchTrainer

__all__ = ["TrainerBackend", "TorchTrainer"]


def build_backend(cfg, checkpoint, *, with_critic: bool) -> TrainerBackend:
    if cfg.backend == "torch":
        return TorchTrainer(checkpoint, cfg, with_critic=with_critic)
    if cfg.backend == "deepspeed":
        from .deepspeed_backend import DeepSpeedTrainer

        return DeepSpeedTrainer(checkpoint, cfg, with_critic=with_critic)
    raise NotImplementedError(f"trainer backend {cfg.backend!r} is not available yet")
