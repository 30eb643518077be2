//! opapi exports: `aclnnMoeFinalizeRoutingV2`, `aclnnMoeTokenUnpermute` and
//! `aclnnAdd`, each as the two-phase pair (`...GetWorkspaceSize`, then the op
//! on a stream).
//!
//! Phase 1 validates shapes and dtypes and snapshots the tensor descriptions
//! into an executor (an [`Op`], in the table of `executor`); phase 2
//! (`launch`) checks the workspace and queues the computation on the
//! stream, which reads and writes the device arena when it runs. Each
//! operator file implements [`Op`] and uses those modules, not this one.
//! Arithmetic is SPEC.md section 1's in f32, rounded once to the output type,
//! but not in SPEC's order: `sum::blocked_sum` adds the experts' terms in pairs
//! from the last, and finalize adds that sum to `x1 + x2` last. An index outside its valid range fails
//! the stream task as a trap of the kernel (`ACL_ERROR_RT_AICORE_EXCEPTION`,
//! 507015), reported by the next synchronisation, and nothing is read out of
//! bounds.

#![allow(non_snake_case, clippy::missing_safety_doc)]

mod add;
mod executor;
mod finalize;
mod launch;
mod sum;
mod tensors;
mod unpermute;

pub use add::{aclnnAdd, aclnnAddGetWorkspaceSize, Add};
pub use executor::{Op, EXECUTORS, MOE_WORKSPACE};
pub use finalize::{aclnnMoeFinalizeRoutingV2, aclnnMoeFinalizeRoutingV2GetWorkspaceSize, Finalize};
pub use launch::WORKSPACE_SCRIBBLE;
pub use unpermute::{aclnnMoeTokenUnpermute, aclnnMoeTokenUnpermuteGetWorkspaceSize, Unpermute};
