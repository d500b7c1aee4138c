"""Every trainer command documented in README.md, docs/*.md and the Makefile's demo targets still works as
written: each is found in the documents (code blocks and `inline code`), run with `--print-config` through the
entry point it names, and its overrides must appear in the printed config. A newly documented command is covered
without editing this file. No JAX is imported (--print-config returns before the trainer loads)."""
import os
import re
import shlex
import tomllib

import pytest
import yaml

from jodc.train.cli import main as cli_main
from jodc.train.core import config as core
from jodc.train.rl.config import RLConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = re.compile(r"(?:jodc-train|python -m jodc\.train)(?: [^`#|\n]*)?")


def _entry_points() -> dict:
    """Command prefix -> main function: the console script of pyproject.toml and the `python -m` modules."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["jodc-train"] == "jodc.train.cli:main"
    return {"python -m jodc.train": cli_main, "jodc-train": cli_main}


def _snippets(text: str) -> list[str]:
    """Lines of fenced code blocks and inline code spans of a Markdown text."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            out.append(line)
        else:
            out += re.findall(r"`([^`\n]+)`", line)
    return out


def _makefile_commands() -> list[str]:
    """The trainer commands of `make demo` and `make demo-rl`, as a shell would run them."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    out = []
    for target in ("demo", "demo-rl"):
        recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.M).group(1)
        for line in recipe.splitlines():
            line = line.strip().replace("$(PY)", "python").replace("$$(date +%Y%m%d_%H%M%S)", "20260101_000000")
            out += [m.group(0).strip() for m in COMMAND.finditer(line)]
    return out


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every complete trainer command in the documents (placeholders like `...` skipped)."""
    found = [("Makefile", c) for c in _makefile_commands()]
    docs = ["README.md"] + sorted(f"docs/{n}" for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    for doc in docs:
        with open(os.path.join(ROOT, doc)) as f:
            snippets = _snippets(f.read())
        found += [(doc, m.group(0).strip()) for s in snippets for m in COMMAND.finditer(s)]
    complete = []
    for where, command in found:
        args = command.split()
        prefix_words = 1 if command.startswith("jodc-train") else 3
        if any(mark in command for mark in ("...", "[", "<")):
            continue
        if len(args) <= prefix_words or args[prefix_words] not in ("sft", "rl"):
            continue
        if (where, command) not in complete:
            complete.append((where, command))
    return complete


COMMANDS = documented_commands()


def test_the_documents_hold_the_commands_users_copy():
    docs = {where for where, _ in COMMANDS}
    assert {"Makefile", "README.md", "docs/training.md", "docs/rl.md"} <= docs
    assert len(COMMANDS) >= 10


def _same(printed, value) -> bool:
    """Whether a printed config value is the override's value (YAML 1.1 reads '3e-3' as a string)."""
    if isinstance(printed, float) and not isinstance(value, bool):
        return float(value) == printed
    return printed == value or str(printed) == str(value)


@pytest.mark.parametrize("where, command", COMMANDS, ids=[f"{w}: {c}" for w, c in COMMANDS])
def test_documented_command_works_as_written(where, command, tmp_path, capsys):
    prefix = next(p for p in _entry_points() if command.startswith(p))
    argv = shlex.split(command[len(prefix):])
    if "--config" in argv:  # a user's own file (my.yaml): an empty one; shipped files are used as they are
        i = argv.index("--config") + 1
        if not os.path.exists(os.path.join(ROOT, argv[i])):
            (tmp_path / "user.yaml").write_text("{}\n")
            argv[i] = str(tmp_path / "user.yaml")
        else:
            argv[i] = os.path.join(ROOT, argv[i])
    rl = argv[0] == "rl"
    status = _entry_points()[prefix](argv + ["--print-config"])
    out, err = capsys.readouterr()
    assert status == 0, f"{where}: `{command}` failed: {err}"
    printed = yaml.safe_load(out)
    overrides = argv[1:]
    if "--config" in overrides:
        i = overrides.index("--config")
        overrides = overrides[:i] + overrides[i + 2:]
    overrides = [a for a in overrides if a != "--print-config"]
    for key, value in core.parse_overrides(overrides, RLConfig if rl else core.SFTConfig).items():
        section, field = key.split(".")
        assert _same(printed[section][field], value), \
            f"{where}: `{command}` printed {key}={printed[section][field]!r}, expected {value!r}"
