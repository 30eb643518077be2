//! # cann-sim
//!
//! A simulated CANN runtime: one shared library (`libcann_sim.so`) exporting
//! the ACL runtime, HCCL, nnopbase and aclnn symbols the ascend-moe NPU
//! backend loads, with the exact C signatures and numeric codes of CANN,
//! implemented over host memory. Point `ASCEND_MOE_ACL_LIB`,
//! `ASCEND_MOE_HCCL_LIB`, `ASCEND_MOE_NNOPBASE_LIB` and `ASCEND_MOE_OPAPI_LIB`
//! at it and the NPU backend runs without an NPU.
//!
//! | module | exports |
//! |---|---|
//! | [`acl`] | `aclInit` ... `aclrtGetVersion`: devices, streams, memory, events |
//! | [`acl_rules`] | (no exports) the argument rules of the real ACL runtime, applied at each ACL export's entry |
//! | [`nnop`] | `aclCreateTensor`, `aclDestroyTensor`, `aclCreateScalar`, `aclDestroyScalar` |
//! | [`aclnn`] | `aclnnMoeFinalizeRoutingV2`, `aclnnMoeTokenUnpermute`, `aclnnAdd` (+ `GetWorkspaceSize`) |
//! | [`hccl`] | `HcclGetRootInfo` ... `HcclBarrier`, over the simulator's own shared-memory data plane |
//! | [`hccl_rules`] | (no exports) the argument rules of real HCCL, applied at each HCCL export's entry |
//! | [`version`] | (no exports) the emulated CANN release, `CANNSIM_CANN_VERSION` |
//! | [`kernel`] | `cannsim_launch_kernel`, `cannsim_launch_kernel_ex` (simulator-only) |
//! | [`capture`] | `aclmdlRICaptureBegin` ... `aclmdlRIDestroy`, `aclrtSynchronizeDevice`: ACL graph capture |
//! | [`lease`] | (no exports) the allocations a queued task's operands lie in, checked when it runs |
//! | [`counters`] | `cannsim_counters`, `cannsim_counters_reset` (simulator-only): per-thread host call counts |
//!
//! What it models and what it does not: see README.md. Configuration: see
//! [`config`].

#![warn(missing_docs)]

pub mod acl;
pub mod acl_rules;
pub mod aclnn;
pub mod arena;
pub mod capture;
pub mod config;
pub mod context;
pub mod counters;
pub mod ffi;
pub mod handles;
pub mod hccl;
pub mod hccl_rules;
pub mod host_bufs;
pub mod kernel;
pub mod leaks;
pub mod lease;
pub mod nnop;
pub mod status;
pub mod stream;
pub mod version;
