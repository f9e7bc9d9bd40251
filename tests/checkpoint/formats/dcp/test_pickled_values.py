"""A DCP step holding a value stored as pickle bytes (torchtitan's data loader position) beside its
tensors: the tensors load, inspect and verify; the value is never unpickled, asking for it fails
naming it, and a conversion leaves it out with one WARNING."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

from shardkit.checkpoint import convert, inspect, load
from shardkit.checkpoint.formats.dcp.reader import DcpReader
from shardkit.checkpoint.io.storage import Storage
from shardkit.errors import UnsupportedFormat
from tests.support.offline_cli import run_cli

KEY = "dataloader.dp_rank_0"


class Sentinel:
    """Unpickling it would record that a pickle ran."""

    ran = False

    def __reduce__(self):
        return (_mark, ())


def _mark():
    Sentinel.ran = True
    return "unpickled"


@pytest.fixture
def titan_step(tmp_path):
    """A step as torchtitan's DCP manager writes one: model keys at the top, the optimizer, a train
    state, and the data loader's position as ``pickle.dumps`` bytes (written by torch's own dcp.save)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    weights = {"tok.weight": torch.randn(7, 4), "out.bias": torch.randn(3)}
    state = {**{k: v.clone() for k, v in weights.items()},
             "optimizer": {"state": {"tok.weight": {"exp_avg": torch.randn(7, 4)}},
                           "param_groups": [{"lr": 0.5, "params": ["tok.weight"]}]},
             "train_state": {"step": 2},
             "dataloader": {"dp_rank_0": pickle.dumps({"position": 40, "hook": Sentinel()})}}
    path = str(tmp_path / "step-2")
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path, weights


def test_the_tensors_beside_a_pickled_value_read_bitwise_and_the_value_is_listed_unread(titan_step):
    path, weights = titan_step
    reader = DcpReader(Storage(path))
    values = reader.values()
    assert set(values) == {"train_state.step", "optim.param_groups", KEY}
    assert values["train_state.step"] == 2
    assert values["optim.param_groups"] == [{"lr": 0.5, "params": ["tok.weight"]}]
    assert reader.unreadable_values() == {KEY: "pickled bytes (a pickle shardkit does not run)"}
    target = {"model": {k: torch.zeros_like(v) for k, v in weights.items()}}
    load(target, path, strict=False)
    assert all(torch.equal(target["model"][k], w) for k, w in weights.items())
    assert Sentinel.ran is False


def test_asking_for_the_pickled_value_fails_naming_it_and_its_file(titan_step):
    path, weights = titan_step
    with pytest.raises(UnsupportedFormat, match=r"__0_0\.distcp \[dataloader\.dp_rank_0\]: value "
                                                r"'dataloader\.dp_rank_0' is pickled bytes"):
        DcpReader(Storage(path)).values()[KEY]
    target = {"model": {k: torch.zeros_like(v) for k, v in weights.items()}, "dataloader": {"dp_rank_0": None}}
    with pytest.raises(UnsupportedFormat, match=r"dataloader\.dp_rank_0"):
        load(target, path, strict=False)
    assert Sentinel.ran is False


def test_inspect_lists_the_pickled_value_and_verify_passes(titan_step):
    path, _ = titan_step
    assert KEY in inspect(path)["values"]
    assert inspect(path)["unread_values"] == {KEY: "pickled bytes (a pickle shardkit does not run)"}
    shown = run_cli("inspect", path)
    assert shown.exit_code == 0
    assert f"  {KEY}: pickled bytes (a pickle shardkit does not run); not read" in shown.stdout
    assert run_cli("verify", path).exit_code == 0
    assert Sentinel.ran is False


@pytest.mark.parametrize("to", ["shardkit", "dcp"])
def test_convert_leaves_the_pickled_value_out_with_one_warning_naming_it(titan_step, tmp_path, caplog, to):
    path, weights = titan_step
    out = str(tmp_path / "out")
    with caplog.at_level(logging.WARNING):
        convert(path, out, to=to)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and KEY in warned[0] and "pickle" in warned[0]
    written = inspect(out)
    assert KEY not in written["values"] and "train_state.step" in written["values"]
    target = {"model": {k: torch.zeros_like(v) for k, v in weights.items()}}
    load(target, out, strict=False)
    assert all(torch.equal(target["model"][k], w) for k, w in weights.items())
    assert Sentinel.ran is False


def test_diff_names_the_pickled_value_as_not_compared_and_compares_the_rest(titan_step, tmp_path):
    path, _ = titan_step
    copy = str(tmp_path / "copy")
    convert(path, copy, to="dcp")  # the same tensors and values, the pickled one left out
    shown = run_cli("diff", path, copy)
    assert shown.exit_code == 0, shown.stdout
    assert f"value {KEY}: not compared (pickled bytes (a pickle shardkit does not run))" in shown.stdout
    assert "equal:" in shown.stdout
    assert Sentinel.ran is False
