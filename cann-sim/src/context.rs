//! Process state: `aclInit`, the calling thread's current device, each
//! device's default stream, and the tables of live streams and events.

use std::cell::Cell;
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

/// `aclInit`.
pub fn init() -> SimResult<()> {
    let mut g = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if *g == InitState::Initialized {
        return fail(ACL_ERROR_REPEAT_INITIALIZE, "aclInit was already called in this process");
    }
    *g = InitState::Initialized;
    crate::leaks::arm();
    Ok(())
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
    let n = config::get().devices;
    if id < 0 || id >= n as i64 {
        return fail(ACL_ERROR_RT_INVALID_DEVICEID, format!("device {id} does not exist ({n} simulated devices)"));
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
        let Some(slot) = devs.get_mut(d as usize).filter(|s| s.refs > 0) else {
            return fail(ACL_ERROR_RT_INVALID_DEVICEID, format!("device {d} was not set in this process"));
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

/// The calling thread's device.
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
/// for a call that uses it: refused while graph capture forbids that use
/// (see [`crate::capture::admit`]).
pub fn stream(h: usize) -> SimResult<Arc<Stream>> {
    let s = resolve_stream(h)?;
    crate::capture::admit(&s)?;
    Ok(s)
}

/// The stream of handle `h` (NULL = the current device's default stream),
/// without the graph capture checks (for the capture calls themselves).
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

/// The stream of handle `h`, which must belong to the calling thread's device.
pub fn stream_here(h: usize) -> SimResult<Arc<Stream>> {
    let cur = current()?;
    let s = stream(h)?;
    if s.device != cur {
        return fail(
            ACL_ERROR_RT_STREAM_CONTEXT,
            format!("the stream belongs to device {} but the current device is {cur}", s.device),
        );
    }
    Ok(s)
}

/// The event of handle `h`.
pub fn event(h: usize) -> SimResult<Arc<Event>> {
    EVENTS.get(h).ok_or_else(|| SimError::new(ACL_ERROR_RT_INVALID_HANDLE, format!("{h:#x} is not a live event")))
}
