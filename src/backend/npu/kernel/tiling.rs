//! Planning a launch: the tiling of a finalize call (H tiles that fit the
//! unified buffer, rows split over the cores), the padded output's slot
//! offsets, and the geometry check every launch passes first.

use super::abi::FINALIZE_OP as OP;
use super::abi::*;
use crate::backend::{FinalizeArgs, FinalizeDims, OutputRows};
use crate::types::TensorMeta;
use crate::{DType, DropPadMode, Error, Result};

/// Everything [`finalize_tiling`] needs: sizes, dtypes, flags and the launch shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TilingParams<'a> {
    /// Validated sizes of the call.
    pub(crate) dims: FinalizeDims,
    /// Dtype of `expanded_x` (and of x1, x2, bias and the output).
    pub(crate) data: DType,
    /// Dtype of `scales`, `None` without scales.
    pub(crate) scales: Option<DType>,
    /// Drop-pad mode.
    pub(crate) mode: DropPadMode,
    /// `x1` is given.
    pub(crate) x1: bool,
    /// `x2` is given.
    pub(crate) x2: bool,
    /// `bias` and `expert_idx` are given.
    pub(crate) bias: bool,
    /// Dense output or the padded EP buffer.
    pub(crate) rows: OutputRows<'a>,
    /// Cores to spread the output rows over (at least 1; more than the rows is fine).
    pub(crate) block_dim: u32,
    /// Unified-buffer budget per core in bytes ([`UB_BYTES_910B`] on the 910B class).
    pub(crate) ub_bytes: usize,
}

impl<'a> TilingParams<'a> {
    /// The parameters of a finalize call, read off its arguments.
    pub(crate) fn from_args(
        args: &FinalizeArgs<TensorMeta<'_>>,
        dims: &FinalizeDims,
        rows: OutputRows<'a>,
        block_dim: u32,
        ub_bytes: usize,
    ) -> Self {
        TilingParams {
            dims: *dims,
            data: args.expanded_x.dtype,
            scales: args.scales.map(|s| s.dtype),
            mode: args.drop_pad_mode,
            x1: args.x1.is_some(),
            x2: args.x2.is_some(),
            bias: args.bias.is_some(),
            rows,
            block_dim,
            ub_bytes,
        }
    }
}

fn to_u32(arg: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::invalid(OP, arg, format!("{v} does not fit the kernel's 32-bit tiling")))
}

/// The tiling of a finalize launch: the largest H tile (a multiple of
/// [`TILE_ALIGN`]) whose buffers fit `ub_bytes`, and the split of the output
/// rows over `block_dim` cores.
pub(crate) fn finalize_tiling(p: &TilingParams<'_>) -> Result<FinalizeTiling> {
    let d = &p.dims;
    if p.block_dim == 0 {
        return Err(Error::invalid(OP, "block_dim", "at least one core is needed"));
    }
    if !p.data.is_float() {
        return Err(Error::dtype(OP, "expanded_x", "f32, f16 or bf16", p.data));
    }
    let scales_dtype = match p.scales {
        None => p.data,
        Some(s) if s == p.data || s == DType::F32 => s,
        Some(s) => return Err(Error::dtype(OP, "scales", format!("{} or f32", p.data), s)),
    };
    if d.k == 0 && d.n != 0 {
        return Err(Error::invalid(OP, "k", "top-k must be at least 1"));
    }
    let (slots, slot_rows, out_rows) = match p.rows {
        OutputRows::Dense => (1, d.n, d.n),
        OutputRows::Padded { local_sizes, slot_rows } => {
            let sum: usize = local_sizes.iter().sum();
            if sum != d.n {
                return Err(Error::invalid(
                    OP,
                    "local_sizes",
                    format!("they sum to {sum}, but the finalize has {} tokens", d.n),
                ));
            }
            if let Some((r, &s)) = local_sizes.iter().enumerate().find(|(_, &s)| s > slot_rows) {
                return Err(Error::invalid(
                    OP,
                    "local_sizes",
                    format!("rank {r} has {s} tokens, more than the {slot_rows} rows of a slot"),
                ));
            }
            let total = local_sizes
                .len()
                .checked_mul(slot_rows)
                .ok_or_else(|| Error::invalid(OP, "slot_rows", "slots * slot_rows overflows"))?;
            (local_sizes.len(), slot_rows, total)
        }
    };
    // Flat index positions and slot offsets travel as 32-bit values.
    to_u32("expanded_row_idx", d.n.saturating_mul(d.k))?;
    if i32::try_from(d.n).is_err() {
        return Err(Error::invalid(OP, "n", format!("{} tokens exceed the kernel's int32 offsets", d.n)));
    }

    let budget = p.ub_bytes.min(u32::MAX as usize);
    let per_tile_unit = ub_bytes(p.data, TILE_ALIGN) - 32;
    let max_units = budget.saturating_sub(32) / per_tile_unit;
    if max_units == 0 {
        return Err(Error::invalid(
            OP,
            "ub_bytes",
            format!("{} bytes of unified buffer cannot hold one {TILE_ALIGN}-element tile", p.ub_bytes),
        ));
    }
    let max_tile = max_units * TILE_ALIGN;
    let tile_h = max_tile.min(d.h.max(1).div_ceil(TILE_ALIGN) * TILE_ALIGN);
    let tiles = d.h.div_ceil(tile_h);
    let tail_h = if tiles == 0 { 0 } else { d.h - (tiles - 1) * tile_h };

    let mut flags = 0;
    if p.x1 {
        flags |= FLAG_X1;
    }
    if p.x2 {
        flags |= FLAG_X2;
    }
    if p.bias {
        flags |= FLAG_BIAS;
    }
    if p.scales.is_some() {
        flags |= FLAG_SCALES;
    }
    if matches!(p.rows, OutputRows::Padded { .. }) {
        flags |= FLAG_PADDED_OUT;
    }
    let out_rows = to_u32("out", out_rows)?;
    Ok(FinalizeTiling {
        magic: TILING_MAGIC,
        n: to_u32("n", d.n)?,
        k: to_u32("k", d.k)?,
        h: to_u32("h", d.h)?,
        expanded_rows: to_u32("expanded_x", d.expanded_rows)?,
        experts: to_u32("bias", d.experts)?,
        data_dtype: p.data as u32,
        scales_dtype: scales_dtype as u32,
        mode: p.mode as u32,
        flags,
        block_dim: p.block_dim,
        out_rows,
        slots: to_u32("local_sizes", slots)?,
        slot_rows: to_u32("slot_rows", slot_rows)?,
        tile_h: to_u32("tile_h", tile_h)?,
        tiles: to_u32("tiles", tiles)?,
        tail_h: to_u32("tail_h", tail_h)?,
        rows_per_core: out_rows / p.block_dim,
        rows_rem: out_rows % p.block_dim,
        ub_bytes: to_u32("ub_bytes", ub_bytes(p.data, tile_h))?,
    })
}

/// The int32 `[slots + 1]` prefix sums of `local_sizes` the padded kernel
/// reads (empty for dense output).
pub(crate) fn slot_offsets(rows: OutputRows<'_>) -> Result<Vec<i32>> {
    match rows {
        OutputRows::Dense => Ok(Vec::new()),
        OutputRows::Padded { local_sizes, .. } => {
            let mut v = Vec::with_capacity(local_sizes.len() + 1);
            let mut acc = 0usize;
            v.push(0);
            for &s in local_sizes {
                acc += s;
                v.push(i32::try_from(acc).map_err(|_| Error::invalid(OP, "local_sizes", "more than 2^31 tokens"))?);
            }
            Ok(v)
        }
    }
}

/// Checks the geometry fields of a tiling against each other, so that any
/// tiling that passes keeps every kernel access inside the buffers whose sizes
/// [`finalize_host_with_tiling`] checks. The tile size and its fit in the
/// unified buffer are deliberately not checked here: the hardware (and the host
/// simulation) is what enforces those.
pub(super) fn check_geometry(t: &FinalizeTiling) -> Result<()> {
    let bad = |why: String| Err(Error::invalid(OP, "tiling", why));
    if t.magic != TILING_MAGIC {
        return bad(format!("magic {:#x}, expected {TILING_MAGIC:#x}", t.magic));
    }
    if t.block_dim == 0 {
        return bad("block_dim is 0".into());
    }
    let covered = u64::from(t.rows_per_core) * u64::from(t.block_dim) + u64::from(t.rows_rem);
    if covered != u64::from(t.out_rows) || t.rows_rem >= t.block_dim {
        return bad(format!(
            "{} cores x {} rows + {} do not split {} output rows",
            t.block_dim, t.rows_per_core, t.rows_rem, t.out_rows
        ));
    }
    if t.h != 0 {
        let tiled = u64::from(t.tiles.saturating_sub(1)) * u64::from(t.tile_h) + u64::from(t.tail_h);
        if t.tile_h == 0 || t.tiles == 0 || t.tail_h == 0 || t.tail_h > t.tile_h || tiled != u64::from(t.h) {
            return bad(format!("{} tiles of {} (tail {}) do not cover h = {}", t.tiles, t.tile_h, t.tail_h, t.h));
        }
    } else if t.tiles != 0 {
        return bad("tiles over an empty row".into());
    }
    if t.padded() {
        if u64::from(t.slots) * u64::from(t.slot_rows) != u64::from(t.out_rows) {
            return bad(format!("{} slots x {} rows != {} output rows", t.slots, t.slot_rows, t.out_rows));
        }
    } else if t.out_rows != t.n {
        return bad(format!("dense output of {} rows for {} tokens", t.out_rows, t.n));
    }
    Ok(())
}
