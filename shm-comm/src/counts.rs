//! Checks of per-rank counts, shared by the public calls and the CPU backend.

use crate::{Error, Result};

/// `sum(counts)`, or an error naming `arg` when it overflows.
pub fn counts_sum(op: &'static str, arg: &'static str, counts: &[usize]) -> Result<usize> {
    counts
        .iter()
        .try_fold(0usize, |acc, &c| acc.checked_add(c))
        .ok_or_else(|| Error::invalid(op, arg, format!("{counts:?} sum past usize::MAX elements")))
}

/// An error naming `arg` unless it holds `expected` elements.
pub(crate) fn same_len(op: &'static str, arg: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(Error::invalid(op, arg, format!("holds {actual} elements, expected {expected}")));
    }
    Ok(())
}

/// An error naming `arg` unless `counts` has one entry per rank of `world`.
pub fn counts_len(op: &'static str, arg: &'static str, counts: &[usize], world: usize) -> Result<()> {
    if counts.len() != world {
        return Err(Error::invalid(op, arg, format!("has {} entries, expected one per rank ({world})", counts.len())));
    }
    Ok(())
}
