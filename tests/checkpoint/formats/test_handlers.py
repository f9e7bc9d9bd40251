"""The format handlers: what a handler says it owns at a destination is what ``--overwrite`` replaces, and a
new writable format is its handler plus one registry entry -- convert needs nothing else."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from shardkit.checkpoint import convert
from shardkit.checkpoint.formats import FORMATS, WRITABLE, FormatHandler, WriteJob
from shardkit.checkpoint.io.storage import Storage
from tests.support.offline_helpers import write_torch_state


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.w": torch.randn(32, 32, generator=gen) for i in range(3)}


def _names(folder: Any) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


# the writable directory formats, and another one to overwrite each with (names that cannot collide)
REPLACED_BY = {"shardkit": "dcp", "hf": "shardkit", "dcp": "hf"}


def test_every_writable_format_is_pinned_here():
    assert set(WRITABLE) == set(REPLACED_BY) | {"torch"}


@pytest.mark.parametrize("fmt", sorted(REPLACED_BY))
def test_files_of_names_exactly_what_overwrite_replaces(tmp_path, fmt):
    src = write_torch_state(tmp_path / "src.pt", _weights(0), [])
    out = tmp_path / "out"
    convert(str(src), str(out), to=fmt)
    (out / "notes.txt").write_text("mine")
    owned = FORMATS[fmt].files_of(Storage(str(out)))
    before = _names(out)
    assert owned and owned < before

    convert(str(src), str(out), to=REPLACED_BY[fmt], overwrite=True)

    assert before - _names(out) == owned
    assert (out / "notes.txt").read_text() == "mine"


def test_files_of_a_torch_save_destination_is_the_file_the_overwrite_replaces(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    convert(str(write_torch_state(tmp_path / "a.pt", _weights(0), [])), str(out / "model.pt"), to="torch")
    assert FORMATS["torch"].files_of(Storage(str(out / "model.pt"))) == {"model.pt"}

    convert(str(write_torch_state(tmp_path / "b.pt", _weights(1), [])), str(out / "model.pt"), to="torch",
            overwrite=True)

    assert _names(out) == {"model.pt", "notes.txt"}
    assert torch.equal(torch.load(out / "model.pt")["model"]["layers.0.w"], _weights(1)["model.layers.0.w"])


class ToyHandler(FormatHandler):
    """A format of the test's own: every tensor as nested lists in one ``toy.json``."""

    name = "toy"
    description = "toy JSON file"
    markers = ("toy.json",)
    writable = True
    file_patterns = ("toy.json",)

    def detect(self, storage: Storage) -> bool:
        return storage.is_dir() and storage.exists("toy.json")

    def check_tensors(self, tensors: Any) -> None:
        pass

    def write_files(self, storage: Storage, job: WriteJob) -> list[str]:
        doc = {fqn: job.fetch(fqn, (0,) * len(shape), shape).tolist() for fqn, _, shape in job.tensors}
        job.before_commit()
        storage.put_atomic("toy.json", json.dumps(doc).encode())
        return ["toy.json"]

    def files_of(self, storage: Storage) -> set[str]:
        return {"toy.json"}


def test_a_new_writable_format_needs_only_its_handler_and_one_registry_entry(tmp_path, monkeypatch):
    monkeypatch.setitem(FORMATS, "toy", ToyHandler())
    src = write_torch_state(tmp_path / "src.pt", _weights(0), [])
    out = tmp_path / "toy"

    result = convert(str(src), str(out), to="toy")

    assert (result.dst_format, result.files) == ("toy", ["toy.json"])
    doc = json.loads((out / "toy.json").read_text())
    assert sorted(doc) == [f"model.layers.{i}.w" for i in range(3)]
    assert torch.equal(torch.tensor(doc["model.layers.2.w"]), _weights(0)["model.layers.2.w"])

    convert(str(src), str(out), to="shardkit", overwrite=True)  # its handler names what --overwrite replaces
    assert not (out / "toy.json").exists()
    assert (out / "manifest.json").exists()
