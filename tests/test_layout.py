"""The package layout: no import cycles between modules nor between packages, and the layers point one way
(core -> nothing above it).

Every import statement is read from the source (module level and inside functions alike), so a lazy
import that only hides a circle is caught too.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MOVED = ("stages", "envs", "teachers", "cache")  # top-level folders that install as opd_sao.stages, ... (setup.py)
PACKAGES = ("opd_sao", *MOVED)
APPLICATION = "opd_sao.app"  # the top layer (cli, pipeline): the only core package that may import stages


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    parts = ["opd_sao", *parts] if parts[0] in MOVED else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def under(name: str, *packages: str) -> bool:
    return any(name == pkg or name.startswith(pkg + ".") for pkg in packages)


def all_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}


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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = all_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def package_of(module: str) -> str:
    """The unit of the package graph: `opd_sao.<name>`, the first level under opd_sao. A subpackage is one unit with
    everything below it (opd_sao.runs.evaluation -> opd_sao.runs, opd_sao.envs.dataset.files -> opd_sao.envs; the
    moved top-level folders are opd_sao.stages, opd_sao.envs, opd_sao.teachers, opd_sao.cache), and a
    top-level module is a unit of its own (opd_sao.config). Finer units would let two packages lean on each
    other through different modules (a.x -> b.y, b.z -> a.w: no module cycle) and hide the layering."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for name, deps in graph.items():
        packages.setdefault(package_of(name), set()).update(package_of(dep) for dep in deps)
    return {pkg: deps - {pkg} for pkg, deps in packages.items()}


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


def check_no_package_cycle(graph: dict[str, set[str]]) -> None:
    cycle = find_cycle(package_graph(graph))
    if cycle:
        edges = [next(f"{n} -> {d}" for n, deps in sorted(graph.items()) for d in sorted(deps)
                      if package_of(n) == a and package_of(d) == b) for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("package import cycle: " + " -> ".join(cycle) + " (" + "; ".join(edges) + ")")


def test_no_package_cycle(graph):
    check_no_package_cycle(graph)


def test_a_package_cycle_without_a_module_cycle_fails_the_layout(tmp_path):
    """A fake source tree read as the real one is: a/x.py imports b.y and b/z.py imports a.w (under a fake
    opd_sao). No module imports itself back, so only the package graph shows the circle."""
    for name, source in {"__init__": "", "a/__init__": "", "a/x": "from ..b import y\n", "a/w": "",
                         "b/__init__": "", "b/y": "", "b/z": "from ..a import w\n"}.items():
        (tmp_path / "opd_sao" / f"{name}.py").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "opd_sao" / f"{name}.py").write_text(source)
    graph = import_graph(tmp_path)
    fake = {name: f"opd_sao.{name}" for name in ("a", "a.w", "a.x", "b", "b.y", "b.z")}
    assert graph[fake["a.x"]] == {fake["b"], fake["b.y"]} and graph[fake["b.z"]] == {fake["a"], fake["a.w"]}
    assert find_cycle(graph) is None
    with pytest.raises(AssertionError, match=r"opd_sao\.a -> opd_sao\.b -> opd_sao\.a \(opd_sao\.a\.x -> "
                                             r"opd_sao\.b; opd_sao\.b\.z -> opd_sao\.a\)"):
        check_no_package_cycle(graph)
    (tmp_path / "opd_sao" / "b" / "z.py").write_text("")  # the circle broken: the layout passes
    check_no_package_cycle(import_graph(tmp_path))


def test_core_imports_no_stage_or_environment(graph):
    """Only the stages and the application reach the environments; the environments reach no stage."""
    offenders = sorted(f"{name} -> {dep}" for name, deps in graph.items()
                       if not under(name, "opd_sao.stages", APPLICATION)
                       for dep in deps if under(dep, "opd_sao.stages")
                       or (under(dep, "opd_sao.envs") and not under(name, "opd_sao.envs")))
    assert not offenders, "core modules importing stages or environments: " + ", ".join(offenders)


def test_the_application_is_on_top_and_the_file_primitives_at_the_bottom(graph):
    """Nothing imports the CLI or the pipeline but themselves; the file primitives (opd_sao.io) import nothing of
    ours but the error base and the regular-file opener, so every layer may use them."""
    above = sorted(f"{n} -> {d}" for n, deps in graph.items() for d in deps
                   if under(d, APPLICATION) and not under(n, APPLICATION))
    assert not above, "imports of the application layer: " + ", ".join(above)
    below = sorted(f"{n} -> {d}" for n, deps in graph.items() for d in deps
                   if under(n, "opd_sao.io") and not under(d, "opd_sao.io", "opd_sao.errors", "opd_sao.regular_files"))
    assert not below, "opd_sao.io must stay a bottom layer: " + ", ".join(below)


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
    assert any(under(dep, "opd_sao.stages") for dep in graph["opd_sao.app.pipeline"])
    assert any(under(dep, "opd_sao.envs") for dep in graph["opd_sao.stages.rl"])
    assert any(under(dep, "opd_sao.cache") for dep in graph["opd_sao.teachers.base"])
    assert graph["opd_sao.errors"] == set()


def test_docs_architecture_lists_the_package_layers_as_they_import(graph):
    """docs/architecture.md ("Layers point one way") names every package in groups, bottom up, and each imports
    only packages of earlier groups (the namespace root, opd_sao, which every import goes through, aside)."""
    text = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    listed = text.split("each package importing only packages of earlier groups:")[1].split(".")[0]
    layer = {f"opd_sao.{name}": i for i, group in enumerate(listed.split(";"))
             for name in re.findall(r"`(\w+)`", group)}
    packages = {pkg: deps - {"opd_sao"} for pkg, deps in package_graph(graph).items() if pkg != "opd_sao"}
    assert set(packages) == set(layer), f"not listed: {set(packages) - set(layer)}, gone: {set(layer) - set(packages)}"
    bad = sorted(f"{pkg} -> {dep}" for pkg, deps in packages.items() for dep in deps if layer[dep] >= layer[pkg])
    assert not bad, "imports of a package in the same or a later group: " + ", ".join(bad)


def test_every_config_setting_is_documented_and_docs_config_md_is_current():
    from opd_sao.config import config_reference, field_docs

    undocumented = [path for path, _, _, text in field_docs() if not text]
    assert not undocumented, f"config fields without a description: {undocumented}"
    table = config_reference(markdown=True)
    assert table in (ROOT / "docs" / "config.md").read_text(), "regenerate docs/config.md (opd-sao config --markdown)"


def test_the_built_in_kinds_declare_stage_fields_each_read_by_some_kind_and_docs_config_md_lists_them():
    """Each built-in kind's `sections` names stage fields (beyond the common ones), each such field is read by
    some kind, and docs/config.md's table of what each kind reads is the registry's (regenerated, not written)."""
    from opd_sao.config import COMMON_STAGE_FIELDS, StageConfig
    from opd_sao.stages import STAGES

    kinds = {name: STAGES.get(name) for name in STAGES.built_ins()}
    assert {"sft", "reasoning", "agent", "chat", "opd"} <= set(kinds)
    own = set(StageConfig.model_fields) - COMMON_STAGE_FIELDS
    assert all(cls.sections <= own for cls in kinds.values())  # each declared name is a stage field
    assert set().union(*(cls.sections for cls in kinds.values())) == own  # and no field is read by none
    docs = (ROOT / "docs" / "config.md").read_text()
    for name, cls in kinds.items():
        assert f"| `{name}` | {', '.join(sorted(cls.sections))} |" in docs, name


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
