"""ascend_moe: the MoE communication and finalize layer for vLLM-Ascend, over
the library's C ABI (ctypes).

The native library is `$ASCEND_MOE_LIB` when set, else the one `pip install`
built into this package. Errors raise `AmoeError` (a `RuntimeError`) carrying
the library's message; argument errors are its subclasses that are also a
`ValueError` (`InvalidArgumentError`, `ShapeError`, `DeviceError`, ...) or a
`TypeError` (`DTypeError`); host memory that cannot be allocated is a
`MemoryError` (`HostMemoryError`).

Operands are numpy arrays (float32, float16, `ml_dtypes.bfloat16`, int32
indices, ...) or tensors, passed where they live, never copied: numpy by its
buffer, any tensor-like (`device`, `data_ptr()`, `dtype`, `shape`,
`is_contiguous()`: torch and torch_npu tensors) by `data_ptr()`, as NPU memory
when `device.type == "npu"`. A non-contiguous host input is made contiguous
first; a non-contiguous NPU tensor or `out` is an error. Every op takes
`out=` (written there and returned; default a new output where the first
input lives: numpy, or `torch.empty(..., device=x.device)`; an `out=` must
live there too, host memory for host inputs and NPU memory of their device
for NPU ones, else `DeviceError` naming `out` and both devices: the library
never copies a result between host and NPU memory) and `stream=` (an
object with `.npu_stream`, the raw aclrtStream, like torch_npu's `Stream`;
default `torch.npu.current_stream()` for NPU operands, an error naming the
missing stream without torch_npu; host operands need none). Each raw stream
is wrapped once per process (`release_streams()` frees those handles).
`Comm.from_process_group(pg)` borrows the HcclComm of a torch.distributed
HCCL group, `Comm.from_hccl(raw, device, world=False)` any engine-owned one.

When torch is importable, the ops are also registered as torch custom ops
(`torch.ops.ascend_moe.*`, functional: each returns a new tensor), with real
implementations for CPU and PrivateUse1 (torch_npu's NPU tensors, which never
leave the device) and fake implementations that size their outputs with
`shapes`, so they work under `FakeTensorMode`, on meta tensors and inside
`torch.compile(fullgraph=True)`:

    moe_finalize_routing(expanded_x, expanded_row_idx, x1=None, x2=None, bias=None,
                         scales=None, expert_idx=None, drop_pad_mode=0)
    moe_token_unpermute(permuted, sorted_indices, probs=None)
    all_reduce(x, comm, op=0)   reduce_scatter(x, comm, op=0)   all_gather(x, comm)
    maybe_pad_and_reduce(x, ep_comm, local_sizes=None)
    maybe_all_gather_and_maybe_unpad(x, ep_comm, local_sizes=None)
    reduce_routed_early / reduce_shared / reduce_final(
        x, comm_type, tp_comm, shared_mode, has_routed_transform, sp, tp_size, ep_size)

A communicator is passed as `Comm.handle_id`, a layout as its `local_sizes`,
a reduce op as a `ReduceOp` int, a policy as `*ReducePolicy.fields`; the comm
type is an int argument, so a compiled graph takes it at run time:

    torch.ops.ascend_moe.reduce_final(x, int(comm_type), tp.handle_id, *policy.fields)

The ops suffixed `_fc` take only tensors and a layer id and read the live
forward context (comm type, DP token counts, actual tokens, SP, PCP size) when
they run, so no compiled graph can freeze it:

    layer = MoeLayer(groups, tp_comm, tp_size, dp_rank, tp_rank, experts, policy)
    with forward_context(CommType.MC2, dp_tokens=[6, 3]):
        y = torch.ops.ascend_moe.moe_layer_fc(x, layer.layer_id)
        y = torch.ops.ascend_moe.reduce_final_fc(y, layer.layer_id)

`TORCH_OPS` says whether they are registered, `TORCH_OPS_ERROR` why not.
`ASCEND_MOE_TORCH=0` skips importing torch (processes that use numpy only).
"""

import os as _os

from . import shapes
from ._enums import CommType, DropPadMode, DType, ReduceOp, SharedMode, Status
from ._errors import (
    AmoeError,
    BufferTooSmallError,
    DeviceError,
    DTypeError,
    HostMemoryError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    NullArgumentError,
    ShapeError,
)
from ._lib import library_path
from ._tensor import release_streams
from ._lib import lib as _lib
from .comm import Comm, all_gather, all_reduce, broadcast, reduce_scatter
from .ops import (
    ReducePolicy,
    SpLayout,
    finalize_and_reduce,
    maybe_all_gather_and_maybe_unpad,
    maybe_pad_and_reduce,
    moe_finalize_routing,
    moe_token_unpermute,
    routed_is_reduced,
    shared_gather_unpad,
    shared_pad_reduce_scatter,
    shared_pad_split,
)
from .prepare import MoeContext, MoeGroups, token_finalize, token_prepare
from .forward import ForwardContext, MoeLayer, forward_context, get_forward_context, set_forward_context
from .live import LiveContext
from .streams import native_kernel, prepare_capture, reserve_capture_records, reserve_like, set_allocator, stream_check, workspace_reserve


def version() -> str:
    """The native library's version (`"MAJOR.MINOR.PATCH"`)."""
    return _lib().amoe_version().decode()



__all__ = [
    "AmoeError",
    "BufferTooSmallError",
    "Comm",
    "CommType",
    "DeviceError",
    "DropPadMode",
    "DType",
    "DTypeError",
    "HostMemoryError",
    "IndexOutOfRangeError",
    "InvalidArgumentError",
    "NullArgumentError",
    "ShapeError",
    "ReduceOp",
    "ReducePolicy",
    "SharedMode",
    "SpLayout",
    "Status",
    "all_gather",
    "all_reduce",
    "broadcast",
    "finalize_and_reduce",
    "forward_context",
    "ForwardContext",
    "get_forward_context",
    "MoeLayer",
    "set_forward_context",
    "library_path",
    "LiveContext",
    "set_allocator",
    "stream_check",
    "workspace_reserve",
    "reserve_capture_records",
    "reserve_like",
    "prepare_capture",
    "MoeContext",
    "MoeGroups",
    "maybe_all_gather_and_maybe_unpad",
    "maybe_pad_and_reduce",
    "moe_finalize_routing",
    "moe_token_unpermute",
    "native_kernel",
    "reduce_scatter",
    "release_streams",
    "routed_is_reduced",
    "shapes",
    "shared_gather_unpad",
    "shared_pad_reduce_scatter",
    "shared_pad_split",
    "token_finalize",
    "token_prepare",
    "version",
]

# torch is optional: register custom ops only when it is importable. A broken
# torch install or an old torch never breaks `import ascend_moe`; the reason
# is kept in TORCH_OPS_ERROR.
TORCH_OPS = False
TORCH_OPS_ERROR = None
_TORCH_SWITCH = _os.environ.get("ASCEND_MOE_TORCH", "1").strip()
if _TORCH_SWITCH not in ("0", "1"):
    import warnings as _warnings

    _warnings.warn(
        f"ASCEND_MOE_TORCH={_TORCH_SWITCH!r} is ignored: set it to 1 (on) or 0 (off); it is taken as unset (on)",
        stacklevel=2,
    )
if _TORCH_SWITCH == "0":
    TORCH_OPS_ERROR = "torch custom ops disabled by ASCEND_MOE_TORCH=0"
else:
    try:
        import torch as _torch  # noqa: F401
    except Exception as _e:  # noqa: BLE001
        TORCH_OPS_ERROR = f"torch not importable: {_e}"
if TORCH_OPS_ERROR is None:
    try:
        from . import _torch_ops

        TORCH_OPS = _torch_ops.register()
        if not TORCH_OPS:
            TORCH_OPS_ERROR = "this torch lacks " + ", ".join(_torch_ops.missing())
    except Exception as _e:  # noqa: BLE001
        TORCH_OPS_ERROR = f"registering torch custom ops failed: {_e}"
