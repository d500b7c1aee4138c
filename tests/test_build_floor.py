"""The build requirement's floor: pyproject's [build-system] names the oldest setuptools that reads jodc's
pyproject.toml (its SPDX `license = "Apache-2.0"` string needs setuptools 77; 69-76 fail with "invalid
pyproject.toml config: project.license"), and that version really builds the metadata: its PEP 517 hook runs
setup.py over a copy of the tracked sources, as `pip install --no-build-isolation` would with it installed. The
Makefile's build-dependency installs name the same floor. Needs the package index for that one setuptools (CI has
it; without it the test says so and skips)."""
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setuptools_floor() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    (floor,) = [m.group(1) for r in requires if (m := re.fullmatch(r"setuptools>=([\d.]+)", r))]
    return floor


def test_the_makefile_installs_the_same_floor():
    floor = setuptools_floor()
    with open(os.path.join(ROOT, "Makefile")) as f:
        named = re.findall(r'"setuptools>=([\d.]+)"', f.read())
    assert named and set(named) == {floor}, named
    assert tuple(map(int, floor.split("."))) >= (77,)  # the SPDX license string


@pytest.mark.slow
def test_the_floor_setuptools_builds_the_metadata(tmp_path):
    floor = setuptools_floor()
    target = tmp_path / "setuptools"
    got = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                          f"setuptools=={floor}"], capture_output=True, text=True, timeout=300)
    if got.returncode != 0:
        pytest.skip(f"setuptools=={floor} could not be fetched (no package index here?): {got.stderr[-500:]}")
    source = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    if not tracked:  # a copy outside the checkout (CI's Python 3.12 run works on one): the 3.11 run checks this
        pytest.skip(f"{ROOT} is not a git checkout's root: no tracked files to build from")
    for name in filter(None, tracked.decode().split("\0")):
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(source / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), source / name)
    metadata = tmp_path / "metadata"
    metadata.mkdir()
    hook = ("import setuptools, setuptools.build_meta as backend, sys; "
            "print('setuptools', setuptools.__version__); "
            "print(backend.prepare_metadata_for_build_wheel(sys.argv[1]))")
    env = {**os.environ, "PYTHONPATH": str(target), "JODC_CUDA": "0"}
    done = subprocess.run([sys.executable, "-c", hook, str(metadata)], cwd=source, capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert f"setuptools {floor}" in done.stdout
    (dist_info,) = metadata.glob("jodc-*.dist-info")
    text = (dist_info / "METADATA").read_text()
    assert "Name: jodc" in text and "License-Expression: Apache-2.0" in text, text[:1000]
