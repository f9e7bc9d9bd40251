"""What a migration loads before torch: the command's front (argument parsing, the head start, its block cache,
the uploads) imports without torch, so the source's first blocks are on their way while torch loads; and the
native format's writer side (the writer, the resumable plan) asks for torch only where a tensor is made, one
step towards a reshard between native checkpoints that never imports it (issue 40's migration target)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# loaded by ``shardkit reshard/convert`` before the engine, i.e. before torch (cli/main.py: start_head)
FRONT = ("shardkit.cli.main", "shardkit.cli.render", "shardkit.checkpoint.io.head_start",
         "shardkit.checkpoint.io.read_cache", "shardkit.checkpoint.io.uploads", "shardkit.checkpoint.io.remote",
         "shardkit.checkpoint.offline.options")
# their own imports name torch only for type checking (the packages above them still import it)
WRITER_SIDE = ("shardkit/checkpoint/formats/native/writer.py", "shardkit/checkpoint/formats/native/resumable.py")


def _import_without_torch(modules: tuple[str, ...]) -> subprocess.CompletedProcess:
    code = "import sys\nsys.modules['torch'] = None\n" + "".join(f"import {m}\n" for m in modules)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_commands_front_and_the_head_start_import_without_torch():
    done = _import_without_torch(FRONT)
    assert done.returncode == 0, done.stderr[-2000:]


def _top_level_torch_imports(tree: ast.Module) -> list[int]:
    """Lines of ``import torch``/``from torch ...`` at module level, outside ``if TYPE_CHECKING:``."""
    lines = []
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        for sub in ast.walk(node):
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            if isinstance(sub, ast.Import) and any(a.name.split(".")[0] == "torch" for a in sub.names):
                lines.append(sub.lineno)
            if isinstance(sub, ast.ImportFrom) and (sub.module or "").split(".")[0] == "torch":
                lines.append(sub.lineno)
    return lines


def test_the_native_writer_side_imports_torch_only_where_a_tensor_is_made():
    for path in WRITER_SIDE:
        tree = ast.parse((ROOT / path).read_text())
        assert _top_level_torch_imports(tree) == [], f"{path} imports torch at module level"


def test_the_check_sees_a_module_level_torch_import():
    assert _top_level_torch_imports(ast.parse("import os\nimport torch\n")) == [2]
    assert _top_level_torch_imports(ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    import torch\ndef f():\n    import torch\n")) == []


# what a byte passthrough between native checkpoints reuses: the manifest, the headers, the journal, the writer,
# the resumable plan and Storage, each loaded through its packages (whose __init__s serve their names on first use)
PASSTHROUGH = ("shardkit.checkpoint.formats.native.manifest_parse", "shardkit.checkpoint.formats.native.headers",
               "shardkit.checkpoint.formats.native.journal", "shardkit.checkpoint.formats.native.writer",
               "shardkit.checkpoint.formats.native.resumable", "shardkit.checkpoint.formats.crc32c",
               "shardkit.checkpoint.formats.dtypes", "shardkit.checkpoint.io.storage")


def test_the_native_writer_side_and_storage_load_without_torch():
    done = _import_without_torch(PASSTHROUGH)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_packages_still_serve_their_names():
    from shardkit.checkpoint import formats
    from shardkit.checkpoint.formats import native
    from shardkit.checkpoint.formats.native.facade import NativeWriter
    from shardkit.checkpoint.formats.registry import FORMATS

    assert formats.FORMATS is FORMATS and native.NativeWriter is NativeWriter
    assert formats.NATIVE is native.NATIVE is FORMATS[native.NATIVE.name]
    from shardkit.checkpoint.formats import registry
    from shardkit.checkpoint.formats.native import facade

    # each package serves exactly what its module exports: the two lists cannot drift apart
    assert sorted(formats.__all__) == sorted(registry.__all__)
    assert sorted(native.__all__) == sorted(facade.__all__)


# a DST's check (is a checkpoint there, of which format, what is foreign) and a source's identity (the file that
# pins its content) ask the registry for names, markers and file patterns: the handlers import their reader and
# writer modules on first use, so the registry loads no reader and no torch
REGISTRY_USERS = ("shardkit.checkpoint.formats.registry", "shardkit.checkpoint.offline.replace",
                  "shardkit.checkpoint.offline.source")


def test_the_registry_and_a_dsts_check_load_without_torch():
    done = _import_without_torch(REGISTRY_USERS + (
        "shardkit.checkpoint.formats.native.chunk_reads",))
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_handler_imports_its_modules_on_first_use():
    from shardkit.checkpoint.formats.dcp import reader as dcp_reader
    from shardkit.checkpoint.formats.native import writer as native_writer
    from shardkit.checkpoint.formats.registry import FORMATS

    assert FORMATS["dcp"].reader is dcp_reader and FORMATS["shardkit"].writer is native_writer
    assert FORMATS["deepspeed"].writer is None
    assert all(isinstance(h.reader_module, str) for h in FORMATS.values())
