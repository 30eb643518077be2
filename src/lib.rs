//! # ascend-moe
//!
//! One correct, fast, tested implementation of the Mixture-of-Experts
//! communication and finalize layer for Huawei Ascend NPUs, with a CPU fallback
//! that runs the same multi-rank test matrix anywhere.
//!
//! | layer | module | what it holds |
//! |---|---|---|
//! | raw bindings | `acl-sys`, `hccl-sys` | CANN ACL / HCCL symbols, loaded at run time |
//! | basic types (leaf) | [`types`] | [`DType`], [`Element`], [`ReduceOp`], [`DropPadMode`], shapes and metas, [`CommOptions`] |
//! | errors | [`error`] | [`Error`], [`Result`] |
//! | backends | [`backend`] | the [`backend::Backend`] and [`backend::Communicator`] traits over each backend's own buffers ([`backend::View`]), the CPU and NPU implementations (the NPU backend's crate-private `kernel` module: the Ascend C kernels' launch code) |
//! | devices | [`device`] | [`Device`] |
//! | tensors | [`tensor`] | [`Tensor`], `Storage` (a backend's buffer, owned or borrowed) |
//! | tensor ops | [`ops`], [`comm`], [`ranks`] | [`ops::DeviceOps`] and [`Collectives`] on tensors, written once over the traits; [`Comm`], [`CommType`]; thread ranks |
//! | MoE ops | [`moe`] | finalize, SP layout, pad/reduce, runtime-aware reductions, prepare/finalize |
//! | test support | `testing` (hidden) | the layer harness, one RNG, one tolerance, the benches |
//! | C ABI | [`capi`] | `amoe_*` exports behind `include/ascend_moe.h` (the Python package uses them) |
//!
//! Each layer imports only the ones listed above it (a
//! test, `tests/layering.rs`, parses the `use` paths of `src/` and fails on
//! any module cycle).
//!
//! ## Quick start
//!
//! The fused finalize on the CPU, then an all-reduce over two ranks that are
//! threads of this process (separate processes work the same way, with
//! [`backend::cpu::CpuComm`]'s rendezvous by name):
//!
//! ```
//! use ascend_moe::ranks::run_ranks;
//! use ascend_moe::backend::FinalizeArgs;
//! use ascend_moe::moe::moe_finalize_routing;
//! use ascend_moe::{Collectives, CommOptions, DType, Device, DropPadMode, ReduceOp, Tensor};
//!
//! // 2 tokens, top-2, hidden size 2, row index layout: out[i] = sum_k s(i,k) * x[idx[2i + k]].
//! let x = Tensor::from_slice(&[1.0f32, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0], &[4, 2])?;
//! let idx = Tensor::from_slice(&[0i32, 1, 2, 3], &[4])?;
//! let scales = Tensor::from_slice(&[0.5f32, 0.5, 1.0, 1.0], &[2, 2])?;
//! let args = FinalizeArgs {
//!     expanded_x: &x,
//!     expanded_row_idx: &idx,
//!     x1: None,
//!     x2: None,
//!     bias: None,
//!     scales: Some(&scales),
//!     expert_idx: None,
//!     drop_pad_mode: DropPadMode::DropLessRow,
//! };
//! let out = moe_finalize_routing(&args)?;
//! assert_eq!(out.shape(), &[2, 2]);
//! assert_eq!(out.to_vec::<f32>()?, vec![1.5, 1.5, 7.0, 7.0]);
//!
//! // Every rank contributes rank + 1; the sum lands on both.
//! let sums = run_ranks(2, &CommOptions::default(), |rank, comm| {
//!     let mine = Tensor::from_slice(&[rank as f32 + 1.0; 4], &[4])?;
//!     let mut sum = Tensor::zeros(&[4], DType::F32, &Device::cpu())?;
//!     comm.all_reduce(&mine, &mut sum, ReduceOp::Sum)?;
//!     sum.to_vec::<f32>()
//! })?;
//! assert_eq!(sums, vec![vec![3.0f32; 4]; 2]);
//! # Ok::<(), ascend_moe::Error>(())
//! ```

#![warn(missing_docs)]

pub mod backend;
pub mod capi;
pub mod comm;
pub mod device;
pub mod error;
mod fork;
pub mod moe;
pub mod ops;
pub mod ranks;
pub mod tensor;
#[doc(hidden)]
pub mod testing;
pub mod types;

pub use backend::DropPadMode;
pub use comm::{Collectives, Comm, CommOptions, CommType, ReduceOp};
pub use device::Device;
pub use error::{CommErrorKind, Error, Result};
pub use moe::{ReducePolicy, SharedMode, SpLayout};
pub use tensor::Tensor;
pub use types::{DType, Element};

#[doc(hidden)]
pub use half;
