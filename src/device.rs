//! [`Device`]: where a tensor lives and ops run, the host CPU or one Ascend NPU.

use crate::backend::cpu::CpuBackend;
use crate::backend::npu::NpuDevice;
use crate::Result;

/// A compute device: the host CPU or one Ascend NPU.
#[derive(Debug, Clone)]
pub enum Device {
    /// The CPU fallback (also the reference implementation).
    Cpu,
    /// An Ascend NPU (real CANN, or the simulated runtime).
    Npu(NpuDevice),
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

/// Whose memory a tensor's bytes are: the host's, or one NPU's (by
/// ordinal). An op's output must be in its input's memory: the ops never
/// copy a result between host and NPU memory. Unlike [`Device`] it names an
/// NPU without opening it, as a C descriptor does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Memory {
    /// Host memory.
    Host,
    /// The memory of the NPU with this ordinal.
    Npu(i64),
}

impl std::fmt::Display for Memory {
    /// As [`Device`] displays itself: `cpu`, `npu:N`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Memory::Host => f.write_str("cpu"),
            Memory::Npu(n) => write!(f, "npu:{n}"),
        }
    }
}

impl From<CpuBackend> for Device {
    fn from(_: CpuBackend) -> Self {
        Device::Cpu
    }
}

impl From<NpuDevice> for Device {
    fn from(d: NpuDevice) -> Self {
        Device::Npu(d)
    }
}

impl Device {
    /// The memory of this device.
    pub(crate) fn memory(&self) -> Memory {
        match self {
            Device::Cpu => Memory::Host,
            Device::Npu(d) => Memory::Npu(i64::from(d.ordinal())),
        }
    }

    /// The CPU device.
    pub fn cpu() -> Self {
        Device::Cpu
    }

    /// NPU `ordinal`; `Err(Error::Unavailable)` when CANN (or the simulated
    /// runtime) cannot be loaded.
    pub fn npu(ordinal: u32) -> Result<Self> {
        Ok(Device::Npu(NpuDevice::open(ordinal)?))
    }
}
