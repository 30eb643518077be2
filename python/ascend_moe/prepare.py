"""Token prepare / finalize per MoE comm type (SPEC section 6)."""

from __future__ import annotations

import contextlib
import ctypes
import sys
from ctypes import c_void_p

import numpy as np

from . import shapes
from ._enums import CommType, Status
from ._errors import AmoeError, error
from ._lib import ALL_TOKENS, Lease, MoeContextC, Owned, c_uint, call, comm_type_code, flag, refusing, sizes
from ._tensor import Desc, Operands, _tensor_like, _torch_tensor, desc_out, dtype_code, lend_out
from .comm import Comm, handle_of, refusing_on


class MoeContext:
    """The run-time parallel context of one forward pass: tokens of every DP
    rank, the TP size, this rank's (dp_rank, tp_rank), whether SP is on, the
    real tokens of this DP rank (`num_actual_tokens`, default all: the MC2 mask
    marks only these), prefill context parallelism (`pcp_size`, `pcp_rank`;
    EP rank order DP x PCP x TP) and the rows MC2 / FUSED_MC2 pad every DP
    rank's tokens to (`padded_num_tokens`, the engine's choice, e.g.
    vLLM-Ascend's forward context; default `ceil_to(max(dp_tokens), tp_size)`;
    the library refuses one that is no multiple of `tp_size` or holds fewer
    rows than a DP rank's tokens)."""

    def __init__(
        self,
        dp_tokens,
        tp_size: int,
        dp_rank: int,
        tp_rank: int,
        sp: bool = False,
        num_actual_tokens=None,
        pcp_size: int = 1,
        pcp_rank: int = 0,
        padded_num_tokens=None,
    ):
        self._tokens, n = sizes(dp_tokens, "dp_tokens")
        self.dp_tokens = tuple(self._tokens[:n])
        self.tp_size, self.dp_rank, self.tp_rank = c_uint("tp_size", tp_size), c_uint("dp_rank", dp_rank), c_uint("tp_rank", tp_rank)
        self.sp = flag("sp", sp)
        self.num_actual_tokens = None if num_actual_tokens is None else c_uint("num_actual_tokens", num_actual_tokens)
        self.pcp_size, self.pcp_rank = c_uint("pcp_size", pcp_size), c_uint("pcp_rank", pcp_rank)
        self.padded_num_tokens = None if padded_num_tokens is None else c_uint("padded_num_tokens", padded_num_tokens)
        if self.padded_num_tokens == 0 and any(self.dp_tokens):
            # The library's struct reads 0 as "the default": say no here, as
            # the library does to any other target below a DP rank's tokens.
            raise error(
                Status.INVALID_ARGUMENT,
                f"MoeContext: invalid argument `padded_num_tokens`: 0 rows hold none of the largest DP rank's "
                f"{max(self.dp_tokens)} tokens (the target is a multiple of the TP size {self.tp_size} and at least that)",
            )
        self._c = MoeContextC()
        call("amoe_moe_context_init", ctypes.byref(self._c))
        self._c.dp_tokens, self._c.dp_size = self._tokens, n
        self._c.tp_size, self._c.dp_rank, self._c.tp_rank, self._c.sp = self.tp_size, self.dp_rank, self.tp_rank, self.sp
        self._c.num_actual_tokens = ALL_TOKENS if self.num_actual_tokens is None else self.num_actual_tokens
        self._c.pcp_size, self._c.pcp_rank = self.pcp_size, self.pcp_rank
        self._c.padded_num_tokens = self.padded_num_tokens or 0

    @property
    def ptr(self):
        return ctypes.byref(self._c)


class MoeGroups(Owned):
    """The TP, DP and (with `pcp_size > 1`) PCP groups of a MoE layer, split
    from the EP world (EP rank `(dp * pcp_size + pcp) * tp_size + tp`).
    Collective: every rank of `world` builds it."""

    _free_fn = "amoe_moe_groups_free"
    _closed_text = "the MoE groups are closed"

    def __init__(self, world: Comm, tp_size: int, pcp_size: int = 1):
        out = c_void_p()
        with handle_of("world", world) as w:
            # Sizes the library cannot take fail the peers waiting in its agreement too.
            with refusing_on(w):
                pcp, tp = c_uint("pcp_size", pcp_size), c_uint("tp_size", tp_size)
            call("amoe_moe_groups_new", w, pcp, tp, ctypes.byref(out))
        self._own(out)

    @classmethod
    def from_comms(cls, ep: Comm, tp: Comm, dp: Comm, pcp: "Comm | None" = None) -> "MoeGroups":
        """The groups of communicators the engine already has (for example
        vLLM-Ascend's EP, TP, DP and PCP groups as `Comm.from_hccl` /
        `Comm.from_process_group`), creating none. They must form the
        DP x PCP x TP layout; the error names what does not fit."""
        g = cls.__new__(cls)
        out = c_void_p()
        with contextlib.ExitStack() as held:
            comms = [held.enter_context(handle_of(arg, c)) for arg, c in (("ep", ep), ("tp", tp), ("dp", dp))]
            comms.append(None if pcp is None else held.enter_context(handle_of("pcp", pcp)))
            call("amoe_moe_groups_from_comms", *comms, ctypes.byref(out))
        g._own(out)
        g._comms = (ep, tp, dp, pcp)
        return g

    @property
    def handle(self) -> Lease:
        """The library handle, held until it is released (`Lease`: `with
        groups.handle as h:` around the calls it is passed to); closed
        groups are refused."""
        return self._lease()

    def __enter__(self) -> "MoeGroups":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# The shape functions, by the names this module has always given them.
token_prepare_shape = shapes.token_prepare
token_finalize_shape = shapes.token_finalize


def token_prepare(x, comm_type, ctx: MoeContext, groups: MoeGroups, *, out=None, mc2_mask=None, stream=None):
    """This rank's tokens prepared for the experts under the live `comm_type`:
    `(hidden, mask)`, `hidden` in `out` (default a new one where `x` lives).
    For MC2 / FUSED_MC2 `mask` marks the real rows (True for the first
    `ctx.num_actual_tokens` of this DP rank): written into `mc2_mask` when
    given (a 1-D bool or uint8 array or tensor of exactly `hidden`'s rows, on
    the host or on the NPU: for example the engine's own mask buffer sliced to
    this TP rank), else into a new bool array or tensor where `x` lives. Other
    comm types return None and leave `mc2_mask` untouched."""
    with handle_of("groups", groups, MoeGroups) as g:
        o = Operands(stream)
        with _refusing(comm_type, ctx, g, finalize=False):
            c = shapes._context_ptr(ctx)
            if mc2_mask is not None and not (isinstance(mc2_mask, np.ndarray) or _tensor_like(mc2_mask)):
                # The op writes the mask into it: a list or a scalar has no memory to write.
                raise error(
                    Status.INVALID_ARGUMENT,
                    f"`mc2_mask` must be a 1-D bool or uint8 numpy array or tensor (cpu or npu) the op writes into, "
                    f"got {type(mc2_mask).__name__}",
                )
            d = o.input("x", x)
            shape = token_prepare_shape(d, comm_type, ctx)
            y = o.output(shape, d, out)
            has_mask = CommType.parse(comm_type) in (CommType.MC2, CommType.FUSED_MC2)
            mask = None
            if has_mask:
                mask = _bool_like(d.obj, shape[0]) if mc2_mask is None else mc2_mask
            m = None if mask is None else _mask_desc(mask)
            if m is not None:
                if mc2_mask is not None:
                    lend_out("mc2_mask", mc2_mask)
                o.descs.append(m)
            st = o.stream
        call(
            "amoe_token_prepare",
            d.ptr,
            comm_type_code(comm_type),
            c,
            g,
            y.ptr,
            None if m is None else m.ptr,
            st,
        )
    return o.result, mask


# A comm type the library knows to be none (`amoe_token_refuse` then sends
# through the comm-type agreement, or returns the error).
_NO_COMM_TYPE = 0xFFFFFFFF


def _refusing(comm_type, ctx, g, finalize: bool, every: bool = False):
    """The argument checks of token prepare (or finalize): one that fails is
    reported to the peers waiting in the op's first collective
    (`amoe_token_refuse`) before it is raised. Without a comm type or a
    context, the peers still wait in the comm-type agreement where that
    check is on (the library sends it there)."""
    try:
        c, ct = shapes._context_ptr(ctx), comm_type_code(comm_type)
    except (AmoeError, TypeError, ValueError):
        c, ct = None, _NO_COMM_TYPE
    return refusing(lambda message: call("amoe_token_refuse", ct, c, g, 1 if finalize else 0, message), every)


@contextlib.contextmanager
def finalize_refusing(comm_type, ctx: MoeContext, groups: MoeGroups, every: bool = False):
    """The checks of a caller between token prepare and token finalize (the
    experts' output): one that fails is reported to the peers waiting in
    finalize before it is raised. With `every`, any `Exception` is (the
    caller's own code runs there, such as the experts). The groups are held
    for the block and released when it ends, also when it raises."""
    with handle_of("groups", groups, MoeGroups) as g, _refusing(comm_type, ctx, g, finalize=True, every=every):
        yield


def _bool_like(x, rows: int):
    """A new bool vector of `rows` entries where `x` lives."""
    if _torch_tensor(x):
        return sys.modules["torch"].empty((rows,), dtype=sys.modules["torch"].bool, device=x.device)
    if _tensor_like(x) and hasattr(x, "new_empty"):
        return x.new_empty((rows,), dtype=bool)
    return np.empty(rows, dtype=bool)


def _mask_desc(mask) -> Desc:
    """A descriptor over the caller's mask buffer as it is (the library
    checks its dtype and length against the mask)."""
    return desc_out("mc2_mask", mask, tuple(mask.shape), dtype_code("mc2_mask", mask.dtype))


def token_finalize(y, comm_type, ctx: MoeContext, groups: MoeGroups, *, out=None, stream=None):
    """The experts' output `y` back in this rank's token layout, in `out`
    (default a new one where `y` lives)."""
    with handle_of("groups", groups, MoeGroups) as g:
        o = Operands(stream)
        with _refusing(comm_type, ctx, g, finalize=True):
            c = shapes._context_ptr(ctx)
            d = o.input("y", y)
            r = o.output(token_finalize_shape(d, comm_type, ctx), d, out)
            st = o.stream
        call("amoe_token_finalize", d.ptr, comm_type_code(comm_type), c, g, r.ptr, st)
    return o.result
