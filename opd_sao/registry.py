"""Name -> class registries, so YAML can pick stages, environments, rewards and teachers by name; and plugins.

Adding a component is one decorated class in one file. Inside the project, `import_submodules` imports every
module of a component package, so the file registers itself just by being there. Outside it, the file is a
plugin: named in the config (`plugins: [my_reward.py]`) or declared by an installed package as an entry point
in one of PLUGIN_GROUPS; `load_plugins` imports it, and its decorators register it. Nothing else changes.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import pkgutil
import sys
import threading
from pathlib import Path
from typing import Callable, Generic, Iterable, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from opd_sao.errors import UsageError

T = TypeVar("T")


class UnknownName(UsageError, KeyError):
    """A name no component is registered under (a KeyError to callers that look names up)."""


class DuplicateName(UsageError):
    """A second component registered under a taken name (a plugin's name clashing with a built-in's, say)."""


# one file's classes registered twice: the file was imported under two module names, as the moved folders are
# from a checkout's root (`envs.chat` beside `opd_sao.envs.chat`; setup.py installs them under opd_sao only)
_TWO_NAMES = ("; one file imported under two module names: import stages, envs, teachers and cache as opd_sao.stages, "
              "opd_sao.envs, opd_sao.teachers and opd_sao.cache")


def _origin(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _same_file(a, b) -> bool:
    try:
        return inspect.getfile(a) == inspect.getfile(b)
    except TypeError:  # a built-in or an instance: no file to compare
        return False


class Registry(Generic[T]):
    def __init__(self, what: str, *, home: str | None = None):
        """`home`: the package whose modules register the built-in members, for a registry that lives below it (the
        config validates stage kinds, and may not import stages/): imported by name, its `discover()` run, on a
        lookup of a name not registered yet, as an installed plugin is imported by its entry point."""
        self.what, self.home = what, home
        self._items: dict[str, T] = {}
        self._built: dict[str, object] = {}
        self._build_lock = threading.RLock()  # re-entrant: a component may build the one it wraps

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise DuplicateName(f"{self.what} {name!r} is registered twice ({_origin(self._items[name])} and "
                                    f"{_origin(obj)}{_TWO_NAMES if _same_file(self._items[name], obj) else ''})")
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        if name not in self:  # (a built-in, or an installed package's entry point, may register it on the way)
            raise UnknownName(self.unknown(name))
        return self._items[name]

    def unknown(self, name: str) -> str:
        """What a lookup of an unregistered `name` says: the registered names, and where plugins come from."""
        known = ", ".join(sorted(self._items)) or "none"
        return f"unknown {self.what} {name!r}; registered: {known} (a plugin of yours: name its file in `plugins:`)"

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

    def built_ins(self) -> list[str]:
        """The names the modules in `home`'s own folder register (not a plugin's, nor one a folder added to its
        path holds): what the project ships, as its reference docs list it."""
        home = importlib.import_module(self.home)
        getattr(home, "discover", lambda: None)()
        folder = Path(home.__file__).parent
        return sorted(name for name, obj in self._items.items() if Path(inspect.getfile(obj)).parent == folder)

    def __contains__(self, name: str) -> bool:
        if name not in self._items and self.home is not None:
            getattr(importlib.import_module(self.home), "discover", lambda: None)()  # also folders added to its path
        if name not in self._items:
            load_plugins()
        return name in self._items


def import_submodules(package_name: str, package_path) -> list[str]:
    """Import every public module (and subpackage) of a package; returns their names."""
    names = []
    for info in pkgutil.iter_modules(package_path):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package_name}.{info.name}")
            names.append(info.name)
    return names


# entry-point groups an installed package declares its plugins in (setup.py `entry_points=`, or pyproject's
# `[project.entry-points."opd_sao.reward"]`), each `name = "my_pkg.module"`: loading imports the module, whose
# decorators register its classes; the group says what kind of plugin it holds
PLUGIN_GROUPS = {
    "opd_sao.stage": "stage kinds (stages.register_stage)",
    "opd_sao.environment": "environments (opd_sao.envs.register_env)",
    "opd_sao.reward": "rewards and judges (opd_sao.envs.rewards.register_reward)",
    "opd_sao.teacher": "teacher kinds (teachers.register_teacher)",
    "opd_sao.weight_sync": "weight-sync modes (opd_sao.engines.weight_sync.WEIGHT_SYNCS.register)",
    "opd_sao.algorithm": "advantage estimators, policy losses, algo presets and OPD divergences (opd_sao.algorithms)",
    "opd_sao.routing": "fleet routing policies (opd_sao.engines.routing.register_routing)",
}
_plugin_lock = threading.RLock()
_loaded_plugins: dict[str, object] = {}  # entry point / resolved file / module name -> what it loaded


def load_plugins(plugins: Iterable[str] = ()) -> None:
    """Import every installed plugin (the entry points of PLUGIN_GROUPS), then `plugins`: Python files (a path
    ending in .py, relative to the working directory) or importable module names. Each is imported once per
    process. A plugin that cannot be found or imported, or that takes a registered name, raises UsageError (an OpdSaoError: one line); an error raised by the
    plugin's own code while it runs keeps its traceback (a bug in it, not a config mistake)."""
    with _plugin_lock:
        for group in PLUGIN_GROUPS:
            for entry in importlib.metadata.entry_points(group=group):
                key = f"{group}:{entry.name}={entry.value}"
                if key not in _loaded_plugins:
                    try:
                        _loaded_plugins[key] = entry.load()
                    except (ImportError, DuplicateName) as err:
                        raise UsageError(f"plugin {entry.name!r} (entry point {group}: {entry.value}): {err}") from None
        for plugin in plugins:
            key = str(Path(plugin).resolve()) if plugin.endswith(".py") else plugin
            if key not in _loaded_plugins:
                _loaded_plugins[key] = _import_plugin(plugin)


def _import_plugin(plugin: str):
    """A .py file (imported as module `opd_sao_plugin_<stem>`) or a module name."""
    if not plugin.endswith(".py"):
        try:
            return importlib.import_module(plugin)
        except ImportError as err:
            raise UsageError(f"plugins: cannot import {plugin!r} ({err}; a plugin is a .py file or a module name)"
                             ) from None
    path = Path(plugin)
    if not path.is_file():
        raise UsageError(f"plugins: {plugin!r} is not a file (paths are relative to the working directory, "
                         f"{Path.cwd()})")
    name = f"opd_sao_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # classes defined there pickle and resolve their module, as any module's do
    try:
        spec.loader.exec_module(module)
    except (SyntaxError, ImportError, DuplicateName) as err:
        del sys.modules[name]
        where = f"{plugin}:{err.lineno}: {err.msg}" if isinstance(err, SyntaxError) else f"{plugin}: {err}"
        raise UsageError(f"plugins: {where}") from None
    except BaseException:
        del sys.modules[name]
        raise
    return module


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


class NoOptions(BaseModel):
    """The `Options` of a component with no settings of its own: its `options:` must be empty."""

    model_config = ConfigDict(extra="forbid")


def parse_options(model: type[BaseModel], options: dict | None, where: str) -> BaseModel:
    """A config's `options:` mapping validated by the `Options` model a component declares (a teacher kind, a
    weight-sync mode), before any work; a mistake is one UsageError line naming the key (`where.KEY: why`)."""
    try:
        return model.model_validate(options or {})
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        raise UsageError(f"{where}.{key}: {first['msg']}" if key else f"{where}: {first['msg']}") from None
