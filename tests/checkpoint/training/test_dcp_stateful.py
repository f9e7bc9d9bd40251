"""torch DCP's ``Stateful`` protocol: torch's DCP tutorial runs after the two-import swap, its ``AppState``
checkpoints resume under ``CheckpointManager`` (``from_dcp="app"``), and save/async_save/load call
``state_dict()``/``load_state_dict()`` on top-level Stateful values exactly as DCP does."""

from __future__ import annotations

import json
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import shardkit.checkpoint as skc
import shardkit.data
from shardkit.checkpoint.training.manager import step_dir
from shardkit.errors import ConfigurationError
from tests.support.dist import run_on_ranks, run_torchrun

SCRIPT = Path(__file__).resolve().parents[2] / "support" / "dcp_tutorial_run.py"
STEPS = 3  # the script's steps before and after the checkpoint


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory) -> Path:
    """Every run of the tutorial script on 2 ranks: save and a new process's resume with torch's modules and
    with shardkit's, the manager's resume of torch's checkpoint, and the uninterrupted run."""
    out = tmp_path_factory.mktemp("dcp-tutorial")
    torch_step = str(out / "root" / step_dir(STEPS))

    def launch(modules: str, phase: str, checkpoint: str, name: str) -> None:
        done = run_torchrun(SCRIPT, 2, [modules, phase, checkpoint, str(out / name)], timeout=240)
        assert done.returncode == 0, f"{modules} {phase}:\n{done.stderr[-4000:]}"

    with ThreadPoolExecutor(3) as pool:  # each wave's runs are independent of one another
        for wave in ([("torch", "save", torch_step, "torch-save"), ("shardkit", "save", str(out / "sk"), "sk-save"),
                      ("torch", "straight", "-", "straight")],
                     [("torch", "resume", torch_step, "torch-resume"),
                      ("shardkit", "resume", str(out / "sk"), "sk-resume"),
                      ("shardkit", "manager", torch_step, "manager")]):
            list(pool.map(lambda run: launch(*run), wave))
    return out


def _losses(out: Path, name: str) -> list[list[float]]:
    return [json.loads((out / f"{name}.rank{rank}.json").read_text()) for rank in range(2)]


def test_the_dcp_tutorial_resumes_bitwise_alike_with_torchs_modules_and_with_shardkits(tutorial):
    straight = _losses(tutorial, "straight")
    for rank in range(2):
        assert _losses(tutorial, "torch-save")[rank] == _losses(tutorial, "sk-save")[rank] == straight[rank][:STEPS]
        assert _losses(tutorial, "torch-resume")[rank] == straight[rank][STEPS:]
        assert _losses(tutorial, "sk-resume")[rank] == straight[rank][STEPS:]
    assert (tutorial / "root" / step_dir(STEPS) / ".metadata").is_file()  # torch wrote DCP
    assert (tutorial / "sk" / "manifest.json").is_file()  # shardkit wrote its own format, from the same script


def test_checkpoint_manager_resumes_a_dcp_appstate_step_on_two_ranks_and_trains_on_alike(tutorial):
    assert _losses(tutorial, "manager") == [s[STEPS:] for s in _losses(tutorial, "straight")]


class ToyModel(nn.Module):  # the tutorial's
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(99)
    model = ToyModel()
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _assert_holds_expected(model: nn.Module, optimizer: torch.optim.Optimizer, expected: dict) -> None:
    got = model.state_dict()
    assert sorted(got) == sorted(expected["model"])
    for key, want in expected["model"].items():
        assert torch.equal(got[key], want), key
    state = get_optimizer_state_dict(model, optimizer)["state"]
    assert sorted(state) == sorted(expected["optim"]["state"])
    for fqn, moments in expected["optim"]["state"].items():
        for name, want in moments.items():
            assert torch.equal(state[fqn][name], want), (fqn, name)


def test_a_dcp_appstate_step_under_a_manager_root_resumes_bitwise_at_one_rank_with_from_dcp(tutorial, tmp_path,
                                                                                           caplog):
    root = tmp_path / "root"
    shutil.copytree(tutorial / "root", root)
    expected = torch.load(tutorial / "torch-save.expected.pt", weights_only=True)
    model, optimizer = _fresh()
    with caplog.at_level(logging.WARNING, logger="shardkit"):  # without the option it stays another tool's folder
        assert skc.CheckpointManager(str(root)).load_latest(model, optimizer) is None
    assert "torch.distributed.checkpoint" in caplog.text

    manager = skc.CheckpointManager(str(root))
    assert manager.load_latest(model, optimizer, from_dcp="app") == (STEPS, None)
    _assert_holds_expected(model, optimizer, expected)

    manager.save(STEPS + 1, model, optimizer)  # the run goes on in shardkit's own steps, beside torch's
    model, optimizer = _fresh()
    assert skc.CheckpointManager(str(root)).load_latest(model, optimizer, from_dcp="app") == (STEPS + 1, None)
    _assert_holds_expected(model, optimizer, expected)
    assert (root / step_dir(STEPS) / ".metadata").is_file()  # torch's step is left as it was


@pytest.mark.parametrize("name", ["model", "rng", "app.x", ""])
def test_from_dcp_must_name_one_top_level_key_of_its_own(tutorial, tmp_path, name):
    shutil.copytree(tutorial / "root", tmp_path / "root")
    with pytest.raises(ConfigurationError, match="from_dcp must name"):
        skc.CheckpointManager(str(tmp_path / "root")).load_latest(*_fresh(), from_dcp=name)


class Recorder:
    """A Stateful whose ``state_dict()`` hands out copies: a load that only wrote in place would change
    nothing here, so what it holds after a load came through ``load_state_dict``."""

    def __init__(self, seed: int) -> None:
        self.w = torch.arange(6.0).reshape(2, 3) * seed
        self.step = seed
        self.calls: list[str] = []

    def state_dict(self) -> dict:
        self.calls.append("state_dict")
        return {"w": self.w.clone(), "step": self.step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.calls.append("load_state_dict")
        self.w, self.step = state_dict["w"], state_dict["step"]


def _round_trip(url: str, how: str) -> tuple[list[str], list[str], bool, int]:
    """On every rank: save a Recorder (and a plain tensor beside it) ``how``, load it into another."""
    saved = Recorder(3)
    if how == "async_save":
        skc.async_save({"app": saved, "t": torch.ones(2)}, checkpoint_id=url).result()
    else:
        skc.save({"app": saved, "t": torch.ones(2)}, checkpoint_id=url)
    loaded = Recorder(5)
    target = {"app": loaded, "t": torch.zeros(2)}
    skc.load(target, checkpoint_id=url)
    assert target["app"] is loaded and torch.equal(target["t"], torch.ones(2))
    return saved.calls, loaded.calls, torch.equal(loaded.w, saved.w), loaded.step


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_save_and_load_of_a_stateful_call_its_methods_as_dcp_does(tmp_path, how):
    for saved_calls, loaded_calls, same_w, step in run_on_ranks(2, _round_trip, str(tmp_path / "ckpt"), how):
        assert saved_calls == ["state_dict"]
        assert loaded_calls == ["state_dict", "load_state_dict"]  # the targets first, then the loaded state
        assert same_w and step == 3


def test_a_module_at_the_top_is_a_stateful_to_dcp_and_here(tmp_path):
    torch.manual_seed(0)
    saved, loaded = ToyModel(), ToyModel()
    skc.save({"model": saved}, tmp_path / "m")
    skc.load({"model": loaded}, checkpoint_id=tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), loaded.state_dict().values()))


def test_shardkits_data_stateful_wrapper_is_not_torchs_protocol_and_is_still_refused_by_a_plain_save(tmp_path):
    wrapped = shardkit.data.Stateful(Recorder(1))
    assert not isinstance(wrapped, Stateful)  # a scope for CheckpointManager(stateful=...), not an AppState
    with pytest.raises(ConfigurationError, match="'x' holds a Stateful"):
        skc.save({"x": wrapped}, str(tmp_path / "c"))


def test_the_protocol_check_agrees_with_torchs_stateful_without_importing_dcp():
    import subprocess
    import sys

    from torch.distributed.checkpoint.stateful import Stateful

    from shardkit.checkpoint.state.dcp_stateful import is_stateful

    model = torch.nn.Linear(2, 2)
    for value in (model, torch.optim.SGD(model.parameters(), lr=0.1), torch.zeros(2), {"a": 1}, 3, "text"):
        assert is_stateful(value) == isinstance(value, Stateful), value
    # the first save of a process that never uses DCP does not pay for importing it (most of a second)
    probe = ("import sys, shardkit.checkpoint.training.save, shardkit.checkpoint.training.load; "
             "print('torch.distributed.checkpoint' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"
