"""Names that belong to one place, checked on every run: format names are the registry's, private names their
module's.

A format is named in ``shardkit/checkpoint/formats/`` only: everything else asks the registry
(``shardkit.checkpoint.formats.FORMATS``), so a new format touches its own folder and the registry and nothing
else.  A ``_name`` is a module's own: another module, or a test, that reaches for it is tied to code that may
change under it without notice (docs/architecture.md, "The direction of imports").  And the checkpoint code
leaves the process through ``io/`` only: an ``os``/``shutil``/``open`` call that touches a file outside
``shardkit/checkpoint/io/`` is one of the exceptions :data:`OUTSIDE_IO` names with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

from shardkit.checkpoint.formats import FORMATS
from tests.project.test_architecture import ROOT, module_files

# every spelling of a format a user may type, read from the registry
FORMAT_NAMES = frozenset(n for f in FORMATS.values() for n in (f.name, *f.aliases))
FORMATS_FOLDER = "shardkit/checkpoint/formats/"
# keywords whose value is a format name (a string there selects a format)
FORMAT_KEYWORDS = ("format", "to", "fmt")
# private attributes of objects shardkit does not own, each with the reason it is used
THIRD_PARTY_PRIVATE = {
    "_exit": "os._exit: the shardkit command leaves at once after Ctrl-C, without joining threads stuck in storage "
             "requests",
    "_register_atexit": "threading's exit hook, run before concurrent.futures stops its pools: shardkit's "
                        "background saves finish there",
    "_local_tensor": "DTensor's local shard, read without the autograd hop of to_local()",
    "_spec": "DTensor's placement spec (mesh, placements, tensor meta), which it has no public name for",
    "_parameters": "nn.Module's own parameter registry: swapping a parameter without a setattr hook",
    "_buffers": "nn.Module's own buffer registry, as for _parameters",
    "_register_state_dict_hook": "nn.Module's state-dict post-hook, as torch's FSDP1 registers it",
    "_IncompatibleKeys": "the named tuple nn.Module.load_state_dict returns, returned the same way",
    "_base": "a view's base tensor (torch.Tensor._base)",
    "_foreach_copy_": "torch's fused multi-tensor copy",
    "_foreach_norm": "torch's fused multi-tensor norm",
    "_foreach_mul_": "torch's fused multi-tensor scale",
    "_C": "torch._C, for the autograd engine's current graph task",
    "_current_graph_task_id": "torch._C's id of the running backward, to run a callback once per backward",
    "_execution_engine": "torch's autograd engine, to queue a callback at the end of backward",
    "_unsafe_preserve_version_counter": "torch.autograd's guard, as torch's fully_shard uses it",
    "_dynamo": "torch._dynamo, to keep the sharding hooks out of compiled graphs",
    "_orig_mod": "the module torch.compile's OptimizedModule wraps",
    "_get_backend": "a ProcessGroup's backend object, for its communication hooks",
    "_flatten": "DeviceMesh._flatten: the flattened sub-mesh torch's own parallelisms use",
    "_concatenate": "DeviceMesh._concatenate: joined sub-meshes, as torch's own parallelisms use",
    "_HYBRID_SHARD_ZERO2": "torch's ShardingStrategy member of that name, mapped as torch's FSDP1 maps it",
    "_getframe": "sys._getframe: the caller's frame, to tell who iterates the sampler",
    "_get_default_store": "torch.distributed's store of the default group, where ranks check in before a "
                          "checkpoint collective within a deadline (no public name gives it)",
}


# files of shardkit/checkpoint/ outside io/ that touch the filesystem themselves, each with its reason
# (docs/architecture.md, "io/"); everything else goes through Storage
OUTSIDE_IO = {
    "shardkit/checkpoint/training/async_save/host_buffers.py":
        "the staging buffer's shared-memory file (/dev/shm), which the writer process maps: memory, not storage",
    "shardkit/checkpoint/training/async_save/writer_process.py":
        "the writer process's end of the shared-memory buffer and its pipe to the training process",
    "shardkit/checkpoint/training/async_save/saver.py":
        "os.register_at_fork: a forked child forgets its parent's background saver",
    "shardkit/checkpoint/training/load.py": "/proc/meminfo: the host memory a load plans its buffers within",
    "shardkit/checkpoint/training/step_fallback.py":
        "whether the nearest existing parent of a missing root is writable, for the words of a warning",
    "shardkit/checkpoint/formats/torchsave/mapped.py":
        "torch.load(mmap=True) maps a local file by path: the temporary copy of a remote file it maps",
    "shardkit/checkpoint/formats/torchsave/state.py": "read_model_keys: a user's list of parameter names, by path",
}
# os and shutil functions that only compute with names, never touch a file
PURE_OS = {"path.join", "path.basename", "path.dirname", "path.abspath", "fspath", "environ.get", "path.expanduser",
           "path.splitext", "path.normpath", "path.relpath", "path.split", "getpid", "cpu_count"}


def file_calls_outside_io(root: Path = ROOT, allowed: dict[str, str] = OUTSIDE_IO) -> list[str]:
    """``os.*``/``shutil.*``/``open`` calls that touch files in shardkit/checkpoint/ outside io/ and the
    named exceptions."""
    found = []
    for path in sorted((root / "shardkit" / "checkpoint").rglob("*.py")):
        where = _relative(path, root)
        if where.startswith("shardkit/checkpoint/io/") or where in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), where)):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            if name == "open" or (name and name.split(".")[0] in ("os", "shutil")
                                  and name.split(".", 1)[-1] not in PURE_OS):
                found.append(f"{where}:{node.lineno}: {name}() outside shardkit/checkpoint/io/; go through "
                             "Storage (or add the file with its reason to OUTSIDE_IO)")
    return sorted(found, key=_by_file_and_line)


def _relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _strings(node: ast.AST | None) -> list[str]:
    """The string constants a node is, or holds as a tuple, list or set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def format_literals(root: Path = ROOT, names: frozenset[str] = FORMAT_NAMES) -> list[str]:
    """Format names used as values outside formats/: compared (``==``, ``!=``, ``in``), a dict key, or a
    ``format=``/``to=``/``fmt=`` argument.  Text for people (docstrings, f-strings, messages) is no choice of
    format and does not count."""
    found = []
    for path in module_files(root).values():
        where = _relative(path, root)
        if where.startswith(FORMATS_FOLDER):
            continue
        for node in ast.walk(ast.parse(path.read_text(), where)):
            if isinstance(node, ast.Compare):
                used = [s for n in (node.left, *node.comparators) for s in _strings(n)]
                how = "compared"
            elif isinstance(node, ast.Dict):
                used = [s for key in node.keys for s in _strings(key)]
                how = "a dict key"
            elif isinstance(node, ast.Call):
                used = [s for kw in node.keywords if kw.arg in FORMAT_KEYWORDS for s in _strings(kw.value)]
                how = "a format argument"
            else:
                continue
            named = sorted(set(used) & names)
            if named:
                found.append(f"{where}:{node.lineno}: format name {', '.join(map(repr, named))} {how} outside "
                             f"{FORMATS_FOLDER}; ask the registry (shardkit.checkpoint.formats) or the format's "
                             "handler instead")
    return sorted(found, key=_by_file_and_line)


def _by_file_and_line(entry: str) -> tuple[str, int]:
    file, line, _ = entry.split(":", 2)
    return file, int(line)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_here(tree: ast.AST) -> set[str]:
    """Every name a module defines: functions, methods, classes, assigned names and attributes, imports."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def private_attributes(root: Path = ROOT, allowed: dict[str, str] = THIRD_PARTY_PRIVATE) -> list[str]:
    """``x._name`` where the module does not define ``_name`` itself: a private name crossing modules."""
    found = []
    for path in module_files(root).values():
        where = _relative(path, root)
        tree = ast.parse(path.read_text(), where)
        own = _defined_here(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in own
                    and node.attr not in allowed):
                found.append(f"{where}:{node.lineno}: .{node.attr} is private to another module; give it a public "
                             "name in the module that owns it (or, for a third-party object, add it with its reason "
                             "to THIRD_PARTY_PRIVATE)")
    return sorted(found, key=_by_file_and_line)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


# private names that are torch's own (the drop-in surface spells them as torch does); a test may use them
TORCH_SPELLED = {
    "shardkit.wrap._or_policy": "torch.distributed.fsdp.wrap._or_policy, which FSDP1 code composes policies with",
}


def private_names_in_tests(root: Path = ROOT) -> list[str]:
    """A test that imports ``_x`` from shardkit, or reads ``module._x`` of a shardkit module."""
    modules = module_files(root)
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        where = _relative(path, root)
        tree = ast.parse(path.read_text(), where)
        bound: dict[str, str] = {}  # local name -> shardkit module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "shardkit":
                        bound[alias.asname or "shardkit"] = alias.name if alias.asname else "shardkit"
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shardkit":
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    elif _is_private(alias.name) and f"{node.module}.{alias.name}" not in TORCH_SPELLED:
                        found.append(f"{where}:{node.lineno}: imports {alias.name} from {node.module}; test the "
                                     "public behaviour, or give the name a public one in its module")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                base = _dotted(node.value)
                head, _, rest = (base or "").partition(".")
                module = ".".join(filter(None, [bound.get(head), rest])) if head in bound else None
                if module in modules and f"{module}.{node.attr}" not in TORCH_SPELLED:
                    found.append(f"{where}:{node.lineno}: uses {module}.{node.attr}; test the public behaviour, "
                                 "or give the name a public one in its module")
    return sorted(found, key=_by_file_and_line)


def test_no_format_is_named_outside_the_formats_folder():
    found = format_literals()
    assert found == [], "\n" + "\n".join(found)


def test_no_private_attribute_is_used_outside_its_module():
    found = private_attributes()
    assert found == [], "\n" + "\n".join(found)


def test_no_test_uses_a_private_name_of_shardkit():
    found = private_names_in_tests()
    assert found == [], "\n" + "\n".join(found)


def test_the_checkpoint_code_touches_files_through_io_only():
    found = file_calls_outside_io()
    assert found == [], "\n" + "\n".join(found)


def test_the_io_check_fails_on_a_planted_violation(tmp_path):
    hot = tmp_path / "shardkit" / "checkpoint" / "training" / "hot"
    io = tmp_path / "shardkit" / "checkpoint" / "io"
    for folder in (hot, io):
        folder.mkdir(parents=True)
    (hot / "local_keep.py").write_text("import os, shutil\n\ndef f(p):\n    os.path.join(p, 'x')\n"
                                      "    shutil.rmtree(p)\n    return open(os.path.join(p, 'y')).read()\n")
    (io / "local_disk.py").write_text("import os\nos.unlink('x')\n")
    assert file_calls_outside_io(tmp_path) == [
        f"shardkit/checkpoint/training/hot/local_keep.py:{line}: {name}() outside shardkit/checkpoint/io/; go through "
        "Storage (or add the file with its reason to OUTSIDE_IO)" for line, name in ((5, "shutil.rmtree"), (6, "open"))]


def test_each_name_check_fails_on_a_planted_violation(tmp_path):
    offline = tmp_path / "shardkit" / "checkpoint" / "offline"
    formats = tmp_path / "shardkit" / "checkpoint" / "formats"
    for folder in (offline, formats, tmp_path / "cli", tmp_path / "tests" / "checkpoint"):
        folder.mkdir(parents=True, exist_ok=True)
    (offline / "convert.py").write_text(
        'def pick(fmt, out):\n    """Converts to "dcp" or "hf"."""\n    if fmt == "dcp":\n'
        '        return write(out, to="hf", note=f"dcp {fmt}")\n    return {"torch": 1}.get(fmt, out._buffer)\n')
    (formats / "dcp.py").write_text('NAME = "dcp"\nif NAME == "dcp":\n    pass\n')
    (offline / "owner.py").write_text("class Owner:\n    def __init__(self):\n        self._buffer = b''\n")
    (tmp_path / "tests" / "checkpoint" / "test_x.py").write_text(
        "from shardkit.checkpoint.offline import convert\nfrom shardkit.checkpoint.offline.owner import _helper\n"
        "convert._table\nconvert.public._inner\n")
    assert format_literals(tmp_path) == [
        f"shardkit/checkpoint/offline/convert.py:{line}: format name {name!r} {how} outside {FORMATS_FOLDER}; ask "
        "the registry (shardkit.checkpoint.formats) or the format's handler instead"
        for line, name, how in ((3, "dcp", "compared"), (4, "hf", "a format argument"), (5, "torch", "a dict key"))]
    assert private_attributes(tmp_path) == [
        "shardkit/checkpoint/offline/convert.py:5: ._buffer is private to another module; give it a public name in "
        "the module that owns it (or, for a third-party object, add it with its reason to THIRD_PARTY_PRIVATE)"]
    assert private_names_in_tests(tmp_path) == [
        "tests/checkpoint/test_x.py:2: imports _helper from shardkit.checkpoint.offline.owner; test the public "
        "behaviour, or give the name a public one in its module",
        "tests/checkpoint/test_x.py:3: uses shardkit.checkpoint.offline.convert._table; test the public behaviour, "
        "or give the name a public one in its module"]
