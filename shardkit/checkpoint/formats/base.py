"""The read and write interfaces every checkpoint format implements.

One engine serves three uses -- the online ``load`` (each rank plans its own
byte-range reads), the offline ``reshard`` and ``convert`` (no process group,
bounded memory) and ``inspect``/``verify``/``diff``.  They all see a checkpoint
through :class:`CheckpointReader`:

* :meth:`CheckpointReader.tensors` -- fqn -> :class:`TensorEntry` (dtype, global
  shape and the stored chunks, each a box with global offsets and a
  format-private ``locator``);
* :meth:`CheckpointReader.values` -- non-tensor state as JSON values;
* :meth:`CheckpointReader.aliases` -- tied keys stored once (listed by ``tensors`` too);
* :attr:`CheckpointReader.info` -- format, writer world size/mesh, user meta (step);
* :meth:`CheckpointReader.read` -- fill :class:`ReadRequest` s, each "this sub-box
  of this stored chunk into this tensor view".  Formats with ranged reads fetch
  only the bytes (and checksum blocks) a request covers; others read the chunk.
  ``read`` validates everything it can *before* writing into any ``out``.

Callers rarely build requests by hand: :func:`plan_reads` turns "fill this box
of this tensor into this view" into requests (and proves the stored chunks
cover it), and :func:`read_box` returns a fresh tensor for one box.

The write side is format-specific (see
:class:`~shardkit.checkpoint.formats.native.writer.NativeWriter` and
``safetensors.SafetensorsStreamWriter``); what they share is the :class:`WriteChunk`
a planner hands them.
"""

from __future__ import annotations

import abc
import math
import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from shardkit.checkpoint.formats.dtypes import as_bytes, is_tensor, itemsize
from shardkit.checkpoint.geometry.boxes import Box, box_contains
from shardkit.checkpoint.geometry.plan import ChunkIndex, plan_box
from shardkit.errors import IncompatibleStateDict

if TYPE_CHECKING:
    import torch

__all__ = ["Fetch", "StoredChunk", "TensorEntry", "CheckpointInfo", "ReadRequest", "ReadStats", "CheckpointReader",
           "WriteChunk", "plan_reads", "read_box", "contiguous_strides"]

# what a writer pulls the data through: ``fetch(fqn, offsets, shape)`` returns that box of the tensor
Fetch = Callable[[str, tuple[int, ...], tuple[int, ...]], "torch.Tensor"]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a row-major contiguous tensor of ``shape``: what every stored chunk is,
    and what a torch.save record must declare for its rows to be addressable by byte ranges."""
    strides, acc = [], 1
    for n in reversed(tuple(shape)):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


@dataclass(frozen=True)
class StoredChunk:
    """A box of a tensor as stored; ``locator`` is private to the format that made it."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    locator: Any = None

    @property
    def box(self) -> Box:
        return self.offsets, self.shape


@dataclass(frozen=True)
class TensorEntry:
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[StoredChunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @cached_property
    def index(self) -> ChunkIndex:
        return ChunkIndex([c.box for c in self.chunks])


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint says about itself."""

    format: str                          # "shardkit", "hf", "torch", "dcp"
    url: str
    version: int | None = None           # format version, when the format has one
    world_size: int | None = None        # writer world size, when known
    mesh: Mapping[str, Any] | None = None  # {"shape", "dim_names", "placements"} of the writer, when known
    meta: Mapping[str, Any] = field(default_factory=dict)  # user metadata (e.g. "step")
    # how the writer held its tensors, when known: [{"mesh": {"shape", "dim_names"}, "placements", "tensors"}]
    layouts: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class ReadRequest:
    """Copy the sub-box ``box`` (global coordinates) of stored chunk ``chunk`` of ``fqn`` into ``out``.

    ``out`` has shape ``box[1]`` and the entry's dtype; it may be a strided view
    into a bigger tensor (e.g. a rank's local shard).
    """

    fqn: str
    chunk: int
    box: Box
    out: torch.Tensor


class ReadStats:
    """Bytes fetched from storage vs bytes the requests needed (thread-safe counters)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_needed = 0
        self.requests = 0

    def add(self, read: int = 0, needed: int = 0, requests: int = 0) -> None:
        with self._lock:
            self.bytes_read += read
            self.bytes_needed += needed
            self.requests += requests


class CheckpointReader(abc.ABC):
    """A checkpoint opened for reading.  Use as a context manager or call :meth:`close`."""

    info: CheckpointInfo

    def __init__(self) -> None:
        self.stats = ReadStats()

    @abc.abstractmethod
    def tensors(self) -> Mapping[str, TensorEntry]:
        """Every stored tensor by flattened fqn."""

    @abc.abstractmethod
    def values(self) -> Mapping[str, Any]:
        """Every non-tensor value (JSON types) by flattened fqn."""

    def unreadable_values(self) -> Mapping[str, str]:
        """Key -> why, for each key of :meth:`values` shardkit lists but does not read (a pickle it does not
        run: torchtitan's data loader position in a DCP step); ``inspect`` and ``diff`` say so by name."""
        return {}

    def aliases(self) -> Mapping[str, str]:
        """Tied keys: ``{alias: key}`` for each key of :meth:`tensors` whose data is stored once under
        ``key`` (native checkpoints record them; other formats have none).  :meth:`tensors` lists the
        alias too, with the chunks of ``key``, so a reader of one key needs to know nothing of this."""
        return {}

    def declares_tied(self, fqn: str) -> bool:
        """Whether this checkpoint says ``fqn`` is tied to another key, so that whoever loads it fills
        ``fqn`` from that key even where nothing is stored under ``fqn``: by default when :meth:`aliases`
        records it (an HF folder decides by its config, see :mod:`~shardkit.checkpoint.formats.hf.reader`).
        ``diff`` takes a key one side lacks as its tied partner only when that side says so."""
        return fqn in self.aliases()

    @property
    def rereads_from_cache(self) -> bool:
        """Whether bytes read again right after they were read cost a memory copy (the page cache holds
        them) instead of a second fetch from storage.  An all-or-nothing load then checks them in a first
        pass and reads them again rather than staging them, which would fault in fresh memory for nothing;
        false by default (remote storage, formats not known to keep it cached): staging reads them once."""
        return False

    def focus(self, wanted: Mapping[str, Sequence[Box]]) -> None:
        """Before planning: the boxes (fqn -> boxes) that will be read.  A reader that fetches chunk
        records lazily fetches those that cover them, and only those; the others hold them all already."""

    @abc.abstractmethod
    def read(self, requests: Sequence[ReadRequest]) -> None:
        """Fill every request's ``out``.  Validate all requests before writing any."""

    def check_requests(self, requests: Sequence[ReadRequest]) -> list[TensorEntry]:
        """The entry of every request, after checking each names a stored chunk, lies inside it and has
        an ``out`` of the right dtype and shape -- all before any ``out`` is written."""
        entries = self.tensors()
        checked = []
        for r in requests:
            entry = entries.get(r.fqn)
            if (entry is None or not 0 <= r.chunk < len(entry.chunks) or r.out.dtype != entry.dtype
                    or tuple(r.out.shape) != tuple(r.box[1]) or not box_contains(entry.chunks[r.chunk].box, r.box)):
                raise IncompatibleStateDict(f"{r.fqn!r}: request for chunk {r.chunk}, box {list(r.box[0])} + "
                                            f"{list(r.box[1])} into {r.out.dtype} {tuple(r.out.shape)} does not "
                                            f"match {self.info.url}")
            checked.append(entry)
        return checked

    def prepare(self, requests: Sequence[ReadRequest]) -> None:  # noqa: B027 - optional
        """Check, without writing any ``out``, everything ``read(requests)`` can check up front
        (e.g. that the files it needs exist with the expected sizes).  ``load`` calls it on
        every rank before any rank writes a target tensor."""

    def verify(self, requests: Sequence[ReadRequest]) -> None:
        """Read and check every byte ``read(requests)`` would read, writing no ``out``.

        ``load(..., verify_first=True)`` calls it so that a damaged checkpoint
        leaves the targets untouched.  The default reads into scratch tensors.
        """
        import torch

        for r in requests:
            self.read([ReadRequest(r.fqn, r.chunk, r.box, torch.empty_like(r.out))])

    def close(self) -> None:  # noqa: B027 - optional for formats without resources
        pass

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True)
class WriteChunk:
    """One chunk a writer should store: box ``offsets``/``shape`` of ``fqn`` and its data.

    ``data`` is a tensor of ``shape`` in ``dtype`` (any strides, any device:
    :meth:`materialize` makes the contiguous CPU copy a writer needs, when it
    needs it) or a zero-argument callable producing one when the writer gets
    to it (so a writer holds one chunk at a time, and an offline reshard reads
    each chunk just in time).  A byte passthrough gives ``dtype`` as a code (``"F32"``) and ``data`` as
    the chunk's bytes, C order (any buffer): they are stored as they are.
    ``tensor_shape`` is the whole tensor's shape (the native writer lays its
    column strips on the tensor's grid); unknown, the chunk's own extent stands in.
    """

    fqn: str
    dtype: torch.dtype | str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    data: torch.Tensor | Any | Callable[[], torch.Tensor | Any]
    tensor_shape: tuple[int, ...] | None = None

    @property
    def columns(self) -> int:
        """The tensor's size along dim 1 (0 for a chunk of fewer than two dims)."""
        if len(self.shape) < 2:
            return 0
        return self.tensor_shape[1] if self.tensor_shape else self.offsets[1] + self.shape[1]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def materialize(self) -> torch.Tensor | memoryview:
        data = self.data() if callable(self.data) else self.data
        if not is_tensor(data):  # the chunk's bytes as they are stored (a passthrough): a flat byte view
            view = as_bytes(data)
            if view.nbytes != self.nbytes:
                raise ValueError(f"chunk of {self.fqn!r} at {list(self.offsets)}: {view.nbytes} bytes of data, "
                                 f"planned {self.nbytes} ({self.shape} {self.dtype})")
            return view
        if tuple(data.shape) != tuple(self.shape) or data.dtype != self.dtype:
            raise ValueError(f"chunk of {self.fqn!r} at {list(self.offsets)}: data has shape {tuple(data.shape)} "
                             f"{data.dtype}, planned {self.shape} {self.dtype}")
        if data.device.type != "cpu":
            return data.to("cpu").contiguous()
        return data if data.is_contiguous() else data.contiguous()


def plan_reads(reader: CheckpointReader, wanted: Iterable[tuple[str, Box, torch.Tensor]]) -> list[ReadRequest]:
    """Requests that fill each ``(fqn, box, out)``: ``out`` has the box's shape (any strides).

    Raises :class:`~shardkit.errors.IncompatibleStateDict` for an unknown fqn,
    a dtype mismatch, or a box outside the tensor, and
    :class:`~shardkit.errors.CorruptCheckpoint` when stored chunks do not cover the box.
    """
    entries = reader.tensors()
    requests: list[ReadRequest] = []
    for fqn, box, out in wanted:
        entry = entries.get(fqn)
        if entry is None:
            raise IncompatibleStateDict(f"{fqn!r} is not a tensor in {reader.info.url}")
        if out.dtype != entry.dtype:
            raise IncompatibleStateDict(f"{fqn!r}: checkpoint holds {entry.dtype}, the target is {out.dtype}")
        offsets, shape = box
        if (len(offsets) != len(entry.shape)
                or any(o < 0 or o + s > n for o, s, n in zip(offsets, shape, entry.shape))):
            raise IncompatibleStateDict(f"{fqn!r}: box at {list(offsets)} of shape {list(shape)} lies outside the "
                                        f"stored shape {list(entry.shape)}")
        if tuple(out.shape) != tuple(shape):
            raise IncompatibleStateDict(f"{fqn!r}: destination has shape {tuple(out.shape)}, box has {tuple(shape)}")
        for piece in plan_box(entry.index, box, f"{fqn!r} in {reader.info.url}"):
            index = tuple(slice(po - bo, po - bo + ps) for po, bo, ps in zip(piece.box[0], offsets, piece.box[1]))
            requests.append(ReadRequest(fqn, piece.chunk, piece.box, out[index]))
    return requests


def read_box(reader: CheckpointReader, fqn: str, box: Box | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Read one box (default: the whole tensor) of ``fqn`` into ``out`` or a new tensor."""
    import torch

    entry = reader.tensors().get(fqn)
    if entry is None:
        raise IncompatibleStateDict(f"{fqn!r} is not a tensor in {reader.info.url}")
    if box is None:
        box = ((0,) * len(entry.shape), entry.shape)
    if out is None:
        out = torch.empty(box[1], dtype=entry.dtype)
    reader.read(plan_reads(reader, [(fqn, box, out)]))
    return out
