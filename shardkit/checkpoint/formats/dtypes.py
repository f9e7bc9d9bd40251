"""Dtypes as the format names them: the safetensors codes (docs/format.md) and byte views.

The codes are the format's vocabulary for every file it writes or reads, so
they live in one table; ``itemsize`` is the geometry's, extended to codes, because
dtype codes and sizes go together at every call site.  Where a dtype is asked of
a code (``"F32"``) rather than a ``torch.dtype`` -- a byte passthrough that never
imports torch -- :func:`itemsize` and :func:`dtype_to_code` take it as is, and
:func:`dtype_spelling` names it as ``str(torch.float32)`` does, so a plan salted
with dtype names is the same whichever way its dtypes were given.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

from shardkit.checkpoint.geometry.boxes import itemsize as dtype_itemsize
from shardkit.errors import InvalidManifest, UnsupportedFormat

if TYPE_CHECKING:
    import torch

__all__ = ["CODE_ITEMSIZE", "CODE_TORCH_NAMES", "dtype_to_code", "code_to_dtype", "code_itemsize", "itemsize",
           "dtype_spelling", "as_bytes", "is_tensor"]

# float8 kinds that only newer torch releases define: stored when the running torch has them
_NEWER_FLOAT8 = (("F8_E8M0", "e8m0fnu"), ("F8_E4M3FNUZ", "e4m3fnuz"), ("F8_E5M2FNUZ", "e5m2fnuz"))

# bytes per element of every code the format knows, without torch: what a byte passthrough needs of a dtype
CODE_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "F16": 2,
                 "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, **{code: 1 for code, _ in _NEWER_FLOAT8}}

# the torch dtype of every code, by its name in torch (``torch.<name>``): the one code -> dtype table, from which
# the dtypes (when torch is imported) and their spelling (without it) both come
CODE_TORCH_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
                    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                    **{code: f"float8_{name}" for code, name in _NEWER_FLOAT8}}


@functools.cache
def _tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    import torch

    codes = {code: getattr(torch, name) for code, name in CODE_TORCH_NAMES.items() if hasattr(torch, name)}
    return codes, {v: k for k, v in codes.items()}


def is_tensor(data: Any) -> bool:
    """Whether ``data`` is a torch tensor (asked without importing torch: a tensor exists only once it is)."""
    torch_ = sys.modules.get("torch")
    return torch_ is not None and isinstance(data, torch_.Tensor)


def itemsize(dtype: torch.dtype | str) -> int:
    """Bytes per element of a ``torch.dtype`` or of a dtype code (``"F32"``, without torch)."""
    if isinstance(dtype, str):
        return code_itemsize(dtype)
    return dtype_itemsize(dtype)


def dtype_spelling(dtype: torch.dtype | str) -> str:
    """``str(dtype)`` of a ``torch.dtype``, or of the dtype a code names (``"F32"`` -> ``"torch.float32"``)."""
    if isinstance(dtype, str):
        code_itemsize(dtype)  # an unknown code is refused here, as anywhere
        return f"torch.{CODE_TORCH_NAMES[dtype]}"
    return str(dtype)


def dtype_to_code(dtype: torch.dtype | str) -> str:
    """The code of a ``torch.dtype``; a code is its own."""
    if isinstance(dtype, str):
        if dtype in CODE_ITEMSIZE:
            return dtype
        raise UnsupportedFormat(f"dtype {dtype} cannot be stored (supported: {sorted(CODE_ITEMSIZE)})")
    try:
        return _tables()[1][dtype]
    except KeyError:
        raise UnsupportedFormat(f"dtype {dtype} cannot be stored (supported: {sorted(_tables()[0])}); "
                                f"convert the tensor first") from None


def code_to_dtype(code: Any, where: str = "") -> torch.dtype:
    """The ``torch.dtype`` of dtype code ``code``: one vocabulary (:func:`code_itemsize`'s) decides whether
    the code is ours; a code of ours that this torch does not define says so, not that it is unknown."""
    code_itemsize(code, where)
    dtype = _tables()[0].get(code)
    if dtype is None:
        import torch

        raise InvalidManifest(f"dtype {code}{' in ' + where if where else ''} is not defined by torch "
                              f"{torch.__version__}; upgrade torch to read it")
    return dtype


def code_itemsize(code: Any, where: str = "") -> int:
    """Bytes per element of dtype code ``code``, without torch (a code no torch defines is refused where a
    tensor of it is made)."""
    if not isinstance(code, str) or code not in CODE_ITEMSIZE:
        raise InvalidManifest(f"unknown dtype {code!r}{' in ' + where if where else ''}; "
                              f"known: {sorted(CODE_ITEMSIZE)}")
    return CODE_ITEMSIZE[code]


def as_bytes(tensor: torch.Tensor | Any) -> torch.Tensor | memoryview:
    """A flat ``uint8`` view of a contiguous tensor (no copy); of any other buffer, a flat byte memoryview."""
    if not is_tensor(tensor):
        return memoryview(tensor).cast("B")
    if not tensor.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    import torch

    return tensor.reshape(-1).view(torch.uint8)
