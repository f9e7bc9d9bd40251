"""``pip install shardkit`` into an environment that holds nothing else: the built wheel, not this checkout.

The suite itself runs against an editable install with the test extra, so a
module that imports a package only the test extra brings (numpy was one) would
pass every other test and still fail a user's ``pip install shardkit``.  Here
the wheel is built from the tracked files, installed without extras into a new
virtual environment, and used from outside the checkout: ``shardkit --help``,
every module of the package imported (each framework integration, without its framework, raising the
error that names its extra), and ``shardkit verify`` of the stored
format fixtures.

Only torch is taken from the suite's environment: README asks users to install
the torch build for their hardware first, and installing it again costs
minutes.  The new environment sees torch and what torch itself requires
through a ``.pth`` file naming a folder of links to those distributions;
everything else shardkit declares, pip installs (from its cache where it can).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "support" / "fixtures"

IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
import shardkit
assert shardkit.__file__.startswith(sys.prefix), f"shardkit came from {shardkit.__file__}, not the new environment"
from shardkit.errors import IntegrationUnavailable
names = ["shardkit"] + [m.name for m in pkgutil.walk_packages(shardkit.__path__, "shardkit.")]
unavailable = []
for name in names:
    try:
        importlib.import_module(name)
    except IntegrationUnavailable as exc:  # a framework integration without its framework: it names the extra
        assert name.startswith("shardkit.integrations."), (name, exc)
        assert "pip install 'shardkit[" in str(exc), (name, exc)
        unavailable.append(name.split(".")[2])
print(len(names), "modules")
print("integrations without their framework:", ", ".join(sorted(set(unavailable))))
"""


def _requirement_name(requirement: str) -> str | None:
    """The distribution a ``Requires-Dist`` line names, or ``None`` for one that only an extra asks for."""
    if "extra ==" in requirement:
        return None
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0]


def torch_and_its_requirements() -> list[importlib.metadata.Distribution]:
    """torch and, transitively, every distribution it requires (no extras), as installed here."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = ["torch"]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in found:
            continue
        dist = found[name] = importlib.metadata.distribution(name)
        todo += [req for req in map(_requirement_name, dist.requires or []) if req]
    return list(found.values())


def link_distributions(dists: list[importlib.metadata.Distribution], into: Path) -> None:
    """Link every top-level file and folder of ``dists`` (code and ``.dist-info``) into ``into``."""
    into.mkdir()
    for dist in dists:
        tops = {Path(str(f)).parts[0] for f in dist.files or []} - {".."}
        for top in tops:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (into / top).exists():
                (into / top).symlink_to(source)


def tracked_tree(into: Path) -> Path:
    """A copy of the files a clean clone has (``git ls-files``), to build the wheel from."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    return into


def outside_env() -> dict[str, str]:
    """The caller's environment without anything that points Python at this checkout or its venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_built_wheel_alone_runs_help_imports_every_module_and_verifies_the_fixtures(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("builds the wheel from the tracked files, which needs a git checkout")
    env = outside_env()
    source = tracked_tree(tmp_path / "source")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(source)], check=True, env=env, cwd=tmp_path)
    (wheel,) = wheels.glob("shardkit-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True, env=env).stdout.strip())
    link_distributions(torch_and_its_requirements(), tmp_path / "torch-only")
    (site / "torch-only.pth").write_text(f"{tmp_path / 'torch-only'}\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", str(wheel)],
                   check=True, env=env, cwd=tmp_path)

    def run(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done

    assert "Usage: shardkit" in run(venv / "bin" / "shardkit", "--help").stdout
    # every module imports; each framework integration, its framework absent here, names its extra instead
    imported = run(python, "-c", IMPORT_EVERY_MODULE).stdout
    assert re.fullmatch(r"\d+ modules\nintegrations without their framework: accelerate, lightning, torchtitan\n",
                        imported), imported
    fixtures = shutil.copytree(FIXTURES, tmp_path / "fixtures")
    for checkpoint in (fixtures / "format-v3", fixtures / "format-v4" / "step-0000000002"):
        verdict = run(venv / "bin" / "shardkit", "verify", checkpoint)
        assert verdict.stdout.startswith(f"ok: shardkit checkpoint {checkpoint}:"), verdict.stdout
