"""Shape functions with the same names as the ops.

Each takes anything with `.shape` and `.dtype` (numpy arrays, torch tensors
including meta / fake tensors) or `(shape, dtype)` pairs, calls the library's
`*_output_shape` function, which is the one the real op sizes its output
with, and returns the output shape as a tuple. The output dtype of every op is
the dtype of its first argument.
"""

from __future__ import annotations

import ctypes
import math
from ctypes import c_size_t

from ._enums import MAX_EP_RANKS, REDUCIBLE_DTYPE_NAMES, DropPadMode, DType, Status
from ._errors import error
from ._lib import (
    SIZE_MAX,
    FinalizeArgs,
    MoeContextC,
    Table,
    c_uint,
    call,
    comm_type_code,
    integer,
    integers,
    shared_sizes,
    sizes,
)
from ._tensor import NUMPY_DTYPES, desc_meta, desc_meta_opt, ptr, shape_of, shape_out


def _ep(ep, arg: str = "ep") -> tuple:
    """`(rank, world_size)` of a `Comm` or a pair passed as `arg`; anything
    else is an `InvalidArgumentError` naming `arg`."""
    try:
        rank, size = ep.rank, ep.world_size
    except AttributeError:
        try:
            rank, size = ep
        except (TypeError, ValueError):
            raise error(
                Status.INVALID_ARGUMENT,
                f"`{arg}` must be a Comm or a (rank, world_size) pair, got {type(ep).__name__}",
            ) from None
    return c_uint("rank", rank), c_uint("world_size", size)


def _context_ptr(ctx):
    """The `amoe_moe_context` of a `MoeContext` (`prepare`, which imports this
    module), known by the struct it holds; anything else is an
    `InvalidArgumentError` naming `ctx`."""
    if not isinstance(getattr(ctx, "_c", None), MoeContextC):
        raise error(Status.INVALID_ARGUMENT, f"`ctx` must be a MoeContext, got {type(ctx).__name__}")
    return ctx.ptr


class SpLayout:
    """Rows held by every EP rank (SPEC section 2)."""

    def __init__(self, local_sizes):
        sizes_ = integers("local_sizes", local_sizes)
        if not sizes_:
            raise error(Status.INVALID_ARGUMENT, "SpLayout: local_sizes needs one entry per EP rank, got none")
        if any(s < 0 for s in sizes_):
            raise error(Status.INVALID_ARGUMENT, f"SpLayout: local_sizes must be >= 0, got {list(sizes_)}")
        self._local_sizes = sizes_
        self._size_array = shared_sizes(sizes_, "local_sizes")  # the library's size_t[] of them

    @property
    def local_sizes(self) -> tuple:
        return self._local_sizes

    @classmethod
    def from_dp_tokens(cls, num_tokens_across_dp, tp_size: int, pcp_size: int = 1) -> "SpLayout":
        """`local_sizes[d * tp + t] = ceil(T_d / tp)` for every TP rank `t`; with
        prefill context parallelism (`pcp_size` > 1) EP rank order is DP x PCP x TP
        and `local_sizes[(d * pcp + p) * tp + t] = ceil(T_d / tp)` (SPEC section 2)."""
        arr, n = sizes(num_tokens_across_dp, "num_tokens_across_dp")
        need = c_size_t(0)
        tp, pcp = c_uint("tp_size", tp_size), c_uint("pcp_size", pcp_size)
        # The library refuses more than MAX_EP_RANKS entries before it looks at `out`.
        cap = max(min(n * tp * pcp, MAX_EP_RANKS), 1)
        out = (c_size_t * cap)()
        if pcp == 1:
            call("amoe_sp_layout_from_dp_tokens", arr, n, tp, out, cap, ctypes.byref(need))
        else:
            call("amoe_sp_layout_from_dp_tokens_pcp", arr, n, pcp, tp, out, cap, ctypes.byref(need))
        return cls(out[: need.value])

    @property
    def ep_size(self) -> int:
        return len(self.local_sizes)

    @property
    def max_rows(self) -> int:
        return max(self.local_sizes)

    @property
    def total_rows(self) -> int:
        return sum(self.local_sizes)

    def __eq__(self, other) -> bool:
        return isinstance(other, SpLayout) and other.local_sizes == self.local_sizes

    def __hash__(self) -> int:
        return hash(self._local_sizes)

    def __reduce__(self):
        # By its sizes: the size_t[] it keeps is rebuilt where it is loaded (ctypes arrays do not pickle).
        return SpLayout, (self._local_sizes,)

    def __repr__(self) -> str:
        return f"SpLayout({list(self.local_sizes)})"


def _layout(layout):
    """`(size_t[], n)` or `(None, 0)` for an `SpLayout`, a sequence of sizes, or None."""
    if layout is None:
        return None, 0
    if isinstance(layout, SpLayout):
        return layout._size_array
    return shared_sizes(getattr(layout, "local_sizes", layout), "local_sizes")


# The `amoe_finalize_args` of every set of operands seen so far, keyed by the
# identities of its descriptor pointers and its mode. `_tensor._core` builds
# one descriptor per data pointer, shape, dtype and device, so an equal key
# means equal operands. An entry is `(pointers, struct)`: it holds the pointer
# objects whose identities make up its key (the struct holds only what they
# point to), so no identity in a key is reused while it is cached. Cleared
# when full.
_FINALIZE_ARGS = Table(256)

# The answers of the library's `*_output_shape` functions, keyed by the
# function, the identities of the C objects it reads (descriptor pointers,
# argument structs, size arrays: none changes after it is built) and its
# integer arguments. An entry keeps those objects alive, so no identity in a
# key is reused while it is cached. A shape function reads the descriptors'
# shapes and dtypes only, so its answer stands. Cleared when full.
_SHAPES = Table(256)


def _asked(name: str, objs: tuple, ints: tuple) -> tuple:
    """The output shape the library's `name` gives for the arguments `objs`
    then `ints`, asked once per key of `_SHAPES`."""
    key = (name, *map(id, objs), *ints)
    hit = _SHAPES.get(key)
    if hit is not None:
        return hit[1]
    buf, ndim, out = shape_out()
    call(name, *objs, *ints, *out)
    shape = shape_of(buf, ndim)
    _SHAPES.put(key, (objs, shape))
    return shape


def finalize_args(expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx, drop_pad_mode, make):
    """An `amoe_finalize_args` plus the descriptors it points to (kept alive)."""
    mode = integer("drop_pad_mode", drop_pad_mode)
    if not 0 <= mode <= int(max(DropPadMode)):
        raise error(Status.INVALID_ARGUMENT, f"drop_pad_mode {drop_pad_mode} is not one of 0..={int(max(DropPadMode))}")
    descs = [
        make("expanded_x", expanded_x),
        make("expanded_row_idx", expanded_row_idx),
        None if x1 is None else make("x1", x1),
        None if x2 is None else make("x2", x2),
        None if bias is None else make("bias", bias),
        None if scales is None else make("scales", scales),
        None if expert_idx is None else make("expert_idx", expert_idx),
    ]
    ptrs = [ptr(d) for d in descs]
    key = (*map(id, ptrs), mode)
    hit = _FINALIZE_ARGS.get(key)
    if hit is None:
        hit = _FINALIZE_ARGS.put(key, (ptrs, FinalizeArgs(*ptrs, mode & 0xFFFFFFFF)))
    return hit[1], descs


def moe_finalize_routing(
    expanded_x,
    expanded_row_idx,
    x1=None,
    x2=None,
    bias=None,
    scales=None,
    expert_idx=None,
    drop_pad_mode=DropPadMode.DROP_LESS_COLUMN,
) -> tuple:
    """`[N, H...]`; validates every input as the op does."""
    args, _keep = finalize_args(
        expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx, drop_pad_mode, desc_meta
    )
    return _finalize_shape(args)


def _finalize_shape(args) -> tuple:
    """`moe_finalize_routing`'s output shape from an `amoe_finalize_args`
    of `finalize_args` (an op passes the one it runs with)."""
    return _asked("amoe_moe_finalize_routing_output_shape", (args,), ())


def moe_token_unpermute(permuted, sorted_indices, probs=None) -> tuple:
    """`[T, H...]`."""
    p, s, pr = desc_meta("permuted", permuted), desc_meta("sorted_indices", sorted_indices), desc_meta_opt("probs", probs)
    return _asked("amoe_moe_token_unpermute_output_shape", (p.ptr, s.ptr, ptr(pr)), ())


def maybe_pad_and_reduce(x, layout, ep) -> tuple:
    """`[local_sizes[ep_rank], H...]` (`[rows / ep_size, H...]` without a layout);
    `ep` is the EP `Comm` or `(ep_rank, ep_size)`."""
    d = desc_meta("x", x)
    ls, n = _layout(layout)
    rank, size = _ep(ep)
    return _asked("amoe_maybe_pad_and_reduce_output_shape", (d.ptr, ls), (n, rank, size))


def maybe_all_gather_and_maybe_unpad(x, layout, ep) -> tuple:
    """`[sum(local_sizes), H...]` (`[rows * ep_size, H...]` without a layout)."""
    d = desc_meta("x", x)
    ls, n = _layout(layout)
    rank, size = _ep(ep)
    return _asked("amoe_maybe_all_gather_and_maybe_unpad_output_shape", (d.ptr, ls), (n, rank, size))


def finalize_and_reduce(
    expanded_x,
    expanded_row_idx,
    layout,
    ep,
    x1=None,
    x2=None,
    bias=None,
    scales=None,
    expert_idx=None,
    drop_pad_mode=DropPadMode.DROP_LESS_COLUMN,
) -> tuple:
    """`[local_sizes[ep_rank], H...]` of the fused finalize + EP/SP reduce."""
    args, _keep = finalize_args(
        expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx, drop_pad_mode, desc_meta
    )
    return _finalize_and_reduce_shape(args, layout, ep)


def _finalize_and_reduce_shape(args, layout, ep) -> tuple:
    """`finalize_and_reduce`'s output shape from an `amoe_finalize_args`."""
    ls, n = _layout(layout)
    rank, size = _ep(ep)
    return _asked("amoe_finalize_and_reduce_output_shape", (args, ls), (n, rank, size))


def shared_pad_split(x, tp) -> tuple:
    """`[ceil(T / tp_size), H...]` of the DP batch `x [T, H...]`; `tp` is the TP `Comm` or `(tp_rank, tp_size)`."""
    d = desc_meta("x", x)
    rank, size = _ep(tp, "tp")
    return _asked("amoe_shared_pad_split_output_shape", (d.ptr,), (rank, size))


def shared_gather_unpad(x, num_tokens: int, tp) -> tuple:
    """`[num_tokens, H...]`; `x` must have `ceil(num_tokens / tp_size)` rows."""
    d = desc_meta("x", x)
    _, size = _ep(tp, "tp")
    num_tokens = _count("num_tokens", num_tokens)
    return _asked("amoe_shared_gather_unpad_output_shape", (d.ptr,), (num_tokens, size))


def shared_pad_reduce_scatter(x, tp) -> tuple:
    """`[ceil(T / tp_size), H...]` of the TP-partial `x [T, H...]`."""
    d = desc_meta("x", x)
    _, size = _ep(tp, "tp")
    return _asked("amoe_shared_pad_reduce_scatter_output_shape", (d.ptr,), (size,))


def _count(name: str, v) -> int:
    """A non-negative count, or an `AmoeError` naming it."""
    v = integer(name, v)
    if v < 0:
        raise error(Status.INVALID_ARGUMENT, f"{name} must be >= 0, got {v}")
    return v


def _sized(arg: str, shape: tuple, code: int) -> tuple:
    """`shape`, of a tensor `arg` of dtype `code`, or the `ShapeError` the
    library raises for one whose size in bytes does not fit in a size_t."""
    if math.prod(shape) * NUMPY_DTYPES[code].itemsize > SIZE_MAX:
        raise error(Status.SHAPE, f"`{arg}` has shape {list(shape)}, whose size in bytes overflows")
    return shape


def _identity(x) -> tuple:
    """`x`'s shape, through its descriptor: the fakes of the collectives then
    refuse a dtype or shape the library cannot take at trace time, with the
    error the real op (which builds the same descriptor) raises."""
    d = desc_meta("x", x)
    return _sized("x", d.shape, d.c.dtype)


def _reduced(op: str, x) -> tuple:
    """`x`'s shape, for collective `op` that sums it: a dtype that is only
    moved is refused as the library refuses it when the collective runs."""
    d = desc_meta("x", x)
    _sized("x", d.shape, d.c.dtype)
    name = DType(d.c.dtype).name.lower()
    if name not in REDUCIBLE_DTYPE_NAMES:
        raise error(
            Status.DTYPE,
            f"{op}: `src` has dtype {name}, expected a reducible dtype ({', '.join(REDUCIBLE_DTYPE_NAMES)}); "
            f"{name} is moved as bytes, never reduced",
        )
    return d.shape


def all_reduce(x, comm=None) -> tuple:
    """Identity; the dtype must be one a reduction takes."""
    return _reduced("all_reduce", x)


def reduce_scatter(x, comm) -> tuple:
    """`[rows / world_size, ...]`; the dtype must be one a reduction takes."""
    s = _reduced("reduce_scatter", x)
    _, world = _ep(comm, "comm")
    if not s or s[0] % world:
        raise error(Status.SHAPE, f"reduce_scatter: x has shape {s}, whose rows the world size {world} does not divide")
    return (s[0] // world,) + s[1:]


def all_gather(x, comm) -> tuple:
    """`[rows * world_size, ...]`."""
    d = desc_meta("x", x)
    s = _sized("x", d.shape, d.c.dtype)
    _, world = _ep(comm, "comm")
    return _sized("out", (s[0] * world,) + s[1:] if s else (world,), d.c.dtype)


def reduce_routed_early(x, *_args) -> tuple:
    """Identity (SPEC section 5)."""
    return _identity(x)


reduce_shared = reduce_routed_early
reduce_final = reduce_routed_early


def token_prepare(x, comm_type, ctx) -> tuple:
    """Shape of `ascend_moe.token_prepare`'s hidden output (`ctx` a `MoeContext`)."""
    d = desc_meta("x", x)
    buf, ndim, out = shape_out()
    call("amoe_token_prepare_output_shape", d.ptr, comm_type_code(comm_type), _context_ptr(ctx), *out)
    return shape_of(buf, ndim)


def token_finalize(y, comm_type, ctx) -> tuple:
    """Shape of `ascend_moe.token_finalize`'s output (`ctx` a `MoeContext`)."""
    d = desc_meta("y", y)
    buf, ndim, out = shape_out()
    call("amoe_token_finalize_output_shape", d.ptr, comm_type_code(comm_type), _context_ptr(ctx), *out)
    return shape_of(buf, ndim)
