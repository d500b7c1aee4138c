"""What a GPU runner has, and whether its CUDA tests really ran: the two checks around `make test-gpu`.

``python tools/cuda_report.py`` prints the GPU model(s), driver and runtime versions, peer access and native peer
atomics for every pair of GPUs, and the transport and accumulation mode a heap over all GPUs uses.
``python tools/cuda_report.py --check-junit FILE`` reads pytest's JUnit XML and fails (exit 1) when the CUDA
tests did not run: none of tests/test_ops_cuda.py ran, or one was skipped for any reason but the documented hardware
ones (a second GPU; memory for the bucket above 2^31 elements).
"""
from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ElementTree

# The only reasons a CUDA test may skip on a GPU runner: the runner lacks the hardware, not the software.
HARDWARE_SKIPS = (r"needs two GPUs", r"needs \d+ GPUs", r"not enough GPU memory")
CUDA_TEST_FILES = ("test_ops_cuda",)


def _version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}" if v > 0 else "none"


def describe(lib, gpus: list[int], transport: str | None = None, landing_slots: bool | None = None) -> str:
    """The report's text for CUDA devices `gpus` through the CUDA library `lib` (anything with versions,
    device_info and peer_info, so tests can pass a fake)."""
    driver, runtime = lib.versions()
    lines = [f"CUDA driver {_version(driver)}, runtime {_version(runtime)} (jodc's library), {len(gpus)} GPU(s)"]
    for g in gpus:
        info = lib.device_info(g)
        major, minor = info["compute_capability"]
        lines.append(f"  GPU {g}: {info['name']}, sm_{major}{minor}, {info['total_bytes'] / 2**30:.1f} GiB")
    if len(gpus) > 1:
        lines.append("peer access / native peer atomics (row: from, column: to):")
        lines.append("        " + " ".join(f"{b:>7}" for b in gpus))
        for a in gpus:
            cells = []
            for b in gpus:
                if a == b:
                    cells.append(f"{'-':>7}")
                else:
                    access, atomics = lib.peer_info(a, b)
                    cells.append(f"{('P' if access else '.') + '/' + ('A' if atomics else '.'):>7}")
            lines.append(f"  {a:>5} " + " ".join(cells))
        lines.append("  (P: peer access, A: native atomics; '.': missing)")
    if transport is not None:
        mode = "" if landing_slots is None else (", accumulation: landing slots" if landing_slots
                                                 else ", accumulation: atomics")
        lines.append(f"transport in use: {transport}{mode}")
    return "\n".join(lines)


def check_junit(path: str) -> tuple[bool, str]:
    """(ok, message) for pytest's JUnit XML at `path`: the CUDA tests ran and none skipped for a software reason."""
    root = ElementTree.parse(path).getroot()
    ran, bad = 0, []
    for case in root.iter("testcase"):
        where = f"{case.get('classname', '')}.{case.get('name', '')}"
        if not any(f in where for f in CUDA_TEST_FILES):
            continue
        skipped = case.find("skipped")
        if skipped is None:
            ran += 1
            continue
        reason = (skipped.get("message") or "") + " " + (skipped.text or "")
        if not any(re.search(r, reason) for r in HARDWARE_SKIPS):
            bad.append(f"{where}: {reason.strip()}")
    if bad:
        return False, "CUDA tests were skipped on a GPU runner:\n  " + "\n  ".join(bad)
    if ran == 0:
        return False, f"no CUDA test ran ({', '.join(CUDA_TEST_FILES)} collected nothing or failed to import)"
    return True, f"{ran} CUDA tests ran"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-junit", metavar="FILE", help="check pytest's JUnit XML instead of printing the report")
    args = parser.parse_args(argv)
    if args.check_junit:
        ok, message = check_junit(args.check_junit)
        print(message)
        return 0 if ok else 1
    import jax
    import numpy as np

    from jodc.ops.transports import cuda_library
    from jodc.ops.heap import SymmetricHeap

    lib = cuda_library.library()
    devices = jax.devices("gpu")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, platform version "
          f"{devices[0].client.platform_version!r}")
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    with SymmetricHeap(mesh) as heap:
        text = describe(lib, [int(d.local_hardware_id) for d in devices], heap.transport, heap.landing_slots)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
