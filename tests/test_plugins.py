"""Plugins: a user's extension is one file named in the config's `plugins:`, or a module an installed package
declares as an entry point (opd_sao.registry.PLUGIN_GROUPS). The recipes in the README run through the CLI in
tests/test_readme_recipes.py; here, how plugins are found, and the one-line errors when they are not."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from launchers import HANG_S

from opd_sao.config import ConfigError, parse_config

STAGE = {"name": "r", "kind": "reasoning", "env": "arithmetic"}

TEACHER_PLUGIN = '''
from opd_sao.teachers.base import register_teacher
from opd_sao.teachers.in_process import InProcessTeacher


@register_teacher("{kind}")
class Teacher(InProcessTeacher):
    pass
'''


def _teacher_stage(kind: str, checkpoint: str) -> dict:
    return {"name": "opd", "kind": "opd", "domains": ["arithmetic"],
            "opd": {"teachers": [{"name": "t", "kind": kind, "checkpoint": checkpoint, "domains": ["arithmetic"]}]}}


def test_a_plugin_file_is_imported_before_validation_and_only_once(tmp_path, monkeypatch):
    from opd_sao.teachers import TEACHER_KINDS

    monkeypatch.chdir(tmp_path)  # paths are relative to the working directory, as every path in a config
    (tmp_path / "my_teacher.py").write_text(TEACHER_PLUGIN.format(kind="plugin_file_teacher"))
    (tmp_path / "ckpt").mkdir()
    data = {"plugins": ["my_teacher.py"], "stages": [STAGE, _teacher_stage("plugin_file_teacher", "ckpt")]}
    cfg = parse_config(data)
    assert cfg.plugins == ["my_teacher.py"]  # kept in the run's config.yaml, so --resume loads it again
    registered = TEACHER_KINDS.get("plugin_file_teacher")
    assert registered.__module__ == "opd_sao_plugin_my_teacher"
    parse_config(data)  # a second load of the same file is not a second registration (which would raise)
    assert TEACHER_KINDS.get("plugin_file_teacher") is registered


def test_a_plugin_module_by_name(tmp_path, monkeypatch):
    from opd_sao.teachers import TEACHER_KINDS

    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "teacher.py").write_text(TEACHER_PLUGIN.format(kind="plugin_module_teacher"))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "plugin_module_teacher" not in TEACHER_KINDS
    parse_config({"plugins": ["my_pkg.teacher"], "stages": [STAGE]})
    assert TEACHER_KINDS.get("plugin_module_teacher").__module__ == "my_pkg.teacher"


@pytest.mark.parametrize("plugin, source, message", [
    ("missing.py", None, r"^plugins: 'missing.py' is not a file \(paths are relative to the working directory, "),
    ("broken.py", "x = 1\ndef f(:\n", r"^plugins: broken.py:2: invalid syntax"),
    ("needs.py", "import no_such_module_here\n", r"^plugins: needs.py: No module named 'no_such_module_here'$"),
    ("no_such_pkg.module", None, r"^plugins: cannot import 'no_such_pkg.module' \(No module named 'no_such_pkg'; "),
    ("clash.py", TEACHER_PLUGIN.format(kind="in_process"),
     r"^plugins: clash.py: teacher kind 'in_process' is registered twice \(opd_sao\.teachers\.[\w.]+ and "
     r"opd_sao_plugin_clash\.\w+\)$"),
])
def test_a_plugin_that_cannot_be_imported_is_one_line(tmp_path, monkeypatch, plugin, source, message):
    monkeypatch.chdir(tmp_path)
    if source is not None:
        (tmp_path / plugin).write_text(source)
    with pytest.raises(ConfigError, match=message) as err:
        parse_config({"plugins": [plugin], "stages": [STAGE]})
    assert "\n" not in str(err.value)
    assert f"opd_sao_plugin_{plugin.removesuffix('.py')}" not in sys.modules  # a failed import leaves nothing behind


def test_plugins_must_be_a_list_of_names():
    with pytest.raises(ConfigError, match=r"^plugins: a list of .py files or module names \(got 'x.py'\)$"):
        parse_config({"plugins": "x.py", "stages": [STAGE]})


def test_a_plugins_own_error_keeps_its_traceback(tmp_path, monkeypatch):
    """A plugin whose code raises while it is imported has a bug: that is not reported as a config mistake."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "buggy.py").write_text("def f():\n    return {}['x']\n\nf()\n")
    with pytest.raises(KeyError):
        parse_config({"plugins": ["buggy.py"], "stages": [STAGE]})


def test_an_installed_packages_entry_points_register_its_plugins(tmp_path):
    """A real package installed by pip (setuptools, `[project.entry-points."opd_sao.teacher"]`): a fresh interpreter
    that looks its teacher kind up finds it, with no `plugins:` entry anywhere (so do commands that read no config)."""
    src = tmp_path / "src"
    (src / "acme_teacher").mkdir(parents=True)
    (src / "acme_teacher" / "__init__.py").write_text(TEACHER_PLUGIN.format(kind="acme"))
    (src / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "acme-teacher"
        version = "0.1"

        [project.entry-points."opd_sao.teacher"]
        acme = "acme_teacher"
    '''))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(src)], check=True, capture_output=True, timeout=HANG_S)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    script = textwrap.dedent('''
        from opd_sao.teachers import TEACHER_KINDS
        print(TEACHER_KINDS.get("acme").__module__)
    ''')
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["acme_teacher"]
    without = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert "unknown teacher kind 'acme'" in without.stderr  # not installed: not found (the test is not vacuous)


def test_an_unknown_teacher_kind_is_refused_before_any_work(tmp_path, monkeypatch):
    """A teacher kind is looked up when the config is checked (a plugin not named in `plugins:` is then found
    missing at once), not when its OPD stage starts after the earlier stages have run."""
    from opd_sao.app.pipeline import check_before_work

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    cfg = parse_config({"stages": [STAGE, _teacher_stage("in_proces_bf16", "ckpt")]})
    with pytest.raises(ValueError, match=r"^stage 'opd': teacher 't': unknown teacher kind 'in_proces_bf16'; "
                                         r"registered: .*in_process, .*name its file in `plugins:`\)$"):
        check_before_work(cfg)


def test_one_file_registered_under_two_module_names_says_so(tmp_path, monkeypatch):
    """`import envs.dataset` from a checkout's root, then `opd_sao.envs`: each name runs the file's decorators, and
    the second registration names both modules and what to import instead (before: only "registered twice")."""
    from opd_sao.registry import DuplicateName, Registry

    registry = Registry("reward")
    (tmp_path / "judge.py").write_text("def register(registry):\n    @registry.register('rule')\n"
                                       "    class Rule:\n        pass\n")
    for module in ("envs_judge", "opd_sao_envs_judge"):
        spec = importlib.util.spec_from_file_location(module, tmp_path / "judge.py")
        loaded = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, module, loaded)  # as an import puts it (where inspect finds its file)
        spec.loader.exec_module(loaded)
        try:
            loaded.register(registry)
        except DuplicateName as err:
            assert str(err) == ("reward 'rule' is registered twice (envs_judge.register.<locals>.Rule and "
                                "opd_sao_envs_judge.register.<locals>.Rule; one file imported under two module names: "
                                "import stages, envs, teachers and cache as opd_sao.stages, opd_sao.envs, "
                                "opd_sao.teachers and opd_sao.cache)")
            return
    pytest.fail("the second registration was accepted")
