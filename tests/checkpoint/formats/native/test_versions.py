"""Checkpoints written by every earlier version of the native format still load, reshard and convert.

``tests/support/fixtures/format-v1`` was written by the version-1 writer (before column
strips existed), ``tests/support/fixtures/format-v2`` by the version-2 writer (its
dim-1 sharded matrix stored as column strips) and ``tests/support/fixtures/format-v3``
by the version-3 writer (chunk records in one index file per writer, forced on
this small state) and ``tests/support/fixtures/format-v4/step-0000000002`` by the
version-4 writer (a dedup save: every chunk but those of ``model.norm.weight``
referenced from ``step-0000000001`` beside it), all at two ranks: a dim-0
sharded embedding and AdamW moment, a dim-1 sharded matrix, a plain vector, a
bf16 tensor, a scalar step and JSON values.  Every tensor's content is a
formula of its shape (:func:`expected_state`), so each test can say exactly
what it must read back.  The stored bytes are never regenerated: they are
what those writers wrote.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

STORED = Path(__file__).parents[3] / "support" / "fixtures"
FIXTURES = {version: STORED / f"format-v{version}" for version in (1, 2, 3)}
FIXTURES[4] = STORED / "format-v4" / "step-0000000002"  # reads its sibling's data
FIXTURE_SHAPES = {
    "model.emb.weight": ((37, 26), torch.float32),
    "model.w2.weight": ((26, 51), torch.float32),
    "model.norm.weight": ((26,), torch.float32),
    "optim.state.emb.weight.exp_avg": ((37, 26), torch.bfloat16),
    "optim.state.emb.weight.step": ((), torch.float32),
}
PARAM_GROUPS = [{"lr": 0.01, "betas": [0.9, 0.999], "params": ["emb.weight", "w2.weight", "norm.weight"]}]


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float64) * 0.37 + seed).sin().to(dtype).reshape(shape)


def expected_state() -> dict:
    """The fixture's content: every tensor a formula of its shape, plus the optimizer's param groups."""
    out: dict = {k: _values(shape, dtype, i) for i, (k, (shape, dtype)) in enumerate(FIXTURE_SHAPES.items())}
    out["optim.param_groups"] = PARAM_GROUPS
    return out


def _read_all(url: str) -> dict[str, torch.Tensor]:
    from shardkit.checkpoint.formats import open_reader
    from shardkit.checkpoint.formats.base import read_box

    with open_reader(url) as reader:
        return {k: read_box(reader, k) for k in reader.tensors()}


def _assert_tensors_are_the_fixtures(got: dict[str, torch.Tensor], keys=None) -> None:
    want = {k: v for k, v in expected_state().items() if isinstance(v, torch.Tensor)}
    keys = sorted(want) if keys is None else sorted(keys)
    assert sorted(got) == keys
    for key in keys:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


versions = pytest.mark.parametrize("version", sorted(FIXTURES), ids=[f"v{v}" for v in sorted(FIXTURES)])


@versions
def test_each_fixture_is_a_checkpoint_of_its_version_from_two_writers(version):
    manifest = json.loads((FIXTURES[version] / "manifest.json").read_text())
    assert manifest["version"] == version
    if "indexes" not in manifest:
        writers = {f["writer"] for f in manifest["files"].values()}
        chunks = {k: t["chunks"] for k, t in manifest["tensors"].items()}
    else:  # the chunk records are in the writers' index files, which the manifest lists
        indexes = [json.loads((FIXTURES[version] / name).read_text()) for name in manifest["indexes"]]
        writers = {i["writer"] for i in indexes}
        chunks = {k: [c for i in indexes for c in i["chunks"].get(k, [])] for k in manifest["tensors"]}
        assert {k for k, t in manifest["tensors"].items() if "rule" in t} == {
            "model.emb.weight", "model.w2.weight", "optim.state.emb.weight.exp_avg"}
    assert writers == {0, 1}
    if version == 4:
        assert manifest["references"] == ["step-0000000001"]
        own = {k for k, c in chunks.items() if all(not r["file"].startswith("../") for r in c)}
        assert own == {"model.norm.weight"}
    striped = {k for k, c in chunks.items() if any("strips" in r for r in c)}
    assert striped == (set() if version == 1 else {"model.w2.weight"})


@versions
def test_an_older_version_loads_into_one_process_bitwise_with_its_values_and_meta(version):
    import shardkit.checkpoint as skc

    sd = {k: (torch.zeros(shape, dtype=dtype)) for k, (shape, dtype) in FIXTURE_SHAPES.items()}
    sd["optim.param_groups"] = None
    meta = skc.load(sd, str(FIXTURES[version]))
    assert meta["step"] == 7
    assert sd.pop("optim.param_groups") == PARAM_GROUPS
    _assert_tensors_are_the_fixtures(sd)


def _load_fixture_at_three_ranks(url: str) -> bool:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import shardkit.checkpoint as skc

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {k: distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [Shard(0)]) if shape else torch.zeros(())
          for k, (shape, dtype) in FIXTURE_SHAPES.items()}
    sd["optim.param_groups"] = None
    skc.load(sd, url)
    want = expected_state()
    return sd.pop("optim.param_groups") == PARAM_GROUPS and all(
        torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, want[k]) for k, v in sd.items())


@versions
def test_an_older_version_written_at_two_ranks_loads_at_three_bitwise(version):
    from tests.support.dist import run_on_ranks

    assert run_on_ranks(3, _load_fixture_at_three_ranks, str(FIXTURES[version])) == [True, True, True]


@versions
def test_an_older_version_reshards_and_converts_to_every_format_bitwise(tmp_path, version):
    from shardkit.checkpoint import convert, reshard, verify

    src = tmp_path / f"v{version}"
    if version >= 4:  # the step with the sibling it references
        shutil.copytree(FIXTURES[version].parent, tmp_path / "root")
        src = tmp_path / "root" / FIXTURES[version].name
    else:  # the offline tools only read it; a copy keeps the fixture clean regardless
        shutil.copytree(FIXTURES[version], src)
    assert verify(str(src)).ok
    reshard(str(src), str(tmp_path / "n3"), world_size=3)
    _assert_tensors_are_the_fixtures(_read_all(str(tmp_path / "n3")))
    convert(str(src), str(tmp_path / "pt"), to="torch")
    _assert_tensors_are_the_fixtures(_read_all(str(tmp_path / "pt")))
    convert(str(src), str(tmp_path / "dcp"), to="dcp")
    _assert_tensors_are_the_fixtures(_read_all(str(tmp_path / "dcp")))
    convert(str(src), str(tmp_path / "hf"), to="hf")
    _assert_tensors_are_the_fixtures(_read_all(str(tmp_path / "hf")),
                                     [k for k in FIXTURE_SHAPES if k.startswith("model.")])
