"""Dtypes as the format names them: the safetensors codes (docs/format.md) and byte views.

The codes are the format's vocabulary for every file it writes or reads, so
they live in one table; ``itemsize`` is re-exported from the geometry because
dtype codes and sizes go together at every call site.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.geometry.boxes import (
    itemsize,  # re-exported: dtype codes and sizes go together
)
from shardkit.errors import InvalidManifest, UnsupportedFormat

if TYPE_CHECKING:
    import torch

__all__ = ["CODE_ITEMSIZE", "dtype_to_code", "code_to_dtype", "code_itemsize", "itemsize", "as_bytes"]

# float8 kinds that only newer torch releases define: stored when the running torch has them
_NEWER_FLOAT8 = (("F8_E8M0", "e8m0fnu"), ("F8_E4M3FNUZ", "e4m3fnuz"), ("F8_E5M2FNUZ", "e5m2fnuz"))

# bytes per element of every code the format knows, without torch: what a byte passthrough needs of a dtype
CODE_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "F16": 2,
                 "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, **{code: 1 for code, _ in _NEWER_FLOAT8}}


@functools.cache
def _tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    import torch

    codes = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
             "U16": torch.uint16, "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64,
             "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
             "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
             **{code: getattr(torch, f"float8_{name}") for code, name in _NEWER_FLOAT8
                if hasattr(torch, f"float8_{name}")}}
    return codes, {v: k for k, v in codes.items()}


def dtype_to_code(dtype: torch.dtype) -> str:
    try:
        return _tables()[1][dtype]
    except KeyError:
        raise UnsupportedFormat(f"dtype {dtype} cannot be stored (supported: {sorted(_tables()[0])}); "
                                f"convert the tensor first") from None


def code_to_dtype(code: Any, where: str = "") -> torch.dtype:
    codes = _tables()[0]
    if not isinstance(code, str) or code not in codes:
        raise InvalidManifest(f"unknown dtype {code!r}{' in ' + where if where else ''}; "
                              f"known: {sorted(codes)}")
    return codes[code]


def code_itemsize(code: Any, where: str = "") -> int:
    """Bytes per element of dtype code ``code``, without torch (a code no torch defines is refused where a
    tensor of it is made)."""
    if not isinstance(code, str) or code not in CODE_ITEMSIZE:
        raise InvalidManifest(f"unknown dtype {code!r}{' in ' + where if where else ''}; "
                              f"known: {sorted(CODE_ITEMSIZE)}")
    return CODE_ITEMSIZE[code]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    import torch

    return tensor.reshape(-1).view(torch.uint8)
