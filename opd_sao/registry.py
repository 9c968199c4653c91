"""Name -> class registries, so YAML can pick stages, environments, rewards and teachers by name.

Adding a component is one decorated class in one new file: `import_submodules` imports every module of
a component package, so the file registers itself just by being there; nothing else in the project changes.
"""
from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import threading
from typing import Callable, Generic, TypeVar

from opd_sao.errors import UsageError

T = TypeVar("T")


class UnknownName(UsageError, KeyError):
    """A name no component is registered under (a KeyError to callers that look names up)."""


class Registry(Generic[T]):
    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, T] = {}
        self._built: dict[str, object] = {}
        self._build_lock = threading.RLock()  # re-entrant: a component may build the one it wraps

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        if name not in self._items:
            known = ", ".join(sorted(self._items)) or "none"
            raise UnknownName(f"unknown {self.what} {name!r}; registered: {known}")
        return self._items[name]

    def build(self, name: str, options: dict | None = None):
        """The process-wide instance of `name` with `options`, built on first use (judges and rewards: an
        environment is created per episode and must stay cheap, while a reward model is a network to load once)."""
        key = json.dumps([name, options or {}], sort_keys=True)
        with self._build_lock:
            if key not in self._built:
                cls = self.get(name)
                try:
                    self._built[key] = cls(**(options or {}))
                except TypeError as err:
                    raise UsageError(f"{self.what} {name!r}: bad {self.what}_options {options}: {err}") from None
            return self._built[key]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


def import_submodules(package_name: str, package_path) -> list[str]:
    """Import every public module (and subpackage) of a package; returns their names."""
    names = []
    for info in pkgutil.iter_modules(package_path):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package_name}.{info.name}")
            names.append(info.name)
    return names


def check_keywords(factory: Callable, options: dict, *, also: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming the keys `factory(**options)` would refuse (unknown or missing), without calling it:
    a config mistake is then found before any work, not when the object is first built. `also`: further keys
    the caller consumes itself."""
    if not isinstance(options, dict):
        raise UsageError(f"options must be a mapping (got {options!r})")
    params = [p for p in inspect.signature(factory).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(factory).parameters.values()):
        unknown = sorted(set(options) - {p.name for p in params} - set(also))
        if unknown:
            takes = ", ".join([p.name for p in params] + list(also)) or "none"
            raise UsageError(f"unknown option{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))} "
                             f"(options: {takes})")
    missing = [p.name for p in params if p.default is p.empty and p.name not in options]
    if missing:
        raise UsageError(f"missing option{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}")
