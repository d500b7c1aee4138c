"""One list of FFI targets: ffi/common/ops.h (the C++ X-macro every backend generates its handlers from), the Python
names (jodc/ops/transports/target_names.py) and each built library's handler table must agree; a difference fails here."""
import os
import re

import pytest

from jodc.ops.transports import mpi_library, registration, target_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def header_ops(macro: str) -> tuple[str, ...]:
    """The op names of X-macro `macro` in ffi/common/ops.h, in order."""
    text = open(os.path.join(ROOT, "ffi", "common", "ops.h")).read()
    body = re.search(rf"#define {macro}\(X\)((?:.*\\\n)*.*\n)", text)
    assert body is not None, f"{macro} not found in ffi/common/ops.h"
    return tuple(re.findall(r"X\((\w+),\s*\w+\)", body.group(1)))


def test_python_names_are_the_headers():
    assert target_names.HEAP_OPS == header_ops("JODC_HEAP_OPS")
    assert target_names.TOKEN_OPS == header_ops("JODC_TOKEN_OPS")
    assert target_names.GROUP_OPS == header_ops("JODC_GROUP_OPS")


def test_every_op_module_calls_a_listed_target():
    """Each Python op file names its target through _targets or _call.native (a typo'd or unlisted op would fail at
    trace time)."""
    ops_dir = os.path.join(ROOT, "jodc", "ops")
    called = set()
    for name in os.listdir(ops_dir):
        if name.endswith(".py") and not name.startswith("_"):  # the op modules, not the plumbing
            src = open(os.path.join(ops_dir, name)).read()
            called |= set(re.findall(r"""target(?:_name)?\([^"']*["'](\w+)["']\)""", src))
            called |= set(re.findall(r"""\bnative\(\w+, ["'](\w+)["']""", src))  # _call.native(owner, "op", ...)
            assert not re.search(r"""ffi_call\(\s*["']""", src), f"{name} hard-codes an FFI target name"
    assert called == set(target_names.ALL_OPS + target_names.GROUP_OPS)


def test_cpu_library_exports_exactly_the_targets():
    assert sorted(registration.cpu_library().handlers()) == sorted(target_names.expected_targets("local"))


@pytest.mark.skipif(not mpi_library.available(), reason="the MPI backend is not built")
def test_mpi_library_exports_exactly_the_heap_targets():
    lib = mpi_library.library()
    assert sorted(lib.handler_pointers()) == sorted(target_names.expected_targets("mpi"))
    assert all(ptr for ptr in lib.handler_pointers().values())


def test_target_names():
    assert target_names.target_name("gather") == "jodc_gather"
    assert target_names.target_name("gather", "mpi") == "jodc_mpi_gather"
    # CUDA IPC heaps run the in-process CUDA kernels; NVSHMEM has its own heap ops (and uses CUDA's token ops)
    assert target_names.target_name("after", "cuda_ipc") == "jodc_after"
    assert target_names.target_name("barrier", "nvshmem") == "jodc_nvshmem_barrier"
    assert target_names.expected_targets("nvshmem") == tuple("jodc_nvshmem_" + op for op in target_names.HEAP_OPS)
    with pytest.raises(ValueError, match="no nvshmem FFI op 'depend_on'"):
        target_names.target_name("depend_on", "nvshmem")
    with pytest.raises(ValueError, match="no mpi FFI op 'after'"):
        target_names.target_name("after", "mpi")
    with pytest.raises(ValueError, match="no local FFI op 'gathr'"):
        target_names.target_name("gathr")
    # the group ops: CPU and MPI libraries, not (yet) CUDA's or NVSHMEM's
    assert target_names.target_name("group_gather", "mpi") == "jodc_mpi_group_gather"
    assert "jodc_group_barrier" in target_names.expected_targets("local", "cpu")
    assert "jodc_group_barrier" not in target_names.expected_targets("local", "cuda")
    with pytest.raises(ValueError, match="no nvshmem FFI op 'group_gather'"):
        target_names.target_name("group_gather", "nvshmem")


def test_a_library_out_of_step_is_refused_naming_the_difference():
    table = {name: object() for name in target_names.expected_targets("local")}
    target_names.check_handlers(table, "local", "lib")
    del table["jodc_after"]
    table["jodc_extra"] = object()
    with pytest.raises(RuntimeError, match=r"missing \['jodc_after'\], unexpected \['jodc_extra'\]"):
        target_names.check_handlers(table, "local", "lib")
