"""Environments, registered by name. Importing this package registers the built-in ones."""
from .base import ENVIRONMENTS, Environment, register_env, sample_tasks
from . import arithmetic  # noqa: F401  (registers "arithmetic")

__all__ = ["ENVIRONMENTS", "Environment", "register_env", "sample_tasks"]
