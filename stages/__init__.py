"""Stages, registered by kind. Every module in this folder is imported, so a new stage is one file here."""
from opd_sao.registry import import_submodules

from .base import STAGES, RunContext, Stage, StageResult, register_stage


def discover() -> list[str]:
    """Import every stage module (also ones added to `__path__` after the first import)."""
    return import_submodules(__name__, __path__)


discover()

__all__ = ["STAGES", "RunContext", "Stage", "StageResult", "register_stage", "discover"]
