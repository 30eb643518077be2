//! Which finalize implementation an NPU call runs ([`FinalizeImpl`]), and the
//! launcher of the native kernel on this runtime.

use std::sync::atomic::{AtomicBool, Ordering};

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

/// Why the native kernel cannot launch here: the AI Core library's load
/// error (this runtime has no `cannsim_launch_kernel` with the host build).
pub(super) fn native_unavailable_reason() -> String {
    match kernels::kernel_lib_status() {
        Ok(path) => format!("the AI Core kernel library loaded from {path}"),
        Err(e) => format!("the AI Core kernel library is not loaded: {e}"),
    }
}

/// `Ok` when the native kernels (`kernels/`) can launch here: a simulated
/// runtime with the host build, or the AI Core kernel library loaded (the
/// first call loads it). Else [`Error::Unavailable`] naming `who` and why:
/// then NPU finalize and unpermute calls use aclnn, which reads the index
/// tensors on the host at every call and cannot be captured.
pub fn native_kernel_check(who: &str) -> Result<()> {
    launcher().map(drop).ok_or_else(|| native_unavailable(who))
}

/// The error of a call that needs the native kernel where it cannot launch,
/// naming `who` and why.
pub(crate) fn native_unavailable(who: &str) -> Error {
    Error::Unavailable(format!(
        "{who}: neither cannsim_launch_kernel with the host kernel build nor the AI Core kernel library is \
         available ({})",
        native_unavailable_reason()
    ))
}

/// The warning printed once per process when finalize calls fall back to
/// aclnn because the native kernel cannot launch (`reason`), unasked.
pub(super) fn fallback_warning(reason: &str) -> String {
    format!(
        "ascend-moe: warning: the native finalize kernel cannot launch ({reason}); finalize_routing and \
         token_unpermute use aclnn instead, which reads the index tensors on the host at every call (a stream \
         synchronisation and a blocking copy, refused under graph capture); set {FINALIZE_ENV}=aclnn to choose \
         aclnn and silence this warning"
    )
}

/// Prints `message` on stderr unless `warned` says it was printed; true when
/// it printed.
fn warn_once(warned: &AtomicBool, message: impl FnOnce() -> String) -> bool {
    if warned.swap(true, Ordering::Relaxed) {
        return false;
    }
    eprintln!("{}", message());
    true
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
/// when it can be launched here, else aclnn, with a warning on stderr the
/// first time ([`fallback_warning`], naming the library's load error).
pub(super) fn choose_finalize(forced: Option<FinalizeImpl>) -> Result<FinalizeImpl> {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let (choice, fallback) = decide(forced, FinalizeImpl::from_env()?, launcher().is_some());
    if fallback {
        warn_once(&WARNED, || fallback_warning(&native_unavailable_reason()));
    }
    Ok(choice)
}

/// [`choose_finalize`]'s decision from the device's override, the
/// environment's choice and whether the native kernel can launch, and
/// whether it is a fall-back to aclnn nobody asked for.
fn decide(forced: Option<FinalizeImpl>, env: Option<FinalizeImpl>, native: bool) -> (FinalizeImpl, bool) {
    match forced.or(env) {
        Some(f) => (f, false),
        None if native => (FinalizeImpl::Native, false),
        None => (FinalizeImpl::Aclnn, true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unasked_fall_back_to_aclnn_warns() {
        use FinalizeImpl::{Aclnn, Native};
        assert_eq!(decide(None, None, true), (Native, false));
        assert_eq!(decide(None, None, false), (Aclnn, true), "no native kernel, nothing chosen: warned");
        assert_eq!(decide(None, Some(Aclnn), false), (Aclnn, false), "ASCEND_MOE_NPU_FINALIZE=aclnn");
        assert_eq!(decide(Some(Aclnn), None, false), (Aclnn, false), "the device's override");
        assert_eq!(decide(Some(Native), Some(Aclnn), false), (Native, false));
    }

    #[test]
    fn the_fall_back_warning_names_the_load_error_and_is_printed_once() {
        let text = fallback_warning("loading /nowhere/libamoe_kernels_npu.so: No such file");
        assert!(text.contains("loading /nowhere/libamoe_kernels_npu.so: No such file"), "{text}");
        assert!(text.contains("ASCEND_MOE_NPU_FINALIZE=aclnn") && text.contains("on the host"), "{text}");
        let warned = AtomicBool::new(false);
        assert!(warn_once(&warned, || "first".into()));
        assert!(!warn_once(&warned, || "second".into()));
    }
}
