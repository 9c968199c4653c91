"""Stages, registered by kind. Importing this package registers the built-in ones."""
from .base import STAGES, RunContext, Stage, StageResult, register_stage
from . import rl  # noqa: F401  (registers reasoning, agent, chat)

__all__ = ["STAGES", "RunContext", "Stage", "StageResult", "register_stage"]
