"""The MoE ops (SPEC sections 1-5) on numpy arrays and tensors (cpu or npu).

Every op takes `out=` (written and returned; default a new output where the
first input lives; an `out=` elsewhere than the inputs, host memory for NPU
inputs or NPU memory for host ones, is a `DeviceError`: no op copies its
result between host and NPU memory) and `stream=` (an object with `.npu_stream`; default
`torch.npu.current_stream()` for NPU operands, none for host ones)."""

from __future__ import annotations

import contextlib
import ctypes
from ctypes import c_uint8

from . import shapes
from ._enums import CommType, DropPadMode, SharedMode
from ._errors import AmoeError
from ._lib import ReducePolicyC, c_uint, call, comm_type_code, flag, refusing
from ._tensor import Operands
from .comm import Comm, handle_of, refusing_on
from .shapes import SpLayout


def moe_finalize_routing(
    expanded_x,
    expanded_row_idx,
    x1=None,
    x2=None,
    bias=None,
    scales=None,
    expert_idx=None,
    drop_pad_mode=DropPadMode.DROP_LESS_COLUMN,
    *,
    out=None,
    stream=None,
):
    """`out[i] = x1[i] + x2[i] + sum_k s(i,k) * (row(R(i,k)) + bias[expert_idx[i,k]])`, `[N, H...]`."""
    o = Operands(stream)
    args, keep = shapes.finalize_args(
        expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx, drop_pad_mode, o.input
    )
    y = o.output(shapes._finalize_shape(args), keep[0], out)
    call("amoe_moe_finalize_routing", args, y.ptr, o.stream)
    return o.result


def moe_token_unpermute(permuted, sorted_indices, probs=None, *, out=None, stream=None):
    """`out[t] = sum_k probs[t,k] * permuted[sorted_indices[t*K + k]]`, `[T, H...]`."""
    o = Operands(stream)
    p, s, pr = o.input("permuted", permuted), o.input("sorted_indices", sorted_indices), o.optional("probs", probs)
    y = o.output(shapes.moe_token_unpermute(p, s, pr), p, out)
    call("amoe_moe_token_unpermute", p.ptr, s.ptr, pr.ptr if pr else None, y.ptr, o.stream)
    return o.result


def _sp_op(name: str, shape_fn, x, layout, ep_comm: Comm, out, stream):
    """An EP/SP op of `x` over `ep_comm` with `layout`; a bad argument is
    reported to the EP peers waiting in its collective."""
    with handle_of("ep_comm", ep_comm) as h:
        o = Operands(stream)
        with refusing_on(h):
            d = o.input("x", x)
            ls, n = shapes._layout(layout)
            # The shape function checks x's rows against the layout before
            # any collective starts.
            y = o.output(shape_fn(d, layout, ep_comm), d, out)
            st = o.stream
        call(name, d.ptr, ls, n, h, y.ptr, st)
    return o.result


def maybe_pad_and_reduce(x, layout, ep_comm: Comm, *, out=None, stream=None):
    """EP/SP finalize (SPEC section 3): this rank's `[local_sizes[rank], H...]`
    shard of the sum over `ep_comm` of every rank's `x` (`sum(local_sizes)` rows)."""
    return _sp_op("amoe_maybe_pad_and_reduce", shapes.maybe_pad_and_reduce, x, layout, ep_comm, out, stream)


def maybe_all_gather_and_maybe_unpad(x, layout, ep_comm: Comm, *, out=None, stream=None):
    """EP/SP prepare (SPEC section 4): every rank's `x` (`local_sizes[rank]`
    rows) concatenated, `[sum(local_sizes), H...]`."""
    shape_fn = shapes.maybe_all_gather_and_maybe_unpad
    return _sp_op("amoe_maybe_all_gather_and_maybe_unpad", shape_fn, x, layout, ep_comm, out, stream)


def finalize_and_reduce(
    expanded_x,
    expanded_row_idx,
    layout,
    ep_comm: Comm,
    x1=None,
    x2=None,
    bias=None,
    scales=None,
    expert_idx=None,
    drop_pad_mode=DropPadMode.DROP_LESS_COLUMN,
    *,
    out=None,
    stream=None,
):
    """`maybe_pad_and_reduce(moe_finalize_routing(...), layout, ep_comm)` in one pass."""
    with handle_of("ep_comm", ep_comm) as h:
        o = Operands(stream)
        with refusing_on(h):
            args, keep = shapes.finalize_args(
                expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx, drop_pad_mode, o.input
            )
            shape = shapes._finalize_and_reduce_shape(args, layout, ep_comm)
            y = o.output(shape, keep[0], out)
            ls, n = shapes._layout(layout)
            st = o.stream
        call("amoe_finalize_and_reduce", args, ls, n, h, y.ptr, st)
    return o.result


def _tp_op(name: str, shape_fn, x, tp_comm: Comm, counts, out, stream, collective: bool = True):
    """A shared-expert op over `tp_comm`; a `collective` one reports a bad
    argument to the TP peers waiting in its collective."""
    with handle_of("tp_comm", tp_comm) as h:
        o = Operands(stream)
        with refusing_on(h) if collective else contextlib.nullcontext():
            d = o.input("x", x)
            counts = counts()
            y = o.output(shape_fn(d, *counts, tp_comm), d, out)
            st = o.stream
        call(name, d.ptr, *counts, h, y.ptr, st)
    return o.result


def shared_pad_split(x, tp_comm: Comm, *, out=None, stream=None):
    """DP-only shared-expert prepare: this TP rank's equal part of the DP batch
    `x [T, H...]` zero-padded to a multiple of TP, `[ceil(T / TP), H...]`."""
    return _tp_op("amoe_shared_pad_split", shapes.shared_pad_split, x, tp_comm, tuple, out, stream, collective=False)


def shared_gather_unpad(x, num_tokens: int, tp_comm: Comm, *, out=None, stream=None):
    """DP-only shared-expert finalize / SP-only prepare: every TP rank's
    `ceil(num_tokens / TP)` rows gathered, the first `num_tokens` kept."""
    counts = lambda: (shapes._count("num_tokens", num_tokens),)  # noqa: E731
    return _tp_op("amoe_shared_gather_unpad", shapes.shared_gather_unpad, x, tp_comm, counts, out, stream)


def shared_pad_reduce_scatter(x, tp_comm: Comm, *, out=None, stream=None):
    """SP-only shared-expert finalize: the TP-partial `x [T, H...]` zero-padded
    to a multiple of TP and reduce-scattered (sum): `[ceil(T / TP), H...]`."""
    return _tp_op("amoe_shared_pad_reduce_scatter", shapes.shared_pad_reduce_scatter, x, tp_comm, tuple, out, stream)


def point_refusing(h, reduces=lambda: 0):
    """The checks before a reduction point over the TP communicator `h`: one
    that fails is reported to the TP peers waiting in the point
    (`amoe_reduce_refuse`, with `reduces()`: 1 when the point reduces, 0 when
    unknown) before it is raised."""
    return refusing(lambda message: call("amoe_reduce_refuse", h, reduces(), message))


# The decision of each reduction-point export (`ReducePolicy.decisions`).
_DECISIONS = {"amoe_reduce_routed_early": "routed", "amoe_reduce_shared": "shared", "amoe_reduce_final": "final"}


def routed_is_reduced(comm_type, sp: bool) -> bool:
    """`comm_type in {MC2, ALLTOALL, FUSED_MC2} or (comm_type == ALLGATHER and sp)`."""
    out = c_uint8(0)
    call("amoe_routed_is_reduced", comm_type_code(comm_type), int(flag("sp", sp)), ctypes.byref(out))
    return bool(out.value)


class ReducePolicy:
    """The static reduction policy of a layer (SPEC section 5). Each reduction
    point takes the live comm type, so a policy built while one comm type was
    live stays correct when another is used."""

    def __init__(self, shared_mode, has_routed_transform: bool, sp: bool, tp_size: int, ep_size: int):
        self.shared_mode = SharedMode.NONE if shared_mode is None else SharedMode.parse(shared_mode)
        self.has_routed_transform = flag("has_routed_transform", has_routed_transform)
        self.sp = flag("sp", sp)
        self.tp_size = c_uint("tp_size", tp_size)
        self.ep_size = c_uint("ep_size", ep_size)
        self._c = ReducePolicyC(self.shared_mode, self.has_routed_transform, self.sp, self.tp_size, self.ep_size)
        self.decisions(CommType.ALLGATHER)  # validates

    def decisions(self, comm_type) -> dict:
        """`{"early", "routed", "shared", "final"}`: which reduction points all-reduce for `comm_type`."""
        vals = [c_uint8(0) for _ in range(4)]
        ct = comm_type_code(comm_type)
        call("amoe_reduce_policy_decisions", ctypes.byref(self._c), ct, *[ctypes.byref(v) for v in vals])
        return dict(zip(("early", "routed", "shared", "final"), (bool(v.value) for v in vals)))

    @property
    def fields(self) -> tuple:
        """`(shared_mode, has_routed_transform, sp, tp_size, ep_size)` as plain
        ints and bools: the trailing arguments of the torch reduction-point ops
        (`torch.ops.ascend_moe.reduce_final(x, comm_type, tp_comm.handle_id, *policy.fields)`)."""
        return (int(self.shared_mode), self.has_routed_transform, self.sp, self.tp_size, self.ep_size)

    @property
    def early(self) -> bool:
        return self.decisions(CommType.ALLGATHER)["early"]

    def _point(self, name: str, x, comm_type, tp_comm: Comm, out, stream):
        with handle_of("tp_comm", tp_comm) as h:
            o = Operands(stream)
            with point_refusing(h, lambda: self._reduces(name, comm_type)):
                d = o.input("x", x)
                y = o.output(d.shape, d, out)
                ct = comm_type_code(comm_type)
                st = o.stream
            call(name, ctypes.byref(self._c), d.ptr, ct, h, y.ptr, st)
        return o.result

    def _reduces(self, name: str, comm_type) -> int:
        """1 when the reduction point of export `name` reduces under
        `comm_type`, 0 also when that is unknown (an unknown comm type)."""
        try:
            return int(self.decisions(comm_type)[_DECISIONS[name]])
        except (AmoeError, TypeError, ValueError):
            return 0

    def reduce_routed_early(self, x, comm_type, tp_comm: Comm, *, out=None, stream=None):
        """Point 1: routed output before the transform (TP all-reduce if `early`
        and not `routed_is_reduced`). Returns `out` (default a new array / tensor)."""
        return self._point("amoe_reduce_routed_early", x, comm_type, tp_comm, out, stream)

    def reduce_shared(self, x, comm_type, tp_comm: Comm, *, out=None, stream=None):
        """Point 2: the shared-expert output. Returns `out` (default a new array / tensor)."""
        return self._point("amoe_reduce_shared", x, comm_type, tp_comm, out, stream)

    def reduce_final(self, x, comm_type, tp_comm: Comm, *, out=None, stream=None):
        """Point 3: after `shared + routed`. Returns `out` (default a new array / tensor)."""
        return self._point("amoe_reduce_final", x, comm_type, tp_comm, out, stream)

    def __repr__(self) -> str:
        return (
            f"ReducePolicy({self.shared_mode.name.lower()!r}, has_routed_transform={self.has_routed_transform}, "
            f"sp={self.sp}, tp_size={self.tp_size}, ep_size={self.ep_size})"
        )
