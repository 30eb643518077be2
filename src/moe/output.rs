//! [`Output`]: where an op that reads `x` writes its result, with the
//! aliasing rule decided once: `out` may be `x` itself, and may not overlap it
//! otherwise.
//!
//! Safe Rust cannot lend one tensor as `&x` and `&mut out` at once, but two
//! tensors may still share memory when both borrow memory they do not own
//! (the C ABI lends the caller's `x` and `out` descriptors as two tensors).
//! [`Output::of`] looks at the bytes both tensors cover and picks the form;
//! every reduction point takes the result of that one decision. The ops
//! that gather rows from anywhere in their inputs (finalize, unpermute, the
//! SP and shared-expert ops) take an `out` over their inputs as well, on
//! every device: they read a copy of the input (`read_apart`) or write a
//! workspace result copied into `out` (`write_apart`), so the caller gets
//! what separate memory would get.

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

/// Has `write` put an op's result into `out` while the op reads `inputs`,
/// also when `out` covers bytes of them (the residual `x1` as `out`, an
/// `out` over `expanded_x`): the op's rows come from anywhere in its inputs,
/// so it then writes a workspace tensor of `out`'s shape on `out`'s device,
/// copied into `out` afterwards (one device copy, queued on the NPU). On
/// the host as on an NPU, every input is read as the caller passed it.
pub(crate) fn write_apart<'t>(
    out: &mut Tensor,
    inputs: impl IntoIterator<Item = (&'static str, Option<&'t Tensor>)>,
    write: impl FnOnce(&mut Tensor) -> Result<()>,
) -> Result<()> {
    if !inputs.into_iter().any(|(_, t)| t.is_some_and(|t| overlaps(t, out))) {
        return write(out);
    }
    let device = out.device();
    let backend = device.backend();
    let mut result = backend.output(out.shape(), out.dtype())?;
    write(&mut result)?;
    if out.numel() > 0 {
        backend.copy_rows(&result, 0, out, 0, out.rows())?;
    }
    Ok(())
}

/// `x` as an op writing `out` reads it: `None` when `out` covers none of its
/// bytes (read `x` itself), else a copy of `x` in the device's workspace (one
/// device copy, queued on the NPU), so that the op never reads rows it has
/// already written.
pub(crate) fn read_apart(x: &Tensor, out: &Tensor) -> Result<Option<Tensor>> {
    if !overlaps(x, out) {
        return Ok(None);
    }
    let device = x.device();
    let backend = device.backend();
    let mut copy = backend.output(x.shape(), x.dtype())?;
    if x.numel() > 0 {
        backend.copy_rows(x, 0, &mut copy, 0, x.rows())?;
    }
    Ok(Some(copy))
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
