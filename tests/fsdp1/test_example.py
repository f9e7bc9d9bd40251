"""The FSDP1 training example runs on shardkit with only its imports changed:
at 2 ranks under torchrun, in fp32 it matches single-process training, and
both of its checkpoints resume to the same losses.  With torch's imports
(and, on CPU-only torch, without ``offload_to_cpu``) torch's own FSDP1 runs
the same file to the same losses."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest
import torch

from tests.support.dist import run_on_ranks, run_torchrun

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp1_migration.py"


def _load_example(path: str | Path = EXAMPLE):
    spec = importlib.util.spec_from_file_location("fsdp1_migration_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, *args):
    result = run_torchrun(EXAMPLE, 2, ["--checkpoint-dir", str(tmp_path), *args], timeout=240)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return _phases(result.stdout.splitlines())


def _phases(lines: list[str]) -> dict[str, list[float]]:
    """The example's JSON lines as {phase: [loss per step]}."""
    phases: dict[str, list[float]] = {}
    for record in (json.loads(line) for line in lines if line.startswith("{")):
        phases.setdefault(record["phase"], []).append(record["loss"])
    return phases


def _single_process_losses(example, steps: int) -> list[float]:
    """The example's model, data and optimizer in one process on the whole global batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks (OMP_NUM_THREADS=1): same kernels, same summation order
    try:
        return _train_one_process(example, steps)
    finally:
        torch.set_num_threads(threads)


def _train_one_process(example, steps: int) -> list[float]:
    model = example.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        parts = [example.make_batch(step, rank) for rank in range(2)]
        batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_only_the_imports_differ_from_the_fsdp1_script():
    source = EXAMPLE.read_text()
    start = source.index("# --- the only lines")
    block = source[start:source.index("# ----", start + 5)]
    code = re.sub(r'""".*?"""', "", source.replace(block, ""), flags=re.S)  # docstrings aside
    assert "shardkit" not in code and "torch.distributed.fsdp" not in code
    assert "from shardkit import" in block and "from shardkit.wrap import transformer_auto_wrap_policy" in block


FP32_ARGS = ["--mixed-precision", "none", "--steps", "4", "--resume-steps", "2"]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    """The example at 2 ranks under torchrun in fp32: (checkpoint dir, losses per phase)."""
    root = tmp_path_factory.mktemp("fsdp1-example-fp32")
    return root, _run(root, *FP32_ARGS)


def test_example_in_fp32_matches_single_process_training_and_resumes_identically(fp32_run):
    tmp_path, phases = fp32_run
    reference = _single_process_losses(_load_example(), 6)
    ours = phases["train"] + phases["continue"]
    assert len(ours) == 6
    for step, (a, b) in enumerate(zip(ours, reference)):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {a!r} vs single process {b!r}"
    assert phases["resume-sharded"] == phases["continue"]
    assert phases["resume-full"] == phases["continue"]
    assert (tmp_path / "model.pt").is_file() and (tmp_path / "optim.pt").is_file()
    assert (tmp_path / "sharded" / ".metadata").is_file()


def _run_in_rank(argv: list[str], path: str = str(EXAMPLE)) -> list[str]:
    """The example's ``run`` on an already-formed process group (no torchrun start-up)."""
    example = _load_example(path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        example.run(example.parse_args(argv))
    return out.getvalue().splitlines()


def test_example_in_bf16_mixed_precision_trains_and_resumes(tmp_path):
    lines = run_on_ranks(2, _run_in_rank, ["--steps", "3", "--resume-steps", "2", "--checkpoint-dir", str(tmp_path)])[0]
    phases = _phases(lines)
    reference = _single_process_losses(_load_example(), 5)
    ours = phases["train"] + phases["continue"]
    # bf16 compute and reduction: close to fp32 training, not equal
    for a, b in zip(ours, reference):
        assert abs(a - b) <= 2e-2 * abs(b)
    assert phases["resume-sharded"] == phases["continue"]
    assert phases["resume-full"] == phases["continue"]


def _with_torch_imports(path: Path) -> Path:
    """The example with its import block swapped for torch's FSDP1 imports
    (and, on CPU-only torch, ``offload_to_cpu=True`` dropped: torch's FSDP1
    crashes on it there)."""
    source = EXAMPLE.read_text()
    start = source.index("# --- the only lines")
    block = source[start:source.index("# ----", start + 5)]
    torch_block = block.replace("from shardkit import", "from torch.distributed.fsdp import").replace(
        "from shardkit.wrap import", "from torch.distributed.fsdp.wrap import")
    variant = source.replace(block, torch_block)
    if not torch.cuda.is_available():
        offloading = "FullStateDictConfig(offload_to_cpu=True, rank0_only=True)"
        assert offloading in variant
        variant = variant.replace(offloading, "FullStateDictConfig(rank0_only=True)")
    assert variant.count("torch.distributed.fsdp") >= 2 and "shardkit" not in re.sub(r'""".*?"""', "", variant,
                                                                                     flags=re.S)
    path.write_text(variant)
    return path


def test_the_same_file_with_torch_imports_runs_on_torch_fsdp1_to_the_same_losses(fp32_run, tmp_path):
    _, ours = fp32_run
    script = _with_torch_imports(tmp_path / "torch_fsdp1_migration.py")
    lines = run_on_ranks(2, _run_in_rank, [*FP32_ARGS, "--checkpoint-dir", str(tmp_path)], str(script))[0]
    theirs = _phases(lines)
    for phase in ("train", "continue", "resume-sharded"):
        assert theirs[phase] == ours[phase], phase  # bitwise: same kernels, same reduction order
    # torch's full checkpoint restores the weights (its first resumed loss matches) but not AdamW's moments: on
    # CPU with use_orig_params=True its full_optim_state_dict returns exp_avg equal to exp_avg_sq (example docstring)
    assert len(theirs["resume-full"]) == 2 and theirs["resume-full"][0] == ours["resume-full"][0]
