"""DCP directories: real dcp.save output from torch's fully_shard reads bitwise; our DCP output is
read by torch's own dcp.load; the metadata unpickler refuses anything but DCP's classes."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from shardkit.checkpoint.formats.base import read_box
from shardkit.checkpoint.formats.dcp.reader import DcpReader, read_dcp_metadata
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import InvalidManifest, UnsafeCheckpoint
from tests.support.formats_helpers import torch_fully_shard_dcp
from tests.support.models import ModelArgs, Transformer


def _read_all(reader) -> dict[str, torch.Tensor]:
    return {k: read_box(reader, k) for k in reader.tensors()}


@pytest.fixture
def fsdp_dcp():
    return torch_fully_shard_dcp()


def test_dcp_saved_by_torch_fully_shard_reads_bitwise(fsdp_dcp):
    path, flat, groups = fsdp_dcp
    source = DcpReader(Storage(path))
    got = _read_all(source)
    assert sorted(got) == sorted(flat)
    for key, tensor in flat.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    # sharded params have one chunk per rank; values (param_groups) come back as JSON
    assert len(source.tensors()["model.tok_embeddings.weight"].chunks) == 2
    params = source.values()["optim.param_groups"][0]["params"]
    assert params == groups[0]["params"]
    assert source.values()["optim.param_groups"][0]["lr"] == pytest.approx(1e-2)


def test_convert_writes_dcp_that_torch_dcp_load_reads_with_optimizer_state(tmp_path, fsdp_dcp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_optimizer_state_dict,
    )

    from shardkit.checkpoint import convert

    path, flat, groups = fsdp_dcp
    out = str(tmp_path / "out")
    convert(path, out, to="dcp", max_memory="16MiB")
    torch.manual_seed(5)  # different weights: everything compared below comes from the file
    model = Transformer(ModelArgs())
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    msd, osd = get_state_dict(model, optim)  # FQN-keyed, state initialised by torch
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=out, no_dist=True)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, flat[f"model.{key}"]), key
    names = {p: n for n, p in model.named_parameters()}
    for param, st in optim.state.items():
        for name, value in st.items():
            assert torch.equal(value, flat[f"optim.state.{names[param]}.{name}"]), (names[param], name)
    assert optim.param_groups[0]["lr"] == groups[0]["lr"] == pytest.approx(1e-2)


def test_dcp_output_tensor_larger_than_block_is_split_into_chunks(tmp_path):
    import torch.distributed.checkpoint as dcp

    from shardkit.checkpoint.formats.dcp.writer import write_dcp

    big = torch.randn(1000, 64)
    out = tmp_path / "d"
    out.mkdir()
    write_dcp(Storage(str(out)), [("model.w", big.dtype, tuple(big.shape))], {"step": 3},
              lambda f, o, s: big[o[0]:o[0] + s[0]], block_bytes=64 * 4 * 100)
    entry = DcpReader(Storage(str(out))).tensors()["model.w"]
    assert len(entry.chunks) == 10
    target = {"model": {"w": torch.zeros_like(big)}, "step": 0}
    dcp.load(target, checkpoint_id=str(out), no_dist=True)
    assert torch.equal(target["model"]["w"], big) and target["step"] == 3


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_dcp_metadata_with_foreign_global_is_refused():
    blob = pickle.dumps({"x": _Evil()})
    with pytest.raises(UnsafeCheckpoint, match="posix.system|os.system|system"):
        read_dcp_metadata(blob)


def test_dcp_metadata_garbage_is_invalid():
    with pytest.raises(InvalidManifest):
        read_dcp_metadata(b"\x80\x04not a pickle")
    with pytest.raises(InvalidManifest, match="not Metadata"):
        read_dcp_metadata(pickle.dumps({"a": 1}))


def test_cli_convert_of_malicious_dcp_fails_in_one_line_and_writes_nothing(tmp_path):
    from tests.support.offline_cli import run_cli

    src = tmp_path / "evil"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(_Evil()))
    dst = tmp_path / "dst"
    result = run_cli("convert", str(src), str(dst), "--to", "shardkit")
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and "refusing" in result.stderr
    assert not (dst / "manifest.json").exists()


def test_dcp_truncated_payload_is_reported(tmp_path, fsdp_dcp):
    import shutil

    from shardkit.checkpoint import verify

    path, _, _ = fsdp_dcp
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    data = copy / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    report = verify(str(copy))
    assert not report.ok and any("__1_0.distcp" in p for p in report.problems)


def test_dcp_zstd_transform_is_decoded(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    sd = {"model": {"w": torch.randn(33, 7)}}
    writer = dcp.FileSystemWriter(str(tmp_path / "z"), _extensions=[ZStandard()])
    dcp.save(sd, storage_writer=writer, no_dist=True)
    got = _read_all(DcpReader(Storage(str(tmp_path / "z"))))
    assert torch.equal(got["model.w"], sd["model"]["w"])


def test_dcp_output_holds_each_block_once(tmp_path):
    from shardkit.checkpoint import convert
    from tests.support.offline_helpers import write_torch_state

    big = {"model.w": torch.randn(2000, 300), "model.v": torch.randn(10)}
    src = write_torch_state(tmp_path / "s.pt", big, [])
    convert(str(src), str(tmp_path / "d"), to="dcp", max_memory="16MiB")
    payload = sum(t.numel() * t.element_size() for t in big.values())
    size = (tmp_path / "d" / "__0_0.distcp").stat().st_size
    assert payload <= size < payload + 64 * 1024  # torch.save framing only, no stray buffer bytes


def test_dcp_saved_with_safetensors_serialization_reads(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    sd = {"model": {"w": torch.randn(17, 5), "ids": torch.arange(9)}, "step": 4}
    writer = dcp.FileSystemWriter(str(tmp_path / "st"), serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    reader = DcpReader(Storage(str(tmp_path / "st")))
    got = _read_all(reader)
    assert torch.equal(got["model.w"], sd["model"]["w"]) and torch.equal(got["model.ids"], sd["model"]["ids"])
    assert reader.values() == {"step": 4}


def test_dcp_rows_are_read_by_range_without_decoding_the_whole_chunk(fsdp_dcp):
    path, flat, _ = fsdp_dcp
    reader = DcpReader(Storage(path))
    fqn = "model.tok_embeddings.weight"
    entry = reader.tensors()[fqn]
    layout = reader._row_layout(entry, 1)
    assert layout is not None and layout.row_bytes == entry.shape[1] * 4
    lo = entry.chunks[1].offsets[0]
    box = ((lo + 2, 3), (4, entry.shape[1] - 5))
    got = read_box(reader, fqn, box)
    assert torch.equal(got, flat[fqn][lo + 2:lo + 6, 3:entry.shape[1] - 2])
    assert getattr(reader._local, "cache", None) is None  # no chunk was decoded whole


def test_dcp_relative_path_outside_the_directory_is_refused_at_open(tmp_path, fsdp_dcp):
    import shutil

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    path, _, _ = fsdp_dcp
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    md = pickle.loads((copy / ".metadata").read_bytes())  # torch's own classes, to write a hostile file
    index = next(iter(md.storage_data))
    info = md.storage_data[index]
    md.storage_data[index] = _StorageInfo("../outside.distcp", info.offset, info.length)
    (copy / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpoint, match=r"\.\./outside\.distcp"):
        DcpReader(Storage(str(copy)))


def test_verify_names_a_flipped_payload_byte_through_the_zip_crc(tmp_path, fsdp_dcp):
    import shutil

    from shardkit.checkpoint import verify

    path, _, _ = fsdp_dcp
    clean = verify(path)
    assert clean.ok and clean.scope == "checksums"
    assert clean.bytes_checked >= sum(e.nbytes for e in DcpReader(Storage(path)).tensors().values())
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    reader = DcpReader(Storage(str(copy)))
    entry = reader.tensors()["model.output.weight"]
    layout = reader._row_layout(entry, 0)
    data = bytearray((copy / layout.file).read_bytes())
    data[layout.data_start + 5] ^= 0x10  # inside the tensor bytes: shape, dtype and zip structure stay intact
    (copy / layout.file).write_bytes(bytes(data))
    report = verify(str(copy))
    assert not report.ok
    assert len(report.problems) == 1 and "model.output.weight" in report.problems[0] and \
        "CRC" in report.problems[0], report.problems


def test_metadata_written_without_torch_dcp_unpickles_to_what_torch_would_write():
    """Our opcode-by-opcode .metadata decodes (with plain pickle and torch's classes) to the object
    torch's own writer pickles, and our restricted reader reads it back."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from shardkit.checkpoint.formats.dcp.metadata import encode_dcp_metadata

    blob = encode_dcp_metadata(
        {"model.w": (torch.bfloat16, (5, 3), [(0, 0), (4, 0)], [(4, 3), (1, 3)]), "s": (torch.int64, (), [()], [()])},
        ["optim.param_groups.0.lr"],
        {("model.w", (0, 0)): ("__0_0.distcp", 0, 100), ("model.w", (4, 0)): ("__0_0.distcp", 100, 50),
         ("s", ()): ("__0_0.distcp", 150, 9), ("optim.param_groups.0.lr", None): ("__0_0.distcp", 159, 7)},
        {"model.w": ("model", "w"), "s": ("s",), "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr")})
    want = Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([5, 3]), [
                ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 3])),
                ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([1, 3]))]),
            "s": TensorStorageMetadata(TensorProperties(dtype=torch.int64), torch.Size([]),
                                       [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]),
            "optim.param_groups.0.lr": BytesStorageMetadata()},
        planner_data={"model.w": ("model", "w"), "s": ("s",), "optim.param_groups.0.lr": ("optim", "param_groups", 0,
                                                                                          "lr")},
        storage_data={MetadataIndex("model.w", (0, 0)): _StorageInfo("__0_0.distcp", 0, 100),
                      MetadataIndex("model.w", (4, 0)): _StorageInfo("__0_0.distcp", 100, 50),
                      MetadataIndex("s", ()): _StorageInfo("__0_0.distcp", 150, 9),
                      MetadataIndex("optim.param_groups.0.lr"): _StorageInfo("__0_0.distcp", 159, 7)})
    assert pickle.loads(blob) == want
    ours = read_dcp_metadata(blob)
    assert ours.state_dict_metadata["model.w"].properties.dtype == torch.bfloat16
    assert [tuple(c.offsets) for c in ours.state_dict_metadata["model.w"].chunks] == [(0, 0), (4, 0)]
    assert {(k.fqn, k.offset): v.length for k, v in ours.storage_data.items()}[("model.w", (4, 0))] == 50


def test_reading_and_writing_dcp_never_imports_torch_distributed_checkpoint(tmp_path, fsdp_dcp):
    import subprocess
    import sys

    path, _, _ = fsdp_dcp
    code = ("import sys\n"
            "from shardkit.checkpoint import convert, verify\n"
            f"convert({path!r}, {str(tmp_path / 'out')!r}, to='dcp')\n"
            f"assert verify({str(tmp_path / 'out')!r}).ok and verify({path!r}).ok\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_dcp_of_a_bare_model_state_dict_is_read_as_the_model_and_its_optimizer_as_optim(tmp_path):
    """``dcp.save({**model.state_dict(), "optimizer": ...})``, as torchtitan lays it out: the bare model keys
    are read as ``model.*`` and ``optimizer.*`` as ``optim.*``, so ``load`` fills a model and its optimizer."""
    import torch.distributed.checkpoint as dcp

    import shardkit.checkpoint as skc

    model = Transformer(ModelArgs())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.arange(8)[None]).sum().backward()
    opt.step()
    osd = {"state": {n: opt.state[p] for n, p in model.named_parameters()},
           "param_groups": [{**opt.param_groups[0], "params": [n for n, _ in model.named_parameters()]}]}
    dcp.save({**model.state_dict(), "optimizer": osd, "lr_scheduler": {"last_epoch": 1}},
             checkpoint_id=str(tmp_path / "bare"), no_dist=True)
    with DcpReader(Storage(str(tmp_path / "bare"))) as reader:
        name = next(iter(model.state_dict()))
        assert f"model.{name}" in reader.tensors() and f"optim.state.{name}.exp_avg" in reader.tensors()
        assert reader.values()["lr_scheduler.last_epoch"] == 1
    fresh = Transformer(ModelArgs())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    sd = skc.get_training_state(fresh, fresh_opt)
    skc.load(sd, str(tmp_path / "bare"), strict=False)  # the lr_scheduler is not this state dict's
    skc.set_training_state(fresh, fresh_opt, sd)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert fresh_opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("state", [
    {"model": {"w": torch.ones(2)}, "step": torch.tensor(3)},            # shardkit-style, a tensor beside
    {"model": {"w": torch.ones(2)}, "ema": {"w": torch.ones(2)}},         # another top-level tensor
    {"app": {"model": {"w": torch.ones(2)}, "optim": {"state": {"w": {"exp_avg": torch.ones(2)}}}}},  # AppState
], ids=["tensor-beside-model", "ema-beside-model", "nested-app-state"])
def test_a_dcp_that_nests_its_model_keeps_its_keys(tmp_path, state):
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    with DcpReader(Storage(str(tmp_path / "d"))) as reader:
        stored = set(read_dcp_metadata((tmp_path / "d" / ".metadata").read_bytes(), "x").state_dict_metadata)
        assert set(reader.tensors()) <= stored
