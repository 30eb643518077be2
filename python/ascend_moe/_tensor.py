"""Arrays and tensors <-> `amoe_tensor` descriptors, outputs, streams, and
shape-only metadata.

Operands are passed where they are, never copied: numpy arrays by their
buffer, tensor-likes (anything with `device`, `data_ptr()`, `dtype`, `shape`,
`is_contiguous()`, such as torch and torch_npu tensors) by `data_ptr()`, as NPU
memory (device kind 1, ordinal `device.index`) when `device.type == "npu"`.
The one copy: a non-contiguous host *input* is made contiguous first. A
non-contiguous NPU tensor or `out` is an error."""

from __future__ import annotations

import ctypes
import math
import operator
import os
import sys
import threading
from ctypes import c_size_t

import ml_dtypes
import numpy as np

from ._enums import MAX_NDIM, DeviceKind, DType, Status
from ._errors import error
from ._lib import SIZE_MAX, Table, Tensor, call, lib, retire_streams

# `amoe_device_kind` codes.
DEVICE_CPU = int(DeviceKind.CPU)
DEVICE_NPU = int(DeviceKind.NPU)

# The numpy / ml_dtypes dtype of each `amoe_dtype` variant, by the library's
# variant name; the codes are `DType`'s. numpy, ml_dtypes and torch
# agree on the dtype names. The one-byte dtypes (int8 .. float8_e5m2) are
# carried by data movement as exact bytes (quantized hidden states, packed fp4
# as uint8, masks); reductions refuse them.
_NUMPY_BY_VARIANT = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I32": np.int32,
    "I64": np.int64,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8E4M3": ml_dtypes.float8_e4m3fn,
    "F8E5M2": ml_dtypes.float8_e5m2,
}
# amoe_dtype code -> numpy dtype, and dtype name -> code, for the dtypes both
# the library and this package know.
NUMPY_DTYPES = {
    int(code): np.dtype(_NUMPY_BY_VARIANT[code.name]) for code in DType if code.name in _NUMPY_BY_VARIANT
}
DTYPE_CODES = {d.name: code for code, d in NUMPY_DTYPES.items()}


def dtype_name(dtype) -> str:
    """`float32`, `bfloat16`, ... for a numpy / ml_dtypes / torch dtype, the
    package's `DType` or a name; what is none of them is named as it prints
    (and then refused by `dtype_code`)."""
    if isinstance(dtype, DType):
        np_type = _NUMPY_BY_VARIANT.get(dtype.name)
        return dtype.name.lower() if np_type is None else np.dtype(np_type).name
    s = str(dtype)
    if s.startswith("torch."):
        return s[len("torch.") :]
    if isinstance(dtype, str):
        return s
    try:
        return np.dtype(dtype).name
    except TypeError:
        return s


# The code of every dtype object (numpy, ml_dtypes, torch) or name already
# accepted: naming a numpy dtype costs microseconds, and every operand of every
# call asks. Only accepted dtypes are kept, so it holds a few entries.
_CODE_OF: dict = {}


def dtype_code(arg: str, dtype) -> int:
    try:
        return _CODE_OF[dtype]
    except (KeyError, TypeError):
        pass
    name = dtype_name(dtype)
    if name not in DTYPE_CODES:
        # numpy has no bfloat16 or float8: those come from ml_dtypes.
        where = "" if str(dtype).startswith("torch.") else " (bfloat16 and the float8 types from ml_dtypes)"
        raise error(Status.DTYPE, f"`{arg}` has dtype {name}, expected one of {', '.join(DTYPE_CODES)}{where}")
    if isinstance(dtype, np.dtype) and not dtype.isnative:
        # numpy names '>f4' float32 too; the library reads native byte order.
        raise error(
            Status.DTYPE,
            f"`{arg}` has dtype {name} in non-native byte order ({dtype.str}); pass it as "
            f"`.astype(x.dtype.newbyteorder('='))`",
        )
    code = DTYPE_CODES[name]
    try:
        _CODE_OF[dtype] = code
    except TypeError:
        pass
    return code


def _torch_tensor(x) -> bool:
    """Whether `x` is a real `torch.Tensor` (torch is never imported here)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _tensor_like(x) -> bool:
    """A torch-style tensor: `device`, `data_ptr()`, `dtype`, `shape`, `is_contiguous()`."""
    return not isinstance(x, np.ndarray) and hasattr(x, "data_ptr") and hasattr(x, "device")


# The C part of every descriptor built so far, by what it holds: the data
# pointer, shape, dtype and NPU ordinal. A descriptor is nothing but those
# values, so the one built for an earlier call over the same memory, shape and
# dtype is the same bytes: it is reused, and never points anywhere the key does
# not name. Cleared when full.
_CORES = Table(1024)


def _core(arg: str, shape, dtype, data, npu):
    """`(shape, shape_buf, struct, pointer)` of a descriptor, built once per key."""
    key = (data, shape, dtype, npu)
    try:
        core = _CORES.get(key)
    except TypeError:  # an unhashable shape (symbolic sizes) or dtype: built, not kept
        key = None
    else:
        if core is not None:
            return core
    shape = _dims(arg, shape)
    if len(shape) > MAX_NDIM:
        raise error(Status.SHAPE, f"`{arg}` has {len(shape)} dims, at most {MAX_NDIM} are supported")
    shape_buf = (c_size_t * (len(shape) or 1))(*shape)
    kind, ordinal = (DEVICE_CPU, 0) if npu is None else (DEVICE_NPU, npu)
    c = Tensor(data, dtype_code(arg, dtype), len(shape), shape_buf, None, kind, ordinal)
    core = (shape, shape_buf, c, ctypes.pointer(c))
    if key is not None:
        _CORES.put(key, core)
    return core


def _dims(arg: str, shape) -> tuple:
    """`shape` as the `size_t` dims of `arg`'s descriptor: each taken by
    `operator.index` (a float is refused, never truncated) and in
    0..=SIZE_MAX, since ctypes would store -1 as SIZE_MAX and 2**64 as 0
    without a word; anything else is a `ShapeError` naming `arg`."""
    try:
        dims = tuple(map(operator.index, shape))
    except TypeError:
        raise error(Status.SHAPE, f"`{arg}` has shape {list(shape)}, whose dims must be integers") from None
    if any(not 0 <= s <= SIZE_MAX for s in dims):
        raise error(Status.SHAPE, f"`{arg}` has shape {list(dims)}, whose dims must be in 0..={SIZE_MAX} (size_t)")
    return dims


class Desc:
    """An `amoe_tensor` over a host array, host / NPU tensor memory (or a shape
    and dtype only), keeping everything it points to alive. `obj` is the
    array or tensor it describes; `npu` the NPU ordinal, None for host memory."""

    __slots__ = ("arg", "obj", "npu", "shape", "shape_buf", "c", "ptr")

    def __init__(self, arg: str, shape, dtype, obj=None, data=None, npu: int | None = None):
        self.arg, self.obj, self.npu = arg, obj, npu
        self.shape, self.shape_buf, self.c, self.ptr = _core(arg, shape, dtype, data, npu)


def as_array(arg: str, x) -> np.ndarray:
    """`x` as a C-contiguous numpy array of a supported dtype: no copy when it
    already is one; a non-contiguous input array is copied to a contiguous one."""
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__array__") or isinstance(x, (list, tuple)):
            x = np.asarray(x)
        else:
            raise error(
                Status.INVALID_ARGUMENT,
                f"`{arg}` must be a numpy array or a tensor (cpu or npu), got {type(x).__name__}",
            )
    dtype_code(arg, x.dtype)
    return np.asarray(x, order="C")  # keeps a 0-d array 0-d (ascontiguousarray makes it 1-d)


def _device(arg: str, x) -> int | None:
    """The NPU ordinal of tensor-like `x`, None on the CPU; an error on any other device."""
    if getattr(x, "is_cpu", False):  # torch's flag: a tenth of the cost of naming `x.device.type`
        return None
    dev = x.device
    kind = getattr(dev, "type", dev)
    if kind == "cpu":
        return None
    if kind == "npu":
        index = getattr(dev, "index", None)
        if index is None or int(index) < 0:
            raise error(Status.DEVICE, f"`{arg}` is on device {dev!r}, which names no NPU ordinal")
        return int(index)
    if kind == "meta":
        raise error(Status.DEVICE, f"`{arg}` is a meta tensor, which has no data (the shape functions take it)")
    raise error(Status.DEVICE, f"`{arg}` is on device {dev}; expected a cpu or npu tensor")


# `torch.Tensor` once a call has passed one (this module never imports torch).
# A contiguous CPU tensor of this exact class takes the short way in
# `desc_in` and `desc_out`: what `_tensor_desc` would check of it holds
# already (a CPU device; a dtype the library knows is checked by `_core` when
# it builds the descriptor), so only its pointer, shape and dtype are read.
_HOST_TENSOR_TYPES: set = set()
# `torch.strided` once a tensor entered `_HOST_TENSOR_TYPES`: the short way
# takes only dense tensors (see `check_dense`).
_STRIDED: list = [None]


def _tensor_desc(arg: str, x, writable: bool) -> Desc:
    """A descriptor over tensor-like `x`'s own memory (`data_ptr()`), never a copy,
    except that a non-contiguous CPU *input* is made contiguous (`.contiguous()`)."""
    npu = _device(arg, x)
    dtype_code(arg, x.dtype)
    check_dense(arg, x)
    if getattr(x, "is_neg", None) is not None and x.is_neg():
        # torch's negative bit: the values are the negated memory (a view
        # such as `.conj().imag`), which the library would read as it is.
        if writable:
            raise error(
                Status.INVALID_ARGUMENT,
                f"`{arg}` has torch's negative bit (a lazily negated view such as .conj().imag): the library "
                "writes its memory as it is; pass a tensor without it",
            )
        x = x.resolve_neg()
    if not x.is_contiguous():
        if npu is not None or writable or not hasattr(x, "contiguous"):
            where = "an NPU" if npu is not None else "a CPU"
            raise error(
                Status.SHAPE,
                f"`{arg}` is {where} tensor that is not contiguous; the library takes C-contiguous tensors"
                + (" (call .contiguous() first)" if not writable else " (pass a contiguous `out`)"),
            )
        x = x.contiguous()
    if npu is None and type(x) is getattr(sys.modules.get("torch"), "Tensor", None):
        _STRIDED[0] = sys.modules["torch"].strided
        _HOST_TENSOR_TYPES.add(type(x))
    return Desc(arg, x.shape, x.dtype, x, x.data_ptr() or None, npu)


def check_dense(arg: str, x) -> None:
    """Refuses a tensor whose elements are not laid out in its own strided
    memory (sparse, mkldnn, nested): the library reads `data_ptr()` as the
    dense elements, which such a tensor does not have."""
    layout = getattr(x, "layout", None)
    torch = sys.modules.get("torch")
    if torch is not None and layout is not None and layout is not torch.strided:
        raise error(
            Status.INVALID_ARGUMENT,
            f"`{arg}` is a tensor of layout {layout}; the library takes dense (torch.strided) tensors "
            "(convert it with .to_dense())",
        )
    if getattr(x, "is_nested", False):
        raise error(
            Status.INVALID_ARGUMENT,
            f"`{arg}` is a nested tensor; the library takes dense tensors of one shape",
        )


def _host_tensor_desc(arg: str, x) -> Desc | None:
    """The short way of `_tensor_desc` (see `_HOST_TENSOR_TYPES`), or None
    when `x` does not qualify for it."""
    if (
        type(x) in _HOST_TENSOR_TYPES
        and x.layout is _STRIDED[0]
        and not x.is_nested
        and x.is_cpu
        and x.is_contiguous()
        and not x.is_neg()
    ):
        return Desc(arg, x.shape, x.dtype, x, x.data_ptr() or None)
    return None


_BYTES = np.dtype(np.uint8)


def _address(a: np.ndarray) -> int:
    """The data pointer of C-contiguous array `a`. Through the buffer protocol
    where it can (a writable, non-empty array: a third to a half of the cost of
    `a.ctypes.data`, which builds a ctypes helper object on every access), which
    for a C-contiguous array starts at its first element."""
    try:
        # A dtype numpy does not build in (bfloat16) has no buffer format: seen as bytes.
        return ctypes.addressof(ctypes.c_char.from_buffer(a if a.dtype.isbuiltin == 1 else a.view(_BYTES)))
    except (TypeError, ValueError):  # read-only, empty or 0-d
        return a.ctypes.data


def desc_in(arg: str, x) -> Desc:
    """An input descriptor: tensors (cpu or npu) by `data_ptr()`, numpy arrays by their buffer."""
    if type(x) is np.ndarray:
        if x.flags.c_contiguous:
            return Desc(arg, x.shape, x.dtype, x, _address(x))
    elif (d := _host_tensor_desc(arg, x)) is not None:
        return d
    if _tensor_like(x):
        return _tensor_desc(arg, x, writable=False)
    a = as_array(arg, x)
    return Desc(arg, a.shape, a.dtype, a, _address(a))


def desc_opt(arg: str, x) -> Desc | None:
    return None if x is None else desc_in(arg, x)


def desc_out(arg: str, out, shape, code: int) -> Desc:
    """A descriptor over the caller's `out`, which must have the op's output
    shape and dtype and be contiguous and writable (it is never copied)."""
    if isinstance(out, np.ndarray):
        flags = out.flags
        if not flags.writeable:
            raise error(Status.INVALID_ARGUMENT, f"`{arg}` is a read-only numpy array: the op writes its result there")
        if not flags.c_contiguous:
            raise error(Status.SHAPE, f"`{arg}` must be a C-contiguous numpy array (its strides are {out.strides})")
        d = Desc(arg, out.shape, out.dtype, out, _address(out))
    else:
        d = _host_tensor_desc(arg, out)
        if d is None:
            if not _tensor_like(out):
                raise error(
                    Status.INVALID_ARGUMENT,
                    f"`{arg}` must be a numpy array or a tensor (cpu or npu), got {type(out).__name__}",
                )
            d = _tensor_desc(arg, out, writable=True)
    if d.shape != tuple(shape):
        shape = [int(s) for s in shape]
        raise error(Status.SHAPE, f"`{arg}` has shape {list(d.shape)}, the op's output is {shape}")
    if d.c.dtype != code:
        raise error(
            Status.DTYPE, f"`{arg}` has dtype {dtype_name(out.dtype)}, the op's output is {NUMPY_DTYPES[code].name}"
        )
    return d


def lend_out(arg: str, out) -> None:
    """Marks the caller's torch tensor `out` as written in place, before the
    library writes it through its data pointer, where torch cannot see it:
    its version counter is bumped (`torch.autograd.graph.increment_version`,
    the API for kernels that write `data_ptr()` memory), so a tensor saved for
    backward before the write fails that backward instead of giving a wrong
    gradient. A tensor that requires grad while grad mode is on is refused
    (`InvalidArgumentError` naming `arg`): autograd cannot record a write
    done behind it. So is an inference tensor outside inference mode, which
    torch refuses to update in place there (it has no version counter to
    bump). Anything that is no torch tensor is left as it is."""
    if not _torch_tensor(out):
        return
    torch = sys.modules["torch"]
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise error(
            Status.INVALID_ARGUMENT,
            f"`{arg}` is an inference tensor (made under torch.inference_mode()) and inference mode is off: "
            "torch refuses to update it in place outside inference mode; call under torch.inference_mode(), "
            f"or pass a clone of it as `{arg}`",
        )
    if out.requires_grad and torch.is_grad_enabled():
        raise error(
            Status.INVALID_ARGUMENT,
            f"`{arg}` requires grad and grad mode is on: the op writes it in place, which autograd cannot "
            "record; pass a tensor that does not require grad, or call under torch.no_grad()",
        )
    torch.autograd.graph.increment_version(out)


class _HostBlock:
    """Host memory of the library's reuse pool (`amoe_host_block_new`), seen
    by numpy as `nbytes` bytes. Every array (and torch tensor) over it keeps
    it alive; when the last one goes, the memory returns to the pool for the
    next output of the same size."""

    __slots__ = ("__array_interface__", "_free", "_handle")

    def __init__(self, nbytes: int):
        from ._lib import call, lib

        data, handle = ctypes.c_void_p(), ctypes.c_void_p()
        if nbytes > SIZE_MAX:
            # ctypes would pass it modulo 2**64: a small block for a huge array.
            raise error(Status.HOST_MEMORY, f"host block: {nbytes} bytes of host memory could not be allocated")
        call("amoe_host_block_new", nbytes, ctypes.byref(data), ctypes.byref(handle))
        # Held here, so freeing needs no module lookup (also at interpreter exit).
        self._free = lib().amoe_host_block_free
        self._handle = handle
        self.__array_interface__ = {"data": (data.value, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}

    def __del__(self):
        free = getattr(self, "_free", None)  # unset when the allocation failed
        if free is not None:
            free(self._handle)


_POOLED_FROM: list = []


def _pooled_bytes(nbytes: int) -> np.ndarray | None:
    """`nbytes` bytes of the library's host pool as a uint8 array, or None
    below the size the pool serves (the usual allocator is as cheap there)."""
    if not _POOLED_FROM:
        from ._lib import lib

        _POOLED_FROM.append(lib().amoe_host_block_min_len())
    if nbytes < _POOLED_FROM[0]:
        return None
    return np.asarray(_HostBlock(nbytes))


def host_empty(shape, dtype) -> np.ndarray:
    """A host array for an output the library writes entirely: a block of its
    reuse pool for large ones, `np.empty` otherwise. A fresh large allocation
    would be new pages on every call, each zeroed and mapped by the kernel
    when the op first writes it."""
    dtype = np.dtype(dtype)
    raw = _pooled_bytes(math.prod(shape) * dtype.itemsize)
    if raw is None:
        return np.empty(shape, dtype=dtype)
    return raw.view(dtype).reshape(shape)


def _torch_host_empty(shape, dtype):
    """`host_empty` for a torch CPU output: a tensor over a pool block (it
    keeps the block alive), or `torch.empty` for small ones. The block is
    the tensor's whole storage, which cannot be resized (no larger
    `resize_`); the README says so."""
    torch = sys.modules["torch"]
    itemsize = getattr(dtype, "itemsize", None) or torch.empty((), dtype=dtype).element_size()
    raw = _pooled_bytes(math.prod(shape) * itemsize)
    if raw is None:
        return torch.empty(shape, dtype=dtype)
    return torch_over(raw, dtype, shape)


def torch_over(a: np.ndarray, dtype, shape):
    """A contiguous torch tensor of `dtype` and `shape` over the memory of the
    C-contiguous array `a` (whose storage keeps `a` alive). It is no view
    (`._base` is None), as a `torch.empty` output is not: autograd lets a
    caller modify it in place as it lets any fresh output be, whichever
    memory it lies on (`from_numpy(a).view(dtype)` would be a view of a
    tensor of `a`'s dtype)."""
    torch = sys.modules["torch"]
    storage = torch.from_numpy(a.reshape(-1).view(_BYTES)).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))


def alloc(arg: str, shape, like: Desc):
    """A new output of `shape` with `like`'s dtype, where `like` lives: numpy
    for arrays and torch's CPU tensors (large ones from the library's reuse
    pool, `host_empty`), `torch.empty(..., device=like.device)` for other
    torch tensors (torch's caching allocator owns it), `like.new_empty(shape)`
    for other tensor-likes."""
    shape = tuple(int(s) for s in shape)
    x = like.obj
    if _torch_tensor(x):
        if x.is_cpu:
            return _torch_host_empty(shape, x.dtype)
        return sys.modules["torch"].empty(shape, dtype=x.dtype, device=x.device)
    if _tensor_like(x):
        if hasattr(x, "new_empty"):
            return x.new_empty(shape)
        raise error(
            Status.INVALID_ARGUMENT,
            f"`{like.arg}` ({type(x).__name__} on {x.device}) has no `new_empty` to allocate the output: pass `{arg}=`",
        )
    return host_empty(shape, NUMPY_DTYPES[like.c.dtype])


# --------------------------------------------------------------- streams

_STREAMS: dict = {}
_STREAMS_LOCK = threading.Lock()


def _new_streams_lock() -> None:
    """In a child made by `fork`: a lock another thread held stays held."""
    global _STREAMS_LOCK
    _STREAMS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_streams_lock)
# Cached handles that an open LiveContext is attached through, by key: count.
_HELD: dict = {}


def streams_of(device: int) -> list:
    """The handles of the streams of NPU `device` the package wrapped."""
    with _STREAMS_LOCK:
        return [h for (_, d), h in _STREAMS.items() if d == device]


def wrap_stream(raw: int, device: int) -> ctypes.c_void_p:
    """The library's handle on the engine's stream `raw` (an `aclrtStream`) of
    NPU `device`: wrapped once per (stream, device) and kept for the process,
    never owning the stream (`amoe_stream_wrap`)."""
    key = (int(raw), int(device))
    with _STREAMS_LOCK:
        h = _STREAMS.get(key)
        if h is None:
            h = ctypes.c_void_p()
            call("amoe_stream_wrap", ctypes.c_void_p(key[0]), key[1], ctypes.byref(h))
            _STREAMS[key] = h
    return h


def hold_stream(raw: int, device: int) -> ctypes.c_void_p:
    """`wrap_stream`, for a LiveContext that keeps the handle (the ops on the
    stream share it): `release_streams` refuses it until `unhold_stream`."""
    h = wrap_stream(raw, device)
    key = (int(raw), int(device))
    with _STREAMS_LOCK:
        _HELD[key] = _HELD.get(key, 0) + 1
    return h


def unhold_stream(raw: int, device: int) -> None:
    key = (int(raw), int(device))
    with _STREAMS_LOCK:
        n = _HELD.pop(key, 0) - 1
        if n > 0:
            _HELD[key] = n


def release_streams() -> int:
    """Frees every cached stream handle (never the engine's streams), for an
    engine about to destroy the streams they wrap; returns how many. Later
    calls wrap their streams again. An error, freeing nothing, while a
    LiveContext is open on one of them (close it first). A handle another
    thread's call is using is freed once no call is in flight; a call that
    took its handle before the release is refused, naming `stream`. A
    handle's stream workspace goes with it, including what work captured
    into graphs uses at every replay: destroy those graphs first."""
    with _STREAMS_LOCK:
        if _HELD:
            (raw, device), n = next(iter(_HELD.items()))
            raise error(
                Status.INVALID_ARGUMENT,
                f"release_streams: {n} open LiveContext(s) use the handle of stream {raw:#x} on npu:{device}; "
                "close them before releasing the streams",
            )
        handles = list(_STREAMS.values())
        _STREAMS.clear()
    # Another thread's call may be using one of them: freed when none is.
    retire_streams(handles)
    return len(handles)


_NO_TORCH_NPU = []  # the reason torch_npu could not be imported, once known


def default_stream(device: int):
    """`torch.npu.current_stream(device)` when torch_npu is importable, else None."""
    if _NO_TORCH_NPU:
        return None
    if os.environ.get("ASCEND_MOE_TORCH", "1") == "0":
        _NO_TORCH_NPU.append("torch is disabled by ASCEND_MOE_TORCH=0")
        return None
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as e:  # noqa: BLE001
        _NO_TORCH_NPU.append(str(e))
        return None
    return torch.npu.current_stream(device)


def resolve_stream(descs, stream) -> ctypes.c_void_p | None:
    """The `amoe_stream` of a call over `descs`: NULL when every operand is host
    memory and no stream was given; else the wrapped `stream.npu_stream`
    (default `torch.npu.current_stream()`), on the device of the NPU operands."""
    npu = [d for d in descs if d is not None and d.npu is not None]
    given = stream is not None
    if stream is None:
        if not npu:
            return None
        stream = default_stream(npu[0].npu)
        if stream is None:
            why = _NO_TORCH_NPU[0] if _NO_TORCH_NPU else "no current stream"
            raise error(
                Status.NULL_ARGUMENT,
                f"`{npu[0].arg}` is an NPU tensor (npu:{npu[0].npu}) but no stream was given: pass `stream=`"
                f" (an object with .npu_stream, the raw aclrtStream, such as torch.npu.current_stream());"
                f" the default, torch_npu's current stream, is unavailable ({why})",
            )
    raw = getattr(stream, "npu_stream", None)
    if not raw:
        raise error(
            Status.INVALID_ARGUMENT,
            f"`stream` must have a non-null .npu_stream (the raw aclrtStream), got {type(stream).__name__}",
        )
    index = getattr(getattr(stream, "device", None), "index", None)
    if npu:
        device = npu[0].npu
        if index is not None and int(index) != device:
            raise error(Status.DEVICE, f"`stream` is on npu:{int(index)}, but `{npu[0].arg}` is on npu:{device}")
    else:
        if index is None:
            raise error(
                Status.INVALID_ARGUMENT, "`stream` has no .device.index and no operand is an NPU tensor to take it from"
            )
        device = int(index)
    if given and npu:
        _order_after_current(stream, device, npu)
    return wrap_stream(raw, device)


def _order_after_current(stream, device: int, npu) -> None:
    """A `stream=` other than torch_npu's current stream of `device` first
    waits for that stream (`stream.wait_stream`): the caller's inputs, and the
    package's own copies of them (broadcast's clone or `out.copy_(x)`, a
    resolved negative bit), were queued there. And every NPU tensor of the
    call is marked in use on `stream` (`record_stream`): torch's caching
    allocator gave outputs from the current stream's pool, and must reuse
    none of them before `stream` is done with it."""
    current = default_stream(device)
    if current is None or getattr(current, "npu_stream", None) == getattr(stream, "npu_stream", None):
        return
    wait = getattr(stream, "wait_stream", None)
    if wait is None:
        raise error(
            Status.INVALID_ARGUMENT,
            f"`stream` ({type(stream).__name__}) is not torch_npu's current stream of npu:{device} and has no "
            "wait_stream to order it after the current stream's work: pass a torch.npu.Stream",
        )
    wait(current)
    for d in npu:
        mark = getattr(d.obj, "record_stream", None)
        if mark is not None:
            mark(stream)


def _records_grad(x) -> bool:
    """Whether autograd would record an op on torch tensor `x`: it requires
    grad and grad mode is on."""
    return _torch_tensor(x) and x.requires_grad and sys.modules["torch"].is_grad_enabled()


_NO_GRADIENT = []


def _no_gradient(result, inputs: list):
    """`result` (a new torch tensor the op writes) as a tensor over the same
    memory that autograd links to `inputs` (`(arg, tensor)` pairs that
    require grad), whose backward fails naming them: the ops have no
    gradient, and a result cut off from its inputs would train on silently,
    as if they had none. The torch custom ops behave the same way. It is no
    view (`detach()`, not `view_as()`), so the caller may modify it in place
    as any fresh output."""
    if not _NO_GRADIENT:
        torch = sys.modules["torch"]

        class NoGradient(torch.autograd.Function):
            @staticmethod
            def forward(ctx, names, out, *tensors):
                ctx.names = names
                return out.detach()

            @staticmethod
            def backward(ctx, *grads):
                raise RuntimeError(
                    f"ascend_moe ops have no gradient: a backward reached an op whose {ctx.names} required grad"
                )

        _NO_GRADIENT.append(NoGradient)
    names = ", ".join(f"`{arg}`" for arg, _ in inputs)
    return _NO_GRADIENT[0].apply(names, result, *(t for _, t in inputs))


class Operands:
    """The descriptors of one op call, its output (`out=` or a new one) and its stream."""

    def __init__(self, stream=None):
        self.descs: list = []
        self._stream = stream
        self.result = None
        self._grad: list = []

    def input(self, arg: str, x) -> Desc:
        d = desc_in(arg, x)
        self.descs.append(d)
        if _records_grad(x):
            self._grad.append((arg, x))
        return d

    def optional(self, arg: str, x) -> Desc | None:
        return None if x is None else self.input(arg, x)

    def output(self, shape, like: Desc, out=None, arg: str = "out") -> Desc:
        """`out` checked against the op's output (`shape`, `like`'s dtype) and
        marked written (`lend_out`), or a new output. An input that requires
        grad in grad mode makes a new output one whose backward fails
        (`_no_gradient`), and refuses `out`, which cannot record the op (as
        torch refuses `out=` there)."""
        if out is not None and self._grad:
            first = self._grad[0][0]
            raise error(
                Status.INVALID_ARGUMENT,
                f"`{first}` requires grad and grad mode is on, but the op has no gradient and writes `{arg}` in "
                f"place, which autograd cannot record: call it under torch.no_grad(), or pass `{first}`.detach()",
            )
        self.result = alloc(arg, shape, like) if out is None else out
        d = desc_out(arg, self.result, shape, like.c.dtype)
        if out is not None:
            lend_out(arg, out)
        elif self._grad and _torch_tensor(self.result):
            self.result = _no_gradient(self.result, self._grad)
        self.descs.append(d)
        return d

    @property
    def stream(self):
        return resolve_stream(self.descs, self._stream)


def desc_meta(arg: str, x) -> Desc:
    """A descriptor with shape and dtype only: `x` is anything with `.shape` and
    `.dtype` (numpy array, torch tensor incl. meta / fake tensors) or a
    `(shape, dtype)` pair. An op passes the descriptors of its operands, which
    the shape functions take as they are (they read only shape and dtype)."""
    if isinstance(x, Desc):
        return x
    if isinstance(x, tuple) and len(x) == 2 and not hasattr(x, "shape"):
        shape, dtype = x
    else:
        shape, dtype = x.shape, x.dtype
    return Desc(arg, tuple(shape), dtype)


def desc_meta_opt(arg: str, x) -> Desc | None:
    return None if x is None else desc_meta(arg, x)


def ptr(d: Desc | None):
    return None if d is None else d.ptr


def shape_out():
    """Out-buffers of a shape function: `(shape_buf, ndim, args)`."""
    buf = (c_size_t * MAX_NDIM)()
    ndim = c_size_t(0)
    return buf, ndim, (buf, MAX_NDIM, ctypes.byref(ndim))


def shape_of(buf, ndim) -> tuple:
    return tuple(buf[: ndim.value])
