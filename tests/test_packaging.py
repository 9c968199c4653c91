"""What the distribution promises: one import namespace (`opd_sao`), a torch range that admits the CUDA builds
people have, the errors the CLI reports in one line, and an offline install for the GPU check."""
from __future__ import annotations

import email
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from launchers import HANG_S
from packaging.requirements import Requirement

from opd_sao.app import cli
from opd_sao.errors import OpdSaoError, UsageError
from opd_sao.stages.base import ENV_SECTIONS, Stage, register_stage

ROOT = Path(__file__).resolve().parents[1]
MOVED = ("stages", "envs", "teachers", "cache")  # the top-level folders installed as opd_sao.stages, ...


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(out), str(ROOT)], check=True, timeout=600)
    return next(out.glob("opd_sao-*.whl"))


def test_the_wheels_requirements_admit_torch_2_11_and_2_13(wheel):
    with zipfile.ZipFile(wheel) as zf:
        metadata = email.message_from_bytes(zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))))
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    torch = next(r for r in requirements if r.name == "torch" and r.marker is None)
    assert all(torch.specifier.contains(v) for v in ("2.11.0", "2.13.0")), torch
    assert not torch.specifier.contains("2.3.1"), torch  # the range has a floor
    assert {"fastapi", "uvicorn", "orjson", "urllib3", "anyio"} <= {r.name for r in requirements}
    optional = {r.name: str(r.marker) for r in requirements if r.marker is not None}
    assert 'extra == "deepspeed"' in optional["deepspeed"] and 'extra == "wandb"' in optional["wandb"]


def test_the_wheel_installs_everything_under_opd_sao(wheel, tmp_path):
    """Installed from the wheel into a fresh folder (not the checkout), the stages, environments, teachers and the
    logit cache import as opd_sao.*, and none of them is a top-level name."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--disable-pip-version-check",
                    "--target", str(target), str(wheel)], check=True, timeout=HANG_S)
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin") == ["opd_sao"]
    probe = ("import importlib; names = ('opd_sao', 'opd_sao.envs', 'opd_sao.teachers.routing', 'opd_sao.cache'); "
             "print(*(importlib.import_module(name).__file__ for name in names))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)},
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    assert all(path.startswith(str(target)) for path in out.stdout.split()), out.stdout


def test_a_checkout_installed_nowhere_maps_its_folders_under_opd_sao():
    """The offline GPU check's route: the checkout only on PYTHONPATH (no install, so no setuptools finder: `-S`
    skips site-packages' .pth files, the dependencies come in through PYTHONPATH). opd_sao.stages, .envs, .teachers
    and .cache are still the checkout's folders (opd_sao/__init__.py); before, `opd_sao.stages` was not found."""
    site = next(p for p in sys.path if p.endswith("site-packages"))
    probe = ("import json, opd_sao.stages, opd_sao.envs, opd_sao.teachers, opd_sao.cache, opd_sao.app.cli, sys; "
             "print(json.dumps([sys.modules['opd_sao.' + m].__file__ for m in %r]))" % (MOVED,))
    out = subprocess.run([sys.executable, "-S", "-c", probe], cwd="/", capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [str(ROOT / m / "__init__.py") for m in MOVED]


def test_importing_the_whole_package_puts_no_moved_folder_on_sys_modules():
    """Every module of opd_sao (opd_sao.app.cli, the stages, environments, teachers and cache included) imported in a
    fresh interpreter: no top-level `stages`, `envs`, `teachers` or `cache` module appears (`cache` collides with
    other distributions)."""
    probe = """
import importlib, json, pkgutil, sys
import opd_sao.app.cli
failed, walked = [], []
# the moved folders are no subfolders of opd_sao/ in a checkout, so each is walked from its own path
for root in [importlib.import_module(name) for name in ("opd_sao", *("opd_sao." + m for m in %r))]:
    walked.append(root.__name__)
    for info in pkgutil.walk_packages(root.__path__, root.__name__ + "."):
        walked.append(info.name)
        try:
            importlib.import_module(info.name)
        except ImportError as err:  # reported: every module must import here
            failed.append(f"{info.name}: {err}")
print(json.dumps([walked, failed, sorted(m for m in sys.modules if m.split(".")[0] in %r)]))
""" % (MOVED, MOVED)
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    walked, failed, top_level = json.loads(out.stdout.splitlines()[-1])
    files = [p.relative_to(ROOT).with_suffix("").parts for top in ("opd_sao", *MOVED) for p in (ROOT / top).rglob("*.py")]
    modules = {".".join((("opd_sao",) if parts[0] in MOVED else ()) + parts[: -1 if parts[-1] == "__init__" else None])
               for parts in files}
    assert set(walked) == modules and not failed, (sorted(modules ^ set(walked)), failed)  # all of it, imported
    assert top_level == [], top_level


@register_stage("test-packaging-buggy")
class BuggyStage(Stage):
    """A plugin stage with a bug: a KeyError is no user mistake."""

    sections = ENV_SECTIONS

    def run(self):
        return {}["checkpoint"]


@register_stage("test-packaging-refusing")
class RefusingStage(Stage):
    """A plugin stage that refuses the user's input with an OpdSaoError."""

    sections = ENV_SECTIONS

    def run(self):
        raise UsageError("this stage needs a larger model")


def _run(tmp_path, model_dir, kind):
    config = {"seed": 0, "model": {"path": str(model_dir)}, "logging": {"wandb": False, "progress": False},
              "stages": [{"name": "s", "kind": kind, "env": "arithmetic", "env_options": {"max_operand": 9}}]}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    return cli.main(["run", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run")])


def test_a_bug_in_a_plugin_stage_keeps_its_traceback(tmp_path, tiny_model_dir):
    with pytest.raises(KeyError, match="checkpoint"):  # raised through main: Python prints the traceback
        _run(tmp_path, tiny_model_dir, "test-packaging-buggy")


def test_an_opd_sao_error_from_a_plugin_stage_is_one_line(tmp_path, tiny_model_dir, capsys):
    assert _run(tmp_path, tiny_model_dir, "test-packaging-refusing") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["opd-sao run: error: this stage needs a larger model"]


def test_user_error_classes_share_the_base():
    from opd_sao.cache.errors import CacheMismatchError, CacheReadOnlyError
    from opd_sao.config import ConfigError
    from opd_sao.envs.dataset.files import DatasetError
    from opd_sao.io.lock import RunDirLocked
    from opd_sao.registry import UnknownName
    from opd_sao.teachers.base import TeacherIncompatibleError

    for cls in (ConfigError, RunDirLocked, DatasetError, TeacherIncompatibleError, CacheMismatchError,
                CacheReadOnlyError, UnknownName):
        assert issubclass(cls, OpdSaoError), cls
    assert issubclass(ConfigError, ValueError) and issubclass(UnknownName, KeyError)  # what callers catch stays
