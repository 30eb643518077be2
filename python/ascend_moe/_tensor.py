"""numpy arrays <-> `amoe_tensor` descriptors, and shape-only metadata."""

from __future__ import annotations

import ctypes
from ctypes import c_size_t

import ml_dtypes
import numpy as np

from ._lib import MAX_NDIM, AmoeError, Status, Tensor

# amoe_dtype codes by dtype name (numpy, ml_dtypes and torch names agree on these).
# Codes 5..=9 are the one-byte dtypes data movement carries as exact bytes
# (quantized hidden states, packed fp4 as uint8, masks); reductions refuse them.
DTYPE_CODES = {
    "float32": 0,
    "float16": 1,
    "bfloat16": 2,
    "int32": 3,
    "int64": 4,
    "int8": 5,
    "uint8": 6,
    "bool": 7,
    "float8_e4m3fn": 8,
    "float8_e5m2": 9,
}
NUMPY_DTYPES = {
    0: np.dtype(np.float32),
    1: np.dtype(np.float16),
    2: np.dtype(ml_dtypes.bfloat16),
    3: np.dtype(np.int32),
    4: np.dtype(np.int64),
    5: np.dtype(np.int8),
    6: np.dtype(np.uint8),
    7: np.dtype(np.bool_),
    8: np.dtype(ml_dtypes.float8_e4m3fn),
    9: np.dtype(ml_dtypes.float8_e5m2),
}


def dtype_name(dtype) -> str:
    """`float32`, `bfloat16`, ... for a numpy / ml_dtypes / torch dtype or a name."""
    s = str(dtype)
    return s[len("torch.") :] if s.startswith("torch.") else (np.dtype(dtype).name if not isinstance(dtype, str) else s)


def dtype_code(arg: str, dtype) -> int:
    name = dtype_name(dtype)
    if name not in DTYPE_CODES:
        raise AmoeError(
            Status.DTYPE,
            f"`{arg}` has dtype {name}, expected one of float32, float16, bfloat16 (ml_dtypes), int32, int64, "
            "int8, uint8, bool, float8_e4m3fn, float8_e5m2 (ml_dtypes)",
        )
    return DTYPE_CODES[name]


class Desc:
    """An `amoe_tensor` for a host array (or for a shape + dtype only), keeping
    everything it points to alive."""

    def __init__(self, arg: str, shape, dtype, array: np.ndarray | None = None):
        shape = tuple(int(s) for s in shape)
        if len(shape) > MAX_NDIM:
            raise AmoeError(Status.SHAPE, f"`{arg}` has {len(shape)} dims, at most {MAX_NDIM} are supported")
        self.array = array
        self.shape_buf = (c_size_t * max(len(shape), 1))(*shape)
        self.c = Tensor()
        self.c.data = array.ctypes.data if array is not None else None
        self.c.dtype = dtype_code(arg, dtype)
        self.c.ndim = len(shape)
        self.c.shape = ctypes.cast(self.shape_buf, ctypes.POINTER(c_size_t))
        self.c.strides = None
        self.c.device_kind = 0
        self.c.device_ordinal = 0

    @property
    def ptr(self):
        return ctypes.pointer(self.c)


def as_array(arg: str, x) -> np.ndarray:
    """`x` as a C-contiguous numpy array of a supported dtype (no copy when it already is one)."""
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__array__") or isinstance(x, (list, tuple)):
            x = np.asarray(x)
        else:
            raise AmoeError(Status.INVALID_ARGUMENT, f"`{arg}` must be a numpy array, got {type(x).__name__}")
    dtype_code(arg, x.dtype)
    return np.ascontiguousarray(x)


def desc_in(arg: str, x) -> Desc:
    a = as_array(arg, x)
    return Desc(arg, a.shape, a.dtype, a)


def desc_opt(arg: str, x) -> Desc | None:
    return None if x is None else desc_in(arg, x)


def desc_meta(arg: str, x) -> Desc:
    """A descriptor with shape and dtype only: `x` is anything with `.shape` and
    `.dtype` (numpy array, torch tensor incl. meta / fake tensors) or a
    `(shape, dtype)` pair."""
    if isinstance(x, tuple) and len(x) == 2 and not hasattr(x, "shape"):
        shape, dtype = x
    else:
        shape, dtype = x.shape, x.dtype
    return Desc(arg, tuple(shape), dtype)


def desc_meta_opt(arg: str, x) -> Desc | None:
    return None if x is None else desc_meta(arg, x)


def empty(shape, code: int) -> np.ndarray:
    return np.empty(tuple(shape), dtype=NUMPY_DTYPES[code])


def ptr(d: Desc | None):
    return None if d is None else d.ptr


def shape_out():
    """Out-buffers of a shape function: `(shape_buf, ndim, args)`."""
    buf = (c_size_t * MAX_NDIM)()
    ndim = c_size_t(0)
    return buf, ndim, (buf, MAX_NDIM, ctypes.byref(ndim))


def shape_of(buf, ndim) -> tuple:
    return tuple(int(buf[i]) for i in range(ndim.value))
