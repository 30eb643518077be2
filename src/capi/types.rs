//! The leaf of the C ABI: the types every other module of `capi` shares, and
//! nothing that imports them back.
//!
//! | item | what |
//! |---|---|
//! | [`amoe_status`] | the status code of every export |
//! | [`ENUMS`] | every enum the ABI numbers, the source of the header's enum blocks and of `amoe_enum_*` |
//! | [`amoe_dtype`], [`amoe_device_kind`], [`amoe_reduce_op`], [`amoe_comm_type`], [`amoe_shared_mode`], [`amoe_drop_pad_mode`] | the codes of enum-like arguments |
//! | [`amoe_tensor`], [`AMOE_MAX_NDIM`] | the tensor descriptor |
//! | [`amoe_comm`], [`amoe_stream`], [`amoe_live_context`], [`amoe_moe_groups`] | opaque handles |
//!
//! The argument structs of one family of exports (`amoe_finalize_args`,
//! `amoe_moe_context`, `amoe_forward_context`, ...) live with those exports.
//!
//! Every enum is numbered once, in Rust: the crate's enums (`DType`,
//! `CommType`, ...) and the two that exist only in the ABI (`amoe_status`,
//! `amoe_device_kind`) are defined with `numbered!`; the ABI's names for the
//! crate's enums are aliases. The header's `enum amoe_*` blocks are generated
//! from [`ENUMS`] (`tests/capi_header.rs`), and the Python package reads the
//! same table through `amoe_enum_count` / `amoe_enum_info` / `amoe_enum_entry`.

use std::ffi::{c_void, CStr};

use crate::moe::SharedMode;
use crate::types::{numbered, DropPadMode, Numbered, Variant};
use crate::{CommType, DType, ReduceOp};

numbered! {
    /// Status code of every export. Numbers are fixed forever: a retired code is
    /// never reused for something else.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum amoe_status {
        /// Success.
        Ok = 0 => "OK",
        /// A required pointer argument was NULL.
        NullArgument = 1 => "NULL_ARGUMENT",
        /// An argument has a value the function does not accept (also a
        /// handle of another type than the argument's, a released handle,
        /// or a pointer that is no handle of this library).
        InvalidArgument = 2 => "INVALID_ARGUMENT",
        /// A tensor has the wrong shape.
        Shape = 3 => "SHAPE",
        /// A tensor has the wrong dtype, or a dtype code is unknown.
        Dtype = 4 => "DTYPE",
        /// An index tensor holds a value outside its valid range.
        IndexOutOfRange = 5 => "INDEX_OUT_OF_RANGE",
        /// A tensor is on the wrong device, or a device kind is unknown.
        Device = 6 => "DEVICE",
        /// Ranks called different collectives (kind, count, dtype, root, op).
        CommMismatch = 7 => "COMM_MISMATCH",
        /// A peer did not arrive within the communicator's timeout.
        CommTimeout = 8 => "COMM_TIMEOUT",
        /// A peer died or aborted the group.
        CommPeerFailed = 9 => "COMM_PEER_FAILED",
        /// Rendezvous or sub-group construction was invalid.
        CommSetup = 10 => "COMM_SETUP",
        /// An ACL runtime call failed.
        Acl = 11 => "ACL",
        /// An HCCL call failed.
        Hccl = 12 => "HCCL",
        /// An aclnn operator call failed.
        Aclnn = 13 => "ACLNN",
        /// A runtime library or backend is not available (e.g. no CANN / NPU backend).
        Unavailable = 14 => "UNAVAILABLE",
        /// An operating-system call failed (shared memory, files).
        Io = 15 => "IO",
        /// A caller-provided buffer is too small; the needed size was written where the function says.
        BufferTooSmall = 16 => "BUFFER_TOO_SMALL",
        /// The library panicked; this is a bug. The message says where.
        Panic = 17 => "PANIC",
        /// A device kernel reported a fault (bad index, tiling, or a simulated hardware rule).
        Kernel = 18 => "KERNEL",
        /// Work captured for one forward context ran under another (found on the
        /// device by the captured ops' guard, reported by the stream check).
        StaleContext = 19 => "STALE_CONTEXT",
        /// Host memory could not be allocated (the message names the call and
        /// the size). Device memory the ACL runtime refuses is `AMOE_STATUS_ACL`.
        HostMemory = 20 => "HOST_MEMORY",
    }
}

impl amoe_status {
    /// The message text `amoe_status_name` returns.
    pub const fn message(self) -> &'static CStr {
        match self {
            amoe_status::Ok => c"ok",
            amoe_status::NullArgument => c"null argument",
            amoe_status::InvalidArgument => c"invalid argument",
            amoe_status::Shape => c"shape mismatch",
            amoe_status::Dtype => c"dtype mismatch",
            amoe_status::IndexOutOfRange => c"index out of range",
            amoe_status::Device => c"wrong device",
            amoe_status::CommMismatch => c"collective mismatch",
            amoe_status::CommTimeout => c"collective timeout",
            amoe_status::CommPeerFailed => c"peer failed",
            amoe_status::CommSetup => c"communicator setup failed",
            amoe_status::Acl => c"ACL error",
            amoe_status::Hccl => c"HCCL error",
            amoe_status::Aclnn => c"aclnn error",
            amoe_status::Unavailable => c"unavailable",
            amoe_status::Io => c"I/O error",
            amoe_status::BufferTooSmall => c"buffer too small",
            amoe_status::Panic => c"internal panic",
            amoe_status::Kernel => c"kernel fault",
            amoe_status::StaleContext => c"stale forward context",
            amoe_status::HostMemory => c"out of host memory",
        }
    }
}

numbered! {
    /// Device kinds of `amoe_tensor::device_kind`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum amoe_device_kind {
        /// Host memory.
        Cpu = 0 => "CPU",
        /// Ascend NPU memory (`device_ordinal` names the device, which must be
        /// the device of the call's `amoe_stream`). Borrowed for the call, never
        /// copied to the host and never freed; `AMOE_STATUS_UNAVAILABLE` when
        /// CANN cannot be loaded.
        Npu = 1 => "NPU",
    }
}

pub(crate) const AMOE_DEVICE_CPU: u32 = amoe_device_kind::Cpu as u32;
pub(crate) const AMOE_DEVICE_NPU: u32 = amoe_device_kind::Npu as u32;

/// Element type codes of `amoe_tensor::dtype`: the crate's [`DType`].
/// cbindgen:ignore
pub type amoe_dtype = DType;
/// Reduction operators of the collectives: the crate's [`ReduceOp`].
/// cbindgen:ignore
pub type amoe_reduce_op = ReduceOp;
/// MoE communication types: the crate's [`CommType`].
/// cbindgen:ignore
pub type amoe_comm_type = CommType;
/// Shared-expert modes of `amoe_reduce_policy::shared_mode`: the crate's [`SharedMode`].
/// cbindgen:ignore
pub type amoe_shared_mode = SharedMode;
/// Drop-pad modes of the finalize op: the crate's [`DropPadMode`].
/// cbindgen:ignore
pub type amoe_drop_pad_mode = DropPadMode;

/// The C ABI's Rust spellings of the comm types whose C names
/// (`AMOE_COMM_TYPE_ALLGATHER`, `AMOE_COMM_TYPE_ALLTOALL`) are one word.
/// cbindgen:ignore
#[allow(non_upper_case_globals)]
impl CommType {
    /// [`CommType::AllGather`] (`AMOE_COMM_TYPE_ALLGATHER`).
    pub const Allgather: CommType = CommType::AllGather;
    /// [`CommType::AllToAll`] (`AMOE_COMM_TYPE_ALLTOALL`).
    pub const Alltoall: CommType = CommType::AllToAll;
}

/// One enum of the C ABI: `enum <name>` in the header, whose variants are
/// `<NAME>_<variant name> = <value>`.
#[derive(Debug, Clone, Copy)]
pub struct CEnum {
    /// The C type name (`"amoe_dtype"`).
    pub name: &'static CStr,
    /// Its doc comment in the header.
    pub doc: &'static str,
    /// Its variants, in numbering order.
    pub variants: &'static [Variant],
}

/// Every enum the C ABI numbers, in header order.
/// cbindgen:ignore
pub const ENUMS: [CEnum; 7] = [
    CEnum {
        name: c"amoe_status",
        doc: "Status code of every export. Numbers are fixed forever: a retired code is\nnever reused for something else.",
        variants: amoe_status::TABLE,
    },
    CEnum {
        name: c"amoe_dtype",
        doc: "Element type codes of `amoe_tensor::dtype` (the crate's `DType` numbering).",
        variants: DType::TABLE,
    },
    CEnum { name: c"amoe_device_kind", doc: "Device kinds of `amoe_tensor::device_kind`.", variants: amoe_device_kind::TABLE },
    CEnum { name: c"amoe_reduce_op", doc: "Reduction operators of the collectives.", variants: ReduceOp::TABLE },
    CEnum {
        name: c"amoe_comm_type",
        doc: "vLLM-Ascend's MoE communication types (SPEC section 5), chosen per forward pass.",
        variants: CommType::TABLE,
    },
    CEnum {
        name: c"amoe_shared_mode",
        doc: "Shared-expert modes of `amoe_reduce_policy::shared_mode` (SPEC section 5).",
        variants: SharedMode::TABLE,
    },
    CEnum {
        name: c"amoe_drop_pad_mode",
        doc: "Drop-pad modes of the finalize op (SPEC section 1).",
        variants: DropPadMode::TABLE,
    },
];

/// Most dimensions an `amoe_tensor` may have.
pub const AMOE_MAX_NDIM: usize = 8;

/// `amoe_comm_from_hccl` flag: the borrowed communicator is the engine's world
/// (made from a root info, e.g. torch.distributed's default group), so
/// `amoe_comm_split` may split it. Without it a borrowed communicator may be a
/// sub-communicator, which HCCL does not split again, and the split is refused.
pub const AMOE_HCCL_WORLD: u32 = 1;

/// A tensor descriptor: where the bytes are, what they hold, on which device.
///
/// The descriptor is only read. It never transfers ownership: `data`,
/// `shape` and `strides` stay owned by the caller and must stay valid for the
/// duration of the call that receives the descriptor, no longer.
/// - `data`: for inputs, readable for `prod(shape) * dtype_size` bytes; for
///   outputs, writable for that many bytes. May be NULL when the tensor has
///   no elements, and is ignored by `*_output_shape` functions.
/// - `dtype`: an `amoe_dtype` code.
/// - `ndim`: number of dimensions, `0..=AMOE_MAX_NDIM`; 0 is a scalar.
/// - `shape`: `ndim` sizes (may be NULL when `ndim == 0`). The product of
///   `dtype_size` and the non-zero sizes must not exceed `PTRDIFF_MAX`, also
///   for a tensor without elements (`AMOE_STATUS_SHAPE` otherwise).
/// - `strides`: NULL for a C-contiguous tensor, else `ndim` strides in
///   elements, which must describe a C-contiguous layout (size-1 dimensions
///   may carry any stride, and a tensor without elements any strides); other
///   layouts are rejected.
/// - `device_kind`: an `amoe_device_kind` code; `device_ordinal` names the NPU.
///   An output is in the memory of the op's inputs: NPU memory of their
///   device for NPU inputs (the op writes it on the stream), host memory for
///   host inputs. No op copies its result between host and NPU memory, so an
///   NPU output of host inputs, or a host output of NPU inputs, is
///   `AMOE_STATUS_DEVICE` naming the output and both devices, before any work.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct amoe_tensor {
    /// First byte of the elements.
    pub data: *mut c_void,
    /// An `amoe_dtype` code.
    pub dtype: u32,
    /// Number of dimensions.
    pub ndim: usize,
    /// `ndim` sizes.
    pub shape: *const usize,
    /// NULL, or `ndim` strides in elements (must be C-contiguous).
    pub strides: *const isize,
    /// An `amoe_device_kind` code.
    pub device_kind: u32,
    /// NPU ordinal (ignored for host tensors).
    pub device_ordinal: i32,
}

/// A communicator: one rank's handle on a group (a CPU shared-memory world,
/// a sub-group of one, or an HCCL communicator).
///
/// Created by `amoe_comm_cpu_new`, `amoe_comm_split` or `amoe_comm_from_hccl`;
/// owned by the caller, who releases it with `amoe_comm_free`. A handle may
/// be used by one thread at a time; different handles (ranks) may be used by
/// different threads concurrently.
pub struct amoe_comm {
    _private: [u8; 0],
}

/// A borrowed NPU stream (an `aclrtStream` owned by the engine, e.g. torch_npu's
/// current stream) on one device. Every op and collective takes one: NPU
/// tensor descriptors must live on its device and the work is queued on it;
/// pass NULL when every tensor is a host tensor. The handle never owns the
/// engine's stream: `amoe_stream_free` releases only the handle. The calls
/// that take one stream (its ops, collectives and `amoe_stream_check`) are
/// made from one thread at a time, as work is queued on a stream in one
/// order: the status records of its launches are freed by its check. A
/// call on a stream of another device than the calling thread's current one
/// makes the stream's device current for the call only: an export returns
/// with the device the thread had current (`aclrtGetDevice`) current again
/// (by `aclrtSetDevice`, that device's default context; a thread with no
/// device current is left with the one the call bound).
pub struct amoe_stream {
    _private: [u8; 0],
}

/// A live forward context in NPU memory (256 bytes), which the engine
/// rewrites before each graph replay, plus the records of the guards
/// enqueued against it. Owned by the caller (free with
/// `amoe_live_context_free`, outside capture).
pub struct amoe_live_context {
    _private: [u8; 0],
}

/// Host memory for a large result, from the library's reuse pool
/// (`amoe_host_block_new`). Owned by the caller; `amoe_host_block_free`
/// gives the memory back for a later block of the same size.
pub struct amoe_host_block {
    _private: [u8; 0],
}

/// The EP / TP / DP groups of a MoE layer, split from a world communicator.
/// Owned by the caller (free with `amoe_moe_groups_free`).
pub struct amoe_moe_groups {
    _private: [u8; 0],
}
