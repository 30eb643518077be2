//! The MoE ops of SPEC.md, written once against the [`crate::backend::Backend`]
//! trait and the [`crate::Collectives`] trait, so every backend runs them.
//!
//! Every op sizes its output with its own `*_output_shape` function; the
//! shape-only variants (`*_shape`) take shapes and dtypes and are what the C ABI
//! exports for meta / fake implementations. The MoE comm type is always a
//! run-time argument.
//!
//! # API
//!
//! | SPEC | function | shape function |
//! |---|---|---|
//! | 1 | [`finalize::moe_finalize_routing`]`(&FinalizeArgs) -> Result<Tensor>` | [`finalize::moe_finalize_routing_output_shape`]`(&FinalizeArgs) -> Result<(Vec<usize>, FinalizeDims)>`, [`finalize::moe_finalize_routing_shape`]`(&FinalizeMeta)` |
//! | 1 | [`finalize::moe_token_unpermute`]`(permuted, sorted_indices, probs: Option<&Tensor>)` | [`finalize::moe_token_unpermute_output_shape`], [`finalize::moe_token_unpermute_shape`]`(TensorMeta, TensorMeta, Option<TensorMeta>)` |
//! | 2 | [`layout::SpLayout`]`::{new(&[usize]), from_dp_tokens(&[usize], tp_size)}` | `local_sizes()`, `max_rows()`, `total_rows()`, `offsets()` |
//! | 3 | [`pad_reduce::maybe_pad_and_reduce`]`(x, Option<&SpLayout>, ep)` | [`pad_reduce::maybe_pad_and_reduce_output_shape`]`(x_shape, layout, ep_rank, ep_size)` |
//! | 4 | [`pad_reduce::maybe_all_gather_and_maybe_unpad`]`(x, Option<&SpLayout>, ep)` | [`pad_reduce::maybe_all_gather_and_maybe_unpad_output_shape`] |
//! | 1+3 | [`pad_reduce::finalize_and_reduce`]`(&FinalizeArgs, Option<&SpLayout>, ep)` | [`pad_reduce::finalize_and_reduce_output_shape`], [`pad_reduce::finalize_and_reduce_shape`]`(&FinalizeMeta, ..)` |
//! | 5 | [`reduce::routed_is_reduced`]`(CommType, sp)`, [`reduce::ReducePolicy`]`::new(SharedMode, has_routed_transform, sp, tp_size, ep_size)` | identity |
//! | 5 | `ReducePolicy::{reduce_routed_early, reduce_shared, reduce_final}(x: Tensor, CommType, tp)` | identity |
//! | 5 | [`shared::shared_pad_split`]`(x, tp)`, [`shared::shared_gather_unpad`]`(x, num_tokens, tp)`, [`shared::shared_pad_reduce_scatter`]`(x, tp)` | [`shared::shared_pad_split_output_shape`], [`shared::shared_gather_unpad_output_shape`], [`shared::shared_pad_reduce_scatter_output_shape`] |
//! | 6 | [`prepare_finalize::prepare`], [`prepare_finalize::finalize`], [`prepare_finalize::dispatch`], [`prepare_finalize::combine`] | [`prepare_finalize::prepare_output_shape`], [`prepare_finalize::finalize_output_shape`] |
//!
//! `testing::layer` is the end-to-end MoE layer harness (`run_layer_case`,
//! `all_layer_cases`) used by the tests and by `ascend-moe check`.
//!
//! ```
//! use ascend_moe::backend::FinalizeArgs;
//! use ascend_moe::moe::{moe_finalize_routing, moe_finalize_routing_output_shape};
//! use ascend_moe::{DropPadMode, Tensor};
//!
//! // Two tokens, top-2, H = 2, row layout: out[i] = sum_k scales[i,k] * x[idx[i*2 + k]].
//! let x = Tensor::from_slice(&[1f32, 1., 2., 2., 3., 3., 4., 4.], &[4, 2])?;
//! let idx = Tensor::from_slice(&[3i32, 0, 1, 2], &[4])?;
//! let scales = Tensor::from_slice(&[0.5f32, 0.5, 1.0, 2.0], &[2, 2])?;
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
//! let (shape, _) = moe_finalize_routing_output_shape(&args)?;
//! let out = moe_finalize_routing(&args)?;
//! assert_eq!(out.shape(), shape.as_slice());
//! assert_eq!(out.to_vec::<f32>()?, vec![2.5, 2.5, 8.0, 8.0]);
//! # Ok::<(), ascend_moe::Error>(())
//! ```
//!
//! Collectives are taken as `&C` with `C: Collectives + ?Sized`, so a
//! [`crate::Comm`] of either backend works.

pub mod finalize;
pub mod layout;
pub mod live;
pub mod output;
pub mod pad_reduce;
pub mod prepare_finalize;
pub mod reduce;
pub mod shared;

pub use finalize::{
    moe_finalize_routing, moe_finalize_routing_into, moe_finalize_routing_output_shape, moe_finalize_routing_shape,
    moe_token_unpermute, moe_token_unpermute_into, moe_token_unpermute_output_shape, moe_token_unpermute_shape,
    FinalizeMeta, TensorMeta, UnpermuteDims,
};
pub use layout::SpLayout;
pub use live::{ForwardContext, LiveStream};
pub use output::Output;
pub use pad_reduce::{
    check_sp_layout_agreement, finalize_and_reduce, finalize_and_reduce_into, finalize_and_reduce_output_shape,
    finalize_and_reduce_shape, maybe_all_gather_and_maybe_unpad, maybe_all_gather_and_maybe_unpad_into,
    maybe_all_gather_and_maybe_unpad_output_shape, maybe_pad_and_reduce, maybe_pad_and_reduce_dtype,
    maybe_pad_and_reduce_into, maybe_pad_and_reduce_output_shape,
};
pub use reduce::{routed_is_reduced, ReducePoint, ReducePolicy, SharedMode};
