//! Which finalize implementation an NPU call runs ([`FinalizeImpl`]), and the
//! launcher of the native kernel on this runtime.

use super::kernel as kernels;
use crate::{Error, Result};

/// How [`NpuDevice`](super::NpuDevice)'s finalize routing runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalizeImpl {
    /// The native kernel (`kernels/finalize_kernel.cpp`): the AI Core build
    /// (`libamoe_kernels_npu.so`, loaded at run time), or, under the
    /// simulated runtime, the host build through `cannsim_launch_kernel`.
    /// Padded output is written in place.
    Native,
    /// `aclnnMoeFinalizeRoutingV2` (padded output through a scratch buffer and
    /// row copies).
    Aclnn,
}

impl FinalizeImpl {
    /// `"native"` or `"aclnn"`.
    pub fn name(self) -> &'static str {
        match self {
            FinalizeImpl::Native => "native",
            FinalizeImpl::Aclnn => "aclnn",
        }
    }

    /// The choice forced by `ASCEND_MOE_NPU_FINALIZE` (`native` or `aclnn`),
    /// `None` when unset or empty.
    pub fn from_env() -> Result<Option<FinalizeImpl>> {
        match std::env::var(FINALIZE_ENV) {
            Err(_) => Ok(None),
            Ok(v) => match v.trim() {
                "" => Ok(None),
                "native" => Ok(Some(FinalizeImpl::Native)),
                "aclnn" => Ok(Some(FinalizeImpl::Aclnn)),
                other => Err(Error::invalid(
                    "finalize_routing",
                    FINALIZE_ENV,
                    format!("{other:?}: expected \"native\" or \"aclnn\""),
                )),
            },
        }
    }
}

/// Environment variable forcing the finalize implementation (`native` or `aclnn`).
pub const FINALIZE_ENV: &str = "ASCEND_MOE_NPU_FINALIZE";

/// A way to launch the native kernel on this runtime.
pub(super) enum Launcher {
    /// The simulated runtime's `cannsim_launch_kernel` with the host build.
    Sim(acl_sys::CannsimLaunchKernelFn, kernels::KernelEntry),
    /// The AI Core build.
    Npu(&'static kernels::NpuKernelLib),
}

pub(super) fn launcher() -> Option<Launcher> {
    if let (Ok(api), Some(entry)) = (super::runtime::acl(), kernels::host_entry()) {
        if let Some(launch) = api.cannsim_launch_kernel {
            return Some(Launcher::Sim(launch, entry));
        }
    }
    kernels::shared_kernel_lib().map(Launcher::Npu)
}

/// The implementation a finalize call on a device with override `forced`
/// uses: the override, else `ASCEND_MOE_NPU_FINALIZE`, else the native kernel
/// when it can be launched here, else aclnn.
pub(super) fn choose_finalize(forced: Option<FinalizeImpl>) -> Result<FinalizeImpl> {
    if let Some(f) = forced {
        return Ok(f);
    }
    if let Some(f) = FinalizeImpl::from_env()? {
        return Ok(f);
    }
    Ok(if launcher().is_some() { FinalizeImpl::Native } else { FinalizeImpl::Aclnn })
}
