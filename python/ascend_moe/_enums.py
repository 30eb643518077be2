# Rendered from ascend_moe::capi::ENUMS and the C ABI's constants by
# tests/python_enums.rs; do not edit. Regenerate:
# AMOE_BLESS_PYTHON=1 cargo test --test python_enums
"""The library's enums as static `IntEnum` classes, and the C ABI's constants.

Numbered once, by the library's Rust enums; `_lib` checks at load that the
library's table (`amoe_enum_info` / `amoe_enum_entry`) is this one."""

from __future__ import annotations

import enum
import operator

from ._errors import error

#: `AMOE_MAX_NDIM`: most dimensions an `amoe_tensor` may have.
MAX_NDIM = 8
#: `AMOE_GUARD_ACTUAL_TOKENS`: a live-context guard also compares the actual tokens.
GUARD_ACTUAL_TOKENS = 1
#: `AMOE_HCCL_WORLD`: `amoe_comm_from_hccl` flag, the borrowed communicator is the world.
HCCL_WORLD = 1
#: `AMOE_MAX_EP_RANKS`: most EP ranks a layout or a forward context may have.
MAX_EP_RANKS = 1048576

#: The dtypes a reduction (sum, max, min) takes, as the library's `DType::REDUCIBLE`;
#: every other dtype is only moved (all_gather, all_to_all, broadcast).
REDUCIBLE_DTYPE_NAMES = ("f32", "f16", "bf16", "i32", "i64")


class _Numbered(enum.IntEnum):
    """An enum of the library; members are its C names without the enum's prefix."""

    @classmethod
    def parse(cls, v):
        """A member from itself, its number, or its name in any case (`"tensor_parallel"`);
        a number is taken by `operator.index`, so a float is refused, never truncated."""
        what = LABELS[cls.__name__]
        if isinstance(v, str):
            try:
                return cls[v.strip().upper()]
            except KeyError:
                names = ", ".join(m.name.lower() for m in cls)
                raise error(Status.INVALID_ARGUMENT, f"unknown {what} {v!r} (expected one of {names})") from None
        try:
            return cls(operator.index(v))
        except (TypeError, ValueError):
            top = int(max(cls))
            raise error(Status.INVALID_ARGUMENT, f"unknown {what} {v!r} (expected 0..={top})") from None


class Status(_Numbered):
    """`amoe_status`: Status code of every export. Numbers are fixed forever: a retired code is
    never reused for something else.
    """

    #: Success.
    OK = 0
    #: A required pointer argument was NULL.
    NULL_ARGUMENT = 1
    #: An argument has a value the function does not accept (also a
    #: handle of another type than the argument's, a released handle,
    #: or a pointer that is no handle of this library).
    INVALID_ARGUMENT = 2
    #: A tensor has the wrong shape.
    SHAPE = 3
    #: A tensor has the wrong dtype, or a dtype code is unknown.
    DTYPE = 4
    #: An index tensor holds a value outside its valid range.
    INDEX_OUT_OF_RANGE = 5
    #: A tensor is on the wrong device, or a device kind is unknown.
    DEVICE = 6
    #: Ranks called different collectives (kind, count, dtype, root, op).
    COMM_MISMATCH = 7
    #: A peer did not arrive within the communicator's timeout.
    COMM_TIMEOUT = 8
    #: A peer died or aborted the group.
    COMM_PEER_FAILED = 9
    #: Rendezvous or sub-group construction was invalid.
    COMM_SETUP = 10
    #: An ACL runtime call failed.
    ACL = 11
    #: An HCCL call failed.
    HCCL = 12
    #: An aclnn operator call failed.
    ACLNN = 13
    #: A runtime library or backend is not available (e.g. no CANN / NPU backend).
    UNAVAILABLE = 14
    #: An operating-system call failed (shared memory, files).
    IO = 15
    #: A caller-provided buffer is too small; the needed size was written where the function says.
    BUFFER_TOO_SMALL = 16
    #: The library panicked; this is a bug. The message says where.
    PANIC = 17
    #: A device kernel reported a fault (bad index, tiling, or a simulated hardware rule).
    KERNEL = 18
    #: Work captured for one forward context ran under another (found on the
    #: device by the captured ops' guard, reported by the stream check).
    STALE_CONTEXT = 19
    #: Host memory could not be allocated (the message names the call and
    #: the size). Device memory the ACL runtime refuses is `AMOE_STATUS_ACL`.
    HOST_MEMORY = 20


class DType(_Numbered):
    """`amoe_dtype`: Element type codes of `amoe_tensor::dtype` (the crate's `DType` numbering)."""

    #: IEEE 754 binary32.
    F32 = 0
    #: IEEE 754 binary16.
    F16 = 1
    #: bfloat16.
    BF16 = 2
    #: Signed 32-bit integer (index tensors).
    I32 = 3
    #: Signed 64-bit integer.
    I64 = 4
    #: Signed 8-bit integer (int8-quantized hidden states; moved, never reduced).
    I8 = 5
    #: Unsigned 8-bit integer (also packed fp4: two e2m1 values per byte; moved,
    #: never reduced).
    U8 = 6
    #: Boolean, one byte (0 or 1; masks, moved, never reduced).
    BOOL = 7
    #: 8-bit float, 4 exponent / 3 mantissa bits, finite only (`float8_e4m3fn`;
    #: moved, never reduced).
    F8E4M3 = 8
    #: 8-bit float, 5 exponent / 2 mantissa bits (`float8_e5m2`; moved, never reduced).
    F8E5M2 = 9


class DeviceKind(_Numbered):
    """`amoe_device_kind`: Device kinds of `amoe_tensor::device_kind`."""

    #: Host memory.
    CPU = 0
    #: Ascend NPU memory (`device_ordinal` names the device, which must be
    #: the device of the call's `amoe_stream`). Borrowed for the call, never
    #: copied to the host and never freed; `AMOE_STATUS_UNAVAILABLE` when
    #: CANN cannot be loaded.
    NPU = 1


class ReduceOp(_Numbered):
    """`amoe_reduce_op`: Reduction operators of the collectives."""

    #: Sum (f32 accumulation for f16 / bf16).
    SUM = 0
    #: Elementwise maximum.
    MAX = 1
    #: Elementwise minimum.
    MIN = 2


class CommType(_Numbered):
    """`amoe_comm_type`: vLLM-Ascend's MoE communication types (SPEC section 5), chosen per forward pass."""

    #: DP all-gather of tokens; routed output is TP-partial unless SP is on.
    ALLGATHER = 0
    #: MC2 dispatch / combine.
    MC2 = 1
    #: All-to-all dispatch / combine.
    ALLTOALL = 2
    #: Fused MC2.
    FUSED_MC2 = 3


class SharedMode(_Numbered):
    """`amoe_shared_mode`: Shared-expert modes of `amoe_reduce_policy::shared_mode` (SPEC section 5)."""

    #: No shared expert.
    NONE = 0
    #: TP-sharded weights: each TP rank's output is a TP-partial sum.
    TENSOR_PARALLEL = 1
    #: Sequence parallel (SEDP): output already complete on the shard.
    SEQUENCE_PARALLEL_SEDP = 2
    #: Sequence parallel only: output already complete on the shard.
    SEQUENCE_PARALLEL_ONLY = 3
    #: Replicated weights: output complete.
    DATA_PARALLEL_ONLY = 4


class DropPadMode(_Numbered):
    """`amoe_drop_pad_mode`: Drop-pad modes of the finalize op (SPEC section 1)."""

    #: Drop-less, `expanded_x [N*K, H]`, column index layout `R(i,k) = idx[k*N + i]`.
    DROP_LESS_COLUMN = 0
    #: Drop-pad, `expanded_x [E, C, H]`, column layout, `-1` = dropped slot.
    DROP_PAD_COLUMN = 1
    #: Drop-less, row index layout `R(i,k) = idx[i*K + k]`.
    DROP_LESS_ROW = 2
    #: Drop-pad, row layout, `-1` = dropped slot.
    DROP_PAD_ROW = 3


#: The class of each C enum, in the library's order.
TABLES = {
    "amoe_status": Status,
    "amoe_dtype": DType,
    "amoe_device_kind": DeviceKind,
    "amoe_reduce_op": ReduceOp,
    "amoe_comm_type": CommType,
    "amoe_shared_mode": SharedMode,
    "amoe_drop_pad_mode": DropPadMode,
}
#: What an error message calls a value of each enum.
LABELS = {
    "Status": "status",
    "DType": "dtype",
    "DeviceKind": "device kind",
    "ReduceOp": "reduce op",
    "CommType": "comm type",
    "SharedMode": "shared mode",
    "DropPadMode": "drop pad mode",
}
