"""The NPU stream as the library sees it: the caller's sync point, workspace
reserved ahead of graph capture, and the engine's allocator.

NPU ops only enqueue work on the stream they are given and return; the
errors only the device can find (a bad index seen by a kernel, a collective
that mismatched, timed out or lost a peer, a graph replayed under another
forward context) are reported by `stream_check(stream)`, where the engine
synchronises anyway.
"""

from __future__ import annotations

import ctypes

from ._enums import Status
from ._errors import AmoeError, error
from ._lib import c_uint, call
from ._tensor import streams_of, wrap_stream
from .live import _stream_handle

# `amoe_alloc_fn` / `amoe_free_fn` of the header.
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)

# Callbacks handed to the library, per stream handle, kept alive while set.
_ALLOCATORS: dict = {}


def stream_check(stream, device=None) -> None:
    """Waits for the work queued on `stream` (an object with `.npu_stream`)
    and raises `AmoeError` with the first error the device recorded for it
    since the last check (`amoe_stream_check`). Outside graph capture."""
    h, _ = _stream_handle(stream, device)
    call("amoe_stream_check", h)


def workspace_reserve(stream, nbytes: int, staging_bytes: int = 4096, device=None) -> None:
    """Reserves `nbytes` of device workspace (and `staging_bytes` of pinned
    staging) on `stream` before graph capture, where the pool cannot grow."""
    h, _ = _stream_handle(stream, device)
    call("amoe_workspace_reserve", h, c_uint("nbytes", nbytes), c_uint("staging_bytes", staging_bytes))


def reserve_capture_records(stream, launches: int, device=None) -> None:
    """Reserves, before graph capture, the status records of `launches`
    native kernel launches captured on `stream` (each keeps its record for
    the stream's life). A stream keeps 256 free, or as many as its largest
    capture after an eager call took; reserve for a first capture of more
    (`amoe_capture_records_reserve`)."""
    h, _ = _stream_handle(stream, device)
    call("amoe_capture_records_reserve", h, c_uint("launches", launches))


def reserve_like(stream, warm, device=None) -> None:
    """Reserves on `stream` what `warm` (a stream of the same device)
    reserved by running ops eagerly, so that ops first run on `stream` under
    graph capture find it: reservations are per stream
    (`amoe_stream_reserve_like`)."""
    h, dev = _stream_handle(stream, device)
    w, _ = _stream_handle(warm, dev)
    call("amoe_stream_reserve_like", h, w)


def prepare_capture(stream, device=None) -> None:
    """Before a graph capture on `stream`: reserves on it what every other
    stream of its device that the package has run ops on reserved
    (`reserve_like`). `torch.npu.graph` without `stream=` captures on its own
    side stream, not the stream the warm-up ran on; the vLLM-Ascend adapter
    calls this for it at every capture (`vllm_ascend.install`)."""
    h, dev = _stream_handle(stream, device)
    for w in streams_of(dev):
        if w.value != h.value:
            call("amoe_stream_reserve_like", h, w)


def set_allocator(stream, alloc=None, free=None, device=None) -> None:
    """Serves the ops' workspace on `stream` from the engine's allocator:
    `alloc(nbytes, raw_stream) -> int` (a device address, 0 when out of
    memory) and `free(ptr, nbytes, raw_stream)`, for example over torch_npu's
    caching allocator. Both None goes back to the library's pool. The
    callbacks must not call into this library."""
    if (alloc, free) != (None, None):
        for arg, fn in (("alloc", alloc), ("free", free)):
            if not callable(fn):
                raise error(
                    Status.INVALID_ARGUMENT,
                    f"set_allocator: `{arg}` is {type(fn).__name__}, expected a callable (give both alloc and "
                    "free, or neither)",
                )
    h, _ = _stream_handle(stream, device)
    if alloc is None and free is None:
        call("amoe_stream_set_allocator", h, None, None, None)
        _ALLOCATORS.pop(h.value, None)
        return

    def c_alloc(_ctx, nbytes, raw):
        try:
            return int(alloc(int(nbytes), raw) or 0) or None
        except Exception:  # noqa: BLE001 (an exception must not unwind into C)
            return None

    def c_free(_ctx, ptr, nbytes, raw):
        try:
            free(ptr, int(nbytes), raw)
        except Exception:  # noqa: BLE001
            pass

    fns = (ALLOC_FN(c_alloc), FREE_FN(c_free))
    call("amoe_stream_set_allocator", h, ctypes.cast(fns[0], ctypes.c_void_p), ctypes.cast(fns[1], ctypes.c_void_p), None)
    _ALLOCATORS[h.value] = fns



def native_kernel() -> dict:
    """Whether the native kernels can launch here: `{"available": True,
    "reason": None}`, or `available` False with why (no AI Core kernel
    library in this build and no `$ASCEND_MOE_KERNEL_LIB`, or it failed to
    load). Without them NPU finalize and unpermute calls use aclnn, which
    reads the index tensors on the host at every call (a synchronisation)
    and cannot be captured into a graph. The first call loads the library."""
    try:
        call("amoe_native_kernel_check")
    except AmoeError as e:
        if e.status != Status.UNAVAILABLE:
            raise
        return {"available": False, "reason": str(e)}
    return {"available": True, "reason": None}


__all__ = ["native_kernel", "stream_check", "workspace_reserve", "set_allocator", "wrap_stream"]
