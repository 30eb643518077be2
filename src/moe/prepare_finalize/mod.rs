//! Prepare / finalize of the token dimension for every MoE comm type
//! (SPEC section 6), and the token exchange (dispatch / combine) that the MC2
//! and ALLTOALL paths use.
//!
//! | comm type | SP | prepare | finalize |
//! |---|---|---|---|
//! | ALLGATHER | on | [`maybe_all_gather_and_maybe_unpad`](crate::moe::maybe_all_gather_and_maybe_unpad) | [`maybe_pad_and_reduce`](crate::moe::maybe_pad_and_reduce) |
//! | ALLGATHER | off | pad to `max_d T_d`, DP all-gather | DP reduce-scatter, keep `T_d` rows |
//! | MC2, FUSED_MC2 | off | pad to `padded_num_tokens` (default `ceil_to(max_d T_d, TP)`), equal TP split, `mc2_mask` | TP all-gather, keep `T_d` rows |
//! | ALLTOALL | off | pad to TP rows only when `T_d < TP`, uneven TP split | TP all-gather, keep `T_d` rows |
//! | MC2, FUSED_MC2, ALLTOALL | on | none (tokens already sharded) | none |
//!
//! On the CPU backend MC2 / FUSED_MC2 / ALLTOALL dispatch and combine are the
//! same exchange over the EP group done with `all_to_all_v` ([`dispatch`],
//! [`combine`]); the combine's weighted sum is the finalize op in drop-pad row
//! mode. The comm type is a run-time argument of every function here.

mod exchange;
mod groups;
mod plan;
mod prepare;

pub use exchange::{combine, dispatch, Dispatched};
pub use groups::{check_comm_type_agreement, MoeGroups};
pub(crate) use groups::{comm_type_agreement, comm_type_check_enabled, Facts};
pub(crate) use plan::finalize_shape_and_dtype;
pub use plan::{
    finalize_dtype, finalize_output_shape, mc2_mask, mc2_mask_extent, prepare_output_shape, token_plan, MoeContext,
    TokenPlan,
};
pub use prepare::{
    finalize, finalize_into, mc2_mask_into, prepare, prepare_into, prepare_tokens_into, prepare_with_mask,
    prepare_with_mask_into, Prepared,
};
pub(crate) use prepare::{refuse_first, refuse_unread, Stage};
