"""Shared reads on the wire: messages per peer and round, in place or through the staging buffer.

Small blocks going to the same ranks are packed into one message in a slot
of the transfer buffer; a block travels alone and in place where its target
is contiguous memory on the wire's device.  On gloo the wire's device is the
CPU, so the rounds, slots and copies NCCL runs on a GPU are pinned down here
-- the bytes arrive bitwise (any dtype, strided targets, blocks bigger than
a round cut into rows or parts of rows), as bytes on both ends, the buffer
never holds more than one round, and a failure on one rank (a read, a copy,
the buffer itself) fails every rank without leaving any of them waiting.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch

from tests.support.dist import run_on_ranks
from tests.support.read_sharing import sharing_every_read

ROUND = 256  # bytes: far smaller than the tensors below, so they travel in many rounds
CPU = torch.device("cpu")


def _truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "rows": torch.randn(40, 6, generator=g),  # 960 bytes: runs of whole rows per round
        "wide": torch.randn(3, 100, generator=g).to(torch.bfloat16),  # a row (200 bytes) fits, two do not
        "long": torch.randint(-2**40, 2**40, (50,), generator=g),  # 400 bytes of int64: cut into elements
        "flags": torch.rand(7, 5, generator=g) > 0.5,
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "strided": torch.randn(12, 9, generator=g),  # received into a transposed view below
    }


HOLDERS = {"rows": [0, 1, 2], "wide": [1, 2], "long": [0, 2], "flags": [0, 1, 2], "scalar": [0, 1, 2],
           "strided": [0, 1], "own": [1]}


def _exchange_on_rank(pack_below: int) -> tuple[bool, int, int, int]:
    """(every target equals the truth bitwise, rounds, staging buffer bytes, bytes this rank read itself)."""
    import torch.distributed as dist

    from shardkit.checkpoint.formats.base import ReadRequest
    from shardkit.checkpoint.io.dist import Dist
    from shardkit.checkpoint.training.shared_reads import exchange, share_reads

    rank = dist.get_rank()
    truth = {**_truth(), "own": torch.arange(5.0)}
    requests = []
    for key, ranks in HOLDERS.items():
        if rank not in ranks:
            continue
        t = truth[key]
        out = torch.zeros(t.shape[::-1], dtype=t.dtype).t() if key == "strided" else torch.zeros_like(t)
        requests.append(ReadRequest(key, 0, ((0,) * t.dim(), tuple(t.shape)), out))
    plan = share_reads(requests, Dist(), round_bytes=ROUND, pack_below=pack_below)
    read_here = 0
    for r in plan.mine:  # what storage would have filled
        r.out.copy_(truth[r.fqn])
        read_here += r.out.numel() * r.out.element_size()
    held = exchange(plan, Dist())
    same = all(torch.equal(r.out, truth[r.fqn]) for r in requests)
    return same, plan.rounds, held, read_here


@pytest.mark.parametrize("pack_below", [ROUND, 1], ids=["packed", "alone"])
def test_shared_blocks_arrive_bitwise_in_rounds_that_never_stage_more_than_one_round(pack_below):
    results = run_on_ranks(3, _exchange_on_rank, pack_below)
    assert [same for same, *_ in results] == [True, True, True]
    assert all(rounds > 5 for _, rounds, _, _ in results)  # the tensors really were cut into rounds
    assert all(held <= ROUND for _, _, held, _ in results)
    # only the ranks with the strided target (0 and 1) need a buffer: rank 2's messages are single contiguous
    # blocks (packed or not), received in place
    assert [held > 0 for _, _, held, _ in results] == [True, True, False]
    # every shared tensor was read by one of its holders only: the ranks read the checkpoint once together
    truth = _truth()
    assert sum(read for *_, read in results) == sum(t.numel() * t.element_size() for t in truth.values()) + 20


def _exchange_counting_ops(targets: dict[str, torch.Tensor], round_bytes: int) -> tuple[bool, int, list]:
    """Two ranks that both need every tensor of ``targets``: (bitwise, buffer bytes, each round's ops as
    (op, dtype, whether the op's memory is a target's own))."""
    import torch.distributed as dist

    from shardkit.checkpoint.formats.base import ReadRequest
    from shardkit.checkpoint.io.dist import Dist
    from shardkit.checkpoint.training import shared_reads

    truth = {k: v.clone() for k, v in targets.items()}
    requests = [ReadRequest(k, 0, ((0,) * t.dim(), tuple(t.shape)), torch.zeros_like(t)) for k, t in truth.items()]
    plan = shared_reads.share_reads(requests, Dist(), round_bytes=round_bytes)
    for r in plan.mine:
        r.out.copy_(truth[r.fqn])
    pointers = {r.out.data_ptr() for r in requests}
    rounds: list = []
    original = dist.batch_isend_irecv

    def counting(ops):
        rounds.append([(op.op.__name__, str(op.tensor.dtype), op.tensor.data_ptr() in pointers) for op in ops])
        return original(ops)

    dist.batch_isend_irecv = counting
    try:
        held = shared_reads.exchange(plan, Dist(), wire=CPU)
    finally:
        dist.batch_isend_irecv = original
    return all(torch.equal(r.out, truth[r.fqn]) for r in requests), held, rounds


def _many_small_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return {f"layer{i}.bias": torch.randn(4 + i, generator=g) for i in range(20)}


def test_small_blocks_between_two_ranks_travel_as_one_message_of_bytes_each_way_per_round():
    results = run_on_ranks(2, _exchange_counting_ops, _many_small_tensors(), 1 << 16)
    assert [same for same, _, _ in results] == [True, True]
    # each rank reads about half of the 20 tensors: one send and one receive carry all of them
    assert [ops for _, _, ops in results] == [[[("isend", "torch.uint8", False), ("irecv", "torch.uint8", False)]]] * 2
    assert all(0 < held <= 1 << 16 for _, held, _ in results)


def test_a_contiguous_target_on_the_wires_device_is_sent_and_received_in_place_as_bytes():
    g = torch.Generator().manual_seed(4)
    targets = {"w": torch.randn(1024, 512, generator=g).to(torch.bfloat16),  # 1 MiB each: blocks that travel alone
               "mask": torch.rand(1 << 20, generator=g) > 0.5, "b": torch.randn(512, 512, generator=g),
               "step": torch.tensor(7, dtype=torch.int64)}  # alone too: the only small block of its reader
    results = run_on_ranks(2, _exchange_counting_ops, targets, 4 << 20)
    assert [same for same, _, _ in results] == [True, True]
    assert [held for _, held, _ in results] == [0, 0]  # no block went through the buffer
    for _, _, rounds in results:
        ops = [op for round_ops in rounds for op in round_ops]
        assert len(ops) == 4 and all(dtype == "torch.uint8" and own for _, dtype, own in ops), rounds


def test_blocks_cover_a_tensor_once_in_row_order_and_each_fits_the_limit():
    from shardkit.checkpoint.training.shared_reads import block_indices

    t = torch.arange(3 * 5 * 7, dtype=torch.int32).reshape(3, 5, 7)
    for limit in (16, 28, 60, 140, 300, 420):
        blocks = block_indices(t.shape, 4, limit)
        assert all(nbytes <= limit for _, nbytes in blocks), limit
        assert [nbytes for _, nbytes in blocks] == [t[index].numel() * 4 for index, _ in blocks]
        assert torch.equal(torch.cat([t[index].reshape(-1) for index, _ in blocks]), t.reshape(-1)), limit
    assert block_indices(t.shape, 4, 420) == [((), 420)]
    assert block_indices(t.shape, 4, 300) == [((slice(0, 2),), 280), ((slice(2, 3),), 140)]
    assert block_indices((), 8, 16) == [((), 8)]


def test_round_bytes_below_one_element_of_any_dtype_is_refused():
    from shardkit.checkpoint.io.dist import Dist
    from shardkit.checkpoint.training.shared_reads import share_reads
    from shardkit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="round_bytes must be at least 64 bytes"):
        share_reads([], Dist(), round_bytes=32)


SHAPES = {"model.emb": (101, 64), "model.w": (37, 26), "model.b": (26,)}


def _saved_truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import shardkit.checkpoint as skc

    url = str(tmp_path_factory.mktemp("wire") / "ck")
    skc.save(_saved_truth(), url, block_bytes=512)
    return url


def _load_through_the_staged_wire(url: str, fail: str | None) -> str:
    """Load at HSDP 2x2 (64 KiB rounds: the smaller tensors travel packed, through the buffer); with ``fail``,
    rank 1's storage read ("read"), its copies through the buffer ("staging") or the buffer itself ("buffer",
    as a GPU out of memory would) fails."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardkit.checkpoint as skc
    from shardkit.checkpoint.io.storage import Storage
    from shardkit.checkpoint.io.transfer_buffer import TransferBuffer
    from shardkit.checkpoint.training import load as load_module

    mesh = init_device_mesh("cpu", (2, 2))
    sd = {k: distribute_tensor(torch.zeros(s), mesh, [Replicate(), Shard(0)]) for k, s in SHAPES.items()}
    patched = [(load_module, "share_reads", functools.partial(load_module.share_reads, round_bytes=1 << 16))]
    if dist.get_rank() == 1 and fail == "read":
        def broken(self, name, start, parts):
            raise OSError(f"simulated I/O error reading {name}")
        patched.append((Storage, "read_parts", broken))
    if dist.get_rank() == 1 and fail == "staging":
        def broken_copy(self, start, tensor):
            raise RuntimeError("simulated failure copying a block through the transfer buffer")
        patched += [(TransferBuffer, "take", broken_copy), (TransferBuffer, "put", broken_copy)]
    if dist.get_rank() == 1 and fail == "buffer":
        def no_memory(self, nbytes, device):
            raise torch.OutOfMemoryError(f"simulated: no memory for a {nbytes}-byte transfer buffer")
        patched.append((TransferBuffer, "__init__", no_memory))
    saved_attrs = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, value in patched:
        setattr(owner, name, value)
    try:
        with sharing_every_read():  # these 30 KB travel, as a larger model's replicas would
            skc.load(sd, url)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        from shardkit.errors import ShardkitError

        return f"{'shardkit ' if isinstance(exc, ShardkitError) else ''}{type(exc).__name__}: {exc}"
    finally:
        for owner, name, value in saved_attrs:
            setattr(owner, name, value)
    truth = _saved_truth()
    return "bitwise" if all(torch.equal(v.full_tensor(), truth[k]) for k, v in sd.items()) else "different"


def test_a_load_at_hsdp_2x2_through_the_staged_wire_is_bitwise(saved):
    assert run_on_ranks(4, _load_through_the_staged_wire, saved, None) == ["bitwise"] * 4


@pytest.mark.parametrize("fail,message", [
    ("read", "simulated I/O error reading data/"),
    ("staging", "simulated failure copying a block through the transfer buffer"),
    ("buffer", "simulated: no memory for a"),
])
def test_a_failure_on_one_rank_of_a_staged_load_raises_on_every_rank_without_a_hang(saved, fail, message):
    outcomes = run_on_ranks(4, _load_through_the_staged_wire, saved, fail, timeout=30)
    assert all(message in outcome for outcome in outcomes), outcomes
    assert all(outcome.startswith("shardkit ") for outcome in outcomes), outcomes  # a shardkit error everywhere
    assert len({outcome.split(":")[0] for outcome in outcomes}) == 1, outcomes  # of the same class on every rank
    assert all("failed on rank 1" in outcome for rank, outcome in enumerate(outcomes) if rank != 1), outcomes


def _exchange_with_a_buffer_that_fails_on_rank(failing: int) -> str:
    import torch.distributed as dist

    from shardkit.checkpoint.formats.base import ReadRequest
    from shardkit.checkpoint.io.dist import Dist
    from shardkit.checkpoint.io.transfer_buffer import TransferBuffer
    from shardkit.checkpoint.training.shared_reads import exchange, share_reads

    out = torch.zeros(6, 4).t()  # strided: staged on every rank, so every rank sets up a buffer
    plan = share_reads([ReadRequest("w", 0, ((0, 0), (4, 6)), out)], Dist(), round_bytes=1024)
    original = TransferBuffer.__init__
    if dist.get_rank() == failing:
        def no_memory(self, nbytes, device):
            raise torch.OutOfMemoryError("simulated: no memory for the transfer buffer")
        TransferBuffer.__init__ = no_memory
    try:
        exchange(plan, Dist())
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"{type(exc).__name__}: {exc}"
    finally:
        TransferBuffer.__init__ = original
    return "exchanged"


def test_an_exchange_whose_buffer_fails_on_one_rank_raises_on_every_rank_naming_it_before_any_round():
    outcomes = run_on_ranks(3, _exchange_with_a_buffer_that_fails_on_rank, 1, timeout=30)
    assert outcomes[1] == "OutOfMemoryError: simulated: no memory for the transfer buffer"
    expected = ("CheckpointOutOfMemoryError: rank 1 could not set up the exchange of shared reads (OutOfMemoryError: "
                "simulated: no memory for the transfer buffer); no block was sent")
    assert [outcomes[0], outcomes[2]] == [expected, expected]


PACKAGE = Path(__file__).resolve().parents[3] / "shardkit"


def _top_level(path: Path) -> list[ast.stmt]:
    return ast.parse(path.read_text()).body


def test_shared_reads_lists_every_public_definition_in_all_and_nothing_else():
    from shardkit.checkpoint.training import shared_reads

    tree = _top_level(PACKAGE / "checkpoint" / "training" / "shared_reads.py")
    defined = {n.name for n in tree if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for n in tree if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert sorted(shared_reads.__all__) == sorted(n for n in defined if not n.startswith("_") and n != "log")


def test_no_public_class_of_shared_reads_shares_its_name_with_another_modules():
    ours = {n.name for n in _top_level(PACKAGE / "checkpoint" / "training" / "shared_reads.py")
            if isinstance(n, ast.ClassDef)}
    elsewhere = {n.name for path in PACKAGE.rglob("*.py") if path.name != "shared_reads.py"
                 for n in _top_level(path) if isinstance(n, ast.ClassDef)}
    assert ours & elsewhere == set()


def test_the_round_size_slot_alignment_and_byte_size_of_staged_transfers_are_defined_once():
    constants = {"ROUND_BYTES", "ALIGNMENT", "_ALIGNMENT"}
    helpers = {"aligned", "_aligned", "nbytes_of", "_nbytes"}
    found = sorted(
        (str(path.relative_to(PACKAGE)), name)
        for path in (PACKAGE / "checkpoint").rglob("*.py") for n in _top_level(path)
        for name in ([n.name] if isinstance(n, ast.FunctionDef) else
                     [t.id for t in n.targets if isinstance(t, ast.Name)] if isinstance(n, ast.Assign) else [])
        if name in constants | helpers)
    assert found == [("checkpoint/io/rounds.py", "ALIGNMENT"), ("checkpoint/io/rounds.py", "ROUND_BYTES"),
                     ("checkpoint/io/rounds.py", "aligned"), ("checkpoint/io/rounds.py", "nbytes_of")]
