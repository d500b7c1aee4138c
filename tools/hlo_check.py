"""Checks on compiled programs that use jodc's ops: which jodc custom calls an HLO module holds, with which attributes,
and whether XLA put any of them inside a command buffer (CUDA graph).

jodc's ops must never be captured into a command buffer: the barrier waits on the host for its kernel (a replayed
graph would skip that wait and its timeout), and every op resolves heap and bucket pointers when it is called (a
replayed graph would bake in the pointers of the first call). XLA captures only custom calls whose handlers declare
themselves command-buffer compatible, which jodc's do not; these functions verify it on the optimized HLO
(`compiled.as_text()`), e.g. under ``--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE``.
"""
from __future__ import annotations

import re

_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\([^{]*\))?\s*(?:->\s*[^{]*)?\{\s*$")
_CALLEE = re.compile(r"\b(?:to_apply|calls|body|condition|branch_computations|called_computations)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")
_JODC_TARGET = re.compile(r'custom_call_target="(jodc_\w+)"')


def computations(hlo_text: str) -> dict[str, list[str]]:
    """HLO module text -> {computation name: its instruction lines}."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and not line.lstrip().startswith("HloModule"):
                current = m.group(1)
                out[current] = []
            continue
        if line.strip() == "}":
            current = None
        else:
            out[current].append(line)
    return out


def _callees(lines: list[str]) -> set[str]:
    names = set()
    for line in lines:
        for m in _CALLEE.finditer(line):
            names.update(n.strip().lstrip("%") for n in m.group(1).strip("{}").split(",") if n.strip())
    return names


def command_buffer_count(hlo_text: str) -> int:
    """How many command buffers (computations named command_buffer*) XLA formed in the module: 0 means the checks
    below had nothing to look into, whatever they say."""
    return sum(1 for name in computations(hlo_text) if name.startswith("command_buffer"))


def jodc_calls_in_command_buffers(hlo_text: str) -> tuple[int, list[tuple[str, str]]]:
    """(number of jodc custom calls in the module, [(computation, target)] of those inside a command buffer: in a
    computation named command_buffer* or one reachable from it)."""
    comps = computations(hlo_text)
    total = sum(len(_JODC_TARGET.findall(line)) for lines in comps.values() for line in lines)
    pending = [name for name in comps if name.startswith("command_buffer")]
    captured_comps = set()
    while pending:
        name = pending.pop()
        if name in captured_comps or name not in comps:
            continue
        captured_comps.add(name)
        pending.extend(_callees(comps[name]))
    captured = sorted((name, target) for name in captured_comps for line in comps[name]
                      for target in _JODC_TARGET.findall(line))
    return total, captured


def jodc_custom_calls(hlo_text: str) -> list[dict]:
    """The jodc custom calls of an optimized HLO module (``compiled.as_text()``): per call its computation, target,
    and the attributes XLA schedules by: has_side_effect (never CSE'd, DCE'd or hoisted) and api_version
    (API_VERSION_TYPED_FFI for XLA FFI handlers)."""
    calls = []
    for name, lines in computations(hlo_text).items():
        for line in lines:
            m = _JODC_TARGET.search(line)
            if not m:
                continue
            api = re.search(r"api_version=(\w+)", line)
            calls.append({"computation": name, "target": m.group(1),
                          "has_side_effect": "custom_call_has_side_effect=true" in line,
                          "api_version": api.group(1) if api else None})
    return calls
