//! The device context every handle on a device shares.

use std::sync::{Arc, OnceLock};

use acl_sys::Acl;

use super::load::acl;
use crate::backend::npu::result::acl as rt;
use crate::{Error, Result};

/// Calls `aclInit(NULL)` once per process.
fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(rt::init).clone()
}

/// Number of visible devices.
pub fn device_count() -> Result<u32> {
    acl()?;
    init()?;
    rt::get_device_count()
}

/// Per-device state shared by every handle on that device.
#[derive(Debug)]
pub struct DeviceCtx {
    pub(super) ordinal: u32,
    pub(super) api: &'static Acl,
}

impl DeviceCtx {
    /// Loads ACL, initialises it and checks `ordinal` exists.
    pub fn open(ordinal: u32) -> Result<Arc<Self>> {
        let api = acl()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::invalid(
                "NpuDevice::open",
                "ordinal",
                format!("device {ordinal} does not exist ({count} visible)"),
            ));
        }
        let ctx = Arc::new(DeviceCtx { ordinal, api });
        ctx.bind()?;
        Ok(ctx)
    }

    /// The ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The ACL function table.
    pub fn api(&self) -> &'static Acl {
        self.api
    }

    /// Makes this device current on the calling thread. `aclrtSetDevice` is
    /// per thread; it is only called when `aclrtGetDevice` reports another
    /// device (or none), so a host engine that switched the thread's device
    /// behind our back is noticed.
    pub fn bind(&self) -> Result<()> {
        if rt::get_device()? == Some(self.ordinal as i32) {
            return Ok(());
        }
        // The ordinal was validated against the device count.
        rt::set_device(self.ordinal as i32)
    }
}

/// The device current on the calling thread when a C ABI call began, made
/// current again when it ends (on drop): a call on another device's stream
/// binds that device ([`DeviceCtx::bind`]), and an engine thread (torch_npu's)
/// must not find its device switched behind its back. Keeps nothing before
/// the runtime was loaded by this library, or on a thread with no device.
pub(crate) struct ThreadDevice(Option<i32>);

impl ThreadDevice {
    pub(crate) fn kept() -> Self {
        if acl_sys::acl_if_loaded().is_none() {
            return ThreadDevice(None);
        }
        ThreadDevice(rt::get_device().ok().flatten())
    }

    /// [`kept`](Self::kept) after loading the runtime (a no-op once it is):
    /// for the exports that bind a device of their own and may be the
    /// process's first NPU call, made by an engine that loaded the runtime
    /// itself (torch_npu) and has a device current.
    pub(crate) fn kept_loading() -> Self {
        let _ = super::load::acl();
        Self::kept()
    }
}

impl Drop for ThreadDevice {
    fn drop(&mut self) {
        let Some(device) = self.0 else { return };
        if rt::get_device().ok().flatten() != Some(device) {
            if let Err(e) = rt::set_device(device) {
                super::record_drop_error(e);
            }
        }
    }
}
