"""mkdocs hooks for jodc's docs site (`make docs`, mkdocs.yml).

- The site's home page is README.md itself (one landing page, not two that drift apart): it is added as a generated
  `index.md`, its links into docs/ made site-relative.
- A relative link from a page to a file of the repository outside docs/ (a results file under bench/results/, a
  config under configs/, a test) is rewritten to a copy of that file served under `repo/` in the site, so the link
  works in the site as it does on the repository's web view. A link to a file that does not exist is left as it is,
  and mkdocs' own check reports it (`mkdocs build --strict` fails).
- The API reference reads the package statically (griffe, no JAX import). The distribution maps three folders to
  one namespace (`jodc`, `models/` -> `jodc.models`, `train/` -> `jodc.train`: pyproject.toml's
  `[tool.setuptools.package-dir]`); `build/docs-api/jodc` is a tree of symbolic links that lays them out as the
  installed package, and mkdocstrings' search path points there (mkdocs.yml).
"""
from __future__ import annotations

import os
import posixpath
import re

from mkdocs.structure.files import File, InclusionLevel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_TREE = os.path.join(ROOT, "build", "docs-api")
#: Folders installed under another name (pyproject.toml's package-dir): folder -> name inside `jodc`.
MAPPED_PACKAGES = {"models": "models", "train": "train"}
REPO_PREFIX = "repo"
#: [text](target) and ![alt](target); the target up to a space, ')' or a title.
LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")


def _api_tree() -> None:
    """build/docs-api/jodc: links to every entry of jodc/, plus models/ and train/ under their installed names."""
    pkg = os.path.join(API_TREE, "jodc")
    os.makedirs(pkg, exist_ok=True)
    wanted = {name: os.path.join(ROOT, "jodc", name) for name in os.listdir(os.path.join(ROOT, "jodc"))
              if name != "__pycache__" and not name.endswith(".so")}
    wanted.update({name: os.path.join(ROOT, folder) for folder, name in MAPPED_PACKAGES.items()})
    for name in os.listdir(pkg):
        if name not in wanted or os.readlink(os.path.join(pkg, name)) != wanted[name]:
            os.remove(os.path.join(pkg, name))
    for name, target in wanted.items():
        if not os.path.lexists(os.path.join(pkg, name)):
            os.symlink(target, os.path.join(pkg, name))


def on_config(config):
    _api_tree()
    return config


def _readme_markdown() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def _sources(config) -> list[tuple[str, str]]:
    """(the page's path in the site, its Markdown file in the repository) of every page: README.md as index.md."""
    docs_dir = config["docs_dir"]
    out = [("index.md", os.path.join(ROOT, "README.md"))]
    for folder, _, names in os.walk(docs_dir):
        for name in names:
            if name.endswith(".md"):
                path = os.path.join(folder, name)
                out.append((os.path.relpath(path, docs_dir).replace(os.sep, "/"), path))
    return out


def _target(site_page: str, source: str, target: str, config) -> tuple[str, str | None] | None:
    """Where a relative link of a page goes in the site: (the link to write, the repository file to serve under
    repo/ or None); None for a link left as it is (external, an anchor on the page, or a file that does not
    exist: mkdocs reports the last)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.partition("#")[0]
    repo_path = os.path.relpath(os.path.normpath(os.path.join(os.path.dirname(source), path)), ROOT)
    repo_path = repo_path.replace(os.sep, "/")
    docs_dir = os.path.relpath(config["docs_dir"], ROOT).replace(os.sep, "/")
    page_dir = posixpath.dirname(site_page)
    if repo_path == "README.md":
        site_path, served = "index.md", None
    elif repo_path.startswith(docs_dir + "/"):
        site_path, served = posixpath.relpath(repo_path, docs_dir), None
    elif not repo_path.startswith("..") and os.path.isfile(os.path.join(ROOT, repo_path)):
        site_path, served = posixpath.join(REPO_PREFIX, repo_path), repo_path
    else:
        return None
    return posixpath.relpath(site_path, page_dir or "."), served


def on_files(files, config):
    """README.md becomes the home page (docs/ has no index.md of its own), and every repository file outside docs/
    that a page links to is served under repo/."""
    if files.get_file_from_path("index.md") is None:
        files.append(File.generated(config, "index.md", content=_readme_markdown()))
    for site_page, source in _sources(config):
        with open(source, encoding="utf-8") as f:
            text = f.read()
        for m in LINK.finditer(text):
            found = _target(site_page, source, m.group(2), config)
            if found and found[1] and files.get_file_from_path(posixpath.join(REPO_PREFIX, found[1])) is None:
                files.append(File.generated(config, posixpath.join(REPO_PREFIX, found[1]),
                                            abs_src_path=os.path.join(ROOT, found[1]),
                                            inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown, page, config, files):
    site_page = page.file.src_uri
    source = os.path.join(ROOT, "README.md") if site_page == "index.md" else os.path.join(config["docs_dir"],
                                                                                         site_page)

    def repl(m: re.Match) -> str:
        head, target, tail = m.groups()
        found = _target(site_page, source, target, config)
        if found is None:
            return m.group(0)
        hash_, anchor = target.partition("#")[1:]
        return f"{head}{found[0]}{hash_}{anchor}{tail}"

    return LINK.sub(repl, markdown)


if __name__ == "__main__":  # `make docs` lays the tree out before mkdocs starts: mkdocstrings drops a search path
    _api_tree()  # that does not exist yet when it reads its config, which is before on_config runs
