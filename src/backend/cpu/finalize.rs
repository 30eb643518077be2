//! CPU finalize-routing and token-unpermute kernels.

use crate::backend::{FinalizeArgs, FinalizeDims, OutputRows};
use crate::{Error, Result, Tensor};

/// Fused finalize routing on the host (SPEC section 1).
pub fn finalize_routing(
    _args: &FinalizeArgs<'_>,
    _dims: &FinalizeDims,
    _out: &mut Tensor,
    _rows: OutputRows<'_>,
) -> Result<()> {
    Err(Error::invalid("moe_finalize_routing", "backend", "the CPU finalize kernel is not built yet"))
}

/// Token unpermute on the host.
pub fn token_unpermute(
    _permuted: &Tensor,
    _sorted_indices: &Tensor,
    _probs: Option<&Tensor>,
    _k: usize,
    _out: &mut Tensor,
) -> Result<()> {
    Err(Error::invalid("moe_token_unpermute", "backend", "the CPU unpermute kernel is not built yet"))
}
