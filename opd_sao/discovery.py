"""Import every module of a package, so a component registers itself just by being a file there."""
from __future__ import annotations

import importlib
import pkgutil


def import_submodules(package_name: str, package_path) -> list[str]:
    names = []
    for info in pkgutil.iter_modules(package_path):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package_name}.{info.name}")
            names.append(info.name)
    return names
