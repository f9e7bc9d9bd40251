"""The public surface resolves lazily, through one helper (shardkit/lazy.py).

``import shardkit`` must stay cheap (no runtime, no checkpoint half until a name
of theirs is used), every public name must still resolve, and every package
``__init__`` that re-exports lazily must do it through
:func:`shardkit.lazy.lazy_exports`, so names resolve one way everywhere.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_shardkit_loads_nothing_of_shardkit_but_the_lazy_helper():
    loaded = _run("import sys, shardkit; print(' '.join(m for m in sys.modules if m.startswith('shardkit')))")
    assert set(loaded.split()) <= {"shardkit", "shardkit.lazy"}


def test_every_public_name_and_submodule_of_shardkit_resolves_and_is_listed():
    out = _run(
        "import shardkit\n"
        "missing = [n for n in shardkit.__all__ if getattr(shardkit, n, None) is None]\n"
        "unlisted = sorted(set(shardkit.__all__) - set(dir(shardkit)))\n"
        "print(missing, unlisted, shardkit.checkpoint.__name__, shardkit.fully_shard.__module__)\n"
        "try:\n"
        "    shardkit.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n")
    assert out.splitlines() == ["[] [] shardkit.checkpoint shardkit.runtime.fully_shard",
                                "module 'shardkit' has no attribute 'no_such_name'"]


def test_every_package_that_resolves_names_lazily_does_it_through_lazy_exports():
    own_ways = []
    for init in sorted((ROOT / "shardkit").rglob("__init__.py")):
        tree = ast.parse(init.read_text())
        imports_importlib = any(isinstance(n, ast.Import) and any(a.name == "importlib" for a in n.names)
                                or isinstance(n, ast.ImportFrom) and n.module == "importlib" for n in ast.walk(tree))
        resolves = any(isinstance(n, (ast.FunctionDef, ast.Assign)) and "__getattr__" in ast.unparse(n).split("=")[0]
                       for n in tree.body)
        uses_helper = "lazy_exports(" in init.read_text()
        if imports_importlib or (resolves and not uses_helper):
            own_ways.append(init.relative_to(ROOT).as_posix())
    assert own_ways == []
