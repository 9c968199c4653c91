"""The package layout: no import cycles, and the layers point one way (core -> nothing above it).

Every import statement is read from the source (module level and inside functions alike), so a lazy
import that only hides a circle is caught too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MOVED = ("stages", "teachers", "cache")  # top-level folders that install as opd_sao.stages, ... (setup.py)
PACKAGES = ("opd_sao", *MOVED)
APPLICATION = {"opd_sao.cli", "opd_sao.pipeline"}  # the only core modules that may import stages


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = ["opd_sao", *parts] if parts[0] in MOVED else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def under(name: str, *packages: str) -> bool:
    return any(name == pkg or name.startswith(pkg + ".") for pkg in packages)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (a `from pkg import sub` names the submodule when it is one)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules)
    return {m for m in found if m in modules and m != name}


@pytest.fixture(scope="module")
def graph():
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_imports_no_stage(graph):
    offenders = sorted(f"{name} -> {dep}" for name, deps in graph.items()
                       if not under(name, "opd_sao.stages") and name not in APPLICATION
                       for dep in deps if under(dep, "opd_sao.stages"))
    assert not offenders, "core modules importing stages: " + ", ".join(offenders)


def test_cache_and_teachers_stay_below_the_trainer(graph):
    """The logit cache is a library of its own (imports nothing of ours but two leaves: the error base,
    opd_sao.errors, and the regular-file opener, opd_sao.regular_files, which imports only the error base); teachers
    import no RL or stage code."""
    assert graph["opd_sao.regular_files"] <= {"opd_sao.errors"}, "regular_files must stay a leaf"
    bad = sorted(f"{n} -> {d}" for n, deps in graph.items() for d in deps
                 if (under(n, "opd_sao.cache") and not under(d, "opd_sao.cache", "opd_sao.errors",
                                                             "opd_sao.regular_files"))
                 or (under(n, "opd_sao.teachers")
                     and under(d, "opd_sao.rl", "opd_sao.consistency.gate", "opd_sao.stages")))
    assert not bad, ", ".join(bad)


def test_the_graph_names_the_moved_packages_as_they_import(graph):
    """The rules above see real edges under the installed names (a rename that left the graph empty of them would
    make every rule pass); the error base imports nothing of ours, so every layer may use it."""
    assert any(under(dep, "opd_sao.stages") for dep in graph["opd_sao.pipeline"])
    assert any(under(dep, "opd_sao.cache") for dep in graph["opd_sao.teachers.base"])
    assert graph["opd_sao.errors"] == set()


def test_every_config_setting_is_documented_and_docs_config_md_is_current():
    from opd_sao.config import config_reference, field_docs

    undocumented = [path for path, _, _, text in field_docs() if not text]
    assert not undocumented, f"config fields without a description: {undocumented}"
    table = config_reference(markdown=True)
    assert table in (ROOT / "docs" / "config.md").read_text(), "regenerate docs/config.md (opd-sao config --markdown)"


def test_each_stage_fields_description_starts_with_the_built_in_kinds_that_read_it():
    """`opd-sao config` says which built-in kinds read each stage field: the list its description starts with is
    exactly the kinds whose `sections` name it."""
    from opd_sao.config import COMMON_STAGE_FIELDS, StageConfig
    from opd_sao.stages import STAGES

    kinds = {name: STAGES.get(name) for name in ("sft", "reasoning", "agent", "chat", "opd")}
    own = set(StageConfig.model_fields) - COMMON_STAGE_FIELDS
    assert all(cls.sections <= own for cls in kinds.values())  # each declared name is a stage field
    for field in own:
        named = set(StageConfig.model_fields[field].description.split(": ", 1)[0].split(", "))
        assert named == {name for name, cls in kinds.items() if field in cls.sections}, field


def test_the_algorithm_registries_drive_the_config():
    """Every preset and every estimator x loss pair loads (grouped ones with groups); unknown names list the
    registered ones. Nothing here names an algorithm: a new one is checked without touching this file."""
    from opd_sao.algorithms import ADVANTAGES, POLICY_LOSSES, PRESETS, resolve_algorithm
    from opd_sao.config import ConfigError, parse_config

    stage = {"name": "r", "kind": "reasoning", "env": "arithmetic"}
    for name in PRESETS.names():
        cfg = parse_config({"algo": name, "stages": [dict(stage)]})
        assert (cfg.stages[0].rollout.group_size > 1) == resolve_algorithm(name).grouped
    for advantage in ADVANTAGES.names():
        for loss in POLICY_LOSSES.names():
            cfg = parse_config({"stages": [{**stage, "rl": {"advantage": advantage, "policy_loss": loss}}]})
            chosen = resolve_algorithm(cfg.algo, cfg.stages[0].rl)
            assert (chosen.advantage.name, chosen.policy_loss.name) == (advantage, loss)
            assert (cfg.stages[0].rollout.group_size > 1) == ADVANTAGES.get(advantage).grouped
    for key, registry in (("algo", PRESETS), ("rl.advantage", ADVANTAGES), ("rl.policy_loss", POLICY_LOSSES)):
        section, _, field = key.rpartition(".")
        bad = {**stage, section: {field: "sarsa"}} if section else {**stage, field: "sarsa"}
        with pytest.raises(ConfigError, match=f"{key}: unknown .* 'sarsa'; registered: {', '.join(registry.names())}"):
            parse_config({"stages": [bad]})


def test_the_readme_stays_the_front_door():
    """Usage only, under 300 lines (issue #23: it had grown to 694 with measurement logs; those live in
    docs/benchmarks.md, the long text in docs/usage.md, docs/data.md and docs/extending.md)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines; move detail to docs/"
