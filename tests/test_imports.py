"""Every module of the library imports: the suite would not notice that a module no test imports breaks on a new jax
(a moved or removed API), and `make test-jax-latest` runs this file on the newest jax."""
import importlib
import pkgutil

import pytest

from jodc.ops.transports import cuda_library, mpi_library, nvshmem_library

# The installed packages (setup.py maps models/ and train/ into jodc: walking jodc's own folder misses them).
PACKAGES = ("jodc", "jodc.models", "jodc.train")
# The plain shared libraries next to the package (loaded with ctypes, not imported): pkgutil lists them as modules.
CTYPES_LIBRARIES = {"jodc." + backend.LIBRARY_NAME.removesuffix(".so")
                    for backend in (cuda_library, mpi_library, nvshmem_library)}


def _reraise(name):
    """pkgutil.walk_packages' onerror: it is called inside the except block of a failed subpackage import, so a bare
    raise re-raises that error instead of the silent skip walk_packages does by default."""
    raise


def library_modules() -> list[str]:
    """The dotted names of every module and package of the library, but `__main__` modules and ctypes libraries."""
    names = set()
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names.add(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + ".", onerror=_reraise):
            if info.name.rsplit(".", 1)[-1] == "__main__":  # `python -m jodc.train` runs the trainer on import
                continue
            if info.name not in CTYPES_LIBRARIES:
                names.add(info.name)
    return sorted(names)


def test_every_package_is_walked():
    """The walk reaches the packages setup.py maps from other folders and their subpackages."""
    modules = library_modules()
    for expected in ("jodc.ops.gather", "jodc.models.hf", "jodc.train.core.config", "jodc.train.rl.loop"):
        assert expected in modules


@pytest.mark.parametrize("name", library_modules())
def test_module_imports(name):
    importlib.import_module(name)
