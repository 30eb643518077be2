//! The device context every handle on a device shares.

use std::sync::Arc;

use acl_sys::{aclError, Acl};

use super::load::{acl, acl_fn, check, device_count};
use crate::{Error, Result};

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
        let get = acl_fn!(self.api, aclrtGetDevice)?;
        let mut current = -1i32;
        // SAFETY: valid out-pointer; fails harmlessly when no device is set.
        if unsafe { get(&mut current) } == acl_sys::ACL_SUCCESS as aclError && current == self.ordinal as i32 {
            return Ok(());
        }
        let f = acl_fn!(self.api, aclrtSetDevice)?;
        // SAFETY: plain integer argument, validated against the device count.
        check("aclrtSetDevice", unsafe { f(self.ordinal as i32) })
    }
}
