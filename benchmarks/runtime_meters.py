"""The memory meters of ``benchmarks/runtime.py``'s ranks (its docstring says what is measured and why): the
peak of malloc's bytes in use since a reset, sampled on a thread (glibc ``mallinfo2``), its CUDA counterpart
from the allocator's own peak, and the process's high-water mark (``VmHWM``)."""

from __future__ import annotations

import ctypes
import threading
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_reader():
    """Bytes malloc holds for the program (glibc >= 2.33), or None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def read() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    return read


def hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class HeapPeak:
    """Peak of malloc's bytes in use since the last ``reset()``, from a sampling thread."""

    def __init__(self) -> None:
        self.read = _heap_reader()
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.read:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(0.0005)

    def reset(self) -> None:
        if self.read:
            self.start = self.peak = self.read()

    def above_start_mib(self) -> float:
        return (max(self.peak, self.read()) - self.start) / 2**20 if self.read else float("nan")

    def stop(self) -> None:
        self._stop.set()


class DevicePeak:
    """The CUDA side of :class:`HeapPeak`: peak of the device memory allocated since the last ``reset()``."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda
        self.start = 0

    def read(self) -> int:
        return self.cuda.memory_allocated()

    @property
    def peak(self) -> int:
        return self.cuda.max_memory_allocated()

    def reset(self) -> None:
        self.cuda.synchronize()
        self.cuda.reset_peak_memory_stats()
        self.start = self.read()

    def above_start_mib(self) -> float:
        self.cuda.synchronize()
        return (self.peak - self.start) / 2**20

    def stop(self) -> None:
        pass
