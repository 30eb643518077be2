//! Process state: `aclInit`, the calling thread's current device, each
//! device's default stream, and the tables of live streams and events.
//!
//! A table layer: it resolves handles and devices and checks no call's use
//! of them. The graph capture's checks on a stream a call uses sit above it
//! ([`crate::capture::stream`]), and the leak report reads it from above.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::config;
use crate::ffi::*;
use crate::handles::Table;
use crate::status::{fail, SimError, SimResult};
use crate::stream::{Event, Stream};

/// Live explicitly created streams.
pub static STREAMS: Table<Stream> = Table::new("stream", 0x5a1);
/// Live events.
pub static EVENTS: Table<Event> = Table::new("event", 0x5a2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InitState {
    Never,
    Initialized,
    Finalized,
}

static INIT: Mutex<InitState> = Mutex::new(InitState::Never);

/// Set by the first successful `aclInit` and never cleared: the leak report
/// runs only in a process that initialised ACL.
static EVER_INITIALIZED: AtomicBool = AtomicBool::new(false);

/// `aclInit`.
pub fn init() -> SimResult<()> {
    let mut g = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if *g == InitState::Initialized {
        return fail(ACL_ERROR_REPEAT_INITIALIZE, "aclInit was already called in this process");
    }
    *g = InitState::Initialized;
    EVER_INITIALIZED.store(true, Ordering::SeqCst);
    Ok(())
}

/// True once `aclInit` has succeeded in this process (`aclFinalize` does
/// not clear it). Lock-free, so the leak report can ask at exit.
pub fn ever_initialized() -> bool {
    EVER_INITIALIZED.load(Ordering::SeqCst)
}

/// `aclFinalize`.
pub fn finalize() -> SimResult<()> {
    let mut g = INIT.lock().unwrap_or_else(|e| e.into_inner());
    match *g {
        InitState::Never => fail(ACL_ERROR_UNINITIALIZE, "aclFinalize without aclInit"),
        InitState::Finalized => fail(ACL_ERROR_REPEAT_FINALIZE, "aclFinalize was already called"),
        InitState::Initialized => {
            *g = InitState::Finalized;
            Ok(())
        }
    }
}

fn require_init() -> SimResult<()> {
    if *INIT.lock().unwrap_or_else(|e| e.into_inner()) != InitState::Initialized {
        return fail(ACL_ERROR_UNINITIALIZE, "aclInit has not been called (or aclFinalize was)");
    }
    Ok(())
}

#[derive(Debug, Default)]
struct DeviceSlot {
    refs: usize,
    default_stream: Option<Arc<Stream>>,
}

static DEVICES: Mutex<Vec<DeviceSlot>> = Mutex::new(Vec::new());

thread_local! {
    static CURRENT: Cell<Option<u32>> = const { Cell::new(None) };
}

fn check_id(id: i64) -> SimResult<u32> {
    // ApiErrorDecorator::SetDevice / DeviceReset: an id outside
    // [0, device count) is RT_ERROR_DEVICE_ID (ACL_ERROR_RT_INVALID_DEVICEID);
    // the count is that of the devices ASCEND_RT_VISIBLE_DEVICES makes
    // visible, none when it was refused (see `config::visible_devices`).
    let cfg = config::get();
    let n = cfg.devices;
    if id < 0 || id >= n as i64 {
        let why = match (&cfg.visible_refused, &cfg.visible_var) {
            (Some(why), _) => format!("no device is visible: {why}"),
            (None, Some(v)) => {
                format!("{n} of the host's {} are visible: ASCEND_RT_VISIBLE_DEVICES={v:?}", cfg.host_devices)
            }
            (None, None) => format!("{n} simulated devices"),
        };
        return fail(ACL_ERROR_RT_INVALID_DEVICEID, format!("device {id} does not exist ({why})"));
    }
    Ok(id as u32)
}

/// `aclrtSetDevice`.
pub fn set_device(id: i32) -> SimResult<()> {
    require_init()?;
    let d = check_id(id as i64)?;
    crate::arena::arena(d)?;
    let mut devs = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    if devs.len() < config::get().devices as usize {
        devs.resize_with(config::get().devices as usize, DeviceSlot::default);
    }
    let slot = &mut devs[d as usize];
    if slot.default_stream.is_none() {
        slot.default_stream = Some(Stream::new(d, true)?);
    }
    slot.refs += 1;
    CURRENT.with(|c| c.set(Some(d)));
    Ok(())
}

/// `aclrtResetDevice`.
pub fn reset_device(id: i32) -> SimResult<()> {
    let d = check_id(id as i64)?;
    let stream = {
        let mut devs = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
        // ApiErrorDecorator::DeviceReset: RT_ERROR_CONTEXT_DEL
        // (ACL_ERROR_RT_CONTEXT_RELEASE_ERROR), "The device has not been set
        // or has already been reset".
        let Some(slot) = devs.get_mut(d as usize).filter(|s| s.refs > 0) else {
            return fail(
                ACL_ERROR_RT_CONTEXT_RELEASE_ERROR,
                format!("device {d} has not been set in this process or has already been reset"),
            );
        };
        slot.refs -= 1;
        if slot.refs == 0 {
            slot.default_stream.take()
        } else {
            None
        }
    };
    if let Some(s) = stream {
        s.shutdown();
    }
    CURRENT.with(|c| {
        if c.get() == Some(d) {
            c.set(None)
        }
    });
    Ok(())
}

/// The calling thread's device. CANN's context is per thread: `aclrtSetDevice`
/// binds the device's default context to the calling thread only, and every
/// call that needs one fails with RT_ERROR_CONTEXT_NULL
/// (ACL_ERROR_RT_CONTEXT_NULL) without it (`ApiImpl::GetDevice`,
/// `CHECK_CONTEXT_VALID_WITH_RETURN` in `ApiImpl`).
pub fn current() -> SimResult<u32> {
    CURRENT.with(|c| c.get()).ok_or_else(|| {
        SimError::new(ACL_ERROR_RT_CONTEXT_NULL, "no current device on this thread (call aclrtSetDevice first)")
    })
}

/// Devices that are still set, with their set counts.
pub fn devices_still_set() -> Vec<(u32, usize)> {
    let devs = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    devs.iter().enumerate().filter(|(_, s)| s.refs > 0).map(|(i, s)| (i as u32, s.refs)).collect()
}

fn default_stream(d: u32) -> SimResult<Arc<Stream>> {
    let devs = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    devs.get(d as usize).and_then(|s| s.default_stream.clone()).ok_or_else(|| {
        SimError::new(ACL_ERROR_RT_CONTEXT_NULL, format!("device {d} has no default stream (aclrtSetDevice)"))
    })
}

/// The stream of handle `h` (NULL = the current device's default stream),
/// without the graph capture checks: [`crate::capture::stream`] adds them for
/// a call that uses the stream; the capture calls themselves use this.
pub fn resolve_stream(h: usize) -> SimResult<Arc<Stream>> {
    if h == 0 {
        return default_stream(current()?);
    }
    STREAMS.get(h).ok_or_else(|| SimError::new(ACL_ERROR_RT_INVALID_HANDLE, format!("{h:#x} is not a live stream")))
}

/// The default stream of device `d` and every live stream created on it.
pub fn device_streams(d: u32) -> Vec<Arc<Stream>> {
    let mut v: Vec<Arc<Stream>> = default_stream(d).into_iter().collect();
    v.extend(STREAMS.all().into_iter().map(|(_, s)| s).filter(|s| s.device == d));
    v
}

/// The event of handle `h`.
pub fn event(h: usize) -> SimResult<Arc<Event>> {
    EVENTS.get(h).ok_or_else(|| SimError::new(ACL_ERROR_RT_INVALID_HANDLE, format!("{h:#x} is not a live event")))
}
