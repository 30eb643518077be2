//! The leaf of the crate: basic types that every layer shares and that import
//! nothing of the crate (only `std`, `half`, `bytemuck`).
//!
//! | item | what |
//! |---|---|
//! | [`DType`], [`Element`], [`with_dtype!`](crate::with_dtype) | element types |
//! | [`Numbered`], [`Variant`], `numbered!` | enums whose numbers the C ABI and Python share, each number written once |
//! | [`ReduceOp`] | reduction operators of the collectives |
//! | [`DropPadMode`] | drop-pad modes of the finalize op (SPEC section 1) |
//! | [`TensorMeta`] | shape + dtype without data (the input of shape functions) |
//! | [`FinalizeDims`], [`OutputRows`] | sizes and output placement of a validated finalize |
//! | [`CommOptions`] | communicator options (timeouts) |
//!
//! Data tensors are `f32`, `f16` or `bf16`; index tensors are `i32`; `i64` is
//! supported by the collectives. Arithmetic on data always accumulates in `f32`
//! and rounds once (round-to-nearest-even) to the output type.
//!
//! The one-byte dtypes `i8`, `u8`, `bool`, `f8e4m3` and `f8e5m2` (packed fp4
//! travels as `u8`) carry quantized hidden states and masks: data movement
//! (all-gather, all-to-all, broadcast and the SP/DP gathers) moves them as exact
//! bytes; reductions refuse them ([`DType::is_reducible`]).

mod comm_options;
mod dtype;
mod enums;
mod env;
mod meta;
mod numbering;

pub use comm_options::CommOptions;
pub use dtype::{Bool, DType, Element, F8E4M3, F8E5M2};
pub use enums::{DropPadMode, ReduceOp};
pub use env::env_switch_setting;
pub(crate) use env::{env_setting, env_switch};
pub use meta::{FinalizeDims, OutputRows, TensorMeta};
pub(crate) use numbering::numbered;
pub use numbering::{Numbered, UnknownValue, Variant};
