"""ascend_moe: the MoE communication and finalize layer for vLLM-Ascend, over
the library's C ABI (ctypes).

The native library is `$ASCEND_MOE_LIB` when set, else `libascend_moe.so`
next to this package. Arrays are numpy (float32, float16,
`ml_dtypes.bfloat16`, int32 indices); every op returns a new array. Errors
raise `AmoeError` (a `RuntimeError`) carrying the library's message.

When torch is importable, the local ops are also registered as torch custom
ops (`torch.ops.ascend_moe.*`) whose fake implementations use `shapes`.
"""

from . import shapes
from ._lib import AmoeError, Status, library_path
from ._lib import lib as _lib
from .comm import Comm, ReduceOp, all_gather, all_reduce, broadcast, reduce_scatter
from .ops import (
    CommType,
    ReducePolicy,
    SharedMode,
    SpLayout,
    finalize_and_reduce,
    maybe_all_gather_and_maybe_unpad,
    maybe_pad_and_reduce,
    moe_finalize_routing,
    moe_token_unpermute,
    routed_is_reduced,
)
from .prepare import MoeContext, MoeGroups, token_finalize, token_prepare


def version() -> str:
    """The native library's version (`"MAJOR.MINOR.PATCH"`)."""
    return _lib().amoe_version().decode()


__all__ = [
    "AmoeError",
    "Comm",
    "CommType",
    "ReduceOp",
    "ReducePolicy",
    "SharedMode",
    "SpLayout",
    "Status",
    "all_gather",
    "all_reduce",
    "broadcast",
    "finalize_and_reduce",
    "library_path",
    "MoeContext",
    "MoeGroups",
    "maybe_all_gather_and_maybe_unpad",
    "maybe_pad_and_reduce",
    "moe_finalize_routing",
    "moe_token_unpermute",
    "reduce_scatter",
    "routed_is_reduced",
    "shapes",
    "token_finalize",
    "token_prepare",
    "version",
]

# torch is optional: register custom ops only when it is importable. A broken
# torch install or an old torch never breaks `import ascend_moe`; the reason
# is kept in TORCH_OPS_ERROR.
TORCH_OPS = False
TORCH_OPS_ERROR = None
try:
    import torch as _torch  # noqa: F401
except Exception as _e:  # noqa: BLE001
    TORCH_OPS_ERROR = f"torch not importable: {_e}"
else:
    try:
        from . import _torch_ops

        TORCH_OPS = _torch_ops.register()
    except Exception as _e:  # noqa: BLE001
        TORCH_OPS_ERROR = f"registering torch custom ops failed: {_e}"
