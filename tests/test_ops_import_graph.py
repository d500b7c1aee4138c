"""The modules of jodc.ops import each other without a circle, counting the imports made inside functions (which
hide a circle from the interpreter until the wrong module is imported first): each transport's module stands on
its own, and the heap reaches them only through `jodc.ops.transports`."""
import ast
import os

import jodc.ops

OPS_DIR = os.path.dirname(jodc.ops.__file__)


def module_files() -> dict[str, str]:
    """{dotted module name: path} of every module under jodc/ops (a package is its __init__)."""
    found = {}
    for folder, _, files in os.walk(OPS_DIR):
        package = "jodc.ops" + folder[len(OPS_DIR):].replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                found[package if f == "__init__.py" else f"{package}.{f[:-3]}"] = os.path.join(folder, f)
    return found


def import_graph() -> dict[str, set[str]]:
    """{module: the jodc.ops modules it imports anywhere in its source}. `from P import name` is an edge to P.name when
    that is a module, else to P; the package jodc.ops itself (which imports the ops for users) is left out."""
    files = module_files()
    graph = {}
    for name, path in files.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    edges.add(sub if sub in files else node.module)
        graph[name] = {e for e in edges if e in files and e not in ("jodc.ops", name)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` as [a, b, ..., a], or [] when there is none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_jodc_ops_has_no_import_circle():
    graph = import_graph()
    assert "jodc.ops.transports.mpi" in graph
    assert "jodc.ops.transports.registration" in graph["jodc.ops.transports.local"]
    assert find_cycle(graph) == []


def test_native_loaders_and_the_transport_choice_live_in_the_transport_wing():
    """The ops root holds the public ops (and their shared front half, `_call`); the libraries' loaders and the one
    choice of transport (`jodc.ops.transports.select`) sit under jodc/ops/transports/."""
    root = sorted(f for f in os.listdir(OPS_DIR) if f.endswith(".py"))
    assert [f for f in root if f.startswith("_") and f not in ("__init__.py", "_call.py")] == []
    defined = {}
    for name, path in module_files().items():
        with open(path) as f:
            for node in ast.parse(f.read()).body:
                if isinstance(node, ast.FunctionDef):
                    defined.setdefault(node.name, []).append(name)
    assert defined["select"] == ["jodc.ops.transports.choice"]
    assert defined["mesh_processes"] == ["jodc.ops.transports.choice"]
