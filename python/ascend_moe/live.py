"""The live forward context on an NPU, for ACL graphs (`amoe_live_context_*`).

A graph captured under one forward context replays that context's layout and
reductions. The engine keeps the live context in a 256-byte device buffer and
rewrites it before each replay; every op called on a stream the context is
attached to enqueues a guard that compares it, on the device, with the context
the op was called with. `check()` is the engine's sync point: it reports a
replay under another context as `AmoeError(Status.STALE_CONTEXT)` naming the
field and both values.

    live = ascend_moe.LiveContext(stream)          # outside capture
    live.reserve(layers * 5 * len(batch_sizes))    # a record per guard the graphs capture (at most 5 a layer)
    live.attach()                                  # ops on `stream` guard themselves
    ... capture the layer ...
    live.set(ForwardContext(CommType.MC2, dp_tokens=[8, 8]))   # before each replay
    graph.replay()
    live.check()
"""

from __future__ import annotations

import ctypes

from ._enums import GUARD_ACTUAL_TOKENS, Status
from ._errors import error
from ._lib import ALL_TOKENS, U32_MAX, ForwardContextC, Owned, c_uint, call, sizes
from ._tensor import hold_stream, unhold_stream, wrap_stream
from .forward import ForwardContext, checked_context


def _stream_handle(stream, device, hold=False):
    """The library's handle on `stream` and its device; `hold`: for a
    LiveContext, which keeps it (see `_tensor.hold_stream`)."""
    raw = getattr(stream, "npu_stream", None)
    if not raw:
        raise error(
            Status.INVALID_ARGUMENT,
            f"`stream` must have a non-null .npu_stream (the raw aclrtStream), got {type(stream).__name__}",
        )
    if device is None:
        device = getattr(getattr(stream, "device", None), "index", None)
    if device is None:
        raise error(Status.INVALID_ARGUMENT, "the stream's device is unknown: pass `device=`")
    device = c_uint("device", device, U32_MAX)
    return (hold_stream if hold else wrap_stream)(raw, device), device


def _context_c(ctx: ForwardContext):
    ctx = checked_context(ctx)
    dp, n = sizes(ctx.dp_tokens, "dp_tokens")
    c = ForwardContextC(
        comm_type=int(ctx.comm_type),
        sp=1 if ctx.sp else 0,
        dp_tokens=ctypes.cast(dp, ctypes.POINTER(ctypes.c_size_t)),
        dp_size=n,
        num_actual_tokens=ALL_TOKENS if ctx.num_actual_tokens is None else c_uint("num_actual_tokens", ctx.num_actual_tokens),
        pcp_size=c_uint("pcp_size", ctx.pcp_size),
    )
    return c, dp


class LiveContext(Owned):
    """A live forward context on the device of `stream` (an object with
    `.npu_stream`, such as torch_npu's Stream), with 128 guard records to
    start with: a guard captured into a graph keeps its record for the
    context's life and cannot add records, so `reserve(n)` them before
    capture; a guard outside capture adds records itself, keeping free as
    many as the largest run of captures after an eager guard took. Made and freed
    outside capture (it allocates). Close it only after every graph that
    captured one of its guards was destroyed: each replay reads the guard's
    record and tiling, freed with the context. `close()` while another
    thread's call (a `check()` waiting on the stream) holds the context
    frees it, and releases its stream handle, when that call returns."""

    _free_fn = "amoe_live_context_free"
    _closed_text = "the live context was closed"

    def __init__(self, stream, device=None):
        self._stream, self.device = _stream_handle(stream, device, hold=True)
        self._raw = int(stream.npu_stream)
        try:
            h = ctypes.c_void_p()
            call("amoe_live_context_new", self._stream, ctypes.byref(h))
        except BaseException:
            unhold_stream(self._raw, self.device)
            raise
        self._own(h)

    def _free(self, h) -> None:
        super()._free(h)
        try:
            unhold_stream(self._raw, self.device)
        except Exception:  # noqa: BLE001 (interpreter shutdown: the module may be gone)
            pass

    def _handle(self):
        return self._lease()

    def set(self, ctx: ForwardContext) -> None:
        """Enqueues the update of the live context to `ctx` on the stream:
        before each replay, outside capture. A replay on another stream must
        be ordered after it (an event recorded on this stream and waited for
        there), or it may read the context before the update was written."""
        c, _keep = _context_c(ctx)
        with self._handle() as h:
            call("amoe_live_context_set", h, ctypes.byref(c), self._stream)

    def guard(self, ctx: ForwardContext, actual_tokens: bool = False) -> None:
        """Enqueues a guard of the ops that follow, built for `ctx` (capture it
        with them); `actual_tokens`: they also depend on `num_actual_tokens`."""
        c, _keep = _context_c(ctx)
        flags = GUARD_ACTUAL_TOKENS if actual_tokens else 0
        with self._handle() as h:
            call("amoe_live_context_guard", h, ctypes.byref(c), flags, self._stream)

    def reserve(self, guards: int) -> None:
        """Makes sure at least `guards` guard records are free, adding them
        when fewer are (the records in use never move): call it before
        capture with the guards the graphs will take, one per guarded op of
        each graph: per MoE layer a prepare, a finalize and each reduction
        point whose result depends on the comm type (`ReducePolicy.decisions`
        lists them; at most 3), so with a graph per batch size at most
        layers x 5 x batch sizes. Allocates; refused while the stream
        captures."""
        with self._handle() as h:
            call("amoe_live_context_reserve", h, c_uint("guards", guards))

    @property
    def capacity(self) -> int:
        """The guard records the context has, in use or free."""
        return self._guards()[0]

    @property
    def guards_in_use(self) -> int:
        """Guard records in use: by captured guards, and by guards enqueued
        outside capture and not yet checked."""
        return self._guards()[1]

    def _guards(self) -> tuple:
        cap, used = ctypes.c_size_t(), ctypes.c_size_t()
        with self._handle() as h:
            call("amoe_live_context_guards", h, ctypes.byref(cap), ctypes.byref(used))
        return cap.value, used.value

    def attach(self) -> None:
        """Makes every op on this stream that depends on the forward context
        guard itself first."""
        with self._handle() as h:
            call("amoe_stream_attach_live_context", self._stream, h)

    def detach(self) -> None:
        call("amoe_stream_attach_live_context", self._stream, None)

    def check(self) -> None:
        """Synchronises the stream and raises `AmoeError(Status.STALE_CONTEXT)`
        when a guard found the live context different from its ops' context."""
        with self._handle() as h:
            call("amoe_live_context_check", h, self._stream)

    @property
    def device_ptr(self) -> tuple:
        """`(address, bytes)` of the live buffer, for an engine that writes it itself."""
        p, n = ctypes.c_void_p(), ctypes.c_size_t()
        with self._handle() as h:
            call("amoe_live_context_device_ptr", h, ctypes.byref(p), ctypes.byref(n))
        return p.value, n.value

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass
