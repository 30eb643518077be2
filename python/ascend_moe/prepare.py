"""Token prepare / finalize per MoE comm type (SPEC section 6)."""

from __future__ import annotations

import ctypes
from ctypes import c_size_t, c_void_p

import numpy as np

from . import shapes
from ._enums import CommType, Status
from ._errors import error
from ._lib import ALL_TOKENS, MoeContextC, call, lib, sizes
from ._tensor import Operands
from .comm import Comm


class MoeContext:
    """The run-time parallel context of one forward pass: tokens of every DP
    rank, the TP size, this rank's (dp_rank, tp_rank), whether SP is on, the
    real tokens of this DP rank (`num_actual_tokens`, default all: the MC2 mask
    marks only these) and prefill context parallelism (`pcp_size`, `pcp_rank`;
    EP rank order DP x PCP x TP)."""

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
    ):
        self._tokens, n = sizes(dp_tokens)
        checked = [("tp_size", tp_size), ("dp_rank", dp_rank), ("tp_rank", tp_rank), ("pcp_size", pcp_size), ("pcp_rank", pcp_rank)]
        if num_actual_tokens is not None:
            checked.append(("num_actual_tokens", num_actual_tokens))
        for name, v in checked:
            if int(v) < 0:
                raise error(Status.INVALID_ARGUMENT, f"MoeContext: {name} must be >= 0, got {v}")
        self.dp_tokens = tuple(int(t) for t in dp_tokens)
        self.tp_size, self.dp_rank, self.tp_rank, self.sp = int(tp_size), int(dp_rank), int(tp_rank), bool(sp)
        self.num_actual_tokens = None if num_actual_tokens is None else int(num_actual_tokens)
        self.pcp_size, self.pcp_rank = int(pcp_size), int(pcp_rank)
        self._c = MoeContextC()
        call("amoe_moe_context_init", ctypes.byref(self._c))
        self._c.dp_tokens, self._c.dp_size = self._tokens, n
        self._c.tp_size, self._c.dp_rank, self._c.tp_rank, self._c.sp = self.tp_size, self.dp_rank, self.tp_rank, self.sp
        self._c.num_actual_tokens = ALL_TOKENS if self.num_actual_tokens is None else self.num_actual_tokens
        self._c.pcp_size, self._c.pcp_rank = self.pcp_size, self.pcp_rank

    @property
    def ptr(self):
        return ctypes.byref(self._c)


class MoeGroups:
    """The TP, DP and (with `pcp_size > 1`) PCP groups of a MoE layer, split
    from the EP world (EP rank `(dp * pcp_size + pcp) * tp_size + tp`).
    Collective: every rank of `world` builds it."""

    def __init__(self, world: Comm, tp_size: int, pcp_size: int = 1):
        out = c_void_p()
        call("amoe_moe_groups_new", world.handle, int(pcp_size), int(tp_size), ctypes.byref(out))
        self._h = out

    @classmethod
    def from_comms(cls, ep: Comm, tp: Comm, dp: Comm, pcp: "Comm | None" = None) -> "MoeGroups":
        """The groups of communicators the engine already has (for example
        vLLM-Ascend's EP, TP, DP and PCP groups as `Comm.from_hccl` /
        `Comm.from_process_group`), creating none. They must form the
        DP x PCP x TP layout; the error names what does not fit."""
        g = cls.__new__(cls)
        out = c_void_p()
        call(
            "amoe_moe_groups_from_comms",
            ep.handle,
            tp.handle,
            dp.handle,
            None if pcp is None else pcp.handle,
            ctypes.byref(out),
        )
        g._h = out
        g._comms = (ep, tp, dp, pcp)
        return g

    @property
    def handle(self) -> c_void_p:
        if not self._h.value:
            raise error(Status.INVALID_ARGUMENT, "the MoE groups are closed")
        return self._h

    def close(self) -> None:
        h, self._h = self._h, c_void_p()
        if h.value:
            lib().amoe_moe_groups_free(h)

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


def token_prepare(x, comm_type, ctx: MoeContext, groups: MoeGroups, *, out=None, stream=None):
    """This rank's tokens prepared for the experts under the live `comm_type`:
    `(hidden, mc2_mask)`, `hidden` in `out` (default a new one where `x`
    lives), the mask (a host bool array, True = real token) only for MC2 /
    FUSED_MC2, else None."""
    o = Operands(stream)
    d = o.input("x", x)
    y = o.output(token_prepare_shape(d.obj, comm_type, ctx), d, out)
    cap = max(y.shape[0] if y.shape else 1, 1)
    mask = (ctypes.c_uint8 * cap)()
    mask_len = c_size_t(0)
    call(
        "amoe_token_prepare",
        d.ptr,
        int(comm_type),
        ctx.ptr,
        groups.handle,
        y.ptr,
        mask,
        cap,
        ctypes.byref(mask_len),
        o.stream,
    )
    has_mask = CommType.parse(comm_type) in (CommType.MC2, CommType.FUSED_MC2)
    return o.result, (np.array(mask[: mask_len.value], dtype=bool) if has_mask else None)


def token_finalize(y, comm_type, ctx: MoeContext, groups: MoeGroups, *, out=None, stream=None):
    """The experts' output `y` back in this rank's token layout, in `out`
    (default a new one where `y` lives)."""
    o = Operands(stream)
    d = o.input("y", y)
    r = o.output(token_finalize_shape(d.obj, comm_type, ctx), d, out)
    call("amoe_token_finalize", d.ptr, int(comm_type), ctx.ptr, groups.handle, r.ptr, o.stream)
    return o.result
