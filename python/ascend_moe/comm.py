"""Communicators and collectives over the library's CPU shared-memory transport.

Every rank of a collective passes the same dtype and element counts. A CPU
communicator also requires every rank's `x` to have the same shape (for
`broadcast` too), and otherwise fails on every rank with a mismatch naming
each rank's shape; a communicator from HCCL (`Comm.from_hccl`,
`Comm.from_process_group`) compares element counts only, as HCCL sees no
shapes."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import sys
import threading
import weakref
from ctypes import c_size_t, c_void_p

import numpy as np

from . import shapes
from ._enums import HCCL_WORLD, ReduceOp, Status
from ._errors import AmoeError, error
from ._lib import U32_MAX, Lease, Owned, c_uint, call, integer, refusing, sizes
from ._tensor import Operands, _no_gradient, _records_grad, as_array, check_dense, desc_out, dtype_code, dtype_name, lend_out, resolve_stream


# Open communicators by `Comm.handle_id`, for callers that can pass only an
# int (the torch custom ops). Weak: the registry never keeps a Comm alive.
_REGISTRY: "weakref.WeakValueDictionary[int, Comm]" = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.RLock()  # reentrant: close() may run from __del__ inside a locked section
_NEXT_ID = itertools.count(1)
# A handle id is `seq << 32 | (world_size - 1) << 16 | rank`: the rank and the
# world size, which decide the output shapes of the collectives and the EP/SP
# ops, are part of the int a traced graph holds, and the id stays a
# non-negative int64 (a torch op's `int`). 16 bits each hold every world HCCL
# forms: a rank table has at most 65536 ranks (hcomm
# src/coll_communicator_mgr/rank_graph/rank_table_info/rank_table_info.h:23,
# checked at rank_table_info.cc:35); a CPU world has at most 64 (shm-comm's
# MAX_WORLD). That leaves 31 bits of sequence: 2**31 - 1 communicators per
# process, ids never reused.
_ID_FIELD_BITS = 16
_ID_MAX_WORLD = 1 << _ID_FIELD_BITS
_ID_SEQ_MAX = (1 << (63 - 2 * _ID_FIELD_BITS)) - 1


def _handle_id(seq: int, world_size: int, rank: int) -> int:
    """The handle id of the `seq`-th communicator of this process, rank
    `rank` of `world_size`; an `InvalidArgumentError` when they do not fit."""
    if not 1 <= world_size <= _ID_MAX_WORLD or not 0 <= rank < world_size:
        raise error(
            Status.INVALID_ARGUMENT,
            f"rank {rank} of a world of {world_size} ranks: handle ids hold worlds of 1..={_ID_MAX_WORLD} ranks",
        )
    if not 1 <= seq <= _ID_SEQ_MAX:
        raise error(Status.INVALID_ARGUMENT, f"this process opened more than {_ID_SEQ_MAX} communicators")
    return seq << (2 * _ID_FIELD_BITS) | (world_size - 1) << _ID_FIELD_BITS | rank


def _is_torch_world(pg) -> bool:
    """Whether `pg` is torch.distributed's default group (its world)."""
    import torch.distributed as dist

    return pg is None or pg is dist.group.WORLD


class Comm(Owned):
    """One rank's handle on a group. Create with `Comm.cpu(...)` or `comm.split(...)`;
    release with `close()` or a `with` block (a call still running on it in
    another thread keeps the handle until it returns)."""

    _free_fn = "amoe_comm_free"
    _closed_text = "the communicator is closed"

    def __init__(self, handle: int):
        self._own(handle)
        self._rank_size = None  # (rank, world_size), asked once: a handle's group never changes
        rank, size = self._ask_rank_size()
        _handle_id(1, size, rank)  # a world ids cannot hold takes no sequence number
        with _REGISTRY_LOCK:
            self._id = _handle_id(next(_NEXT_ID), size, rank)
            _REGISTRY[self._id] = self

    @property
    def handle_id(self) -> int:
        """A process-unique int naming this communicator while it is open (ids are
        never reused), for APIs that cannot take a Python object, such as
        `torch.ops.ascend_moe.*`. `Comm.lookup(id)` returns the communicator.

        The id carries the rank and the world size: a graph that holds it names
        what the outputs' shapes depend on, so a compiled-graph cache shared by
        several processes never hands one rank or world the code of another."""
        return self._id

    @staticmethod
    def lookup(handle_id: int) -> "Comm":
        """The open communicator with this `handle_id`; `AmoeError` when there is
        none (never created, closed, or garbage-collected)."""
        handle_id = integer("handle_id", handle_id)
        comm = _REGISTRY.get(handle_id)
        if comm is None or comm.closed:
            raise error(
                Status.INVALID_ARGUMENT,
                f"no open communicator has handle_id {handle_id} (closed, freed, or never created)",
            )
        return comm

    @classmethod
    def cpu(cls, name: str, world_size: int, rank: int, timeout_s: float = 0.0) -> "Comm":
        """Joins the CPU world `name` of `world_size` ranks as `rank` (threads or
        processes); returns once every rank joined. `timeout_s` bounds every wait
        of this communicator, in seconds, read as the C ABI, the Rust API and
        the CLI read it: 0 (the default), a negative value or NaN is
        `$ASCEND_MOE_COMM_TIMEOUT` or 60 s, `math.inf` is no limit, and a
        positive value under 1e-9 (1 ns) is refused with
        `Status.INVALID_ARGUMENT`."""
        world_size, rank = c_uint("world_size", world_size), c_uint("rank", rank)
        if not isinstance(name, str):
            raise error(Status.INVALID_ARGUMENT, f"`name` is {name!r}, expected a str")
        if "\0" in name:
            # The C string would end there: two names that differ after it
            # would join one world.
            raise error(Status.INVALID_ARGUMENT, f"`name` {name!r} holds a NUL character")
        try:
            timeout_s = float(timeout_s)
        except (TypeError, ValueError):
            raise error(Status.INVALID_ARGUMENT, f"`timeout_s` is {timeout_s!r}, expected a number of seconds") from None
        out = c_void_p()
        call("amoe_comm_cpu_new", name.encode(), world_size, rank, timeout_s, ctypes.byref(out))
        return cls(out.value)

    @classmethod
    def from_hccl(cls, raw_hccl_comm, device_ordinal: int, *, world: bool = False) -> "Comm":
        """Wraps an engine-owned HCCL communicator without owning it (needs the NPU backend).
        `raw_hccl_comm` is the `HcclComm` as an int or as a `ctypes.c_void_p`
        (what vLLM-Ascend's `PyHcclCommunicator.comm` holds); a NULL one is
        refused. `world=True` says it is the engine's world communicator (made
        from a root info), which `split` may split; any other borrowed
        communicator may be a sub-communicator, and HCCL does not split those
        again."""
        out = c_void_p()
        flags = HCCL_WORLD if world else 0
        if isinstance(raw_hccl_comm, c_void_p):
            # `.value` is None for a NULL pointer: passed on as 0, which the C ABI refuses.
            raw_hccl_comm = raw_hccl_comm.value or 0
        raw = c_void_p(c_uint("raw_hccl_comm", raw_hccl_comm))
        device_ordinal = c_uint("device_ordinal", device_ordinal, U32_MAX)
        call("amoe_comm_from_hccl", raw, device_ordinal, flags, ctypes.byref(out))
        return cls(out.value)

    @classmethod
    def from_process_group(cls, pg, device_ordinal=None) -> "Comm":
        """Borrows the HcclComm of the torch.distributed group `pg` (None: the
        default group, as torch.distributed takes it), which must use the HCCL
        backend (torch_npu's ProcessGroupHCCL): no communicator is
        created and no HCCL buffer reserved beyond the group's own. The handle
        keeps `pg` alive; `close()` releases only the handle.

        The raw comm is `pg._get_backend(torch.device("npu")).get_hccl_comm(device_ordinal)`:
        torch_npu's `ProcessGroupHCCL::getHcclComm(int rankid)`
        (torch_npu/csrc/distributed/ProcessGroupHCCL.cpp) returns, as an int64,
        the group's `HcclComm` on device `getDeviceForRank(rankid)`, that is
        `rankid % device_count()`, initialising it on first use. So it is asked
        with this process's local device, not its rank in `pg` (which, for a
        subgroup, names another NPU). `device_ordinal` defaults to
        `torch.npu.current_device()`.

        The borrowed communicator may be a sub-communicator of torch's world
        (torch_npu can make a subgroup with `HcclCreateSubCommConfig`), and
        HCCL splits only a global communicator: `split` on it is refused, except
        on torch's default (world) group; make other subgroups with
        `torch.distributed.new_group` and borrow them."""
        import torch
        import torch.distributed as dist

        try:
            backend = str(dist.get_backend(pg)).lower()
        except Exception as e:  # noqa: BLE001
            raise error(
                Status.INVALID_ARGUMENT, f"Comm.from_process_group: {pg!r} is not a usable torch.distributed group: {e}"
            ) from e
        if backend != "hccl":
            raise error(
                Status.INVALID_ARGUMENT,
                f"Comm.from_process_group: the group uses the {backend!r} backend; only an HCCL group "
                "(torch_npu's ProcessGroupHCCL) has an HcclComm to borrow (use Comm.cpu for host ranks)",
            )
        if pg is None:
            pg = dist.group.WORLD
        # PrivateUse1's device name: "npu" once torch_npu has renamed the backend.
        hccl = pg._get_backend(torch.device(torch._C._get_privateuse1_backend_name()))
        getter = getattr(hccl, "get_hccl_comm", None)
        if getter is None:
            raise error(
                Status.UNAVAILABLE,
                f"Comm.from_process_group: the group's backend {type(hccl).__name__} has no get_hccl_comm",
            )
        if device_ordinal is None:
            device_ordinal = torch.npu.current_device()
        device_ordinal = c_uint("device_ordinal", device_ordinal, U32_MAX)
        raw = int(getter(device_ordinal))
        if not raw:
            raise error(Status.HCCL, "Comm.from_process_group: the HCCL group returned a null HcclComm")
        # torch's default group is its world; any other group may be a split of it.
        comm = cls.from_hccl(raw, device_ordinal, world=_is_torch_world(pg))
        comm._owner = pg
        return comm

    @property
    def handle(self) -> Lease:
        """The library handle, held until it is released (`Lease`: `with
        comm.handle as h:` around the calls it is passed to); a closed
        communicator is refused."""
        return self._lease()

    def _ask_rank_size(self) -> tuple:
        with self.handle as h:  # refuses a closed communicator on every call
            if self._rank_size is None:
                rank, size = c_size_t(), c_size_t()
                call("amoe_comm_rank", h, ctypes.byref(rank))
                call("amoe_comm_world_size", h, ctypes.byref(size))
                self._rank_size = (rank.value, size.value)
        return self._rank_size

    @property
    def rank(self) -> int:
        return self._ask_rank_size()[0]

    @property
    def world_size(self) -> int:
        return self._ask_rank_size()[1]

    def split(self, ranks) -> "Comm":
        """The sub-group of `ranks` (this group's rank numbers; the list order is
        the new rank order). Called by every listed rank with the same list."""
        out = c_void_p()
        with self.handle as h:
            # A list the library cannot take fails the peers waiting in the split too.
            with refusing_on(h):
                arr, n = sizes(ranks, "ranks")
            call("amoe_comm_split", h, arr, n, ctypes.byref(out))
        return Comm(out.value)

    def barrier(self, stream=None) -> None:
        """Returns once every rank reached it (on `stream` for an HCCL communicator)."""
        with self.handle as h:
            with refusing_on(h):
                st = resolve_stream([], stream) if stream is not None else None
            call("amoe_barrier", h, st)

    def close(self) -> None:
        with _REGISTRY_LOCK:
            _REGISTRY.pop(getattr(self, "_id", None), None)
        super().close()

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
        if self.closed:
            return "Comm(closed)"
        return f"Comm(rank={self.rank}, world_size={self.world_size})"


def handle_of(arg: str, obj, cls: type = Comm) -> Lease:
    """The library handle of `obj`, passed as `arg`, which must be a `cls`
    (default `Comm`; `MoeGroups` for groups): anything else (an int, None, a
    handle id, another class) is an `InvalidArgumentError` naming `arg`
    instead of an AttributeError deep in the call. A closed one is refused
    by its own `handle`. The lease is the caller's to release (`with
    handle_of(...) as h:`)."""
    if not isinstance(obj, cls):
        raise error(Status.INVALID_ARGUMENT, f"`{arg}` must be a {cls.__name__}, got {type(obj).__name__}")
    return obj.handle


def _op(op) -> int:
    """A reduce op by name (`"sum"`); a number goes to the library, which checks it."""
    return int(ReduceOp.parse(op)) if isinstance(op, str) else c_uint("op", op, U32_MAX)


def refusing_on(h):
    """The argument checks of a call over the communicator `h`: one that
    fails is reported to the peers waiting in the call (`amoe_comm_refuse`)
    before it is raised. Without a communicator (`h` None) nothing is."""
    if h is None:
        return contextlib.nullcontext()
    return refusing(lambda message: call("amoe_comm_refuse", h, message))


def _collective(name: str, shape_fn, x, comm: Comm, extra, out, stream):
    o = Operands(stream)
    with contextlib.ExitStack() as held:
        try:
            h = held.enter_context(handle_of("comm", comm))
        except AmoeError:
            h = None  # raised below, after x's errors
        with refusing_on(h):
            s = o.input("x", x)  # x's dtype is named first, as the library would
            args = extra()
            h = held.enter_context(handle_of("comm", comm))
            d = o.output(shape_fn(s, comm), s, out)
            st = o.stream
        call(name, h, s.ptr, d.ptr, *args, st)
    return o.result


def all_reduce(x, comm: Comm, op=ReduceOp.SUM, *, out=None, stream=None):
    """`op` of `x` over every rank, of `x`'s shape and dtype, into `out` (default a new one).
    Across ranks, see the module's note on shapes."""
    return _collective("amoe_all_reduce", shapes.all_reduce, x, comm, lambda: (_op(op),), out, stream)


def reduce_scatter(x, comm: Comm, op=ReduceOp.SUM, *, out=None, stream=None):
    """Block `rank` (rows `[rank*R/W, (rank+1)*R/W)`) of `op(x over ranks)`."""
    return _collective("amoe_reduce_scatter", shapes.reduce_scatter, x, comm, lambda: (_op(op),), out, stream)


def all_gather(x, comm: Comm, *, out=None, stream=None):
    """Concatenation of every rank's `x` along dim 0, in rank order."""
    return _collective("amoe_all_gather", shapes.all_gather, x, comm, tuple, out, stream)


def broadcast(x, comm: Comm, root: int = 0, *, out=None, stream=None):
    """Rank `root`'s `x` on every rank. In place when `out is x`; otherwise `x`
    is first copied into `out`, which must have x's shape and dtype (default a
    dense copy of `x`; an `out` tensor takes it with `out.copy_(x)`). Like
    every op it has no gradient: with an `x` that requires grad in grad mode,
    a new result's backward fails, and an `out` other than `x` is refused."""
    with handle_of("comm", comm) as h:
        with refusing_on(h):
            check_dense("x", x)
            grad = _records_grad(x)
            if grad and out is not None and out is not x:
                raise error(
                    Status.INVALID_ARGUMENT,
                    "`x` requires grad and grad mode is on, but the op has no gradient and writes `out` in place, which "
                    "autograd cannot record: call it under torch.no_grad(), or pass `x`.detach()",
                )
            if out is not None:
                lend_out("out", out)
            fresh = out is None
            if out is None:
                if hasattr(x, "clone"):
                    # A dense copy the library writes, never linked to `x` by autograd.
                    out = x.detach().clone(memory_format=sys.modules["torch"].contiguous_format)
                else:
                    out = as_array("x", x).copy()
            elif out is not x:
                xa = x if hasattr(x, "dtype") else as_array("x", x)
                if tuple(out.shape) != tuple(xa.shape) or dtype_name(out.dtype) != dtype_name(xa.dtype):
                    raise error(
                        Status.SHAPE if tuple(out.shape) != tuple(xa.shape) else Status.DTYPE,
                        f"`out` is {dtype_name(out.dtype)} {list(out.shape)}, `x` is {dtype_name(xa.dtype)} "
                        f"{list(xa.shape)}: broadcast takes an `out` of x's shape and dtype",
                    )
                # Before the copy: an `out` or a root refused is left as the caller had it.
                desc_out("out", out, tuple(out.shape), dtype_code("out", out.dtype))
                size = c_size_t()
                call("amoe_comm_world_size", h, ctypes.byref(size))
                if c_uint("root", root) >= size.value:
                    raise error(
                        Status.INVALID_ARGUMENT,
                        f"broadcast: invalid argument `root`: root {root} is out of range for world size {size.value}",
                    )
                if hasattr(out, "copy_"):
                    if not hasattr(x, "copy_"):  # an array into a tensor: its bytes, as the dtypes matched
                        raw = sys.modules["torch"].from_numpy(as_array("x", x).reshape(-1).view(np.uint8))
                        x = raw.view(out.dtype).reshape(out.shape)
                    out.copy_(x)
                elif isinstance(out, np.ndarray):
                    if hasattr(x, "copy_"):  # a tensor into an array: its bytes, as the dtypes matched
                        raw = x.detach().resolve_neg().contiguous().reshape(-1)
                        out[...] = raw.view(sys.modules["torch"].uint8).numpy().view(out.dtype).reshape(out.shape)
                    else:
                        out[...] = as_array("x", x)
                else:
                    raise error(
                        Status.INVALID_ARGUMENT, f"`out` ({type(out).__name__}) has no copy_ to take `x`: pass out=x to broadcast in place"
                    )
            d = desc_out("out", out, tuple(out.shape), dtype_code("out", out.dtype))
            root = c_uint("root", root)
            st = resolve_stream([d], stream)
        call("amoe_broadcast", h, d.ptr, root, st)
    return _no_gradient(out, [("x", x)]) if fresh and grad else out
