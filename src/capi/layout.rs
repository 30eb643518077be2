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
        let dp = read_sizes(F, "dp_tokens", dp_tokens, n)?;
        nonzero(F, "tp_size", tp_size)?;
        let factors = [("dp_size", n), ("tp_size", tp_size)];
        write_layout(F, "tp_size", &factors, out, cap, out_len, || SpLayout::from_dp_tokens(&dp, tp_size))
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
        nonzero(F, "pcp_size", pcp_size)?;
        nonzero(F, "tp_size", tp_size)?;
        let factors = [("dp_size", n), ("pcp_size", pcp_size), ("tp_size", tp_size)];
        write_layout(F, "pcp_size", &factors, out, cap, out_len, || {
            SpLayout::from_dp_tokens_pcp(&dp, pcp_size, tp_size)
        })
    })
}

fn nonzero(f: &'static str, arg: &'static str, v: usize) -> Result<(), Failure> {
    if v == 0 {
        return Err(Failure::invalid(f, arg, "expected >= 1, got 0"));
    }
    Ok(())
}

/// Writes the layout `build` makes, whose entries are the product of
/// `factors`, to `out`. The product is bounded by AMOE_MAX_EP_RANKS and
/// `*out_len` written before the layout is built, and the caller's buffer
/// checked before it is: a caller asking the size allocates nothing past
/// the bound, and a short buffer costs no layout.
///
/// # Safety
/// `out` writable for `cap` entries (or NULL, refused by name); `out_len`
/// writable or NULL (refused by name).
unsafe fn write_layout(
    f: &'static str,
    arg: &'static str,
    factors: &[(&'static str, usize)],
    out: *mut usize,
    cap: usize,
    out_len: *mut usize,
    build: impl FnOnce() -> crate::Result<SpLayout>,
) -> Result<(), Failure> {
    let out_len = try_out!(f, out_len, "out_len");
    let need = bounded_ep(f, arg, factors)?;
    write_out(out_len, need);
    if cap < need {
        return Err(Failure::new(
            amoe_status::BufferTooSmall,
            format!("{f}: `out` holds {cap} entries, the layout has {need}"),
        ));
    }
    let l = build()?;
    write_slice(try_out!(f, out, "out"), l.local_sizes());
    Ok(())
}
