"""The source list of the CPU extension jodc._ffi: one place for setup.py (and for the test that checks the Bazel
build compiles the same files, tests/test_bazel_build.py)."""
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Glob patterns relative to the repository root; BUILD's CPU_SOURCE_GLOBS must expand to the same files.
CPU_SOURCE_GLOBS = ("ffi/module.cc", "ffi/cpu/*.cc", "ffi/balance/*.cc", "ffi/common/*.cc")


def cpu_sources(root: str = ROOT) -> list[str]:
    """Sorted repository-relative paths of every C++ file compiled into jodc._ffi."""
    found = set()
    for pattern in CPU_SOURCE_GLOBS:
        found.update(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern)))
    return sorted(found)
