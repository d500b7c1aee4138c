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


def on_files(files, config):
    """README.md becomes the home page (docs/ has no index.md of its own)."""
    if files.get_file_from_path("index.md") is None:
        files.append(File.generated(config, "index.md", content=_readme_markdown()))
    return files


def _rewrite(markdown: str, page_dir: str, files, config) -> str:
    """Links of a page whose source lies in `page_dir` (a folder of the repository, relative to its root)."""
    docs_dir = os.path.relpath(config["docs_dir"], ROOT)
    site_dir_of_page = posixpath.relpath(page_dir, docs_dir)  # the page's folder inside the site

    def repl(m: re.Match) -> str:
        head, target, tail = m.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)
        path, hash_, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(page_dir, path))
        if repo_path == "README.md":  # the home page
            new = posixpath.relpath("index.md", site_dir_of_page)
        elif repo_path == docs_dir or repo_path.startswith(docs_dir + "/"):
            new = posixpath.relpath(posixpath.relpath(repo_path, docs_dir), site_dir_of_page)
        elif os.path.isfile(os.path.join(ROOT, repo_path)):
            served = posixpath.join(REPO_PREFIX, repo_path)
            if files.get_file_from_path(served) is None:
                files.append(File(repo_path, src_dir=ROOT, dest_dir=os.path.join(config["site_dir"], REPO_PREFIX),
                                  use_directory_urls=False, inclusion=InclusionLevel.NOT_IN_NAV))
            new = posixpath.relpath(served, site_dir_of_page)
        else:
            return m.group(0)  # mkdocs reports it
        return f"{head}{new}{hash_}{anchor}{tail}"

    return LINK.sub(repl, markdown)


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    page_dir = "." if src == "index.md" and page.file.generated_by else posixpath.dirname(
        posixpath.join(os.path.relpath(config["docs_dir"], ROOT), src))
    return _rewrite(markdown, page_dir, files, config)
