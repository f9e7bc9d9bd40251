"""``use_shardkit()`` makes shardkit the engine of a real Accelerate FSDP2 loop's ``save_state``/``load_state``:
a run resumed from its folder in a new process continues with the uninterrupted run's losses, bitwise at the
same world size and on one rank, on the same samples; Accelerate's own files stay where it puts them; a DCP
folder written before the switch still loads; ``total_limit`` still rotates; the undo puts back every binding.

The loop runs under torchrun on gloo (``tests/support/accelerate_shardkit_run.py``: why and how Accelerate's
state is switched to FSDP on a CPU host)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from shardkit.integrations.accelerate import is_on, use_shardkit  # noqa: E402
from shardkit.integrations.accelerate.engine import NAMES, ORIGINALS, REPLACEMENTS, holds_shardkit  # noqa: E402
from tests.support.dist import run_torchrun  # noqa: E402
from tests.support.framework_helpers import FRAMEWORK_MODULE_TIMEOUT, FRAMEWORK_RUN_S  # noqa: E402
from tests.support.offline_cli import run_cli  # noqa: E402

pytestmark = [pytest.mark.slow, FRAMEWORK_MODULE_TIMEOUT]

SCRIPT = Path(__file__).parents[1] / "support" / "accelerate_shardkit_run.py"


def _launch(ranks: int, *args: str) -> None:
    done = run_torchrun(SCRIPT, ranks, list(args), timeout=FRAMEWORK_RUN_S)
    assert done.returncode == 0, f"{SCRIPT.name} {args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The uninterrupted run on 2 ranks (saving with DCP and with shardkit), then each folder resumed in new
    processes on 2 ranks and on 1 (about 20 s)."""
    out = tmp_path_factory.mktemp("accelerate-shardkit")
    _launch(2, "write", str(out))
    _launch(2, "resume", str(out))
    _launch(1, "resume", str(out))
    return out


def _read(runs: Path, name: str) -> dict:
    return json.loads((runs / name).read_text())


def test_a_run_resumed_from_shardkit_at_the_same_world_size_has_the_uninterrupted_losses_bitwise(runs):
    whole, resumed = _read(runs, "run.json"), _read(runs, "resumed-shardkit-2.json")
    assert resumed["losses"] == whole["losses"]
    assert resumed["seen"] == whole["seen"]  # the seedable sampler and skip_first_batches: the next samples


def test_a_run_resumed_from_shardkit_on_one_rank_has_the_same_losses_and_samples(runs):
    whole, resumed = _read(runs, "run.json"), _read(runs, "resumed-shardkit-1.json")
    assert resumed["seen"] == whole["seen"]
    assert resumed["losses"] == pytest.approx(whole["losses"], abs=1e-6, rel=0)
    assert resumed["lr"] == _read(runs, "resumed-shardkit-2.json")["lr"]  # scheduler.bin, read by Accelerate


def test_save_state_writes_shardkit_checkpoints_under_accelerates_names_beside_its_own_files(runs):
    shardkit, dcp = runs / "shardkit", runs / "dcp"
    assert sorted(p.name for p in shardkit.iterdir()) == sorted(p.name for p in dcp.iterdir()) == [
        "optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]
    assert holds_shardkit(str(shardkit / "pytorch_model_fsdp_0")) and holds_shardkit(str(shardkit / "optimizer_0"))
    assert not holds_shardkit(str(dcp / "pytorch_model_fsdp_0"))  # the switch was off: Accelerate's DCP
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        checked = run_cli("verify", str(shardkit / part))
        assert checked.exit_code == 0, checked.stderr
        assert checked.stdout.startswith("ok: shardkit checkpoint"), checked.stdout
    assert run_cli("verify", str(shardkit)).exit_code == 0


def test_a_dcp_folder_saved_before_the_switch_still_loads_with_the_switch_on(runs):
    whole = _read(runs, "run.json")
    assert _read(runs, "resumed-dcp-2.json")["losses"] == whole["losses"]
    assert _read(runs, "resumed-dcp-1.json")["losses"] == pytest.approx(whole["losses"], abs=1e-6, rel=0)


def test_total_limit_still_rotates_shardkit_checkpoints(runs):
    """Three saves with ``automatic_checkpoint_naming`` and ``total_limit=2``: the oldest one is gone."""
    kept = sorted((runs / "project" / "checkpoints").iterdir())
    assert [p.name for p in kept] == ["checkpoint_3", "checkpoint_4"]
    assert all(holds_shardkit(str(p / "pytorch_model_fsdp_0")) for p in kept)


def _bound() -> dict[str, dict[str, object]]:
    import accelerate.accelerator
    import accelerate.utils
    import accelerate.utils.fsdp_utils
    import transformers.trainer

    return {m.__name__: {n: getattr(m, n) for n in NAMES}
            for m in (accelerate.utils.fsdp_utils, accelerate.utils, accelerate.accelerator, transformers.trainer)}


def test_the_switch_rebinds_every_name_and_its_undo_puts_back_accelerates_functions(monkeypatch):
    user = types.ModuleType("a_training_script")  # a user's `from accelerate.utils import save_fsdp_model`
    user.save_fsdp_model = ORIGINALS["save_fsdp_model"]
    monkeypatch.setitem(sys.modules, user.__name__, user)
    before = _bound()
    assert all(f is ORIGINALS[n] for names in before.values() for n, f in names.items()) and not is_on()
    with use_shardkit():
        assert is_on()
        assert all(f is REPLACEMENTS[n] for names in _bound().values() for n, f in names.items())
        assert user.save_fsdp_model is REPLACEMENTS["save_fsdp_model"]
    assert _bound() == before and user.save_fsdp_model is ORIGINALS["save_fsdp_model"]
    use_shardkit()
    use_shardkit()  # twice is once
    assert is_on()
    use_shardkit(False)
    assert _bound() == before and not is_on()


def test_the_replacements_keep_accelerates_signatures():
    """The Trainer asks ``save_fsdp_model``'s signature whether it takes ``adapter_only``."""
    import inspect

    for name in NAMES:
        assert inspect.signature(REPLACEMENTS[name]) == inspect.signature(ORIGINALS[name]), name


def _recorder(calls: list):
    return lambda *args: calls.append(args) or "accelerate's"


@pytest.mark.parametrize("version, kind, use_dcp", [(2, "FULL_STATE_DICT", True), (1, "SHARDED_STATE_DICT", True),
                                                    (2, "SHARDED_STATE_DICT", False)])
def test_what_shardkit_does_not_write_goes_to_accelerates_own_functions_unchanged(monkeypatch, tmp_path, version,
                                                                                  kind, use_dcp):
    """Full state-dict files, FSDP1 and ``use_dcp=False`` per-rank files stay Accelerate's, and so does
    loading a folder that holds no shardkit checkpoint (a DCP folder from before the switch)."""
    from torch.distributed.fsdp import StateDictType

    from shardkit.integrations.accelerate import engine

    calls: list = []
    for name in NAMES:
        monkeypatch.setitem(ORIGINALS, name, _recorder(calls))
    plugin = types.SimpleNamespace(fsdp_version=version, state_dict_type=getattr(StateDictType, kind))
    model, out = object(), str(tmp_path)
    assert engine.save_fsdp_model(plugin, "acc", model, out, 0, False, use_dcp) == "accelerate's"
    assert engine.save_fsdp_optimizer(plugin, "acc", "opt", model, out, 0, use_dcp) == "accelerate's"
    assert engine.load_fsdp_model(plugin, "acc", model, out, 0, False, use_dcp) == "accelerate's"
    assert engine.load_fsdp_optimizer(plugin, "acc", "opt", model, out, 0, False, use_dcp) == "accelerate's"
    assert calls == [(plugin, "acc", model, out, 0, False, use_dcp), (plugin, "acc", "opt", model, out, 0, use_dcp),
                     (plugin, "acc", model, out, 0, False, use_dcp),
                     (plugin, "acc", "opt", model, out, 0, False, use_dcp)]


def test_a_shardkit_folder_is_refused_for_an_fsdp1_model_naming_it(tmp_path):
    import torch

    import shardkit.checkpoint as skc
    from shardkit.errors import ConfigurationError
    from shardkit.integrations.accelerate import engine

    folder = tmp_path / "pytorch_model_fsdp_0"
    skc.save({"model": {"weight": torch.zeros(2)}}, str(folder))
    plugin = types.SimpleNamespace(fsdp_version=1)
    with pytest.raises(ConfigurationError, match=f"{folder} is a shardkit checkpoint.*FSDP1.*fsdp_version=2"):
        engine.load_fsdp_model(plugin, None, torch.nn.Linear(2, 2), str(tmp_path))


def test_without_accelerate_the_import_names_the_extra():
    import subprocess

    code = "import sys; sys.modules['accelerate'] = None; import shardkit.integrations.accelerate"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "IntegrationUnavailable" in done.stderr and "pip install 'shardkit[accelerate]'" in done.stderr


def test_the_engine_round_trips_model_and_optimizer_with_the_switchs_save_options(tmp_path):
    """One process, a plain module: what the replaced functions write under shardkit's keys (``model.*``,
    ``optim.*``, as ``shardkit convert`` reads an Accelerate folder), compressed as ``use_shardkit`` asked, comes
    back bitwise into a fresh model and optimizer, hyper-parameters included."""
    import torch
    from torch.distributed.fsdp import StateDictType

    import shardkit.checkpoint as skc
    from shardkit.integrations.accelerate import engine

    def trained(lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(int(lr * 10))
        model = torch.nn.Linear(64, 32)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
        return model, opt

    plugin = types.SimpleNamespace(fsdp_version=2, state_dict_type=StateDictType.SHARDED_STATE_DICT)
    saved, saved_opt = trained(0.1)
    with use_shardkit(compression="zstd"):
        engine.save_fsdp_model(plugin, None, saved, str(tmp_path))
        engine.save_fsdp_optimizer(plugin, None, saved_opt, saved, str(tmp_path))
        model, opt = trained(0.7)
        assert engine.load_fsdp_model(plugin, None, model, str(tmp_path)) == ([], [])
        engine.load_fsdp_optimizer(plugin, None, opt, model, str(tmp_path))
    stored = skc.inspect(str(tmp_path / "optimizer_0"))
    assert {t["name"] for t in stored["tensors"]} == {f"optim.state.{p}.{k}" for p in ("weight", "bias")
                                                      for k in ("exp_avg", "exp_avg_sq", "step")}
    assert stored["totals"]["stored_bytes"] < stored["totals"]["bytes"]  # zstd
    assert {t["name"] for t in skc.inspect(str(tmp_path / "pytorch_model_fsdp_0"))["tensors"]} == {
        "model.weight", "model.bias"}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved.parameters()))
    for p, q in zip(model.parameters(), saved.parameters()):
        assert all(torch.equal(opt.state[p][k], saved_opt.state[q][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert opt.param_groups[0]["lr"] == 0.1
