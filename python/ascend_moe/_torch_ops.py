"""torch custom ops (`torch.ops.ascend_moe.*`) over the Python API, with fake
implementations that size their outputs with `ascend_moe.shapes`. Imported
only when torch is importable.

The real implementations are registered for CPU and for PrivateUse1, the
dispatch key of torch_npu's NPU tensors. They pass the tensors to the library
where they are (`data_ptr()`: host memory on the CPU, device memory on the
NPU, never a host copy), allocate outputs as the Python API does (NPU ones
with `torch.empty(..., device=x.device)`, torch's caching allocator; large
CPU ones over blocks of the library's host reuse pool, small ones with
`torch.empty`) and run NPU work on `torch.npu.current_stream()`. No other
device has a kernel.

Ops cannot take Python objects, so a communicator is passed as its
`Comm.handle_id` (an int), an EP/SP layout as `local_sizes` (a list of ints or
None), and a reduce policy as its fields (`ReducePolicy.fields`). The comm
type is an ordinary int argument of every reduction point: a compiled graph
passes it through at run time instead of capturing it.

Every op is functional (`mutates_args=()`): it returns a new tensor and never
aliases its input.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from . import comm as _comm
from . import ops, shapes
from ._enums import CommType, ReduceOp, Status
from ._errors import error
from ._tensor import dtype_code, torch_over
from .comm import Comm
from .ops import ReducePolicy

Tensor = torch.Tensor


# Where the real implementations run: CPU and PrivateUse1 (torch_npu's
# dispatch key, whatever name its backend has).
DISPATCH_KEYS = ("CPU", "PrivateUse1")


# Every op is defined straight on a `torch.library.Library`, with the schema
# `torch.library.custom_op` would infer, one kernel per dispatch key, a fake
# and an Autograd kernel, as vLLM-Ascend registers its own ops
# (vllm_ascend/ops/register_custom_ops.py, through vLLM's
# `direct_register_custom_op`): a `custom_op` runs every call through Python
# autograd, aliasing and dynamo wrappers, about twice what these kernels cost
# per call, more than a whole decode-size finalize.
_LIB: list = []  # the `Library`, made once and kept: a collected one takes its ops with it


def custom_op(qualname: str, *, mutates_args, collective: bool = True):
    """A decorator defining `qualname` (`ascend_moe::name`) from a function's
    type hints, with the function as its kernel for `DISPATCH_KEYS` and
    `_autograd_kernel` for Autograd.

    A `collective` op (every op that joins a collective of its group, or may)
    is tagged `nondeterministic_seeded`: FakeTensorMode runs the real kernel
    of an untagged op whose tensor inputs are all constants it made (a
    `torch.tensor(...)` inside the traced code), and Inductor's constant
    folding and the autograd partitioner's recomputation treat a tagged op
    as one that must run exactly where the program runs it. Untagged, a shape
    probe or a compile would run the collective on this rank alone, and its
    peers' next call would meet it."""

    def define(fn):
        lib, name = _library(), qualname.split("::", 1)[1]
        tags = (torch.Tag.nondeterministic_seeded,) if collective else ()
        lib.define(name + _infer_schema()(fn, mutates_args=mutates_args), tags=tags)
        if collective:
            _ordered(qualname)
        for key in DISPATCH_KEYS:
            lib.impl(name, _dense(fn), key)
        lib.impl(name, _autograd_kernel(qualname), "Autograd")
        return _Op(lib, qualname)

    return define


def _ordered(qualname: str):
    """Registers `qualname` as an op with an ordered side effect where this
    torch can (`torch._higher_order_ops.effects`): AOTAutograd then threads
    an effect token through every call, so a compiled graph keeps each call,
    in the program's order, whether or not its result is used. The tag alone
    does not: AOT's dead-code elimination removed an unused all_gather (with
    Inductor's `fallback_random` off, its default, tagged ops count as pure),
    and the peers met this rank's next collective instead. Returns the
    registration's handle (its `destroy()` takes it back), None where this
    torch has no effect tokens (the tag is then all there is)."""
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    except ImportError:
        return None
    return _register_effectful_op(qualname, _EffectType.ORDERED)


def _library():
    """The `ascend_moe` library, made on the first call with the op the
    Autograd kernels' backward calls (`_define_no_gradient`)."""
    if not _LIB:
        _LIB.append(torch.library.Library("ascend_moe", "FRAGMENT"))
        _define_no_gradient(_LIB[0])
    return _LIB[0]


def _dense(fn):
    """`fn` as a real kernel: its tensor arguments made contiguous first. The
    fakes take any strides, as torch ops do; the library takes C-contiguous
    memory, and refuses a non-contiguous NPU tensor (a CPU one the Python API
    copies itself), so a graph traced on a slice or a transpose would fail
    on the NPU when it runs. `contiguous()` returns a contiguous tensor as it
    is, and copies on the tensor's device (on the NPU, on its current stream,
    the one the op then runs on)."""

    def kernel(*args, **kwargs):
        args = [a.contiguous() if isinstance(a, Tensor) else a for a in args]
        return fn(*args, **{k: v.contiguous() if isinstance(v, Tensor) else v for k, v in kwargs.items()})

    return kernel


def _infer_schema():
    """`torch.library.infer_schema` (public from torch 2.5), else the function
    torch 2.4's `custom_op` infers schemas with; None without either."""
    f = getattr(torch.library, "infer_schema", None)
    if f is None:
        try:
            from torch._library.infer_schema import infer_schema as f
        except ImportError:
            return None
    return f


def missing() -> list:
    """What this torch lacks to register the ops (empty: nothing; torch 2.4
    and later have it all): schema inference, fake kernels, libraries, and the
    guard the Autograd kernels pass calls below autograd with."""
    lib = getattr(torch, "library", None)
    have = {
        "torch.library.infer_schema": lib is not None and _infer_schema() is not None,
        "torch.library.register_fake": hasattr(lib, "register_fake"),
        "torch.library.Library": hasattr(lib, "Library"),
        "torch._C._AutoDispatchBelowAutograd": hasattr(torch._C, "_AutoDispatchBelowAutograd"),
    }
    return [name for name, ok in have.items() if not ok]


def _autograd_kernel(qualname: str):
    """The op's Autograd kernel: the ops have no gradient. A call that records
    no gradient (grad mode off, or no input requiring one: every inference
    call) goes straight to the kernels below autograd; otherwise the output
    gets a backward that fails naming the op, as a `custom_op` without an
    autograd formula does (no silent None gradient).

    The backward does not raise itself: it returns, for each tensor input that
    requires grad, `ascend_moe::_no_gradient` of the incoming gradient, whose
    real kernels raise and whose fake returns an empty gradient of the
    input's shape and dtype. torch.compile traces the backward of a forward
    with an input requiring grad when it compiles, whether or not a backward
    ever runs: through the fake that trace succeeds, and the compiled
    backward fails when it runs, as the eager one does."""
    resolved = []

    def op():
        # Resolved on the first call: the op is defined after this kernel is made.
        if not resolved:
            resolved.append(_packet(qualname).default)
        return resolved[0]

    class NoGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            ctx.inputs = [(a.shape, a.dtype) if isinstance(a, Tensor) else None for a in args]
            return op()(*args)  # grad mode is off here: the fast path below

        @staticmethod
        def backward(ctx, grad):
            no_gradient = torch.ops.ascend_moe._no_gradient.default
            return tuple(
                no_gradient(grad, list(meta[0]), meta[1], qualname) if meta is not None and needs else None
                for meta, needs in zip(ctx.inputs, ctx.needs_input_grad)
            )

    def kernel(*args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return NoGradient.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op()(*args)

    return kernel


def _define_no_gradient(lib) -> None:
    """`ascend_moe::_no_gradient(grad, shape, dtype, op)`, what the Autograd
    kernels' backward returns for an input: its real kernels (CPU and
    PrivateUse1, the devices the ops' outputs, and so their gradients, are
    on) raise the RuntimeError naming `op`; its fake returns an empty tensor
    of `shape` and `dtype` on the gradient's device (every op's output is on
    its inputs' device), so a compile can trace the backward. Internal: not
    one of the ops the package offers.

    Tagged `nondeterministic_seeded`, as the collectives are (`custom_op`):
    FakeTensorMode would otherwise run the real kernel, and raise, on a
    gradient it made itself (a constant), at trace time instead of when the
    backward runs."""
    lib.define(
        "_no_gradient(Tensor grad, SymInt[] shape, ScalarType dtype, str op) -> Tensor",
        tags=(torch.Tag.nondeterministic_seeded,),
    )

    def refuse(grad, shape, dtype, op):
        raise RuntimeError(f"{op} has no gradient: it is not differentiable")

    for key in DISPATCH_KEYS:
        lib.impl("_no_gradient", refuse, key)
    torch.library.register_fake(
        "ascend_moe::_no_gradient", lambda grad, shape, dtype, op: grad.new_empty(shape, dtype=dtype), lib=lib
    )


def _packet(qualname: str):
    """`torch.ops.<namespace>.<name>` of `qualname` (`namespace::name`)."""
    namespace, name = qualname.split("::", 1)
    return getattr(getattr(torch.ops, namespace), name)


class _Op:
    """An op of `custom_op`, as `torch.library.custom_op` returns one: called,
    it runs the op through the dispatcher; `register_fake` adds its fake kernel."""

    def __init__(self, lib, qualname: str):
        self._lib, self._qualname = lib, qualname
        self._packet = None  # resolved on the first call, after the op is defined

    def __call__(self, *args, **kwargs):
        if self._packet is None:
            self._packet = _packet(self._qualname)
        return self._packet(*args, **kwargs)

    def register_fake(self, fake):
        torch.library.register_fake(self._qualname, fake, lib=self._lib)
        return fake


def _numpy_view(t: Tensor, arg: str = "x"):
    """A CPU tensor as a numpy array over the same memory (bf16 / fp8 through
    `ml_dtypes`); NPU tensors are returned as they are. A dtype the library
    does not take is a DTypeError naming `arg`, as the fakes name it (numpy
    cannot represent some of them at all)."""
    if t.device.type != "cpu":
        return t
    dtype_code(arg, t.dtype)
    import ml_dtypes

    t = t.detach()
    special = {
        torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
        torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
        torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
    }.get(t.dtype)
    if special is not None:
        return t.view(special[0]).numpy().view(special[1])
    return t.numpy()


def _as_tensor(a, like: Tensor) -> Tensor:
    """A numpy result as a tensor over the same memory (tensors pass through)."""
    if isinstance(a, torch.Tensor):
        return a
    a = np.ascontiguousarray(a)
    if like.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return torch_over(a, like.dtype, a.shape)
    return torch.from_numpy(a)


def _dim(d) -> Optional[int]:
    """A dimension as an int, or None when it is symbolic (a fake traced with
    dynamic shapes, as vLLM compiles its model with a dynamic token count)."""
    if isinstance(d, int):
        return d
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return int(d) if is_concrete_int(d) else None


def _symbolic(*operands) -> bool:
    """Whether a dimension of a tensor among `operands` is symbolic."""
    return any(_dim(d) is None for t in operands if isinstance(t, Tensor) for d in t.shape)


def _traced(t, fallback: int = 1):
    """`(shape, dtype)` of `t` for a shape function, each symbolic dimension at
    the size it was traced with: reading that size adds no guard, so the
    graph keeps the dimension symbolic. A data-dependent (unbacked) size has
    none: its expression is evaluated with every unbacked symbol at
    `fallback` (and every backed one at its traced size), so sizes that are
    expressions of one symbol (`u0`, `2*u0`) keep their relation. The fake
    validates dtypes, trailing dims and arguments on it and sizes its output
    from the symbolic dims; the real op checks the actual sizes when it runs.
    None stays None."""
    if t is None:
        return None
    return tuple(_traced_dim(d, fallback) for d in t.shape), t.dtype


def _traced_dim(d, fallback: int) -> int:
    n = _dim(d)
    if n is not None:
        return n
    hint = getattr(getattr(d, "node", None), "hint", None)
    if isinstance(hint, int):
        return hint
    from torch.fx.experimental import symbolic_shapes

    # `optimization_hint` where this torch has it, else `hint_int`: neither adds a guard.
    f = getattr(symbolic_shapes, "optimization_hint", None) or getattr(symbolic_shapes, "hint_int", None)
    try:
        return int(f(d, fallback=fallback))
    except Exception:  # noqa: BLE001 - no hint this torch can give: the fallback
        return fallback


def _traced_rows(t, rows: int):
    """`_traced(t)`, with a dim 0 that has no traced size (data-dependent) at
    `rows`, the count the op takes there (an SP layout's): the fake then
    checks the rest, and the real op the actual rows when it runs."""
    shape, dtype = _traced(t, rows)
    d = t.shape[0]
    if _dim(d) is None and not isinstance(getattr(getattr(d, "node", None), "hint", None), int):
        shape = (rows, *shape[1:])
    return shape, dtype


def _layout(local_sizes: Optional[List[int]]):
    return None if local_sizes is None else ops.SpLayout(local_sizes)


def _policy(shared_mode: int, has_routed_transform: bool, sp: bool, tp_size: int, ep_size: int) -> ReducePolicy:
    return ReducePolicy(shared_mode, has_routed_transform, sp, tp_size, ep_size)


def _reduce_op(name: str, op) -> None:
    """Refuses, in a fake, a plain-int `op` that names no reduce op, as the
    real collective `name` does when it runs. A symbolic `op` is left to the
    real op: checking it would specialize the graph on its value."""
    if isinstance(op, int) and op not in set(ReduceOp):
        known = ", ".join(f"{int(m)} {m.name.lower()}" for m in ReduceOp)
        raise error(Status.INVALID_ARGUMENT, f"{name}: `op` is {op}, which names no reduce op (expected {known})")


def _no_meta_beside_data(name: str, **operands) -> None:
    """Refuses, in a fake, meta tensors mixed with tensors on another device.
    torch sends such a call to the Meta kernel (the fake), which would return
    an output of the first operand's device that the op never wrote; the
    real op takes no meta tensor. All meta, or none, is a fake's input."""
    tensors = [(arg, t) for arg, t in operands.items() if isinstance(t, Tensor)]
    meta = [arg for arg, t in tensors if t.device.type == "meta"]
    data = [(arg, t.device) for arg, t in tensors if t.device.type != "meta"]
    if meta and data:
        arg, device = data[0]
        raise error(
            Status.DEVICE,
            f"{name}: `{meta[0]}` is a meta tensor, which has no data, but `{arg}` is on {device}: "
            "pass every operand on one device (meta tensors only to size the output)",
        )


def register() -> bool:
    """Registers the ops once; False when this torch lacks what it takes
    (`missing()` says what)."""
    if missing():
        return False

    # Defaults as the plain ints a torch schema holds.
    drop_less_column = int(ops.DropPadMode.DROP_LESS_COLUMN)
    sum_op = int(_comm.ReduceOp.SUM)

    # ------------------------------------------------------------ local ops

    @custom_op("ascend_moe::moe_finalize_routing", mutates_args=(), collective=False)
    def moe_finalize_routing(
        expanded_x: Tensor,
        expanded_row_idx: Tensor,
        x1: Optional[Tensor] = None,
        x2: Optional[Tensor] = None,
        bias: Optional[Tensor] = None,
        scales: Optional[Tensor] = None,
        expert_idx: Optional[Tensor] = None,
        drop_pad_mode: int = drop_less_column,
    ) -> Tensor:
        return ops.moe_finalize_routing(expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx, drop_pad_mode)

    @moe_finalize_routing.register_fake
    def _(
        expanded_x,
        expanded_row_idx,
        x1=None,
        x2=None,
        bias=None,
        scales=None,
        expert_idx=None,
        drop_pad_mode=drop_less_column,
    ):
        args = (x1, x2, bias, scales, expert_idx, drop_pad_mode)
        operands = (expanded_x, expanded_row_idx, *args[:-1])
        dynamic = _symbolic(*operands)
        if dynamic:
            shape = shapes.moe_finalize_routing(*map(_traced, operands), drop_pad_mode)
        else:
            shape = shapes.moe_finalize_routing(expanded_x, expanded_row_idx, *args)
        optional = dict(zip(("x1", "x2", "bias", "scales", "expert_idx"), args))
        _no_meta_beside_data("moe_finalize_routing", expanded_x=expanded_x, expanded_row_idx=expanded_row_idx, **optional)
        if dynamic:
            # `[N, H...]`: N the rows of `scales` (`[N, K]`), else the indices
            # (K = 1); H the trailing dims of `expanded_x`.
            rows = (scales if scales is not None else expanded_row_idx).shape[0]
            trailing = tuple(expanded_x.shape)[len(expanded_x.shape) - (len(shape) - 1) :]
            shape = (rows, *trailing)
        return expanded_x.new_empty(shape)

    @custom_op("ascend_moe::moe_token_unpermute", mutates_args=(), collective=False)
    def moe_token_unpermute(permuted: Tensor, sorted_indices: Tensor, probs: Optional[Tensor] = None) -> Tensor:
        return ops.moe_token_unpermute(permuted, sorted_indices, probs)

    @moe_token_unpermute.register_fake
    def _(permuted, sorted_indices, probs=None):
        if not _symbolic(permuted, sorted_indices, probs):
            shape = shapes.moe_token_unpermute(permuted, sorted_indices, probs)
        else:
            shapes.moe_token_unpermute(_traced(permuted), _traced(sorted_indices), _traced(probs))
            # `[T, H...]`: T the rows of `probs` (`[T, K]`), else the indices
            # (K = 1); H the trailing dims of `permuted`.
            shape = ((probs if probs is not None else sorted_indices).shape[0], *permuted.shape[1:])
        _no_meta_beside_data("moe_token_unpermute", permuted=permuted, sorted_indices=sorted_indices, probs=probs)
        return permuted.new_empty(shape)

    # ----------------------------------------------------------- collectives
    # The fakes look the communicator up too, so a stale handle fails at trace
    # time, and take rank and world size from it.

    @custom_op("ascend_moe::all_reduce", mutates_args=())
    def all_reduce(x: Tensor, comm: int, op: int = sum_op) -> Tensor:
        return _comm.all_reduce(x, Comm.lookup(comm), op)

    @all_reduce.register_fake
    def _(x, comm, op=sum_op):
        Comm.lookup(comm)
        shape = shapes.all_reduce(_traced(x) if _symbolic(x) else x)
        _reduce_op("all_reduce", op)
        return x.new_empty(x.shape if _symbolic(x) else shape)

    @custom_op("ascend_moe::reduce_scatter", mutates_args=())
    def reduce_scatter(x: Tensor, comm: int, op: int = sum_op) -> Tensor:
        return _comm.reduce_scatter(x, Comm.lookup(comm), op)

    @reduce_scatter.register_fake
    def _(x, comm, op=sum_op):
        c = Comm.lookup(comm)
        if not _symbolic(x):
            shape = shapes.reduce_scatter(x, c)
        else:
            # Checked on the traced rows; the rows divided symbolically (the
            # real op refuses rows the world size does not divide).
            shapes.reduce_scatter(_traced_rows(x, c.world_size), c)
            shape = (x.shape[0] // c.world_size, *x.shape[1:])
        _reduce_op("reduce_scatter", op)
        return x.new_empty(shape)

    @custom_op("ascend_moe::all_gather", mutates_args=())
    def all_gather(x: Tensor, comm: int) -> Tensor:
        return _comm.all_gather(x, Comm.lookup(comm))

    @all_gather.register_fake
    def _(x, comm):
        c = Comm.lookup(comm)
        if not _symbolic(x):
            return x.new_empty(shapes.all_gather(x, c))
        shapes.all_gather(_traced(x), c)
        return x.new_empty((x.shape[0] * c.world_size, *x.shape[1:]))

    # ------------------------------------------------------------ EP / SP

    @custom_op("ascend_moe::maybe_pad_and_reduce", mutates_args=())
    def maybe_pad_and_reduce(x: Tensor, ep_comm: int, local_sizes: Optional[List[int]] = None) -> Tensor:
        return ops.maybe_pad_and_reduce(x, _layout(local_sizes), Comm.lookup(ep_comm))

    @maybe_pad_and_reduce.register_fake
    def _(x, ep_comm, local_sizes=None):
        layout, ep = _layout(local_sizes), Comm.lookup(ep_comm)
        if not _symbolic(x):
            return x.new_empty(shapes.maybe_pad_and_reduce(x, layout, ep))
        taken = ep.world_size if layout is None else layout.total_rows
        shape = shapes.maybe_pad_and_reduce(_traced_rows(x, taken), layout, ep)
        # With a layout the output rows are its `local_sizes[rank]`; without
        # one the rows divided symbolically (the real op refuses a remainder).
        rows = shape[0] if layout is not None else x.shape[0] // ep.world_size
        return x.new_empty((rows, *x.shape[1:]))

    @custom_op("ascend_moe::maybe_all_gather_and_maybe_unpad", mutates_args=())
    def maybe_all_gather_and_maybe_unpad(x: Tensor, ep_comm: int, local_sizes: Optional[List[int]] = None) -> Tensor:
        return ops.maybe_all_gather_and_maybe_unpad(x, _layout(local_sizes), Comm.lookup(ep_comm))

    @maybe_all_gather_and_maybe_unpad.register_fake
    def _(x, ep_comm, local_sizes=None):
        layout, ep = _layout(local_sizes), Comm.lookup(ep_comm)
        if not _symbolic(x):
            return x.new_empty(shapes.maybe_all_gather_and_maybe_unpad(x, layout, ep))
        mine = layout.local_sizes[ep.rank] if layout is not None and ep.rank < layout.ep_size else 1
        shape = shapes.maybe_all_gather_and_maybe_unpad(_traced_rows(x, mine), layout, ep)
        # With a layout the output rows are its total; without one the rows
        # times the EP size, symbolically.
        rows = shape[0] if layout is not None else x.shape[0] * ep.world_size
        return x.new_empty((rows, *x.shape[1:]))

    # ------------------------------------------------ the reduction points
    # `comm_type` is read only by the real op: the fake validates the static
    # policy (through the library) and the handle, and refuses a plain-int
    # comm type that names none; a symbolic one is never inspected, so
    # tracing neither needs nor specializes its value.

    def reduction_point(name: str):
        method = getattr(ReducePolicy, name)
        shape_fn = getattr(shapes, name)

        @custom_op(f"ascend_moe::{name}", mutates_args=())
        def point(
            x: Tensor,
            comm_type: int,
            tp_comm: int,
            shared_mode: int,
            has_routed_transform: bool,
            sp: bool,
            tp_size: int,
            ep_size: int,
        ) -> Tensor:
            policy = _policy(shared_mode, has_routed_transform, sp, tp_size, ep_size)
            return method(policy, x, comm_type, Comm.lookup(tp_comm))

        @point.register_fake
        def _(x, comm_type, tp_comm, shared_mode, has_routed_transform, sp, tp_size, ep_size):
            _policy(shared_mode, has_routed_transform, sp, tp_size, ep_size)
            tp = Comm.lookup(tp_comm)
            if tp.world_size != tp_size:
                # What the real op refuses before it runs (the policy's TP
                # group is the one passed), so a compile fails as the run would.
                raise error(
                    Status.INVALID_ARGUMENT,
                    f"{name}: invalid argument `tp`: the group has {tp.world_size} ranks, "
                    f"the policy's tp_size is {tp_size}",
                )
            shape = shape_fn(_traced(x)) if _symbolic(x) else shape_fn(x)
            if isinstance(comm_type, int):
                CommType.parse(comm_type)
            return x.new_empty(x.shape if _symbolic(x) else shape)

    for name in ("reduce_routed_early", "reduce_shared", "reduce_final"):
        reduction_point(name)

    # ------------------------------------ ops reading the forward context
    # They take only tensors and a layer id (`MoeLayer.layer_id`): the real
    # implementation reads the live `ascend_moe.forward_context` when it runs,
    # the fake reads it at trace time, for shapes only. Output shapes depend on
    # input shapes alone, so nothing of the context is frozen into a graph.

    from .forward import MoeLayer, get_forward_context

    @custom_op("ascend_moe::moe_layer_fc", mutates_args=())
    def moe_layer_fc(x: Tensor, layer: int) -> Tensor:
        # The experts callable takes numpy arrays for CPU tensors (views of
        # the tensor memory) and the tensors themselves on the NPU.
        return _as_tensor(MoeLayer.lookup(layer).forward(_numpy_view(x)), x)

    @moe_layer_fc.register_fake
    def _(x, layer):
        from .prepare import token_finalize_shape, token_prepare_shape

        ctx = get_forward_context()
        lay = MoeLayer.lookup(layer)
        mctx = lay.context(ctx)
        lay.groups.handle.release()  # closed groups are refused, as the real op refuses them
        if not _symbolic(x):
            prepared = token_prepare_shape(x, ctx.comm_type, mctx)
            return x.new_empty(token_finalize_shape((prepared, x.dtype), ctx.comm_type, mctx))
        # The layer returns this rank's tokens, the rows it takes: the shapes
        # are checked on the traced ones, the output keeps the symbolic rows
        # (the real op refuses rows the live context does not give this rank).
        # Data-dependent rows are checked at the count the context gives this
        # rank: its DP rank's tokens, split over TP with SP (SPEC section 2).
        tokens = ctx.dp_tokens[lay.dp_rank] if lay.dp_rank < len(ctx.dp_tokens) else 1
        mine = -(-tokens // lay.tp_size) if ctx.sp else tokens
        prepared = token_prepare_shape(_traced_rows(x, mine), ctx.comm_type, mctx)
        token_finalize_shape((prepared, x.dtype), ctx.comm_type, mctx)
        return x.new_empty(x.shape)

    def reduction_point_fc(name: str):
        method = getattr(ReducePolicy, name)
        shape_fn = getattr(shapes, name)

        @custom_op(f"ascend_moe::{name}_fc", mutates_args=())
        def point(x: Tensor, layer: int) -> Tensor:
            lay = MoeLayer.lookup(layer)
            with lay.point_refusing():
                ctx = get_forward_context()
                policy = lay.checked_policy(ctx)
            return method(policy, x, ctx.comm_type, lay.tp_comm)

        @point.register_fake
        def _(x, layer):
            lay = MoeLayer.lookup(layer)
            lay.checked_policy(get_forward_context())
            lay.tp_comm.handle.release()  # a closed TP communicator is refused, as the real op refuses it
            if _symbolic(x):
                shape_fn(_traced(x))
                return x.new_empty(x.shape)
            return x.new_empty(shape_fn(x))

    for name in ("reduce_routed_early", "reduce_shared", "reduce_final"):
        reduction_point_fc(name)

    return True
