"""The forward context (SPEC section 5): the values the engine sets once per
forward pass, read by the ops when they execute.

    with ascend_moe.forward_context(CommType.MC2, dp_tokens=[6, 3], sp=False):
        y = compiled_model(x)

The comm type, the DP token counts, this DP rank's actual-token count (rows past
it are graph padding), SP on/off and the PCP size are run-time values: the
context-reading torch ops (`torch.ops.ascend_moe.*_fc`) take only tensors and a
layer id, so a compiled graph cannot capture any of them. Their fake
implementations read the context at trace time, for shapes only; their output
shapes depend on input shapes alone, so a graph traced under one context is
valid under every other (a different input shape retraces through Dynamo's
shape guards).

The static part of a MoE layer (its groups, this rank's DP / TP / PCP ranks,
its reduce policy and its experts) is registered once with `MoeLayer`, whose
`layer_id` the ops take.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
from typing import Callable, Optional

from ._enums import Status
from ._errors import error
from ._lib import c_uint, flag, integer, integers
from .comm import Comm
from ._enums import CommType
from .ops import ReducePolicy, point_refusing
from ._tensor import dtype_name
from .prepare import MoeContext, MoeGroups, finalize_refusing, token_finalize, token_prepare


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """One forward pass: the live MoE comm type, the tokens of every DP rank,
    the actual tokens of this DP rank (None = all), SP on/off, the PCP size."""

    comm_type: CommType
    dp_tokens: tuple
    num_actual_tokens: Optional[int] = None
    sp: bool = False
    pcp_size: int = 1

    def __post_init__(self):
        if isinstance(self.comm_type, str):
            ct = CommType.parse(self.comm_type)
        else:
            code = integer("comm_type", self.comm_type)
            try:
                ct = CommType(code)
            except ValueError:
                raise error(
                    Status.INVALID_ARGUMENT,
                    f"unknown MoE comm type {self.comm_type!r} (expected 0..={int(max(CommType))})",
                ) from None
        object.__setattr__(self, "comm_type", ct)
        object.__setattr__(self, "dp_tokens", integers("dp_tokens", self.dp_tokens))
        if not self.dp_tokens or any(t < 0 for t in self.dp_tokens):
            raise error(Status.INVALID_ARGUMENT, f"dp_tokens must be one count >= 0 per DP rank, got {list(self.dp_tokens)}")
        if self.num_actual_tokens is not None:
            object.__setattr__(self, "num_actual_tokens", c_uint("num_actual_tokens", self.num_actual_tokens))
        pcp_size = integer("pcp_size", self.pcp_size)
        if pcp_size < 1:
            raise error(Status.INVALID_ARGUMENT, f"pcp_size must be >= 1, got {self.pcp_size}")
        object.__setattr__(self, "pcp_size", pcp_size)
        object.__setattr__(self, "sp", flag("sp", self.sp))


def checked_context(ctx, arg: str = "ctx") -> ForwardContext:
    """`ctx`, which must be a `ForwardContext`; anything else is an
    `InvalidArgumentError` naming `arg`."""
    if not isinstance(ctx, ForwardContext):
        raise error(Status.INVALID_ARGUMENT, f"`{arg}` must be a ForwardContext, got {type(ctx).__name__}")
    return ctx


# Per thread: the engine sets the context in the thread that runs the forward
# (ranks run as threads of one process in tests).
_LOCAL = threading.local()


def _stack() -> list:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


def set_forward_context(ctx: Optional[ForwardContext]) -> None:
    """Replaces the current forward context of this thread (None clears it)."""
    _stack()[:] = [] if ctx is None else [checked_context(ctx)]


def get_forward_context() -> ForwardContext:
    """The live forward context of this thread; an error when the engine set none."""
    stack = _stack()
    if not stack:
        raise error(
            Status.INVALID_ARGUMENT,
            "no MoE forward context is set: run the forward inside `ascend_moe.forward_context(...)` "
            "or after `ascend_moe.set_forward_context(...)`",
        )
    return stack[-1]


@contextlib.contextmanager
def forward_context(comm_type, dp_tokens, num_actual_tokens=None, sp=False, pcp_size=1):
    """Sets the forward context for the body of the `with`; on exit, this
    thread's contexts are again those of its entry (the outer one of a
    nested `with`, the one `set_forward_context` set before it, or none),
    also when the body set or cleared one itself."""
    stack = _stack()
    outer = list(stack)
    stack.append(ForwardContext(comm_type, tuple(dp_tokens), num_actual_tokens, sp, pcp_size))
    try:
        yield stack[-1]
    finally:
        stack[:] = outer


# Registered layers by `layer_id`, for the torch ops that take the id. Weak:
# the registry never keeps a layer alive (nor its groups and communicators,
# which it holds), so a model rebuilt without closing its layers leaks none.
_LAYERS: "weakref.WeakValueDictionary[int, MoeLayer]" = weakref.WeakValueDictionary()
# Layer ids are never reused: a stale id fails instead of running another layer.
_NEXT_LAYER_ID = itertools.count(1)
_LAYERS_LOCK = threading.Lock()


class MoeLayer:
    """The static part of one MoE layer on this rank, registered under
    `layer_id`: its groups (`MoeGroups`, built with the PCP size the forward
    contexts will use), its TP communicator, this rank's place (TP size, DP /
    TP / PCP rank), its reduce policy and its experts, a callable
    `experts(hidden, mc2_mask, comm_type) -> routed` that maps the prepared
    tokens to the routed output of the same rows. `hidden` is of the kind of
    the forward's input: numpy arrays for numpy input (and for CPU tensors
    through `torch.ops.ascend_moe.moe_layer_fc`, as views of their memory), the
    NPU tensors themselves on the NPU.

    The registry does not keep a layer alive: whoever runs `layer_id` (a
    model, a compiled graph's owner) keeps the layer; a collected or closed
    layer's id is refused."""

    def __init__(
        self,
        groups: MoeGroups,
        tp_comm: Comm,
        tp_size: int,
        dp_rank: int,
        tp_rank: int,
        experts: Callable,
        policy: Optional[ReducePolicy] = None,
        pcp_rank: int = 0,
    ):
        # Imported here: both modules import this one.
        from .comm import handle_of
        from .prepare import MoeGroups

        # A layer is registered once and used on every forward: a wrong or
        # closed object is named here, not at the first forward.
        handle_of("groups", groups, MoeGroups).release()
        handle_of("tp_comm", tp_comm).release()
        if not callable(experts):
            raise error(Status.INVALID_ARGUMENT, f"`experts` must be callable, got {type(experts).__name__}")
        self.groups, self.tp_comm, self.experts, self.policy = groups, tp_comm, experts, policy
        self.tp_size, self.dp_rank = c_uint("tp_size", tp_size), c_uint("dp_rank", dp_rank)
        self.tp_rank, self.pcp_rank = c_uint("tp_rank", tp_rank), c_uint("pcp_rank", pcp_rank)
        with _LAYERS_LOCK:
            self.layer_id = next(_NEXT_LAYER_ID)
            _LAYERS[self.layer_id] = self

    @staticmethod
    def lookup(layer_id: int) -> "MoeLayer":
        """The registered layer with this `layer_id`; `AmoeError` when there is
        none (never created, closed, or garbage-collected)."""
        layer = _LAYERS.get(integer("layer_id", layer_id))
        if layer is None:
            raise error(
                Status.INVALID_ARGUMENT,
                f"no MoE layer is registered under id {layer_id} (closed, freed, or never created)",
            )
        return layer

    def close(self) -> None:
        """Unregisters the layer: its id is refused from then on. The layer
        is also unregistered when it is garbage-collected."""
        _LAYERS.pop(self.layer_id, None)

    def __enter__(self) -> "MoeLayer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def context(self, ctx: Optional[ForwardContext] = None) -> MoeContext:
        """The `MoeContext` of this rank in forward context `ctx` (default: the live one)."""
        ctx = get_forward_context() if ctx is None else checked_context(ctx)
        return MoeContext(
            ctx.dp_tokens,
            self.tp_size,
            self.dp_rank,
            self.tp_rank,
            ctx.sp,
            num_actual_tokens=ctx.num_actual_tokens,
            pcp_size=ctx.pcp_size,
            pcp_rank=self.pcp_rank,
        )

    def checked_policy(self, ctx: ForwardContext) -> ReducePolicy:
        ctx = checked_context(ctx)
        if self.policy is None:
            raise error(Status.INVALID_ARGUMENT, f"MoE layer {self.layer_id} has no reduce policy")
        if self.policy.sp != ctx.sp:
            raise error(
                Status.INVALID_ARGUMENT,
                f"MoE layer {self.layer_id}: its policy has sp={self.policy.sp}, the forward context sp={ctx.sp}",
            )
        return self.policy

    def forward(self, x):
        """prepare -> experts -> finalize under the live forward context."""
        ctx = get_forward_context()
        mctx = self.context(ctx)
        hidden, mask = token_prepare(x, ctx.comm_type, mctx, self.groups)
        # Experts that raise, or return an output finalize refuses, fail the
        # peers waiting in token_finalize too.
        with finalize_refusing(ctx.comm_type, mctx, self.groups, every=True):
            routed = self.experts(hidden, mask, ctx.comm_type)
            got = getattr(routed, "dtype", None)  # without one, token_finalize names what is wrong
            if got is not None and dtype_name(got) != dtype_name(hidden.dtype):
                raise error(
                    Status.DTYPE,
                    f"MoE layer {self.layer_id}: the experts returned {dtype_name(got)} for "
                    f"{dtype_name(hidden.dtype)} tokens; the routed output keeps the tokens' dtype",
                )
            shape = getattr(routed, "shape", None)
            if shape is not None and tuple(shape)[1:] != tuple(hidden.shape)[1:]:
                # The rows are token_finalize's to check; the rest is fixed by the
                # tokens (the torch op's fake sizes its output from them).
                raise error(
                    Status.SHAPE,
                    f"MoE layer {self.layer_id}: the experts returned shape {[int(d) for d in shape]} for prepared "
                    f"tokens of shape {[int(d) for d in hidden.shape]}; the routed output keeps the tokens' hidden "
                    "shape",
                )
        return token_finalize(routed, ctx.comm_type, mctx, self.groups)

    @contextlib.contextmanager
    def point_refusing(self):
        """The checks before a reduction point of this layer (the live
        context, the policy): one that fails is reported to the TP peers
        waiting in the point (`amoe_reduce_refuse`) before it is raised."""
        with self.tp_comm.handle as h, point_refusing(h):
            yield
