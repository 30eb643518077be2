//! [`Output`]: where an op that reads `x` writes its result, with the
//! aliasing rule decided once: `out` may be `x` itself, and may not overlap it
//! otherwise.
//!
//! Safe Rust cannot lend one tensor as `&x` and `&mut out` at once, but two
//! tensors may still share memory when both borrow memory they do not own
//! (the C ABI lends the caller's `x` and `out` descriptors as two tensors).
//! [`Output::of`] looks at the bytes both tensors cover and picks the form;
//! every op that writes a caller's output takes the result of that one
//! decision.

use crate::tensor::Storage;
use crate::{Device, Error, Result, Tensor};

/// The output of an op over an input `x`.
#[derive(Debug)]
pub enum Output<'a> {
    /// `x` is read and then overwritten with the result: `x` and the output
    /// are one tensor.
    InPlace(&'a mut Tensor),
    /// `x` is only read; the result goes to `out`, which does not overlap `x`.
    Separate {
        /// The input.
        x: &'a Tensor,
        /// The output.
        out: &'a mut Tensor,
    },
}

/// The device bytes `[start, end)` of `t`'s storage, with the kind of memory
/// (host, or NPU ordinal) they are addresses of.
fn span(t: &Tensor) -> (Option<u32>, usize, usize) {
    match t.storage() {
        Storage::Cpu(b) => (None, b.as_ptr() as usize, b.as_ptr() as usize + t.len_bytes()),
        Storage::Npu(b) => (Some(b.device().ordinal()), b.as_ptr() as usize, b.as_ptr() as usize + t.len_bytes()),
    }
}

/// Whether `a` and `b` cover common bytes of the same memory.
pub(crate) fn overlaps(a: &Tensor, b: &Tensor) -> bool {
    let ((ak, as_, ae), (bk, bs, be)) = (span(a), span(b));
    ak == bk && as_ < be && bs < ae && a.len_bytes() > 0 && b.len_bytes() > 0
}

/// Checks that `out`, written by `op` while it reads `inputs`, covers none
/// of their bytes (an op whose rows are gathered from anywhere in its inputs
/// cannot be computed in place); an error names the input.
pub fn apart<'t>(
    op: &'static str,
    out: &Tensor,
    inputs: impl IntoIterator<Item = (&'static str, Option<&'t Tensor>)>,
) -> Result<()> {
    for (arg, t) in inputs {
        if t.is_some_and(|t| overlaps(t, out)) {
            return Err(Error::invalid(op, "out", format!("overlaps the input `{arg}`: pass memory apart from it")));
        }
    }
    Ok(())
}

impl<'a> Output<'a> {
    /// The form for `x` and `out`, which may cover the same memory: `out`
    /// over exactly the bytes of `x` is [`Output::InPlace`] (`x` is then
    /// read through `out`), an `out` overlapping part of `x` is an error naming
    /// both ranges, anything else [`Output::Separate`]. Checks neither shape
    /// nor device: the op does, for the form it gets.
    pub fn of(op: &'static str, x: &'a Tensor, out: &'a mut Tensor) -> Result<Self> {
        if !overlaps(x, out) {
            return Ok(Output::Separate { x, out });
        }
        let ((_, xs, xe), (_, os, oe)) = (span(x), span(out));
        if (xs, xe) == (os, oe) && x.dtype() == out.dtype() {
            return Ok(Output::InPlace(out));
        }
        Err(Error::invalid(
            op,
            "out",
            format!(
                "covers bytes {os:#x}..{oe:#x}, which overlap `x` ({xs:#x}..{xe:#x}) without being `x`: \
                 pass `x` itself for an in-place call, or memory apart from it"
            ),
        ))
    }

    /// The input.
    pub fn x(&self) -> &Tensor {
        match self {
            Output::InPlace(t) => t,
            Output::Separate { x, .. } => x,
        }
    }

    /// The tensor the result is written to.
    pub fn out(&mut self) -> &mut Tensor {
        match self {
            Output::InPlace(t) => t,
            Output::Separate { out, .. } => out,
        }
    }

    /// The device of the input.
    pub fn device(&self) -> Device {
        self.x().device()
    }
}
