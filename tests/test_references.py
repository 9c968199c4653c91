"""Every reference a reader may follow resolves: the design sections the code cites exist in docs/design.md,
and the repository files and `opd_sao.*` / `stages.*` / `envs.*` / `teachers.*` / `cache.*` modules named in
docstrings, comments and docs exist. (A renamed module used to leave stale paths behind in docstrings and the README.)"""
from __future__ import annotations

import re
from pathlib import Path

from opd_sao.registry import PLUGIN_GROUPS

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for top in ("opd_sao", "stages", "envs", "teachers", "cache", "benchmarks", "tests", "scripts")
           for p in (ROOT / top).rglob("*") if p.suffix in {".py", ".sh"}]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").glob("*.yaml"))]
TOPS = ("opd_sao", "stages", "envs", "teachers", "cache", "docs", "tests", "benchmarks", "scripts", "configs", "examples")

SECTION = re.compile(r"design\.md §(\d+(?:\.\d+)?)")
# a repository path: starts with a top-level folder, ends in a file suffix (or a slash for a folder)
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])" % "|".join(TOPS))
# files a recipe asks the reader to create (a code block's first comment line), or that a command writes
WRITTEN = re.compile(r"^# ((?:%s)/[\w./-]+)" % "|".join(TOPS), re.M)
OUTPUTS = {"docs/gpu_check.txt", "configs/my_run.yaml"}
MODULE = re.compile(r"(?<![\w./-])((?:opd_sao|stages|envs|teachers|cache)(?:\.[A-Za-z_]\w*)+)")


def _texts():
    for path in SOURCES + DOCS:
        if path.name == "test_references.py":
            continue
        yield path, path.read_text(encoding="utf-8")


def _exists(ref: str) -> bool:
    ref = ref.rstrip("/.")
    if any(ch in ref for ch in "*{<"):  # a pattern or a placeholder, not a path
        return True
    return (ROOT / ref).exists()


def _module_exists(dotted: str) -> bool:
    """A module (file or package) named by the dotted path, or an attribute of one (at most two levels deep).
    `stages.<name>.<field>` that is no module is a config key (the run's stages by name), not a reference."""
    if dotted in PLUGIN_GROUPS:  # an entry-point group plugins are declared in (opd_sao.registry), not a module
        return True
    parts = dotted.split(".")
    if parts[0] == "stages" and not (ROOT / "stages" / f"{parts[1]}.py").is_file() \
            and not (ROOT / "stages" / parts[1]).is_dir():
        return True
    if len(parts) > 1 and parts[0] == "opd_sao" and parts[1] in ("stages", "envs", "teachers", "cache"):
        parts = parts[1:]  # the top-level folders install as opd_sao.stages, ... (setup.py's package_dir)
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            rest = parts[cut:]
            return not rest or (len(rest) <= 2 and re.search(rf"\b{rest[0]}\b", source.read_text()) is not None)
    return False


def test_cited_design_sections_exist():
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^##+ §(\d+(?:\.\d+)?)", design, re.M)) | set(re.findall(r"\*\*§(\d+\.\d+)", design))
    missing = [(str(p.relative_to(ROOT)), s) for p, text in _texts() for s in SECTION.findall(text)
               if s not in headings and s.rstrip("b") not in headings]
    assert not missing, f"design sections cited but not in docs/design.md: {missing}"


def test_named_files_and_modules_exist():
    missing = []
    for path, text in _texts():
        rel = str(path.relative_to(ROOT))
        created = set(WRITTEN.findall(text)) | OUTPUTS
        missing += [(rel, ref) for ref in PATH.findall(text) if "." in ref.rsplit("/", 1)[-1] or ref.endswith("/")
                    if ref not in created and not _exists(ref)]
        # in code `teachers.append` is a variable's method: there only opd_sao.* is surely a module path
        missing += [(rel, ref) for ref in MODULE.findall(text) if path.suffix != ".py" or ref.startswith("opd_sao.")
                    if not _module_exists(ref)]
    assert not missing, f"references to files or modules that do not exist: {sorted(set(missing))}"


def test_the_references_checker_catches_a_stale_path():
    """The checks above can fail: a made-up module and file are reported as missing."""
    assert not _module_exists("opd_sao.distill_old_name") and not _exists("envs/no_such_env.py")
    assert _module_exists("opd_sao.rl.distill") and _module_exists("opd_sao.algorithms.PRESETS")
    assert _module_exists("opd_sao.envs.sandbox") and not _module_exists("opd_sao.stages.no_such_module")


def _slugs(markdown: Path) -> set[str]:
    """GitHub's anchors for a markdown file's headings: lower case, punctuation dropped, spaces -> hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_cited_doc_sections_exist():
    """A link to a section (`file.md#anchor`) and a quoted section title of docs/benchmarks.md (`docs/benchmarks.md,
    "Online learning"`) name a heading that exists: that page was rewritten from a notebook, and code, configs and
    docs cite its sections by title."""
    missing = []
    for path, text in _texts():
        rel = str(path.relative_to(ROOT))
        if path.suffix == ".md":
            for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?#([\w-]+)\)", text):
                doc = (path.parent / target) if target else path
                if not doc.is_file() or anchor not in _slugs(doc):
                    missing.append((rel, f"{target}#{anchor}"))
        flat = " ".join(text.replace("#", " ").split())  # a title may wrap, in a comment too
        for doc, title in re.findall(r"(docs/benchmarks\.md),? \"([^\"]+)\"", flat):
            headings = re.findall(r"^#+ (.+)$", (ROOT / doc).read_text(encoding="utf-8"), re.M)
            if not any(h.startswith(title) for h in headings):
                missing.append((rel, f'{doc} "{title}"'))
    assert not missing, f"cited sections that no heading matches: {sorted(set(missing))}"
