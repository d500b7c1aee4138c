"""griffe extensions for jodc's API reference. FieldComments: a class attribute without a docstring takes its comment.

The trainers' config sections (train/core/config.py, train/rl/config.py) and a few library dataclasses document each
field with a trailing comment (`steps: int = 100  # training steps of the whole run`) or with comment lines right
above it; griffe reads only docstrings, so without this the reference would list the fields bare.
"""
from __future__ import annotations

import ast
import re

import griffe


def _comment(lines: list[str], lineno: int, endlineno: int) -> str:
    """The trailing comment of the statement's last line, else the comment lines directly above it."""
    last = lines[endlineno - 1]
    code, hash_, comment = last.partition("  # ")
    if hash_ and comment.strip() and code.count('"') % 2 == 0 and code.count("'") % 2 == 0:
        return comment.strip()
    above, i = [], lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        above.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    return " ".join(above)


class FieldComments(griffe.Extension):
    def on_attribute_instance(self, *, node: ast.AST | griffe.ObjectNode, attr: griffe.Attribute,
                              agent: griffe.Visitor | griffe.Inspector, **kwargs) -> None:
        if attr.docstring is not None or not isinstance(node, ast.AST) or attr.lineno is None:
            return
        parent = attr.parent
        if parent is None or not parent.is_class:
            return
        lines = agent.lines_collection[agent.filepath] if agent.filepath in agent.lines_collection else None
        if lines is None:
            lines = agent.filepath.read_text(encoding="utf-8").splitlines()
        text = _comment(lines, attr.lineno, attr.endlineno or attr.lineno)
        if text:
            attr.docstring = griffe.Docstring(text, lineno=attr.lineno, parent=attr)


#: Sphinx cross-reference roles (`:func:`gather``) that some docstrings use; Markdown shows them literally.
SPHINX_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|obj|exc):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    """Docstrings' Sphinx roles become code spans (`:func:`gather`` -> `` `gather` ``), as the Markdown docs write them."""

    def on_instance(self, *, node: ast.AST | griffe.ObjectNode, obj: griffe.Object,
                    agent: griffe.Visitor | griffe.Inspector, **kwargs) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = SPHINX_ROLE.sub(r"`\1`", obj.docstring.value)
