//! # ascend-moe
//!
//! One correct, fast, tested implementation of the Mixture-of-Experts
//! communication and finalize layer for Huawei Ascend NPUs, with a CPU fallback
//! that runs the same multi-rank test matrix anywhere.
//!
//! | layer | module | what it holds |
//! |---|---|---|
//! | raw bindings | `acl-sys`, `hccl-sys` | CANN ACL / HCCL symbols, loaded at run time |
//! | backends | [`backend`] | [`Device`], the [`backend::Backend`] trait, CPU and NPU implementations |
//! | native kernel | [`kernels`] | tiling and host runner of the Ascend C finalize kernel in `kernels/` |
//! | communication | [`comm`] | [`Comm`], [`Collectives`], [`ReduceOp`], [`CommType`] |
//! | basic types (leaf) | [`types`] | [`DType`], [`Element`], [`ReduceOp`], [`DropPadMode`], shapes and metas, [`CommOptions`] |
//! | tensors | [`tensor`] | [`Tensor`] |
//! | errors | [`error`] | [`Error`], [`Result`] |
//! | MoE ops | [`moe`] | finalize, SP layout, pad/reduce, runtime-aware reductions, prepare/finalize |
//! | C ABI | [`capi`] | `amoe_*` exports behind `include/ascend_moe.h` (the Python package uses them) |

#![warn(missing_docs)]

pub mod backend;
pub mod capi;
pub mod comm;
pub mod error;
pub mod kernels;
pub mod moe;
pub mod tensor;
pub mod types;

pub use backend::{Device, DropPadMode};
pub use comm::{Collectives, Comm, CommOptions, CommType, ReduceOp};
pub use error::{CommErrorKind, Error, Result};
pub use moe::{ReducePolicy, SharedMode, SpLayout};
pub use tensor::Tensor;
pub use types::{DType, Element};

#[doc(hidden)]
pub use half;
