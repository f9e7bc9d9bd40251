"""2-D interop with torch both ways: ``torch.distributed.checkpoint`` output of torch's ``fully_shard`` +
``parallelize_module`` at (2, 2) loads into shardkit at (1, 4) and at 3 ranks; shardkit's 2-D checkpoint,
converted with ``convert --to dcp``, loads with ``dcp.load`` into torch's (2, 2) model.  Bitwise model and
AdamW state, and 5 more steps matching the uninterrupted run."""

from __future__ import annotations

import pytest

from tests.support.checkpoint_2d_helpers import (
    LAYOUTS,
    build,
    full_state,
    mismatches,
    on_rank0,
    optimizer,
    rel_close,
    resume,
    run_layout,
    train,
    train_save_continue,
)
from tests.support.offline_cli import run_cli


def _torch_train_dcp_save_continue(path: str):
    """torch's runtime at (2, 2): 5 steps, ``dcp.save`` of torch's own state dicts, 5 more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    layout = LAYOUTS["dp2tp2"]
    model = build("torch", layout, seed=0)
    opt = optimizer(model)
    first = train(model, opt, layout, range(5))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = full_state(model, opt)
    rest = train(model, opt, layout, range(5, 10))
    return on_rank0({"losses": first + rest, "saved": saved})


@pytest.fixture(scope="module")
def torch_dcp(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("torchdcp") / "dp2tp2")
    return path, run_layout("dp2tp2", _torch_train_dcp_save_continue, path)


@pytest.mark.parametrize("runtime,layout", [("torch", "dp1tp4"), ("shardkit", "fsdp3")])
def test_dcp_of_torch_fsdp_tp_at_2x2_loads_into_shardkit(torch_dcp, runtime, layout):
    path, reference = torch_dcp
    out = run_layout(layout, resume, path, runtime, layout)
    assert mismatches(reference["saved"], out["loaded"]) == []
    assert rel_close(out["losses"], reference["losses"][5:]), (out["losses"], reference["losses"][5:])


def _torch_dcp_load_resume(path: str):
    """torch's runtime at (2, 2), fresh: ``dcp.load`` of torch's own state dicts, then 5 more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    layout = LAYOUTS["dp2tp2"]
    model = build("torch", layout, seed=123)
    opt = optimizer(model)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = full_state(model, opt)
    return on_rank0({"loaded": loaded, "losses": train(model, opt, layout, range(5, 10))})


def test_shardkit_2x2_checkpoint_loads_with_dcp_load_after_convert_to_dcp(tmp_path):
    url, out = str(tmp_path / "native"), str(tmp_path / "dcp")
    reference = run_layout("dp2tp2", train_save_continue, url, "torch", "dp2tp2")
    result = run_cli("convert", url, out, "--to", "dcp")
    assert result.exit_code == 0, result.stderr
    loaded = run_layout("dp2tp2", _torch_dcp_load_resume, out)
    assert mismatches(reference["saved"], loaded["loaded"]) == []
    assert rel_close(loaded["losses"], reference["losses"][5:]), (loaded["losses"], reference["losses"][5:])
