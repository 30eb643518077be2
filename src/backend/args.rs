//! Argument checks every backend and op shares: byte and element counts of
//! shapes, row-count changes of a shape, and the ranges of a row copy. They work on shapes and dtypes
//! ([`TensorMeta`]) only, so they sit below the backends and the tensors.

use crate::types::{DType, TensorMeta};
use crate::{Error, Result};

/// `Ok` when `shape` holds `expected` elements, else the `Error::Shape` of
/// a collective's buffer `arg` of the wrong length, `what` saying where the
/// count comes from (the same error on every communicator).
pub fn collective_len(op: &'static str, arg: &'static str, shape: &[usize], expected: usize, what: &str) -> Result<()> {
    if shape.iter().product::<usize>() != expected {
        return Err(Error::shape(op, arg, format!("{expected} elements ({what})"), shape));
    }
    Ok(())
}

/// Elements of `shape`, or an error naming `op` and `arg` when the product of
/// its non-zero dims overflows `usize`. Zero dims are skipped in that check, so
/// every partial product of the dims (row lengths, ...) fits too, also for
/// empty tensors.
pub fn checked_numel(op: &'static str, arg: &'static str, shape: &[usize]) -> Result<usize> {
    let span = span(shape, 1).ok_or_else(|| Error::shape(op, arg, "dims whose product fits in usize", shape))?;
    Ok(if shape.contains(&0) { 0 } else { span })
}

/// Bytes of a tensor of `shape` and `dtype`, or an error naming `op` and `arg`
/// when they (or those of its non-zero dims) exceed `isize::MAX`, the largest
/// possible allocation.
pub fn checked_bytes(op: &'static str, arg: &'static str, shape: &[usize], dtype: DType) -> Result<usize> {
    match span(shape, dtype.size()) {
        Some(b) if b <= isize::MAX as usize => Ok(if shape.contains(&0) { 0 } else { b }),
        _ => Err(Error::shape(op, arg, format!("dims whose size in bytes of {dtype} fits in isize"), shape)),
    }
}

/// `unit` times the product of the non-zero dims of `shape`, if it fits.
fn span(shape: &[usize], unit: usize) -> Option<usize> {
    shape.iter().try_fold(unit, |acc, &d| acc.checked_mul(d.max(1)))
}

/// Checks a row copy of `rows` rows from `src` row `src_row` to `dst` row
/// `dst_row`: same dtype and row length, ranges inside both tensors.
pub fn check_rows(
    op: &'static str,
    src: TensorMeta<'_>,
    src_row: usize,
    dst: TensorMeta<'_>,
    dst_row: usize,
    rows: usize,
) -> Result<()> {
    if src.dtype != dst.dtype {
        return Err(Error::dtype(op, "dst", src.dtype.name(), dst.dtype));
    }
    if src.row_len() != dst.row_len() {
        return Err(Error::shape(op, "dst", format!("rows of {} elements (as src)", src.row_len()), dst.shape));
    }
    for (arg, name, t, first) in [("src_row", "src", src, src_row), ("dst_row", "dst", dst, dst_row)] {
        // `first + rows` may not even be a number of rows.
        if first.checked_add(rows).map_or(true, |end| end > t.rows()) || t.shape.is_empty() {
            return Err(Error::invalid(
                op,
                arg,
                format!("{rows} rows from row {first} are outside {name} with {} rows", t.rows()),
            ));
        }
    }
    Ok(())
}

/// `shape` with dim 0 replaced by `rows`: the shape of `rows` rows of the
/// tensor `arg` of `op`. An error when its element count overflows.
pub fn with_rows(op: &'static str, arg: &'static str, shape: &[usize], rows: usize) -> Result<Vec<usize>> {
    let mut s = shape.to_vec();
    if let Some(d) = s.first_mut() {
        *d = rows;
    }
    checked_numel(op, arg, &s)?;
    Ok(s)
}
