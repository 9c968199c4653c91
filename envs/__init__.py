"""Environments, registered by name. Every module in this folder is imported, so a new one is one file here."""
from opd_sao.registry import import_submodules

from .base import ENVIRONMENTS, Environment, register_env, sample_tasks

import_submodules(__name__, __path__)

__all__ = ["ENVIRONMENTS", "Environment", "register_env", "sample_tasks"]
