"""The shape of the code, checked on every run: imports go down the layers, no cycles, no private
names imported across modules, no module past the size where it is two ideas.

Every import counts, function-level ones included (a cycle hidden inside a
function is still a cycle).  The rules are docs/architecture.md's ("The direction of imports"):

    cli -> checkpoint.offline | checkpoint.training -> checkpoint.formats -> checkpoint.state
        -> checkpoint.geometry | checkpoint.io -> wire
    data -> wire
    integrations -> checkpoint | runtime | data   (nothing imports integrations)

``shardkit.checkpoint`` never imports the sharding runtime, and the wire imports nothing of shardkit but
the errors.  Names and the map are checked beside this file: test_names.py (format names, private
attributes, private names in tests) and test_map.py (the doc's tree, the paths docstrings name).
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600   # past this a module is two ideas: the check fails
WARN_LINES = 400  # past this it is worth a look: the check warns, so nothing is squeezed to fit the limit

# layer of each checkpoint folder: a module may import its own layer or lower ones, never higher
LAYERS = {
    "shardkit.checkpoint.geometry": 0,
    "shardkit.checkpoint.io": 0,
    "shardkit.checkpoint.state": 1,
    "shardkit.checkpoint.formats": 2,
    "shardkit.checkpoint.training": 3,
    "shardkit.checkpoint.offline": 3,
}
# folders of one layer that must not lean on each other
INDEPENDENT = [("shardkit.checkpoint.geometry", "shardkit.checkpoint.io"),
               ("shardkit.checkpoint.training", "shardkit.checkpoint.offline")]
FORBIDDEN = [("shardkit.checkpoint", "shardkit.runtime"), ("shardkit.checkpoint", "shardkit.fsdp1"),
             ("shardkit.checkpoint", "shardkit.cli"), ("shardkit.data", "shardkit.checkpoint"),
             ("shardkit.data", "shardkit.runtime"),
             # the framework integrations sit on top of the public API: nothing below imports them
             ("shardkit.checkpoint", "shardkit.integrations"), ("shardkit.runtime", "shardkit.integrations"),
             ("shardkit.data", "shardkit.integrations"), ("shardkit.fsdp1", "shardkit.integrations"),
             ("shardkit.cli", "shardkit.integrations")]
# a folder reached from outside its parent only through its package: the names its __init__ gives
FACADES = {"shardkit.checkpoint.formats.native": "shardkit.checkpoint.formats"}
# shardkit.wire sits below data/ and checkpoint/ (both may import it): of shardkit it imports itself and the errors
WIRE_MAY_IMPORT = ("shardkit.wire", "shardkit.errors")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for the package (``cli/`` is installed as ``shardkit.cli``)."""
    found = {}
    for base, prefix in ((root / "shardkit", "shardkit"), (root / "cli", "shardkit.cli")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [alias.name for alias in node.names]
            sub = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in modules]
            out.append((node.module, [n for n in names if f"{node.module}.{n}" not in modules], node.lineno))
            out += [(s, [], node.lineno) for s in sub]
    return [(m, names, line) for m, names, line in out if m.split(".")[0] == "shardkit" and m != name]


def graph(modules: dict[str, Path]) -> dict[str, list[tuple[str, list[str], int]]]:
    return {name: [(m, n, line) for m, n, line in imports_of(name, path, modules) if m in modules]
            for name, path in modules.items()}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str) -> tuple[str, int] | None:
    for package, level in LAYERS.items():
        if _under(module, package):
            return package, level
    return None


def layer_violations(edges: dict[str, list[tuple[str, list[str], int]]]) -> list[str]:
    found = []
    for src, targets in edges.items():
        for dst, _, line in targets:
            a, b = _layer(src), _layer(dst)
            if a and b and b[1] > a[1]:
                found.append(f"{src}:{line} imports {dst}, a higher layer ({b[0]} over {a[0]})")
            for x, y in INDEPENDENT:
                if (_under(src, x) and _under(dst, y)) or (_under(src, y) and _under(dst, x)):
                    found.append(f"{src}:{line} imports {dst}: {x} and {y} are independent")
            for x, y in FORBIDDEN:
                if _under(src, x) and _under(dst, y):
                    found.append(f"{src}:{line} imports {dst}: {x} never imports {y}")
    return found


def wire_violations(edges: dict[str, list[tuple[str, list[str], int]]]) -> list[str]:
    return [f"{src}:{line} imports {dst}: shardkit.wire imports only {' and '.join(WIRE_MAY_IMPORT)}"
            for src, targets in edges.items() if _under(src, "shardkit.wire") for dst, _, line in targets
            if not any(_under(dst, allowed) for allowed in WIRE_MAY_IMPORT)]


def facade_violations(edges: dict[str, list[tuple[str, list[str], int]]]) -> list[str]:
    """Imports of a module behind a facade (``formats/native/*``) from outside the facade's parent."""
    return [f"{src}:{line} imports {dst}: outside {parent}, use {package} (its __init__)"
            for package, parent in FACADES.items() for src, targets in edges.items() if not _under(src, parent)
            for dst, _, line in targets if dst != package and _under(dst, package)]


def cycles(edges: dict[str, list[tuple[str, list[str], int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _, _ in edges.get(v, ()):
            if _is_package_of(w, v):
                continue  # importing a submodule runs its package's __init__, which is no cycle of code
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _is_package_of(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def private_imports(edges: dict[str, list[tuple[str, list[str], int]]]) -> list[str]:
    return [f"{src}:{line} takes {n} from {dst}" for src, targets in edges.items() for dst, names, line in targets
            for n in names if n.startswith("_") and not n.startswith("__")]


def oversized(modules: dict[str, Path], root: Path = ROOT, limit: int = MAX_LINES) -> list[str]:
    return [f"{path.relative_to(root)}: {n} lines" for path in modules.values()
            if (n := len(path.read_text().splitlines())) > limit]


@pytest.fixture(scope="module")
def edges():
    return graph(module_files())


def test_imports_go_down_the_layers(edges):
    assert layer_violations(edges) == []


def test_the_wire_imports_nothing_of_shardkit_but_the_errors(edges):
    assert wire_violations(edges) == []


def test_the_native_format_is_reached_only_through_its_package(edges):
    assert facade_violations(edges) == []


def test_no_module_imports_itself_back_through_others(edges):
    assert cycles(edges) == []


def test_no_private_name_is_used_outside_its_module(edges):
    assert private_imports(edges) == []


def test_no_module_grows_past_the_size_of_one_idea():
    large = oversized(module_files(), limit=WARN_LINES)
    if large:
        warnings.warn(f"modules over {WARN_LINES} lines (the limit is {MAX_LINES}): " + "; ".join(large), stacklevel=1)
    assert oversized(module_files()) == []


def test_each_check_fails_on_a_planted_violation(tmp_path):
    pkg = tmp_path / "shardkit"
    for folder in ("checkpoint/io", "checkpoint/formats", "runtime"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "checkpoint" / "__init__.py").write_text("")
    (pkg / "checkpoint" / "io" / "storage.py").write_text(
        "from shardkit.checkpoint.formats.codec import _crc\n")                     # upward, private
    (pkg / "checkpoint" / "formats" / "codec.py").write_text(
        "def f():\n    import shardkit.checkpoint.formats.reader\n    import shardkit.runtime\n")
    (pkg / "checkpoint" / "formats" / "reader.py").write_text(
        "import shardkit.checkpoint.formats.codec\n" + "x = 1\n" * (MAX_LINES + 1))  # cycle, size
    (pkg / "checkpoint" / "formats" / "base.py").write_text("x = 1\n" * (WARN_LINES + 1))  # only worth a look
    (tmp_path / "cli").mkdir()
    planted = module_files(tmp_path)
    planted_edges = graph(planted)
    assert any("a higher layer" in v for v in layer_violations(planted_edges))
    assert any("never imports shardkit.runtime" in v for v in layer_violations(planted_edges))
    assert cycles(planted_edges) == [["shardkit.checkpoint.formats.codec", "shardkit.checkpoint.formats.reader"]]
    assert private_imports(planted_edges) == [
        "shardkit.checkpoint.io.storage:1 takes _crc from shardkit.checkpoint.formats.codec"]
    assert oversized(planted, tmp_path) == [f"shardkit/checkpoint/formats/reader.py: {MAX_LINES + 2} lines"]
    assert sorted(oversized(planted, tmp_path, limit=WARN_LINES)) == [
        f"shardkit/checkpoint/formats/base.py: {WARN_LINES + 1} lines",
        f"shardkit/checkpoint/formats/reader.py: {MAX_LINES + 2} lines"]


def test_the_facade_check_fails_on_a_planted_violation(tmp_path):
    pkg = tmp_path / "shardkit"
    for folder in ("checkpoint/formats/native", "checkpoint/training"):
        (pkg / folder).mkdir(parents=True)
    for init in ("", "checkpoint/", "checkpoint/formats/", "checkpoint/formats/native/", "checkpoint/training/"):
        (pkg / f"{init}__init__.py").write_text("")
    (pkg / "checkpoint" / "formats" / "native" / "writer.py").write_text("X = 1\n")
    (pkg / "checkpoint" / "formats" / "registry.py").write_text(
        "from shardkit.checkpoint.formats.native import writer\n")
    (pkg / "checkpoint" / "training" / "save.py").write_text(
        "from shardkit.checkpoint.formats.native import X\nfrom shardkit.checkpoint.formats.native.writer import X\n")
    (tmp_path / "cli").mkdir()
    assert facade_violations(graph(module_files(tmp_path))) == [
        "shardkit.checkpoint.training.save:2 imports shardkit.checkpoint.formats.native.writer: outside "
        "shardkit.checkpoint.formats, use shardkit.checkpoint.formats.native (its __init__)"]


def test_the_wire_check_fails_on_a_planted_violation(tmp_path):
    pkg = tmp_path / "shardkit"
    (pkg / "wire").mkdir(parents=True)
    (pkg / "data").mkdir()
    for init in ("__init__.py", "wire/__init__.py", "data/__init__.py", "errors.py"):
        (pkg / init).write_text("")
    (pkg / "wire" / "fqn.py").write_text("import shardkit.errors\nimport shardkit.wire\n")
    (pkg / "wire" / "rng_keys.py").write_text("def f():\n    from shardkit.data.rng import capture\n")
    (pkg / "data" / "rng.py").write_text("import shardkit.wire.rng_keys\n")
    (tmp_path / "cli").mkdir()
    assert wire_violations(graph(module_files(tmp_path))) == [
        "shardkit.wire.rng_keys:2 imports shardkit.data.rng: shardkit.wire imports only shardkit.wire and "
        "shardkit.errors"]
