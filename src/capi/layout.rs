//! The SP layout of DP token counts (SPEC section 2, `moe::layout`).

use super::ffi::{ffi, read_sizes, try_out, write_out, write_slice, Failure};
use super::types::amoe_status;
use crate::moe::SpLayout;

/// The SP layout of DP token counts (SPEC section 2):
/// `local_sizes[d * tp_size + t] = ceil(dp_tokens[d] / tp_size)`.
/// Writes `n * tp_size` entries to the caller-owned `out` (`cap` entries) and
/// the count to `*out_len`; when `cap` is too small only `*out_len` is written
/// and `AMOE_STATUS_BUFFER_TOO_SMALL` returned.
///
/// # Safety
/// `dp_tokens` readable for `n`; `out` writable for `cap`; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_sp_layout_from_dp_tokens(
    dp_tokens: *const usize,
    n: usize,
    tp_size: usize,
    out: *mut usize,
    cap: usize,
    out_len: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_sp_layout_from_dp_tokens";
    ffi!(F, {
        let dp = read_sizes(F, "dp_tokens", dp_tokens, n)?;
        write_layout(F, out, cap, out_len, SpLayout::from_dp_tokens(&dp, tp_size))
    })
}

/// The SP layout with prefill context parallelism (SPEC section 2): EP rank
/// order is DP x PCP x TP, and `local_sizes[(d * pcp_size + p) * tp_size + t]
/// = ceil(dp_tokens[d] / tp_size)`. Writes `n * pcp_size * tp_size` entries to
/// the caller-owned `out` (`cap` entries) and the count to `*out_len`; when
/// `cap` is too small only `*out_len` is written and
/// `AMOE_STATUS_BUFFER_TOO_SMALL` returned. `pcp_size` 1 gives the layout of
/// `amoe_sp_layout_from_dp_tokens`.
///
/// # Safety
/// `dp_tokens` readable for `n`; `out` writable for `cap`; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_sp_layout_from_dp_tokens_pcp(
    dp_tokens: *const usize,
    n: usize,
    pcp_size: usize,
    tp_size: usize,
    out: *mut usize,
    cap: usize,
    out_len: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_sp_layout_from_dp_tokens_pcp";
    ffi!(F, {
        let dp = read_sizes(F, "dp_tokens", dp_tokens, n)?;
        write_layout(F, out, cap, out_len, SpLayout::from_dp_tokens_pcp(&dp, pcp_size, tp_size))
    })
}

/// Writes the layout `built` (the Rust API's, which bounds its entries by
/// `AMOE_MAX_EP_RANKS` before it allocates them) to `out`: its length to
/// `*out_len`, then its entries when `cap` holds them. A layout the Rust API
/// refuses writes nothing, so the size asked for is always one the call
/// then fills.
fn write_layout(
    f: &'static str,
    out: *mut usize,
    cap: usize,
    out_len: *mut usize,
    built: crate::Result<SpLayout>,
) -> Result<(), Failure> {
    let out_len = try_out!(f, out_len, "out_len");
    let l = built?;
    let sizes = l.local_sizes();
    write_out(out_len, sizes.len());
    if cap < sizes.len() {
        return Err(Failure::new(
            amoe_status::BufferTooSmall,
            format!("{f}: `out` holds {cap} entries, the layout has {}", sizes.len()),
        ));
    }
    write_slice(try_out!(f, out, "out"), sizes);
    Ok(())
}
