//! The native finalize kernel (`kernels/finalize_kernel.cpp`, Ascend C): its
//! tiling, its launch checks and a host runner.
//!
//! The same kernel source is built twice by `build.rs`: for the host against
//! the real Ascend C headers in CPU-debug mode, over the host model of
//! `kernels/host_model/` (unified-buffer capacity and alignment, MTE burst
//! limits, queue discipline and the ordering of the asynchronous pipes), and
//! for the AI Core when CANN is installed. This module
//!
//! - computes the [`FinalizeTiling`] (the `#[repr(C)]` mirror of
//!   `kernels/finalize_tiling.h`, in [`abi`]) from the op's sizes, dtypes and
//!   flags ([`tiling`]),
//! - runs the host build on host tensors, every block in turn
//!   ([`finalize_host`]), which is what the tests compare bit for bit with a
//!   plain f32 reference,
//! - exposes the host entry ([`host_entry`]) with the signature of the
//!   simulated runtime's `cannsim_kernel_entry`, the AI Core library
//!   ([`NpuKernelLib`], in [`library`]), and the status decoding
//!   ([`check_status`], in [`status`]) a device launch needs.
//!
//! Global-memory arguments are passed as an array of [`GM_COUNT`] pointers in
//! the order of the `GM_*` constants. Every core writes a status record of
//! [`STATUS_WORDS`] words; an out-of-range index is reported there (never
//! dereferenced) and becomes an [`Error::IndexOutOfRange`].

#[cfg(test)]
use std::ffi::c_void;

#[cfg(test)]
use crate::backend::cpu::CpuBuffer;
use crate::backend::{FinalizeArgs, OutputRows};
#[cfg(test)]
use crate::backend::{FinalizeDims, View, ViewMut};
use crate::types::TensorMeta;
use crate::{DType, DropPadMode, Error, Result};

pub(crate) mod abi;
pub(crate) mod copy;
pub(crate) mod guard;
pub(crate) mod library;
mod status;
mod tiling;

#[cfg(test)]
mod copy_tests;
#[cfg(test)]
mod finalize_tests;
#[cfg(test)]
mod guard_tests;
#[cfg(test)]
mod tiling_tests;

pub(crate) use abi::*;
pub(crate) use library::*;
pub(crate) use status::check_status;
pub(crate) use tiling::{finalize_tiling, slot_offsets, TilingParams};

const OP: &str = FINALIZE_OP;

fn expect_dtype(t: TensorMeta<'_>, arg: &'static str, want: DType) -> Result<()> {
    if t.dtype != want {
        return Err(Error::dtype(OP, arg, want.name(), t.dtype));
    }
    Ok(())
}

fn expect_len(t: TensorMeta<'_>, arg: &'static str, what: &str, want: u64) -> Result<()> {
    if t.numel() as u64 != want {
        return Err(Error::shape(OP, arg, format!("{want} elements ({what})"), t.shape));
    }
    Ok(())
}

fn check_optional(
    t: Option<TensorMeta<'_>>,
    flag: bool,
    arg: &'static str,
    dtype: DType,
    what: &str,
    len: u64,
) -> Result<()> {
    match (t, flag) {
        (None, false) => Ok(()),
        (Some(t), true) => {
            expect_dtype(t, arg, dtype)?;
            expect_len(t, arg, what, len)
        }
        (Some(_), false) => Err(Error::invalid(OP, arg, "given, but the tiling says it is absent")),
        (None, true) => Err(Error::invalid(OP, arg, "absent, but the tiling says it is given")),
    }
}

#[cfg(test)]
fn host_ptr(t: Option<View<'_, CpuBuffer>>) -> *mut c_void {
    match t {
        Some(t) => t.bytes().as_ptr() as *mut c_void,
        None => std::ptr::null_mut(),
    }
}

/// Runs the host build of the kernel on host tensors, planning the tiling for
/// the 910B unified buffer and `block_dim` cores. `out` is `[N, H]` for
/// [`OutputRows::Dense`] or `[slots * slot_rows, H]` for
/// [`OutputRows::Padded`] (whose padding rows are written with zeros).
///
/// Index values are checked by the kernel: an out-of-range one yields
/// [`Error::IndexOutOfRange`] (the output is then unspecified).
#[cfg(test)]
pub(crate) fn finalize_host(
    args: &FinalizeArgs<View<'_, CpuBuffer>>,
    dims: &FinalizeDims,
    out: ViewMut<'_, CpuBuffer>,
    rows: OutputRows<'_>,
    block_dim: u32,
) -> Result<()> {
    let tiling = finalize_tiling(&TilingParams::from_args(&args.metas(), dims, rows, block_dim, UB_BYTES_910B))?;
    finalize_host_with_tiling(args, out, rows, &tiling)
}

/// Checks a launch before it happens, on any device: the tiling's geometry
/// against itself, and every tensor's dtype and element count against the
/// tiling's sizes and flags, so the kernel cannot address memory outside the
/// tensors. The tile size and its unified-buffer footprint are not checked:
/// the hardware (and the host simulation) enforces those. A device launch
/// calls this, then passes the tensors' device pointers in `GM_*` order, the
/// [`slot_offsets`] for padded output, and a status buffer of
/// [`FinalizeTiling::status_words`] words filled with [`STATUS_NOT_RUN`]
/// (bytes `0xFF`), and decodes the status with [`check_status`].
pub(crate) fn check_launch(
    args: &FinalizeArgs<TensorMeta<'_>>,
    out: TensorMeta<'_>,
    rows: OutputRows<'_>,
    tiling: &FinalizeTiling,
) -> Result<()> {
    let t = tiling;
    tiling::check_geometry(t)?;
    if t.flags & FLAG_CHECK_INDICES != 0 {
        return check_index_launch(args, out, rows, t);
    }
    let data = DType::from_u32(t.data_dtype)
        .filter(|d| d.is_float())
        .ok_or_else(|| Error::invalid(OP, "tiling", format!("data dtype {} is not f32/f16/bf16", t.data_dtype)))?;
    let scales_dtype = DType::from_u32(t.scales_dtype)
        .ok_or_else(|| Error::invalid(OP, "tiling", format!("scales dtype {}", t.scales_dtype)))?;
    if DropPadMode::from_u32(t.mode) != Some(args.drop_pad_mode) {
        return Err(Error::invalid(
            OP,
            "tiling",
            format!("mode {} but drop_pad_mode {}", t.mode, args.drop_pad_mode as u32),
        ));
    }
    let (n, k, h) = (u64::from(t.n), u64::from(t.k), u64::from(t.h));
    expect_dtype(args.expanded_x, "expanded_x", data)?;
    expect_len(args.expanded_x, "expanded_x", "expanded_rows * h", u64::from(t.expanded_rows) * h)?;
    expect_dtype(args.expanded_row_idx, "expanded_row_idx", DType::I32)?;
    expect_len(args.expanded_row_idx, "expanded_row_idx", "n * k", n * k)?;
    check_optional(args.x1, t.flags & FLAG_X1 != 0, "x1", data, "n * h", n * h)?;
    check_optional(args.x2, t.flags & FLAG_X2 != 0, "x2", data, "n * h", n * h)?;
    let has_bias = t.flags & FLAG_BIAS != 0;
    check_optional(args.bias, has_bias, "bias", data, "experts * h", u64::from(t.experts) * h)?;
    check_optional(args.expert_idx, has_bias, "expert_idx", DType::I32, "n * k", n * k)?;
    check_optional(args.scales, t.flags & FLAG_SCALES != 0, "scales", scales_dtype, "n * k", n * k)?;
    expect_dtype(out, "out", data)?;
    expect_len(out, "out", "out_rows * h", u64::from(t.out_rows) * h)?;
    match rows {
        OutputRows::Dense if t.padded() => {
            Err(Error::invalid(OP, "rows", "dense output, but the tiling is for the padded buffer"))
        }
        OutputRows::Padded { local_sizes, slot_rows }
            if !t.padded() || local_sizes.len() != t.slots as usize || slot_rows != t.slot_rows as usize =>
        {
            Err(Error::invalid(OP, "rows", "padded layout does not match the tiling"))
        }
        _ => Ok(()),
    }
}

/// [`check_launch`] of a [`FLAG_CHECK_INDICES`] launch: the index tensors and
/// the int32 output of [`checked_indices_len`] elements.
fn check_index_launch(
    args: &FinalizeArgs<TensorMeta<'_>>,
    out: TensorMeta<'_>,
    rows: OutputRows<'_>,
    t: &FinalizeTiling,
) -> Result<()> {
    if t.flags & (FLAG_PADDED_OUT | FLAG_SKIP_INVALID_ROWS) != 0 || !matches!(rows, OutputRows::Dense) {
        return Err(Error::invalid(OP, "tiling", "the index check has a dense output and checks every row index"));
    }
    let nk = u64::from(t.n) * u64::from(t.k);
    expect_dtype(args.expanded_row_idx, "expanded_row_idx", DType::I32)?;
    expect_len(args.expanded_row_idx, "expanded_row_idx", "n * k", nk)?;
    let has_bias = t.flags & FLAG_BIAS != 0;
    check_optional(args.expert_idx, has_bias, "expert_idx", DType::I32, "n * k", nk)?;
    expect_dtype(out, "out", DType::I32)?;
    expect_len(out, "out", "the checked indices", checked_indices_len(nk as usize, has_bias) as u64)
}

/// [`finalize_host`] with a given tiling, checked by [`check_launch`]: a
/// tiling that would break the hardware's rules (tile alignment, unified-buffer
/// capacity) is caught by the host simulation and returned as
/// [`Error::Kernel`].
#[cfg(test)]
pub(crate) fn finalize_host_with_tiling(
    args: &FinalizeArgs<View<'_, CpuBuffer>>,
    mut out: ViewMut<'_, CpuBuffer>,
    rows: OutputRows<'_>,
    tiling: &FinalizeTiling,
) -> Result<()> {
    let t = tiling;
    check_launch(&args.metas(), out.meta(), rows, t)?;
    let offsets = slot_offsets(rows)?;
    let entry = host_entry().ok_or_else(host_unavailable)?;
    let mut status = vec![STATUS_NOT_RUN; t.status_words()];
    let mut gm = [std::ptr::null_mut::<c_void>(); GM_COUNT];
    gm[GM_EXPANDED_X] = host_ptr(Some(args.expanded_x));
    gm[GM_ROW_IDX] = host_ptr(Some(args.expanded_row_idx));
    gm[GM_X1] = host_ptr(args.x1);
    gm[GM_X2] = host_ptr(args.x2);
    gm[GM_BIAS] = host_ptr(args.bias);
    gm[GM_SCALES] = host_ptr(args.scales);
    gm[GM_EXPERT_IDX] = host_ptr(args.expert_idx);
    gm[GM_OUT] = out.bytes_mut().as_mut_ptr() as *mut c_void;
    gm[GM_SLOT_OFFSETS] = if offsets.is_empty() { std::ptr::null_mut() } else { offsets.as_ptr() as *mut c_void };
    gm[GM_STATUS] = status.as_mut_ptr() as *mut c_void;
    for block in 0..t.block_dim {
        // SAFETY: every pointer in `gm` is a live host buffer of at least the
        // size the kernel derives from `t` (checked above, element for element),
        // or NULL where the tiling's flags say the input is absent; the kernel
        // only reads the inputs and writes `out` and `status`, which are
        // exclusively borrowed here; `t` is a valid `AmoeFinalizeTiling`.
        unsafe { entry(block, t.block_dim, gm.as_ptr(), (t as *const FinalizeTiling).cast()) };
    }
    check_status(&status, t)
}
