"""Loading the cdylib, the C types of include/ascend_moe.h, and error handling.

No enum number is written here: the enums are `_enums` (rendered from the
library's table by tests/python_enums.rs), and loading the library checks that
its table (`amoe_enum_count` / `amoe_enum_info` / `amoe_enum_entry`) is that one."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import operator
import os
import sys
import threading
from ctypes import POINTER, c_char_p, c_double, c_int32, c_size_t, c_ssize_t, c_uint8, c_uint32, c_void_p
from pathlib import Path

import numpy as np

from ._enums import MAX_NDIM, TABLES, CommType, Status
from ._errors import AmoeError, error

__all__ = ["AmoeError", "MAX_NDIM", "Status", "call", "check", "lib", "library_path", "sizes"]


class Tensor(ctypes.Structure):
    """`amoe_tensor`."""

    _fields_ = [
        ("data", c_void_p),
        ("dtype", c_uint32),
        ("ndim", c_size_t),
        ("shape", POINTER(c_size_t)),
        ("strides", POINTER(c_ssize_t)),
        ("device_kind", c_uint32),
        ("device_ordinal", c_int32),
    ]


class FinalizeArgs(ctypes.Structure):
    """`amoe_finalize_args`."""

    _fields_ = [
        ("expanded_x", POINTER(Tensor)),
        ("expanded_row_idx", POINTER(Tensor)),
        ("x1", POINTER(Tensor)),
        ("x2", POINTER(Tensor)),
        ("bias", POINTER(Tensor)),
        ("scales", POINTER(Tensor)),
        ("expert_idx", POINTER(Tensor)),
        ("drop_pad_mode", c_uint32),
    ]


class ReducePolicyC(ctypes.Structure):
    """`amoe_reduce_policy`."""

    _fields_ = [
        ("shared_mode", c_uint32),
        ("has_routed_transform", c_uint8),
        ("sp", c_uint8),
        ("tp_size", c_size_t),
        ("ep_size", c_size_t),
    ]


class MoeContextC(ctypes.Structure):
    """`amoe_moe_context`."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("dp_tokens", POINTER(c_size_t)),
        ("dp_size", c_size_t),
        ("tp_size", c_size_t),
        ("dp_rank", c_size_t),
        ("tp_rank", c_size_t),
        ("sp", c_uint8),
        ("num_actual_tokens", c_size_t),
        ("pcp_size", c_size_t),
        ("pcp_rank", c_size_t),
        ("padded_num_tokens", c_size_t),
    ]


class ForwardContextC(ctypes.Structure):
    """`amoe_forward_context`."""

    _fields_ = [
        ("comm_type", c_uint32),
        ("sp", c_uint8),
        ("dp_tokens", POINTER(c_size_t)),
        ("dp_size", c_size_t),
        ("num_actual_tokens", c_size_t),
        ("pcp_size", c_size_t),
    ]


# `AMOE_ALL_TOKENS`: every token of the DP rank is real.
ALL_TOKENS = ctypes.c_size_t(-1).value

_T = POINTER(Tensor)
_SZ = POINTER(c_size_t)
_U8 = POINTER(c_uint8)
_COMM = c_void_p
_STREAM = c_void_p
_SHAPE_OUT = [_SZ, c_size_t, _SZ]

# name -> argument types; every function returns amoe_status unless listed in _RESTYPES.
_SIGNATURES = {
    "amoe_version": [],
    "amoe_last_error_length": [],
    "amoe_native_kernel_check": [],
    "amoe_status_name": [c_uint32],
    "amoe_enum_count": [],
    "amoe_enum_info": [c_size_t, POINTER(c_char_p), _SZ],
    "amoe_enum_entry": [c_size_t, c_size_t, POINTER(c_char_p), POINTER(c_uint32)],
    "amoe_last_error_message": [c_char_p, c_size_t, _SZ],
    "amoe_comm_cpu_new": [c_char_p, c_size_t, c_size_t, c_double, POINTER(c_void_p)],
    "amoe_comm_from_hccl": [c_void_p, c_uint32, c_uint32, POINTER(c_void_p)],
    "amoe_comm_split": [_COMM, _SZ, c_size_t, POINTER(c_void_p)],
    "amoe_comm_refuse": [_COMM, c_char_p],
    "amoe_comm_rank": [_COMM, _SZ],
    "amoe_comm_world_size": [_COMM, _SZ],
    "amoe_comm_free": [_COMM],
    "amoe_stream_wrap": [c_void_p, c_uint32, POINTER(c_void_p)],
    "amoe_stream_free": [_STREAM],
    "amoe_stream_check": [_STREAM],
    "amoe_workspace_reserve": [_STREAM, c_size_t, c_size_t],
    "amoe_capture_records_reserve": [_STREAM, c_size_t],
    "amoe_stream_reserve_like": [_STREAM, _STREAM],
    "amoe_stream_set_allocator": [_STREAM, c_void_p, c_void_p, c_void_p],
    "amoe_host_block_new": [c_size_t, POINTER(c_void_p), POINTER(c_void_p)],
    "amoe_host_block_min_len": [],
    "amoe_host_block_free": [c_void_p],
    "amoe_live_context_new": [_STREAM, POINTER(c_void_p)],
    "amoe_live_context_free": [c_void_p],
    "amoe_live_context_reserve": [c_void_p, c_size_t],
    "amoe_live_context_guards": [c_void_p, _SZ, _SZ],
    "amoe_live_context_device_ptr": [c_void_p, POINTER(c_void_p), _SZ],
    "amoe_live_context_set": [c_void_p, POINTER(ForwardContextC), _STREAM],
    "amoe_live_context_guard": [c_void_p, POINTER(ForwardContextC), c_uint32, _STREAM],
    "amoe_live_context_check": [c_void_p, _STREAM],
    "amoe_stream_attach_live_context": [_STREAM, c_void_p],
    "amoe_all_reduce": [_COMM, _T, _T, c_uint32, _STREAM],
    "amoe_reduce_scatter": [_COMM, _T, _T, c_uint32, _STREAM],
    "amoe_all_gather": [_COMM, _T, _T, _STREAM],
    "amoe_broadcast": [_COMM, _T, c_size_t, _STREAM],
    "amoe_barrier": [_COMM, _STREAM],
    "amoe_moe_finalize_routing_output_shape": [POINTER(FinalizeArgs)] + _SHAPE_OUT,
    "amoe_moe_finalize_routing": [POINTER(FinalizeArgs), _T, _STREAM],
    "amoe_moe_token_unpermute_output_shape": [_T, _T, _T] + _SHAPE_OUT,
    "amoe_moe_token_unpermute": [_T, _T, _T, _T, _STREAM],
    "amoe_sp_layout_from_dp_tokens": [_SZ, c_size_t, c_size_t, _SZ, c_size_t, _SZ],
    "amoe_sp_layout_from_dp_tokens_pcp": [_SZ, c_size_t, c_size_t, c_size_t, _SZ, c_size_t, _SZ],
    "amoe_maybe_pad_and_reduce_output_shape": [_T, _SZ, c_size_t, c_size_t, c_size_t] + _SHAPE_OUT,
    "amoe_maybe_pad_and_reduce": [_T, _SZ, c_size_t, _COMM, _T, _STREAM],
    "amoe_maybe_all_gather_and_maybe_unpad_output_shape": [_T, _SZ, c_size_t, c_size_t, c_size_t] + _SHAPE_OUT,
    "amoe_maybe_all_gather_and_maybe_unpad": [_T, _SZ, c_size_t, _COMM, _T, _STREAM],
    "amoe_finalize_and_reduce_output_shape": [POINTER(FinalizeArgs), _SZ, c_size_t, c_size_t, c_size_t]
    + _SHAPE_OUT,
    "amoe_finalize_and_reduce": [POINTER(FinalizeArgs), _SZ, c_size_t, _COMM, _T, _STREAM],
    "amoe_routed_is_reduced": [c_uint32, c_uint8, _U8],
    "amoe_reduce_policy_decisions": [POINTER(ReducePolicyC), c_uint32, _U8, _U8, _U8, _U8],
    "amoe_reduce_routed_early": [POINTER(ReducePolicyC), _T, c_uint32, _COMM, _T, _STREAM],
    "amoe_reduce_shared": [POINTER(ReducePolicyC), _T, c_uint32, _COMM, _T, _STREAM],
    "amoe_reduce_final": [POINTER(ReducePolicyC), _T, c_uint32, _COMM, _T, _STREAM],
    "amoe_reduce_refuse": [_COMM, c_uint8, c_char_p],
    "amoe_shared_pad_split_output_shape": [_T, c_size_t, c_size_t] + _SHAPE_OUT,
    "amoe_shared_pad_split": [_T, _COMM, _T, _STREAM],
    "amoe_shared_gather_unpad_output_shape": [_T, c_size_t, c_size_t] + _SHAPE_OUT,
    "amoe_shared_gather_unpad": [_T, c_size_t, _COMM, _T, _STREAM],
    "amoe_shared_pad_reduce_scatter_output_shape": [_T, c_size_t] + _SHAPE_OUT,
    "amoe_shared_pad_reduce_scatter": [_T, _COMM, _T, _STREAM],
    "amoe_moe_groups_new": [_COMM, c_size_t, c_size_t, POINTER(c_void_p)],
    "amoe_moe_context_init": [POINTER(MoeContextC)],
    "amoe_moe_groups_free": [c_void_p],
    "amoe_token_prepare_output_shape": [_T, c_uint32, POINTER(MoeContextC)] + _SHAPE_OUT,
    "amoe_token_prepare": [_T, c_uint32, POINTER(MoeContextC), c_void_p, _T, _T, _STREAM],
    "amoe_token_finalize_output_shape": [_T, c_uint32, POINTER(MoeContextC)] + _SHAPE_OUT,
    "amoe_token_finalize": [_T, c_uint32, POINTER(MoeContextC), c_void_p, _T, _STREAM],
    "amoe_token_refuse": [c_uint32, POINTER(MoeContextC), c_void_p, c_uint8, c_char_p],
    "amoe_moe_groups_from_comms": [_COMM, _COMM, _COMM, _COMM, POINTER(c_void_p)],
}
_RESTYPES = {
    "amoe_version": c_char_p,
    "amoe_last_error_length": c_size_t,
    "amoe_status_name": c_char_p,
    "amoe_enum_count": c_size_t,
    "amoe_comm_free": None,
    "amoe_stream_free": None,
    "amoe_live_context_free": None,
    "amoe_host_block_min_len": c_size_t,
    "amoe_host_block_free": None,
    "amoe_moe_groups_free": None,
}

_LIB_NAMES = {"linux": "libascend_moe.so", "darwin": "libascend_moe.dylib", "win32": "ascend_moe.dll"}

_lock = threading.Lock()
_lib = None


def _bundled() -> list[Path]:
    """Where a cdylib inside the package may be: the plain platform name (copied
    by hand), then the names `pip install` gives it (`libascend_moe` plus each
    extension-module suffix of this interpreter, e.g. `.cpython-311-x86_64-linux-gnu.so`)."""
    here = Path(__file__).resolve().parent
    plain = _LIB_NAMES.get(sys.platform, "libascend_moe.so")
    stem = "ascend_moe" if sys.platform == "win32" else "libascend_moe"
    names = [plain] + [stem + suffix for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    return [here / n for n in dict.fromkeys(names)]


def _candidates() -> list[Path]:
    env = os.environ.get("ASCEND_MOE_LIB")
    if env:
        # An explicit override is the only candidate: a typo must not fall back silently.
        return [Path(env)]
    return _bundled()


def library_path() -> Path:
    """The cdylib this package uses: `$ASCEND_MOE_LIB` if set, else the one inside the package."""
    tried = _candidates()
    for p in tried:
        if p.is_file():
            return p
    raise OSError(
        "ascend_moe: the native library was not found; tried "
        + ", ".join(str(p) for p in tried)
        + ". `pip install ./python` builds it into the package; or build it with `cargo build --release`"
        " and set ASCEND_MOE_LIB to target/release/libascend_moe.so."
    )


def lib() -> ctypes.CDLL:
    """The loaded library, with every function's signature declared."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            path = library_path()
            cdll = ctypes.CDLL(str(path))
            for name, argtypes in _SIGNATURES.items():
                f = getattr(cdll, name)
                f.argtypes = argtypes
                f.restype = _RESTYPES.get(name, c_uint32)
            table = _read_enum_tables(cdll)
            ours = {c: {m.name: int(m) for m in cls} for c, cls in TABLES.items()}
            if table != ours:
                raise OSError(
                    f"ascend_moe: the native library {path} numbers its enums differently from this package "
                    "(python/ascend_moe/_enums.py); install the package and the library from one build"
                )
            _lib = cdll
    return _lib


def last_error(lb=None) -> str:
    """This thread's last error message from the library."""
    lb = lb if lb is not None else lib()
    n = lb.amoe_last_error_length()
    buf = ctypes.create_string_buffer(n)
    written = c_size_t(0)
    lb.amoe_last_error_message(buf, n, ctypes.byref(written))
    return buf.raw[: written.value].decode("utf-8", "replace")


def check(status: int) -> None:
    """Raises `AmoeError` with the library's message unless `status` is OK."""
    if status != Status.OK:
        try:
            status = Status(status)
        except ValueError:
            pass
        raise error(status, last_error())


# Calls of the library under way in any thread, and the stream handles
# released while some were (`retire_streams`): a handle is freed only when no
# call is in flight, since one of them may be using it (the C contract: a
# handle is not released while a call uses it).
_INFLIGHT = [0]
_RETIRED: list = []
_INFLIGHT_LOCK = threading.Lock()


def call(name: str, *args) -> None:
    """Calls an `amoe_*` function and checks its status."""
    with _INFLIGHT_LOCK:
        _INFLIGHT[0] += 1
    try:
        status = getattr(lib(), name)(*args)
    finally:
        with _INFLIGHT_LOCK:
            _INFLIGHT[0] -= 1
            if _INFLIGHT[0] == 0 and _RETIRED:
                _free_retired()
    check(status)


def _after_fork_in_child() -> None:
    """A child made by `fork` has only the forking thread: a lock another
    thread held then would stay held for ever, and the calls it counted are
    not the child's. (The library's own locks are handed over by its
    `pthread_atfork` handlers.)"""
    global _lock, _INFLIGHT_LOCK
    _lock, _INFLIGHT_LOCK = threading.Lock(), threading.Lock()
    _INFLIGHT[0] = 0


os.register_at_fork(after_in_child=_after_fork_in_child)


def _free_retired() -> None:
    """Frees the retired stream handles; the caller holds `_INFLIGHT_LOCK`
    with no call in flight, so none starts until they are gone (a call
    that took one of them before then is refused, naming it)."""
    for h in _RETIRED:
        lib().amoe_stream_free(h)
    _RETIRED.clear()


def retire_streams(handles: list) -> None:
    """Frees the stream handles `handles` now if no call of the library is
    in flight, else once the last one in flight returns."""
    with _INFLIGHT_LOCK:
        _RETIRED.extend(handles)
        if _INFLIGHT[0] == 0:
            _free_retired()


@contextlib.contextmanager
def refusing(send, every: bool = False):
    """The argument checks of a call whose peers are already in it: one that
    fails is sent to them with `send(message)` (an `amoe_*_refuse` export),
    so that they fail at once quoting it instead of waiting out the timeout,
    and then raised here. A failure to send is not this rank's to raise.
    With `every`, any `Exception` is sent (the block runs caller code, such
    as a layer's experts), not only argument errors. torch's own errors
    while reading an argument (`RuntimeError`) and a failed allocation are
    argument errors here."""
    try:
        yield
    except (Exception if every else (AmoeError, RuntimeError, TypeError, ValueError, OverflowError, MemoryError)) as e:
        try:
            send(f"{type(e).__name__}: {e}".encode())
        except AmoeError:
            pass
        raise


class Lease:
    """One call's hold on an open library handle: ctypes passes it as the
    handle itself (`_as_parameter_`), and while it is held the handle's
    owner does not free the handle, even when another thread closes the
    owner mid-call. Released by `release()`, at the end of a `with` block
    on it (`with comm.handle as h:`), which every call of this package
    uses, so that a failed call lets go at once: an exception kept by the
    caller (logged, stored in a future) holds the frames that referenced
    the lease, and a `close()` must not wait for it to be dropped. A lease
    never released is released when it is collected.

    A released lease passes NULL, which the library refuses, never the
    handle its owner may have freed since."""

    __slots__ = ("_as_parameter_", "_owner")

    def __init__(self, owner: "Owned", h: c_void_p):
        self._as_parameter_, self._owner = h, owner

    def release(self) -> None:
        """Lets go of the handle (once; later calls do nothing)."""
        owner, self._owner = self._owner, None
        if owner is not None:
            self._as_parameter_ = _NULL_HANDLE
            owner._release()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


_NULL_HANDLE = c_void_p()


class Owned:
    """A Python object that owns one library handle, freed by `_free_fn`
    when it is closed and no `Lease` of it is left: `close()` from one
    thread while another is inside a call on it waits for nothing and frees
    nothing under that call; the last lease frees the handle instead."""

    _free_fn = ""
    _closed_text = "closed"

    def _own(self, h) -> None:
        self._h = h if isinstance(h, c_void_p) else c_void_p(h)
        self._leases, self._pending = 0, None
        # Reentrant: a lease may be collected (and released) by the garbage
        # collector while this thread holds the lock.
        self._hold = threading.RLock()

    def _lease(self) -> Lease:
        with self._hold:
            if not self._h.value:
                raise error(Status.INVALID_ARGUMENT, self._closed_text)
            self._leases += 1
            return Lease(self, self._h)

    def _release(self) -> None:
        with self._hold:
            self._leases -= 1
            h = self._pending if self._leases == 0 else None
            if h is not None:
                self._pending = None
        if h is not None:
            self._free(h)

    def _free(self, h: c_void_p) -> None:
        try:
            getattr(lib(), self._free_fn)(h)
        except Exception:  # noqa: BLE001 (interpreter shutdown: the library may be gone)
            pass

    @property
    def closed(self) -> bool:
        h = getattr(self, "_h", None)
        return h is None or not h.value

    def close(self) -> None:
        """Frees the handle, now or when the last call on it returns."""
        hold = getattr(self, "_hold", None)
        if hold is None:  # __init__ failed before the handle was owned
            return
        with hold:
            h, self._h = self._h, c_void_p()
            if not h.value:
                return
            if self._leases:
                self._pending, h = h, None
        if h is not None:
            self._free(h)


SIZE_MAX = c_size_t(-1).value
U32_MAX = c_uint32(-1).value


def integer(arg: str, v) -> int:
    """`v` as a Python int by `operator.index`: an int, a numpy integer, a
    bool or an `IntEnum`; anything else (a float, a numpy float, a string) is
    an `InvalidArgumentError` naming `arg`, never truncated as `int(v)` would
    (`1.7` as 1, `np.float64(2.9)` as 2)."""
    try:
        return operator.index(v)
    except TypeError:
        raise error(Status.INVALID_ARGUMENT, f"`{arg}` is {v!r}, expected an integer") from None


def integers(arg: str, values) -> tuple:
    """`values` as a tuple of Python ints (`integer` each); anything that is
    not a sequence of them (one int, a string, None) is an
    `InvalidArgumentError` naming `arg`, not a bare `TypeError`."""
    if isinstance(values, (str, bytes)):
        raise error(Status.INVALID_ARGUMENT, f"`{arg}` is {values!r}, expected a sequence of integers")
    try:
        items = iter(values)
    except TypeError:
        raise error(Status.INVALID_ARGUMENT, f"`{arg}` is {values!r}, expected a sequence of integers") from None
    return tuple(integer(arg, v) for v in items)


def flag(arg: str, v) -> bool:
    """`v` as a bool: `True` / `False`, numpy's bool, or the integer 0 or 1
    (by `operator.index`). Anything else (a string, which `bool()` takes as
    True even when it reads `"False"`; a float; None) is an
    `InvalidArgumentError` naming `arg`."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    try:
        n = operator.index(v)
    except TypeError:
        n = -1
    if 0 <= n <= 1:
        return bool(n)
    raise error(Status.INVALID_ARGUMENT, f"`{arg}` is {v!r}, expected a bool (True or False)")


def c_uint(arg: str, v, top: int = SIZE_MAX) -> int:
    """`v` as an unsigned C argument of at most `top` (`size_t` by default).
    ctypes takes an int outside a C type's range modulo its size without a
    word (`2**32 + 2` reaches a `uint32_t` as 2), so such a value is an
    `AmoeError` naming `arg` here instead, and so is a value that is not an
    integer (`integer`)."""
    n = integer(arg, v)
    if not 0 <= n <= top:
        raise error(Status.INVALID_ARGUMENT, f"`{arg}` is {v}, outside 0..={top}")
    return n


def comm_type_code(v) -> int:
    """A caller's comm type (a `CommType`, its number, or its name such as
    `"mc2"`) as the library's `uint32_t` argument (the library names a number
    it does not know)."""
    if isinstance(v, str):
        v = CommType.parse(v)
    return c_uint("comm_type", v, U32_MAX)


def sizes(values, arg: str = "sizes") -> tuple:
    """A `size_t[]` holding `values` (kept alive by the caller) and its length;
    a value that is no integer (`integer`) or outside `size_t` is an
    `InvalidArgumentError` naming `arg`."""
    values = list(integers(arg, values))
    if any(not 0 <= v <= SIZE_MAX for v in values):
        raise error(Status.INVALID_ARGUMENT, f"`{arg}`: sizes must be in 0..={SIZE_MAX}, got {values}")
    return (c_size_t * max(len(values), 1))(*values), len(values)


class Table(dict):
    """Values built once per key, for the calls that follow. It starts over
    (is cleared) when it holds `max` entries, so it stays bounded whatever
    keys callers bring."""

    def __init__(self, max_entries: int):
        super().__init__()
        self.max = max_entries

    def put(self, key, value):
        """Stores `value` under `key` and returns it."""
        if len(self) >= self.max:
            self.clear()
        self[key] = value
        return value


# `sizes` arrays by their values. The library only reads them, so equal sizes
# share one: a layout rebuilt from the same sizes on every call (an engine
# builds one per forward) then has the same array, and the tables keyed by an
# array's identity (`shapes._SHAPES`) find it.
_SIZE_ARRAYS = Table(256)


def shared_sizes(values, arg: str = "sizes") -> tuple:
    """`sizes(values, arg)`, one array per distinct tuple of values; nothing
    may write to it."""
    key = integers(arg, values)
    hit = _SIZE_ARRAYS.get(key)
    return hit if hit is not None else _SIZE_ARRAYS.put(key, sizes(key, arg))


def _read_enum_tables(lb) -> dict:
    """`{C enum name: {variant name: value}}` from the library `lb`, in its order."""

    def ok(status):
        if status != Status.OK:
            raise OSError(f"ascend_moe: reading the library's enum table failed: {last_error(lb)}")

    tables = {}
    for i in range(lb.amoe_enum_count()):
        name, n = c_char_p(), c_size_t(0)
        ok(lb.amoe_enum_info(i, ctypes.byref(name), ctypes.byref(n)))
        variants = {}
        for j in range(n.value):
            vname, value = c_char_p(), c_uint32(0)
            ok(lb.amoe_enum_entry(i, j, ctypes.byref(vname), ctypes.byref(value)))
            variants[vname.value.decode()] = value.value
        tables[name.value.decode()] = variants
    return tables


def library_enum_tables() -> dict:
    """The loaded library's enum table, `{C enum name: {variant name: value}}`."""
    return _read_enum_tables(lib())
