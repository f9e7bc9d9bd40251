"""Dtypes as the format names them: the safetensors codes (docs/format.md) and byte views.

The codes are the format's vocabulary for every file it writes or reads, so
they live in one table; ``itemsize`` is re-exported from the geometry because
dtype codes and sizes go together at every call site.
"""

from __future__ import annotations

from typing import Any

import torch

from shardkit.checkpoint.geometry.boxes import (
    itemsize,  # re-exported: dtype codes and sizes go together
)
from shardkit.errors import InvalidManifest, UnsupportedFormat

__all__ = ["DTYPE_CODES", "dtype_to_code", "code_to_dtype", "itemsize", "as_bytes"]

# float8 kinds that only newer torch releases define: stored when the running torch has them
_NEWER_FLOAT8 = (("F8_E8M0", "e8m0fnu"), ("F8_E4M3FNUZ", "e4m3fnuz"), ("F8_E5M2FNUZ", "e5m2fnuz"))

DTYPE_CODES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64,
    "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    **{code: getattr(torch, f"float8_{name}") for code, name in _NEWER_FLOAT8 if hasattr(torch, f"float8_{name}")}}
_CODE_OF = {v: k for k, v in DTYPE_CODES.items()}


def dtype_to_code(dtype: torch.dtype) -> str:
    try:
        return _CODE_OF[dtype]
    except KeyError:
        raise UnsupportedFormat(f"dtype {dtype} cannot be stored (supported: {sorted(DTYPE_CODES)}); "
                                f"convert the tensor first") from None


def code_to_dtype(code: Any, where: str = "") -> torch.dtype:
    if not isinstance(code, str) or code not in DTYPE_CODES:
        raise InvalidManifest(f"unknown dtype {code!r}{' in ' + where if where else ''}; "
                              f"known: {sorted(DTYPE_CODES)}")
    return DTYPE_CODES[code]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return tensor.reshape(-1).view(torch.uint8)
