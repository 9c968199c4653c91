"""The one base of the errors a user's input causes (a setting, a file, a flag, a run directory, a teacher).

`opd-sao` reports an `OpdSaoError` in one line with exit status 2; any other exception is a bug in opd-sao or
a plugin and keeps its traceback. This module imports nothing, so every layer (the logit cache included) may
derive its errors from it. Classes that callers catch as `ValueError` or `RuntimeError` keep that base too.
"""
from __future__ import annotations


class OpdSaoError(Exception):
    """A mistake in what the user gave or an unusable environment: reported in one line, never a traceback."""


class UsageError(OpdSaoError, ValueError):
    """A user mistake with no class of its own: a bad flag, path, option or value."""
