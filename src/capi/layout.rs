//! The SP layout of DP token counts (SPEC section 2, `moe::layout`).

use super::ffi::{ffi, read_sizes, try_out, write_out, write_slice, Failure};
use super::types::amoe_status;
use crate::moe::layout::bounded_ep;
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
        let out_len = try_out!(F, out_len, "out_len");
        let dp = read_sizes(F, "dp_tokens", dp_tokens, n)?;
        // The layout has n * tp_size entries, at most AMOE_MAX_EP_RANKS:
        // checked before the caller is told a size to allocate, and the
        // caller's buffer before the layout is built.
        if tp_size == 0 {
            return Err(Failure::invalid(F, "tp_size", "expected >= 1, got 0"));
        }
        let need = bounded_ep(F, "tp_size", &[("dp_size", n), ("tp_size", tp_size)])?;
        write_out(out_len, need);
        if cap < need {
            return Err(Failure::new(
                amoe_status::BufferTooSmall,
                format!("{F}: `out` holds {cap} entries, the layout has {need}"),
            ));
        }
        let l = SpLayout::from_dp_tokens(&dp, tp_size)?;
        let sizes = l.local_sizes();
        write_slice(try_out!(F, out, "out"), sizes);
        Ok(())
    })
}
