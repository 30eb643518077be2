"""Communicators and collectives over the library's CPU shared-memory transport."""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
import weakref
from ctypes import c_size_t, c_void_p

from . import shapes
from ._lib import AmoeError, Status, call, lib, sizes
from ._tensor import desc_in, empty


class ReduceOp(enum.IntEnum):
    """`amoe_reduce_op`."""

    SUM = 0
    MAX = 1
    MIN = 2


# Open communicators by `Comm.handle_id`, for callers that can pass only an
# int (the torch custom ops). Weak: the registry never keeps a Comm alive.
_REGISTRY: "weakref.WeakValueDictionary[int, Comm]" = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.RLock()  # reentrant: close() may run from __del__ inside a locked section
_NEXT_ID = itertools.count(1)


class Comm:
    """One rank's handle on a group. Create with `Comm.cpu(...)` or `comm.split(...)`;
    release with `close()` or a `with` block."""

    def __init__(self, handle: int):
        self._h = c_void_p(handle)
        with _REGISTRY_LOCK:
            self._id = next(_NEXT_ID)
            _REGISTRY[self._id] = self

    @property
    def handle_id(self) -> int:
        """A process-unique int naming this communicator while it is open (ids are
        never reused), for APIs that cannot take a Python object, such as
        `torch.ops.ascend_moe.*`. `Comm.lookup(id)` returns the communicator."""
        return self._id

    @staticmethod
    def lookup(handle_id: int) -> "Comm":
        """The open communicator with this `handle_id`; `AmoeError` when there is
        none (never created, closed, or garbage-collected)."""
        comm = _REGISTRY.get(int(handle_id))
        if comm is None or not comm._h.value:
            raise AmoeError(
                Status.INVALID_ARGUMENT,
                f"no open communicator has handle_id {int(handle_id)} (closed, freed, or never created)",
            )
        return comm

    @classmethod
    def cpu(cls, name: str, world_size: int, rank: int, timeout_s: float = 60.0) -> "Comm":
        """Joins the CPU world `name` of `world_size` ranks as `rank` (threads or
        processes); returns once every rank joined. `timeout_s` bounds every wait
        of this communicator (`<= 0`: `$ASCEND_MOE_COMM_TIMEOUT` or 60 s)."""
        if world_size < 0 or rank < 0:
            raise AmoeError(Status.INVALID_ARGUMENT, f"world_size {world_size} and rank {rank} must be >= 0")
        out = c_void_p()
        call("amoe_comm_cpu_new", name.encode(), world_size, rank, float(timeout_s), ctypes.byref(out))
        return cls(out.value)

    @classmethod
    def from_hccl(cls, raw_hccl_comm: int, device_ordinal: int) -> "Comm":
        """Wraps an engine-owned HCCL communicator without owning it (needs the NPU backend)."""
        out = c_void_p()
        call("amoe_comm_from_hccl", c_void_p(raw_hccl_comm), device_ordinal, ctypes.byref(out))
        return cls(out.value)

    @property
    def handle(self) -> c_void_p:
        if not self._h.value:
            raise AmoeError(Status.INVALID_ARGUMENT, "the communicator is closed")
        return self._h

    @property
    def rank(self) -> int:
        out = c_size_t()
        call("amoe_comm_rank", self.handle, ctypes.byref(out))
        return out.value

    @property
    def world_size(self) -> int:
        out = c_size_t()
        call("amoe_comm_world_size", self.handle, ctypes.byref(out))
        return out.value

    def split(self, ranks) -> "Comm":
        """The sub-group of `ranks` (this group's rank numbers; the list order is
        the new rank order). Called by every listed rank with the same list."""
        arr, n = sizes(ranks)
        out = c_void_p()
        call("amoe_comm_split", self.handle, arr, n, ctypes.byref(out))
        return Comm(out.value)

    def barrier(self) -> None:
        call("amoe_barrier", self.handle, None)

    def close(self) -> None:
        h, self._h = self._h, c_void_p()
        with _REGISTRY_LOCK:
            _REGISTRY.pop(getattr(self, "_id", None), None)
        if h.value:
            lib().amoe_comm_free(h)

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if not self._h.value:
            return "Comm(closed)"
        return f"Comm(rank={self.rank}, world_size={self.world_size})"


def _op(op) -> int:
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            raise AmoeError(Status.INVALID_ARGUMENT, f"unknown reduce op {op!r} (sum, max, min)") from None
    return int(op)


def all_reduce(x, comm: Comm, op=ReduceOp.SUM):
    """`op` of `x` over every rank; a new array of `x`'s shape and dtype."""
    s = desc_in("x", x)
    y = empty(s.array.shape, s.c.dtype)
    d = desc_in("out", y)
    call("amoe_all_reduce", comm.handle, s.ptr, d.ptr, _op(op), None)
    return y


def reduce_scatter(x, comm: Comm, op=ReduceOp.SUM):
    """Block `rank` (rows `[rank*R/W, (rank+1)*R/W)`) of `op(x over ranks)`."""
    s = desc_in("x", x)
    y = empty(shapes.reduce_scatter(s.array, comm), s.c.dtype)
    d = desc_in("out", y)
    call("amoe_reduce_scatter", comm.handle, s.ptr, d.ptr, _op(op), None)
    return y


def all_gather(x, comm: Comm):
    """Concatenation of every rank's `x` along dim 0, in rank order."""
    s = desc_in("x", x)
    y = empty(shapes.all_gather(s.array, comm), s.c.dtype)
    d = desc_in("out", y)
    call("amoe_all_gather", comm.handle, s.ptr, d.ptr, None)
    return y


def broadcast(x, comm: Comm, root: int = 0):
    """Rank `root`'s `x` on every rank (a new array)."""
    s = desc_in("x", x)
    y = s.array.copy()
    d = desc_in("x", y)
    call("amoe_broadcast", comm.handle, d.ptr, int(root), None)
    return y
