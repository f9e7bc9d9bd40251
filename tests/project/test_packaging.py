"""What ``pip install shardkit`` installs: every package of the source tree, not only in editable mode."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_under_shardkit_is_listed_for_installation():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "shardkit").rglob("__init__.py")}
    assert on_disk - listed == set(), "packages a non-editable install would leave out"
    assert config["package-dir"]["shardkit.cli"] == "cli" and (ROOT / "cli" / "__init__.py").exists()
