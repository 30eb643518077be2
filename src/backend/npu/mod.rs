//! The NPU backend: safe ACL / HCCL wrappers and the ops on an Ascend device.
//!
//! Everything here loads CANN at run time (real CANN, or the simulated
//! runtime named by `ASCEND_MOE_{ACL,HCCL,NNOPBASE,OPAPI}_LIB`); when it is
//! absent every entry point returns [`Error::Unavailable`](crate::Error::Unavailable) naming the paths
//! that were tried.
//!
//! | module | holds |
//! |---|---|
//! | [`result`] | the result layer: each ACL, HCCL and aclnn C function wrapped once, returning `Result` |
//! | `runtime` | loading, ACL errors, per-thread device binding, [`NpuStream`], [`NpuEvent`] |
//! | `memory`, `device_buffer` | [`NpuBuffer`], [`PinnedHostBuffer`]; [`DeviceBuffer`] |
//! | `live_context` | `LiveContext`: the live forward context on the device and the guards of captured ops ([`ContextWords`], [`GuardTiling`]: the guard kernel's words and tiling) |
//! | `hccl` | [`HcclRootInfo`], [`HcclComm`] and its collectives |
//! | `device`, `backend_impl` | [`NpuDevice`] and its `Backend` impl |
//! | `aclnn` | the aclnn operands: tensor descriptors and scalars, destroyed on drop |
//! | `finalize`, `elementwise`, `operands`, `launch` | the ops behind `Backend` (the finalize family; add and the device-side equality check; what every op shares) and which finalize runs |
//! | `device_check` | checks only the device can make, reported at the caller's sync point |
//! | `probe` | [`probe_report`]: which CANN pieces were found, and where we looked |

mod aclnn;
mod backend_impl;
mod device;
mod device_buffer;
mod device_check;
mod elementwise;
mod finalize;
pub(crate) mod hccl;
pub(crate) mod kernel;
mod launch;
pub(crate) mod live_context;
mod memory;
mod operands;
pub(crate) mod pool;
mod probe;
pub mod result;
pub(crate) mod runtime;

pub use aclnn::acl_dtype;
pub use device::NpuDevice;
pub use device_buffer::DeviceBuffer;
pub use hccl::{hccl_dtype, hccl_op, HcclComm, HcclRootInfo, ROOT_INFO_BYTES};
pub use kernel::guard::{ContextWords, GuardTiling};
pub use launch::{native_kernel_check, FinalizeImpl, FINALIZE_ENV};
pub use live_context::{LiveContext, GUARD_CHUNK, LIVE_BYTES};
pub use memory::{NpuBuffer, PinnedHostBuffer};
pub use pool::{Allocator, PoolStats, WorkspaceAllocator, WORKSPACE_ALIGN};
pub use probe::{probe, probe_report, LibraryProbe, NativeKernelProbe, ProbeReport, RuntimeInfo};
pub use runtime::{device_count, recent_error_message, take_drop_errors, DeviceCtx, NpuEvent, NpuStream};
