"""The map agrees with the territory, checked on every run: docs/architecture.md's tree names every module and
nothing that is gone, and the docstrings and comments of shardkit/ name only modules and files that exist.

The tree is the fenced block under ``## The tree``.  Each line is indented two spaces per folder level, starts
with one or more names (``folder/`` or ``file.py``, separated by spaces) and then, after at least two spaces, what
they are; a line that starts with anything else continues the description above it.  A ``folder/`` line is the
parent of the lines indented below it, and stands for the folder's ``__init__.py``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from tests.project.test_architecture import ROOT, module_files

DOC = "docs/architecture.md"
TREE_HEADING = "## The tree"
NAME = re.compile(r"^(?:[A-Za-z_][\w]*/|[A-Za-z_][\w.]*\.py)$")
DOTTED = re.compile(r"\bshardkit(?:\.[A-Za-z_]\w*)+")
FILE_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w-]+\.py)\b")
RELATIVE = re.compile(r":(?:mod|func|class|meth|data|attr|exc):`~?(\.[A-Za-z_][\w.]*)`")  # :mod:`.sibling`
SEARCHED_FOR_FILES = ("shardkit", "cli", "tests", "benchmarks", "examples", "docs")


def tree_paths(doc_text: str) -> list[tuple[str, int]]:
    """(path relative to the repository root, line of the doc) for every name in the tree."""
    lines = doc_text.splitlines()
    start = lines.index(TREE_HEADING)
    fence = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    parents: list[str] = []
    found = []
    for number in range(fence + 1, len(lines)):
        line = lines[number]
        if line.startswith("```"):
            break
        depth = (len(line) - len(line.lstrip(" "))) // 2
        names = []
        for token in line.split():
            if not NAME.match(token):
                break
            names.append(token)
        if not names or depth > len(parents):
            continue  # a description's next line
        parents = parents[:depth]
        for name in names:
            found.append(("/".join([*parents, name]).rstrip("/"), number + 1))
        folders = [name for name in names if name.endswith("/")]
        if folders:
            parents.append(folders[-1].rstrip("/"))
    return found


def map_violations(root: Path = ROOT) -> list[str]:
    """Modules the tree leaves out, and paths it names that do not exist."""
    named = tree_paths((root / DOC).read_text())
    found = [f"{DOC}:{line}: names {path}, which does not exist: fix the tree to the code"
             for path, line in named if not (root / path).exists()]
    listed = {path for path, _ in named}
    for path in module_files(root).values():
        relative = path.relative_to(root).as_posix()
        shown = relative[:-len("/__init__.py")] if relative.endswith("/__init__.py") else relative
        if shown not in listed:
            found.append(f"{relative}:1: is in no line of {DOC}'s tree: add it under its folder, with its job")
    return found


def _docstrings_and_comments(source: str, where: str) -> list[tuple[str, int]]:
    """(text, first line) of every docstring and comment of a module."""
    texts = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                texts.append((doc, node.body[0].lineno))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            texts.append((token.string, token.start[0]))
    return texts


def _names_defined_by(path: Path) -> set[str]:
    """What ``module.name`` may name: top-level definitions, imports, ``__all__`` and lazy-export keys."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            value = node.value
            if isinstance(value, ast.Dict):
                names.update(k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
            elif isinstance(value, (ast.List, ast.Tuple)):
                names.update(e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return names


def _existing_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for folder in SEARCHED_FOR_FILES for p in (root / folder).rglob("*.py")}


def stale_references(root: Path = ROOT) -> list[str]:
    """Dotted ``shardkit.`` paths and ``folder/file.py`` paths in shardkit/'s docstrings and comments that name
    nothing: a module that moved, or a name its module no longer has."""
    modules = module_files(root)
    files = _existing_files(root)
    found = []
    for path in (p for p in modules.values() if p.is_relative_to(root / "shardkit")):
        where = path.relative_to(root).as_posix()
        for text, first in _docstrings_and_comments(path.read_text(), where):
            for offset, line in enumerate(text.splitlines()):
                for dotted in DOTTED.findall(line):
                    if not _names_something(dotted.rstrip("."), modules):
                        found.append(f"{where}:{first + offset}: names {dotted}, which does not exist: "
                                     "name the module or function where it is now")
                for relative in RELATIVE.findall(line):
                    if not _names_something_near(relative, path, modules):
                        found.append(f"{where}:{first + offset}: names {relative}, which its package does not "
                                     "hold: name the module or function where it is now")
                for file in FILE_PATH.findall(line):
                    if file not in files and not any(f.endswith("/" + file) for f in files):
                        found.append(f"{where}:{first + offset}: names {file}, which does not exist: "
                                     "name the file where it is now")
    return sorted(found, key=lambda entry: (entry.split(":")[0], int(entry.split(":")[1])))


def _names_something_near(relative: str, path: Path, modules: dict[str, Path]) -> bool:
    """Whether ``.x.y`` names something from module ``path``: a module of its package (and a name in it), or a
    name its package's ``__init__`` or the module itself defines (Sphinx's relative lookups)."""
    name = next(n for n, p in modules.items() if p == path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    first = relative[1:].split(".")[0]
    return (_names_something(f"{package}{relative}", modules) or first in _names_defined_by(path)
            or (package in modules and first in _names_defined_by(modules[package])))


def _names_something(dotted: str, modules: dict[str, Path]) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in modules:
            return cut == len(parts) or parts[cut] in _names_defined_by(modules[module])
    return False


def test_the_architecture_tree_names_every_module_and_nothing_that_is_gone():
    found = map_violations()
    assert found == [], "\n" + "\n".join(found)


def test_docstrings_and_comments_name_only_modules_and_files_that_exist():
    found = stale_references()
    assert found == [], "\n" + "\n".join(found)


def test_each_map_check_fails_on_a_planted_violation(tmp_path):
    for folder in ("shardkit/checkpoint/io", "cli", "docs", "tests"):
        (tmp_path / folder).mkdir(parents=True)
    for module in ("shardkit/__init__.py", "shardkit/checkpoint/__init__.py", "shardkit/checkpoint/io/__init__.py",
                   "shardkit/checkpoint/io/names.py", "shardkit/checkpoint/io/rounds.py"):
        (tmp_path / module).write_text("")
    (tmp_path / "shardkit/checkpoint/io/storage.py").write_text(
        '"""Bytes out, as ``shardkit.checkpoint.io.names.check`` and io/files.py say."""\n'
        "def write():\n    pass  # shardkit.checkpoint.io.rounds, see io/names.py and shardkit.checkpoint.io.gone\n"
        "# as :mod:`.rounds` and :func:`~.names.gone` say, and :func:`write`; not :mod:`.moved`\n")
    (tmp_path / DOC).write_text(
        "# Architecture\n\n## The tree\n\n```\nshardkit/\n  __init__.py         the surface\n"
        "  checkpoint/         checkpoints\n    io/               the ways out\n"
        "      names.py  storage.py\n                        names.py continued\n"
        "      direct_io.py    O_DIRECT\ncli/                  the command\n```\n")
    assert map_violations(tmp_path) == [
        f"{DOC}:12: names shardkit/checkpoint/io/direct_io.py, which does not exist: fix the tree to the code",
        f"shardkit/checkpoint/io/rounds.py:1: is in no line of {DOC}'s tree: add it under its folder, with its job"]
    assert stale_references(tmp_path) == [
        "shardkit/checkpoint/io/storage.py:1: names shardkit.checkpoint.io.names.check, which does not exist: "
        "name the module or function where it is now",
        "shardkit/checkpoint/io/storage.py:1: names io/files.py, which does not exist: name the file where it is now",
        "shardkit/checkpoint/io/storage.py:3: names shardkit.checkpoint.io.gone, which does not exist: "
        "name the module or function where it is now",
        "shardkit/checkpoint/io/storage.py:4: names .names.gone, which its package does not hold: name the module "
        "or function where it is now",
        "shardkit/checkpoint/io/storage.py:4: names .moved, which its package does not hold: name the module or "
        "function where it is now"]
