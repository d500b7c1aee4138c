"""The documents' code works as written.

Every trainer command documented in README.md, docs/*.md and the Makefile's demo targets: each is found in the
documents (code blocks and `inline code`), run with `--print-config` through the entry point it names, and its
overrides must appear in the printed config. Every block marked runnable (`<!-- runnable -->`: the README's quick
starts, the guides' examples) is run, in a subprocess. A newly documented command or block is covered without editing
this file. This process runs no training (--print-config returns before the trainer builds anything; blocks run in
subprocesses)."""
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


# ---- Runnable blocks ------------------------------------------------------------------------------------------------
# A fenced block right after `<!-- runnable -->` claims to run as written (docs/development.md, "Code blocks in the
# docs"); these tests run it. The blocks of one document share a scratch directory and run in document order (the
# README's RL quick start starts from its SFT quick start's export). The scratch directory holds what a reader brings:
# `configs/` (the checkout's), and `my-checkpoint`, a tiny HF checkpoint standing in for theirs. The trainer commands
# of a shell block get SHORTEN_* appended (later overrides win), so a run takes seconds; everything else runs as
# written. `<!-- runnable: tests/x.py -->` names the test that runs the block instead (and checks more).
RUNNABLE = re.compile(r"^<!-- runnable(?::\s*(\S+))?\s*-->\n```(\w+)\n(.*?)^```", re.M | re.S)
SHORTEN_SFT = ("--steps 2 --devices 2 --data.max_length 64 --engine.length_buckets 32 "
               "--data.sequences_per_minibatch 4 --attention_block_size 16 --save_every 0 --no-progress")
SHORTEN_RL = ("--steps 1 --devices 2 --prompts_per_step 2 --group_size 2 --max_new_tokens 4 --token_cap 64 "
              "--prompt_bucket 8 --updates_per_step 1 --eval_every 0 --attention_block_size 16 --save_every 0 "
              "--no-progress")
STAND_IN_CHECKPOINT = """
import sys
from flax import nnx
from jodc.models import Decoder, DecoderConfig, byte_level_tokenizer, save_pretrained, save_tokenizer
tokenizer = byte_level_tokenizer()
config = DecoderConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2)
save_pretrained(Decoder(config, rngs=nnx.Rngs(0)), sys.argv[1])
save_tokenizer(tokenizer, sys.argv[1])
"""


def _documents() -> list[str]:
    """README.md and every Markdown file under docs/, relative to the checkout."""
    out = ["README.md"]
    for folder, _, names in sorted(os.walk(os.path.join(ROOT, "docs"))):
        out += sorted(os.path.relpath(os.path.join(folder, n), ROOT) for n in names if n.endswith(".md"))
    return out


def runnable_blocks() -> list[tuple[str, int, str | None, str, str]]:
    """(document, block number, the test named to run it or None, language, code) of every runnable block."""
    out = []
    for doc in _documents():
        with open(os.path.join(ROOT, doc)) as f:
            for i, m in enumerate(RUNNABLE.finditer(f.read())):
                out.append((doc, i, m.group(1), m.group(2), m.group(3)))
    return out


BLOCKS = runnable_blocks()
OWN_BLOCKS = [b for b in BLOCKS if b[2] is None]


def test_the_quick_starts_and_guides_hold_runnable_blocks():
    where = {doc for doc, *_ in BLOCKS}
    assert sum(doc == "README.md" for doc, *_ in OWN_BLOCKS) == 3  # the three quick starts
    assert {"docs/ops.md", "docs/engines.md"} <= where
    assert all(lang in ("bash", "python") for *_, lang, _ in BLOCKS)


@pytest.mark.parametrize("doc, index, test_file, lang, code", [b for b in BLOCKS if b[2] is not None],
                         ids=[f"{b[0]}#{b[1]}" for b in BLOCKS if b[2] is not None])
def test_a_block_run_elsewhere_names_a_test_that_reads_it(doc, index, test_file, lang, code):
    path = os.path.join(ROOT, test_file)
    assert os.path.isfile(path), f"{doc}: block {index} names {test_file}, which does not exist"
    with open(path) as f:
        assert doc in f.read(), f"{test_file} does not read {doc}, whose block {index} it is said to run"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One scratch directory per document (blocks of a document build on each other), with the checkout's configs/
    and the stand-in HF checkpoint made on first use."""
    made = {}

    def get(doc):
        if doc not in made:
            d = tmp_path_factory.mktemp(doc.replace("/", "_").replace(".", "_"))
            os.symlink(os.path.join(ROOT, "configs"), d / "configs")
            made[doc] = d
        return made[doc]
    return get


def _environment() -> dict:
    """The test interpreter's environment with 8 simulated CPU devices and its venv's scripts (jodc-train) first on
    PATH."""
    import sys

    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _shortened(code: str) -> str:
    """A shell block with SHORTEN_* appended to each of its trainer commands (a line's end, or before its comment)."""
    lines = []
    for line in code.splitlines():
        m = re.match(r"^\s*(?:jodc-train|python -m jodc\.train) (sft|rl)\b", line)
        if m:
            command, _, comment = line.partition("  #")
            line = f"{command.rstrip()} {SHORTEN_SFT if m.group(1) == 'sft' else SHORTEN_RL}"
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("doc, index, test_file, lang, code", OWN_BLOCKS, ids=[f"{b[0]}#{b[1]}" for b in OWN_BLOCKS])
def test_runnable_block_runs_as_written(doc, index, test_file, lang, code, scratch):
    import subprocess
    import sys

    cwd, env = scratch(doc), _environment()
    if lang == "bash":
        if "my-checkpoint" in code and not (cwd / "my-checkpoint").exists():
            subprocess.run([sys.executable, "-c", STAND_IN_CHECKPOINT, str(cwd / "my-checkpoint")], cwd=cwd, env=env,
                           check=True, capture_output=True, timeout=120)
        argv = ["bash", "-euo", "pipefail", "-c", _shortened(code)]
    else:
        argv = [sys.executable, "-c", code]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (f"{doc}: runnable block {index} failed ({done.returncode}):\n{code}\n"
                                  f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-6000:]}")


# ---- The documents' shape (issue 46) --------------------------------------------------------------------------------
HISTORY_HEADING = re.compile(r"^#+ .*\b(earlier|previous|before|rerun|re-run|used to)\b", re.I | re.M)


def test_the_readme_is_a_landing_page():
    """At most 200 lines, and a reader meets the quick start for their own checkpoint and data in its first screen."""
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    first_screen = "\n".join(lines[:45])
    assert "## Quick start: SFT of your Hugging Face checkpoint on your data" in first_screen
    assert "--model.hf_path" in "\n".join(lines[:60])


def test_guides_keep_no_section_about_earlier_settings():
    """History (earlier settings, previous defaults, reruns) lives in the dated records of docs/results/, not in a
    guide's headings."""
    for doc in _documents():
        if doc.startswith("docs/results/") or doc == "README.md":
            continue
        with open(os.path.join(ROOT, doc)) as f:
            prose = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)  # headings, not code comments
        found = HISTORY_HEADING.findall(prose)
        assert not found, f"{doc} has a section about {found}: move it to docs/results/"


def test_every_guide_is_in_the_site_navigation():
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        nav = f.read().split("\nnav:", 1)[1]
    for doc in _documents():
        if doc != "README.md":
            assert re.search(rf"\b{re.escape(doc[len('docs/'):])}\b", nav), f"{doc} is not in mkdocs.yml's nav"
