//! Backends: the [`Device`] enum and the small [`Backend`] trait with exactly
//! the device-side ops the MoE layer needs.
//!
//! The ops in [`crate::moe`] are written once against this trait; the CPU
//! backend is the reference for every op, the NPU backend runs the same ops
//! through ACL / aclnn / the native kernel.

pub mod args;
pub mod cpu;
pub mod npu;

pub use crate::types::{DropPadMode, FinalizeDims, OutputRows};
use crate::{DType, Result, Tensor};

/// Inputs of the fused finalize (SPEC section 1). Validated by
/// `moe::finalize::moe_finalize_routing_output_shape`, which produces the
/// [`FinalizeDims`] every backend receives.
#[derive(Debug, Clone, Copy)]
pub struct FinalizeArgs<'a> {
    /// `[N*K, H]` (modes 0/2) or `[E, C, H]` (modes 1/3).
    pub expanded_x: &'a Tensor,
    /// int32 `[N*K]`.
    pub expanded_row_idx: &'a Tensor,
    /// Optional skip input `[N, H]`.
    pub x1: Option<&'a Tensor>,
    /// Optional skip input `[N, H]`.
    pub x2: Option<&'a Tensor>,
    /// Optional `[E, H]`; requires `expert_idx`.
    pub bias: Option<&'a Tensor>,
    /// Optional `[N, K]`, dtype of `expanded_x` or f32.
    pub scales: Option<&'a Tensor>,
    /// Optional int32 `[N, K]`.
    pub expert_idx: Option<&'a Tensor>,
    /// Drop-pad mode.
    pub drop_pad_mode: DropPadMode,
}

/// What a failed [`Backend::expect_all_equal`] reports. It is called with
/// every value when the backend read them all (`Some`, on the host), else
/// (on the device) with `None`, and always with the first position that
/// differs and its value.
pub type Mismatch = Box<dyn Fn(Option<&[i32]>, usize, i32) -> crate::Error + Send + Sync>;

/// The device-side ops every backend implements.
///
/// Arguments reaching these methods are already validated by the op layer
/// (shapes, dtypes, devices); index values are checked by the backend itself,
/// because only it can read them.
pub trait Backend {
    /// A zero-filled tensor on this backend's device.
    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor>;
    /// A zero-filled tensor an op makes for itself (an intermediate or its
    /// result): on an NPU, workspace of the stream (its pool or the caller's
    /// allocator), whose release never synchronises; elsewhere [`zeros`](Self::zeros).
    fn scratch(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        self.zeros(shape, dtype)
    }
    /// A copy of `src` (on any device) on this backend's device.
    fn copy_from(&self, src: &Tensor) -> Result<Tensor>;
    /// A copy on this device of small host data an op made itself (a comm
    /// type, a few counts): on an NPU, workspace filled from pinned staging by
    /// an asynchronous copy, so it neither allocates nor synchronises and can
    /// be captured (a graph keeps the bytes it was captured with); elsewhere
    /// [`copy_from`](Self::copy_from).
    fn scratch_from_host(&self, src: &Tensor) -> Result<Tensor> {
        self.copy_from(src)
    }
    /// Copies `rows` rows of `src` starting at `src_row` into `dst` at `dst_row`.
    /// Same dtype and row length on both sides.
    fn copy_rows(&self, src: &Tensor, src_row: usize, dst: &mut Tensor, dst_row: usize, rows: usize) -> Result<()>;
    /// `out = a + b` elementwise (f32 accumulation, one rounding).
    fn add(&self, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()>;
    /// Fused finalize routing (SPEC section 1) into `out`, placed as `rows` says.
    fn finalize_routing(
        &self,
        args: &FinalizeArgs<'_>,
        dims: &FinalizeDims,
        out: &mut Tensor,
        rows: OutputRows<'_>,
    ) -> Result<()>;
    /// Checks that every element of the int32 tensor `values` equals
    /// `expected`, else fails with `mismatch`'s error. Here the values are
    /// read now; an NPU compares them on the device and reports a difference
    /// at the caller's next stream check, so the check never synchronises.
    fn expect_all_equal(&self, values: &Tensor, expected: i32, mismatch: Mismatch) -> Result<()> {
        let v = values.to_vec::<i32>()?;
        match v.iter().position(|&x| x != expected) {
            None => Ok(()),
            Some(p) => Err(mismatch(Some(&v), p, v[p])),
        }
    }
    /// Token unpermute: `out[t] = sum_k probs[t,k] * permuted[idx[t*K + k]]`;
    /// an index outside `[0, permuted.rows)` contributes nothing.
    fn token_unpermute(
        &self,
        permuted: &Tensor,
        sorted_indices: &Tensor,
        probs: Option<&Tensor>,
        k: usize,
        out: &mut Tensor,
    ) -> Result<()>;
}

/// A compute device: the host CPU or one Ascend NPU.
#[derive(Debug, Clone)]
pub enum Device {
    /// The CPU fallback (also the reference implementation).
    Cpu,
    /// An Ascend NPU (real CANN, or the simulated runtime).
    Npu(npu::NpuDevice),
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Device::Cpu, Device::Cpu) => true,
            (Device::Npu(a), Device::Npu(b)) => a.ordinal() == b.ordinal(),
            _ => false,
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Npu(d) => write!(f, "npu:{}", d.ordinal()),
        }
    }
}

impl Device {
    /// The CPU device.
    pub fn cpu() -> Self {
        Device::Cpu
    }

    /// NPU `ordinal`; `Err(Error::Unavailable)` when CANN (or the simulated
    /// runtime) cannot be loaded.
    pub fn npu(ordinal: u32) -> Result<Self> {
        Ok(Device::Npu(npu::NpuDevice::open(ordinal)?))
    }

    /// The backend implementing the ops on this device.
    pub fn backend(&self) -> &(dyn Backend + '_) {
        match self {
            Device::Cpu => &cpu::CpuBackend,
            Device::Npu(d) => d,
        }
    }
}
