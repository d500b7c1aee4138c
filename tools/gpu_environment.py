"""What a GPU runner is: its GPU(s), driver, CUDA toolkit, Python and package versions, and jax's devices.

``report()`` reads them (never raising: a part that cannot be read says why); tools/gpu_check.py's env step prints it
as a table and one JSON line. ``facts(report)`` keeps what a reader of the run's summary needs first (GPU, driver,
memory, jax / jaxlib / CUDA plugin versions, nvcc, Python).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys

from gpu_overlay import PURE_PYTHON_NEEDS  # noqa: E402  (tools/gpu_overlay.py)

DISTRIBUTIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax", "optax",
                 "orbax-checkpoint", "numpy", "torch", "transformers", "pybind11", "setuptools", "mpi4py",
                 "nvidia-nvshmem-cu13", "pytest", *PURE_PYTHON_NEEDS.values())
NVIDIA_SMI_QUERY = "name,driver_version,memory.total,compute_cap"


def _run_text(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{argv[0]}: {e}"


def report() -> dict:
    """The whole environment report (see the module's docstring)."""
    out: dict = {"bench": "gpu_env", "python": platform.python_version(), "host": platform.node(),
                 "cpus": os.cpu_count()}
    out["gpus"] = _run_text(["nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader"]).splitlines()
    nvcc = _run_text(["nvcc", "--version"]).strip().splitlines()
    out["nvcc"] = next((line for line in nvcc if "release" in line), nvcc[-1] if nvcc else "not found")
    out["compute_sanitizer"] = shutil.which("compute-sanitizer") or "not found"
    versions = {}
    for dist in DISTRIBUTIONS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except Exception:  # noqa: BLE001  (not installed, or a broken distribution: say so, do not stop)
            versions[dist] = None
    out["versions"] = versions
    try:
        import jax
        out["jax_backend"] = jax.default_backend()
        out["jax_devices"] = [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()]
    except Exception as e:  # noqa: BLE001
        out["jax_devices"] = f"jax failed: {type(e).__name__}: {e}"
    return out


def facts(env_report: dict | None) -> dict:
    """The headline of an environment report: {"gpu", "gpu_count", "driver", "gpu_memory", "compute_capability",
    "python", "jax", "jaxlib", "cuda_plugin", "nvcc", "compute_sanitizer", "jax_backend"}; {} for no report."""
    if not env_report:
        return {}
    gpus = [line for line in env_report.get("gpus") or [] if line.count(",") >= 3]
    first = [part.strip() for part in gpus[0].split(",")] if gpus else [None] * 4
    versions = env_report.get("versions") or {}
    plugin = next((f"{name} {versions[name]}" for name in ("jax-cuda13-plugin", "jax-cuda12-plugin")
                   if versions.get(name)), None)
    return {"gpu": first[0], "gpu_count": len(gpus), "driver": first[1], "gpu_memory": first[2],
            "compute_capability": first[3], "python": env_report.get("python"), "jax": versions.get("jax"),
            "jaxlib": versions.get("jaxlib"), "cuda_plugin": plugin, "nvcc": env_report.get("nvcc"),
            "compute_sanitizer": env_report.get("compute_sanitizer"), "jax_backend": env_report.get("jax_backend")}


def main() -> int:
    out = report()
    for key, value in out.items():
        print(f"{key:>18}: {value}")
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
