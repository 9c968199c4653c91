"""opd-sao. setup.py installs the top-level folders stages/, envs/, teachers/ and cache/ as opd_sao.stages,
opd_sao.envs, opd_sao.teachers and opd_sao.cache: a wheel holds them as subpackages, and the editable install of
scripts/setup.sh maps them with setuptools' finder. A checkout that is only on sys.path, installed nowhere
(scripts/gpu_check.sh offline: a Python with its own torch, the other dependencies in a --target folder, the
checkout on PYTHONPATH), maps them here, to the same folders; a finder at the end of sys.meta_path, so an installed
opd_sao (editable or not) keeps its own."""
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

_CHECKOUT = _Path(__file__).resolve().parent.parent
_MOVED = ("stages", "envs", "teachers", "cache")


class _CheckoutFolders:
    """opd_sao.<folder> from <checkout>/<folder>, for the four folders setup.py's package_dir maps."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        top, _, folder = name.partition(".")
        if top != __name__ or folder not in _MOVED:
            return None
        init = _CHECKOUT / folder / "__init__.py"
        return _util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])


if (_CHECKOUT / "setup.py").is_file() and all((_CHECKOUT / f / "__init__.py").is_file() for f in _MOVED) \
        and not any(type(f).__name__ == "_CheckoutFolders" for f in _sys.meta_path):
    _sys.meta_path.append(_CheckoutFolders())
