"""The overlay environment of a GPU runner: the runner's own Python and packages as they are (a CUDA jax, torch, ...),
jodc importable from this checkout without installing it, and the few pure-Python packages the image lacks installed
from a local folder of wheels (the runner has no network).

``prepare`` makes it: a venv with the runner's site-packages visible, a path finder for the package roots that
pyproject.toml's ``package-dir`` declares (what an editable install would do, without building), and the missing
wheels (``make gpu-wheels`` downloads them where an index exists). Where the base interpreter cannot make a venv, a
PYTHONPATH overlay does the same. Idempotent and quick; used by tools/gpu_check.py's first step.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What jodc imports (directly or through draccus / tensorboardX) that a CUDA jax image may lack: import name ->
# distribution. All pure Python but protobuf; `make gpu-wheels` fetches them; only the missing ones are installed.
PURE_PYTHON_NEEDS = {"draccus": "draccus", "mergedeep": "mergedeep", "toml": "toml", "tensorboardX": "tensorboardX",
                     "typing_inspect": "typing-inspect", "mypy_extensions": "mypy-extensions",
                     "google.protobuf": "protobuf"}
FINDER_MODULE = "_jodc_checkout_finder"


def version_floors(pyproject: str = os.path.join(ROOT, "pyproject.toml")) -> dict[str, str]:
    """What the build needs at least of what a CUDA image has anyway (distribution -> oldest version), from pyproject's
    [build-system] requires: setuptools (its SPDX license string needs 77; an older image setuptools fails to read
    pyproject.toml). `make gpu-wheels` fetches it; `prepare` installs it into the overlay where the image's is
    older."""
    with open(pyproject, "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    return {name: floor for name, floor in (r.split(">=", 1) for r in requires if r.startswith("setuptools>="))}


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


# ---------------------------------------------------------------------------------------------------------------
# the overlay environment

def package_dirs(pyproject: str = os.path.join(ROOT, "pyproject.toml")) -> dict[str, str]:
    """pyproject's ``[tool.setuptools.package-dir]`` (package -> folder relative to the checkout): the one
    declaration of which folder is which package, read here too."""
    with open(pyproject, "rb") as f:
        mapping = tomllib.load(f).get("tool", {}).get("setuptools", {}).get("package-dir")
    if not isinstance(mapping, dict) or not mapping:
        raise RuntimeError(f"no [tool.setuptools.package-dir] table in {pyproject}")
    return mapping


def finder_source(root: str, mapping: dict[str, str]) -> str:
    """A module that, imported from a .pth file, puts a finder first on sys.meta_path resolving each package root
    of `mapping` to its folder in the checkout at `root` (what an editable install would do, without building)."""
    locations = {pkg: os.path.join(root, folder) for pkg, folder in mapping.items()}
    return f'''"""Written by tools/gpu_check.py: imports {sorted(locations)} from the checkout {root}."""
import importlib.machinery
import importlib.util
import os
import sys

LOCATIONS = {locations!r}


class CheckoutFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        folder = LOCATIONS.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


if not any(getattr(f, "__name__", "") == "CheckoutFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, CheckoutFinder)
'''


def base_site_dirs(python: str) -> list[str]:
    """The package folders `python` imports from (site-packages, dist-packages, the user site): the overlay makes
    all of them visible, wherever the runner's image installed its packages."""
    out = subprocess.run([python, "-c", "import json, sys; print(json.dumps(sys.path))"], capture_output=True,
                         text=True, check=True).stdout
    return [p for p in json.loads(out) if p and os.path.isdir(p) and
            ("site-packages" in p or "dist-packages" in p)]


def env_python(env_dir: str) -> str:
    """The overlay's interpreter (a venv's bin/python, or the fallback's wrapper script)."""
    return os.path.join(env_dir, "bin", "python")


def _venv_overlay(base_python: str, env_dir: str) -> str:
    """A venv on `base_python` with its site-packages visible; returns the folder our files go to (its purelib).
    A .pth file there adds every package folder of the base interpreter (user site included, which venvs hide) and
    starts the finder."""
    py = env_python(env_dir)
    subprocess.run([base_python, "-m", "venv", "--system-site-packages", "--without-pip", env_dir], check=True,
                   capture_output=True, text=True)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "jodc_checkout.pth"), "w") as f:
        # plain lines are appended to sys.path; an `import` line runs at start-up
        f.write("".join(d + "\n" for d in base_site_dirs(base_python)) + f"import {FINDER_MODULE}\n")
    return site


def _path_overlay(base_python: str, env_dir: str) -> str:
    """The fallback where `base_python` cannot make a venv: bin/python is a script that runs `base_python` with a
    folder of ours first on PYTHONPATH (inherited by every subprocess), whose sitecustomize starts the finder and then
    runs the sitecustomize it shadows, if any."""
    site = os.path.join(env_dir, "site")
    os.makedirs(site, exist_ok=True)
    os.makedirs(os.path.dirname(env_python(env_dir)), exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(f"""import importlib.machinery, os, sys
import {FINDER_MODULE}
_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if p and p != _here])
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(type(sys)("sitecustomize"))
""")
    with open(env_python(env_dir), "w") as f:
        f.write(f'#!/bin/sh\nexport PYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}"\nexec "{base_python}" "$@"\n')
    os.chmod(env_python(env_dir), 0o755)
    return site


def prepare(base_python: str, env_dir: str, wheels: str | None, use_venv: bool = True) -> str:
    """Creates (or refreshes) the overlay environment and returns its python. Idempotent and quick (no index).
    `use_venv=False`, or a base interpreter that cannot make a venv, takes the PYTHONPATH fallback."""
    py = env_python(env_dir)
    stamp = os.path.join(env_dir, ".jodc-overlay")
    base = os.path.realpath(base_python)
    if os.path.exists(env_dir) and (not os.path.exists(stamp) or open(stamp).read().split("\n")[0] != base):
        shutil.rmtree(env_dir)  # made from another interpreter, or half made: start again
    if not os.path.exists(stamp):
        site = None
        if use_venv:
            try:
                site = _venv_overlay(base_python, env_dir)
            except subprocess.CalledProcessError as e:
                print(f"no venv from {base_python} ({(e.stderr or '').strip()[-300:]}): using the PYTHONPATH overlay")
                shutil.rmtree(env_dir, ignore_errors=True)
        site = site or _path_overlay(base_python, env_dir)
        with open(stamp, "w") as f:
            f.write(f"{base}\n{site}\n")
    site = open(stamp).read().split("\n")[1]
    with open(os.path.join(site, FINDER_MODULE + ".py"), "w") as f:
        f.write(finder_source(ROOT, package_dirs()))
    missing = [dist for mod, dist in PURE_PYTHON_NEEDS.items() if not _importable(py, mod)]
    if missing and wheels:
        # exactly the missing ones, no dependency resolution (it would look for what the runner has, in `wheels`)
        subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--find-links", wheels,
                        "--target", site, "--disable-pip-version-check", *missing], check=True)
        missing = [dist for mod, dist in PURE_PYTHON_NEEDS.items() if not _importable(py, mod)]
    if missing:
        raise SystemExit(f"missing Python packages {missing}: pass --wheels <folder of their wheels> (GPU_WHEELS= "
                         "with make; `make gpu-wheels` fetches them into build/gpu-wheels where an index is reachable)")
    too_old = [f"{dist}>={floor}" for dist, floor in version_floors().items()
               if _version_tuple(_installed_version(py, dist)) < _version_tuple(floor)]
    if too_old and wheels:
        subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--find-links", wheels,
                        "--target", site, "--upgrade", "--disable-pip-version-check", *too_old], check=True)
        too_old = [f"{dist}>={floor}" for dist, floor in version_floors().items()
                   if _version_tuple(_installed_version(py, dist)) < _version_tuple(floor)]
    if too_old:
        raise SystemExit(f"the build needs {too_old}, older here: pass --wheels (`make gpu-wheels` fetches it)")
    probe = subprocess.run([py, "-c", "import jodc, jodc.models, jodc.train, jodc.ops; print(jodc.__file__)"],
                           capture_output=True, text=True, cwd="/")
    if probe.returncode != 0 or not probe.stdout.strip().startswith(ROOT):
        raise SystemExit(f"jodc is not importable from the checkout in the overlay:\n{probe.stdout}{probe.stderr}")
    print(f"overlay {env_dir}: python {py}, jodc from {ROOT}")
    return py


def _installed_version(python: str, dist: str) -> str:
    """The version of distribution `dist` that `python` imports ("0" when it has none)."""
    done = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "0"


def _importable(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0

