"""Name -> class registries, so YAML can pick stages, environments, rewards and teachers by name.

Adding a component is one decorated class in one new file: `import_submodules` imports every module of
a component package, so the file registers itself just by being there; nothing else in the project changes.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, T] = {}

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
            raise KeyError(f"unknown {self.what} {name!r}; registered: {known}")
        return self._items[name]

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
