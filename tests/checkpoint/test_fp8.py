"""FP8 and the other one-byte float dtypes: saved, loaded, resharded and converted bit for bit through every
format that can hold them; tensor subclasses whose bytes are not their values are refused by name."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map

import shardkit.checkpoint as skc
from shardkit.errors import UnsupportedFormat
from tests.support.dist import run_on_ranks

FP8 = [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fnuz",
                                         "float8_e5m2fnuz") if hasattr(torch, name)]


def fp8_state() -> dict[str, torch.Tensor]:
    """One tensor per one-byte float dtype, every byte pattern included (NaNs and infinities too)."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for i, dtype in enumerate(FP8):
        raw = torch.cat([torch.arange(256, dtype=torch.uint8), torch.randint(0, 256, (37 * 24 - 256,), generator=g,
                                                                            dtype=torch.uint8)])
        out[f"layers.{i}.weight"] = raw.view(dtype).reshape(37, 24)
    out["layers.scale"] = torch.rand(37, generator=g)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in a)


def empty_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in state.items()}


def test_native_save_and_load_keep_every_fp8_bit(tmp_path):
    state = {"model": fp8_state()}
    skc.save(state, str(tmp_path / "ckpt"))
    out = {"model": empty_like_state(state["model"])}
    skc.load(out, str(tmp_path / "ckpt"))
    assert same_bits(out["model"], state["model"])
    assert skc.verify(str(tmp_path / "ckpt")).ok


@pytest.mark.parametrize("to, name", [("hf", "hf"), ("dcp", "dcp"), ("torch", "state.pt"), ("shardkit", "again")])
def test_fp8_converts_bit_for_bit_and_the_other_tools_read_it(tmp_path, to, name):
    state = {"model": fp8_state()}
    skc.save(state, str(tmp_path / "ckpt"))
    dst = str(tmp_path / name)
    skc.convert(str(tmp_path / "ckpt"), dst, to=to)
    out = {"model": empty_like_state(state["model"])}
    skc.load(out, dst)
    assert same_bits(out["model"], state["model"])
    assert skc.verify(dst).ok
    if to == "hf":  # the safetensors library reads the dtypes it knows
        from safetensors.torch import load_file

        theirs = load_file(str(tmp_path / name / "model.safetensors"))
        assert same_bits(theirs, state["model"])
    elif to == "torch":
        assert same_bits(torch.load(dst, weights_only=True)["model"], state["model"])
    elif to == "dcp":
        import torch.distributed.checkpoint as dcp

        theirs = {"model": empty_like_state(state["model"])}
        dcp.load(theirs, checkpoint_id=dst)
        assert same_bits(theirs["model"], state["model"])


def test_fp8_written_by_torch_save_and_dcp_loads_bit_for_bit(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": fp8_state()}
    torch.save(state, tmp_path / "state.pt")
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    for src in (tmp_path / "state.pt", tmp_path / "dcp"):
        out = {"model": empty_like_state(state["model"])}
        skc.load(out, str(src))
        assert same_bits(out["model"], state["model"]), src


def _sharded(values: dict[str, torch.Tensor], ranks: int) -> dict[str, torch.Tensor]:
    """``Shard(0)`` DTensors of ``values``, each rank's rows cut locally (gloo cannot scatter FP8)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ranks,))
    return {k: DTensor.from_local(v.chunk(ranks)[dist.get_rank()].clone(), mesh, [Shard(0)], run_check=False,
                                  shape=v.shape, stride=v.stride()) for k, v in values.items()}


def _save_sharded(url: str) -> None:
    skc.save({"model": _sharded(fp8_state(), 2)}, url)


def _load_sharded(url: str) -> bool:
    import torch.distributed as dist

    truth = fp8_state()
    state = {"model": _sharded({k: torch.zeros_like(v.view(torch.uint8)).view(v.dtype) for k, v in truth.items()}, 3)}
    skc.load(state, url)
    return same_bits({k: v.to_local() for k, v in state["model"].items()},
                     {k: v.chunk(3)[dist.get_rank()] for k, v in truth.items()})


def test_fp8_dtensors_saved_at_two_ranks_load_at_three_and_reshard_offline(tmp_path):
    url = str(tmp_path / "ckpt")
    run_on_ranks(2, _save_sharded, url)
    assert run_on_ranks(3, _load_sharded, url) == [True] * 3
    skc.reshard(url, str(tmp_path / "ws4"), world_size=4)
    out = {"model": empty_like_state(fp8_state())}
    skc.load(out, str(tmp_path / "ws4"))
    assert same_bits(out["model"], fp8_state())


class ScaledFloat8(torch.Tensor):
    """A wrapper subclass as float8 training libraries make them: FP8 bytes and a scale, standing for
    ``bytes * scale`` in float32."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: float):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32)

    def __init__(self, data: torch.Tensor, scale: float) -> None:
        self.data_fp8, self.scale = data, scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.data_fp8.float() * x.scale if isinstance(x, ScaledFloat8) else x
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_a_tensor_subclass_whose_bytes_are_not_its_values_is_refused_by_name(tmp_path):
    weight = ScaledFloat8(torch.randn(8, 8).to(torch.float8_e4m3fn), 0.5)
    for save in (skc.save, lambda sd, url: skc.async_save(sd, url, writer="thread").result()):
        with pytest.raises(UnsupportedFormat, match="ScaledFloat8"):
            save({"model": {"w": weight, "b": torch.zeros(8)}}, str(tmp_path / "ckpt"))
        assert not (tmp_path / "ckpt").exists()


def test_a_plain_python_subclass_is_its_bytes_and_saves(tmp_path):
    class Tagged(torch.Tensor):
        pass

    t = torch.randn(5).as_subclass(Tagged)
    skc.save({"t": t}, str(tmp_path / "ckpt"))
    out = {"t": torch.empty(5)}
    skc.load(out, str(tmp_path / "ckpt"))
    assert torch.equal(out["t"], t.as_subclass(torch.Tensor))


# -- blockwise-scaled FP8 checkpoints (DeepSeek-V3's layout), dequantized by --dtype ---------------------

def reference_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The published formula, block by block: ``y[i, j] = x[i, j] * s[i // 128, j // 128]`` in float32."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            rows, cols = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
            out[rows, cols] = weight[rows, cols].to(torch.float32) * scale_inv[bi, bj]
    return out.to(dtype)


def fp8_hf_folder(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(11)
    tensors = {
        "model.layers.0.mlp.down_proj.weight": (torch.randn(300, 200, generator=g) * 4).to(torch.float8_e4m3fn),
        "model.layers.0.mlp.down_proj.weight_scale_inv": torch.rand(3, 2, generator=g) / 100,
        "model.layers.0.mlp.gate_proj.weight": (torch.randn(130, 257, generator=g) * 4).to(torch.float8_e4m3fn),
        "model.layers.0.mlp.gate_proj.weight_scale_inv": torch.rand(2, 3, generator=g) / 100,
        "model.norm.weight": torch.rand(200, generator=g).to(torch.bfloat16),
    }
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def test_convert_dtype_dequantizes_blockwise_fp8_like_the_published_formula(tmp_path):
    from safetensors.torch import load_file

    from tests.support.offline_cli import run_cli

    src = fp8_hf_folder(tmp_path / "fp8")
    result = run_cli("convert", str(tmp_path / "fp8"), str(tmp_path / "bf16"), "--to", "hf", "--dtype", "bf16")
    assert result.exit_code == 0, result.stderr
    out = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert not any(k.endswith("_scale_inv") for k in out)
    for key in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        assert out[key].dtype == torch.bfloat16
        assert torch.equal(out[key], reference_dequant(src[key], src[key + "_scale_inv"], torch.bfloat16)), key
    assert torch.equal(out["model.norm.weight"], src["model.norm.weight"])


def test_reshard_dequantizes_boxes_that_do_not_start_on_a_block_edge(tmp_path):
    src = fp8_hf_folder(tmp_path / "fp8")
    skc.reshard(str(tmp_path / "fp8"), str(tmp_path / "ws3"), world_size=3, dtype="fp32")  # rows 100, 100, 100
    key = "model.layers.0.mlp.down_proj.weight"
    reader = skc.open_reader(str(tmp_path / "ws3"))
    assert [c.shape[0] for c in reader.tensors()[f"model.{key}"].chunks] == [100, 100, 100]
    assert not any(k.endswith("_scale_inv") for k in reader.tensors())
    out = {f"model.{key}": torch.empty(300, 200)}
    skc.load(out, str(tmp_path / "ws3"), strict=False)
    assert torch.equal(out[f"model.{key}"], reference_dequant(src[key], src[key + "_scale_inv"], torch.float32))


def test_fp8_without_dtype_is_copied_as_it_is_scales_included(tmp_path):
    src = fp8_hf_folder(tmp_path / "fp8")
    skc.convert(str(tmp_path / "fp8"), str(tmp_path / "copy"), to="shardkit")
    entries = skc.open_reader(str(tmp_path / "copy")).tensors()
    assert {k[len("model."):] for k in entries} == set(src)


def test_a_scale_that_is_not_one_per_block_is_refused_naming_both_keys(tmp_path):
    from safetensors.torch import save_file

    from shardkit.errors import ConfigurationError

    (tmp_path / "fp8").mkdir()
    save_file({"w.weight": torch.zeros(300, 200).to(torch.float8_e4m3fn), "w.weight_scale_inv": torch.ones(2, 2)},
              str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ConfigurationError, match="w.weight_scale_inv.*w.weight"):
        skc.convert(str(tmp_path / "fp8"), str(tmp_path / "out"), to="hf", dtype="bf16")
    assert not (tmp_path / "out").exists()
