//! ACL runtime exports (libascendcl): init, devices, streams, memory, events,
//! error text and version.
//!
//! Safety contract of every export: pointer arguments are what the CANN
//! documentation says they are (valid for the stated number of bytes, or NULL
//! where NULL is allowed). Device pointers and handles are validated; host
//! pointers cannot be and are trusted.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::acl_rules::{self, Proceed};
use crate::arena::{self, Span};
use crate::config;
use crate::context::{self, EVENTS, STREAMS};
use crate::ffi::*;
use crate::host_bufs::{host_bufs, HostBuf};
use crate::lease::{self, Lease};
use crate::status::{self, fail, write_out, SimError, SimResult};
use crate::stream::{Event, Stream};

/// `aclError aclInit(const char *configPath)`.
#[no_mangle]
pub extern "C" fn aclInit(_config_path: *const c_char) -> AclError {
    status::acl("aclInit", context::init)
}

/// `aclError aclFinalize()`.
#[no_mangle]
pub extern "C" fn aclFinalize() -> AclError {
    status::acl("aclFinalize", context::finalize)
}

/// `aclError aclrtSetDevice(int32_t deviceId)`.
#[no_mangle]
pub extern "C" fn aclrtSetDevice(device_id: i32) -> AclError {
    status::acl("aclrtSetDevice", || context::set_device(device_id))
}

/// `aclError aclrtResetDevice(int32_t deviceId)`.
#[no_mangle]
pub extern "C" fn aclrtResetDevice(device_id: i32) -> AclError {
    status::acl("aclrtResetDevice", || context::reset_device(device_id))
}

/// `aclError aclrtGetDevice(int32_t *deviceId)`.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetDevice(device_id: *mut i32) -> AclError {
    status::acl("aclrtGetDevice", || {
        // acl `device.cpp:139`: `ACL_REQUIRES_NOT_NULL_WITH_INPUT_REPORT(deviceId)`,
        // before the runtime is asked.
        if device_id.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, "deviceId is NULL");
        }
        // `ApiImpl::GetDevice`, `api_impl.cc:3307-3320`: no context is
        // RT_ERROR_CONTEXT_NULL, returned as ACL_ERROR_RT_CONTEXT_NULL by
        // `rtGetDevice` (`api_c_device.cc:103`).
        let d = context::current()?;
        write_out(device_id, d as i32, ACL_ERROR_INVALID_PARAM, "deviceId")
    })
}

/// `aclError aclrtGetDeviceCount(uint32_t *count)`: `count` non-NULL (acl
/// `device.cpp:244`; `ApiErrorDecorator::GetDeviceCount`, `api_error.cc:2496`);
/// no context is needed; the devices `ASCEND_RT_VISIBLE_DEVICES` makes
/// visible, or ACL_ERROR_RT_NO_DEVICE when it was refused
/// (`ApiImpl::GetDeviceCount`, `api_impl.cc:3239-3276`; see
/// [`config::visible_devices`]).
#[no_mangle]
pub unsafe extern "C" fn aclrtGetDeviceCount(count: *mut u32) -> AclError {
    status::acl("aclrtGetDeviceCount", || {
        if count.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, "count is NULL");
        }
        let cfg = config::get();
        if let Some(why) = &cfg.visible_refused {
            return fail(ACL_ERROR_RT_NO_DEVICE, why.clone());
        }
        write_out(count, cfg.devices, ACL_ERROR_INVALID_PARAM, "count")
    })
}

/// Streams per device, the default stream included: "the hardware supports at
/// most 1984 streams" on Atlas A2/A3, and a device that already has N streams
/// (the default one among them) lets `aclrtCreateStream` make only 1984 - N
/// more (API reference, hicann/runtime v8.5.0 and v9.0.0
/// `docs/api_docs/aclrtCreateStream.md:40`). The stream ids come from the driver, whose
/// `DRV_ERROR_NO_STREAM_RESOURCES` the runtime maps to
/// `ACL_ERROR_RT_NO_STREAM_RESOURCE` (`errcode_manage.cc:535`, `:92`, v8.5.0).
pub const MAX_STREAMS_PER_DEVICE: usize = 1984;

/// `aclError aclrtCreateStream(aclrtStream *stream)`.
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateStream(stream: *mut AclrtStream) -> AclError {
    static CREATING: Mutex<()> = Mutex::new(());
    status::acl("aclrtCreateStream", || {
        // acl `stream.cpp:37`; `ApiErrorDecorator::StreamCreate`, `api_error.cc:927`.
        if stream.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, "stream is NULL");
        }
        // `ApiImpl::StreamCreate`, `api_impl.cc:1323-1324`: the thread's context.
        let d = context::current()?;
        // One creation at a time, so the count below stays exact.
        let _one = CREATING.lock().unwrap_or_else(|e| e.into_inner());
        let live = context::device_streams(d).len();
        if live >= MAX_STREAMS_PER_DEVICE {
            return fail(
                ACL_ERROR_RT_NO_STREAM_RESOURCE,
                format!(
                    "device {d} already has {live} streams (the default one included), the Atlas A2/A3 limit of \
                     {MAX_STREAMS_PER_DEVICE}: destroy streams no longer used"
                ),
            );
        }
        let h = STREAMS.insert(Stream::new(d, false)?);
        write_out(stream, h as AclrtStream, ACL_ERROR_INVALID_PARAM, "stream")
    })
}

/// `aclError aclrtDestroyStream(aclrtStream stream)`. Queued work is run
/// first, so nothing queued is lost (API reference: "if the stream has
/// unfinished tasks, it waits for them to complete before destroying it").
#[no_mangle]
pub extern "C" fn aclrtDestroyStream(stream: AclrtStream) -> AclError {
    status::acl("aclrtDestroyStream", || {
        acl_rules::destroy_stream(stream)?;
        let s = STREAMS
            .remove(stream as usize)
            .ok_or_else(|| SimError::new(ACL_ERROR_RT_INVALID_HANDLE, format!("{stream:p} is not a live stream")))?;
        s.shutdown();
        Ok(())
    })
}

/// `aclError aclrtSynchronizeStream(aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn aclrtSynchronizeStream(stream: AclrtStream) -> AclError {
    status::acl("aclrtSynchronizeStream", || {
        // `ApiErrorDecorator::StreamSynchronize`, `api_error.cc:1010-1011`: a
        // capturing stream is RT_ERROR_STREAM_CAPTURED, before the context.
        crate::capture::sync_stream("aclrtSynchronizeStream", stream as usize)?;
        acl_rules::synchronize_stream(stream)?;
        crate::capture::stream(stream as usize)?.synchronize(None)
    })
}

/// `aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout)`;
/// timeout in ms, -1 waits forever; 0 is refused (see [`acl_rules`]).
#[no_mangle]
pub extern "C" fn aclrtSynchronizeStreamWithTimeout(stream: AclrtStream, timeout: i32) -> AclError {
    status::acl("aclrtSynchronizeStreamWithTimeout", || {
        // The timeout first (acl `stream.cpp:157`, `api_error.cc:1002`), then
        // the capture (`api_error.cc:1010`), then the context (`api_impl.cc:1581`).
        if timeout < -1 || timeout == 0 {
            crate::counters::host_sync();
            return acl_rules::synchronize_stream_with_timeout(stream, timeout);
        }
        crate::capture::sync_stream("aclrtSynchronizeStreamWithTimeout", stream as usize)?;
        acl_rules::synchronize_stream_with_timeout(stream, timeout)?;
        let t = (timeout >= 0).then(|| Duration::from_millis(timeout as u64));
        crate::capture::stream(stream as usize)?.synchronize(t)
    })
}

/// `aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event)`.
#[no_mangle]
pub extern "C" fn aclrtStreamWaitEvent(stream: AclrtStream, event: AclrtEvent) -> AclError {
    status::acl("aclrtStreamWaitEvent", || {
        acl_rules::stream_wait_event(stream, event)?;
        let s = crate::capture::stream_here(stream as usize)?;
        let e = context::event(event as usize)?;
        // ApiErrorDecorator::StreamWaitEvent (runtime
        // src/runtime/feature/src/api_impl/api_error.cc:994-995, v8.5.0): an
        // event without a wait task (aclrtCreateEventExWithFlag without
        // ACL_EVENT_SYNC) cannot be waited for; the API reference of
        // aclrtCreateEventExWithFlag says the same.
        if e.without_wait_task() {
            return fail(
                ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
                format!("event flag {:#x} has no ACL_EVENT_SYNC: a stream cannot wait for it", e.flag),
            );
        }
        // A stream waits only for an event of its own device. hicann/runtime
        // `docs/zh/dev_guide/05_multi_device_programming.md:91` says the wait
        // fails otherwise; the source (`core/src/event/event.cc:634-646`,
        // `CrossDeviceEventWait`) turns it into a memory-wait task on chips
        // with `RT_FEATURE_TASK_VALUE_WAIT` (`config/910_B_93/dev_info_reg.cc:23`)
        // and, on every other chip, returns success without waiting at all.
        // Code that relies on it is right on some hosts and racy on the rest:
        // refused, as documented.
        if e.device != s.device {
            return fail(
                ACL_ERROR_RT_STREAM_CONTEXT,
                format!("a stream of device {} cannot wait for an event of device {}", s.device, e.device),
            );
        }
        crate::capture::check_wait(&s, &e)?;
        if e.wait_needs_a_record() {
            return fail(
                ACL_ERROR_RT_PARAM_INVALID,
                "a stream cannot wait for an aclrtCreateEvent event before it is recorded (aclrtRecordEvent)",
            );
        }
        if crate::capture::wait_event(&s, &e)? {
            return Ok(());
        }
        if let Some((src, seq)) = e.target() {
            s.enqueue(
                "aclrtStreamWaitEvent",
                Box::new(move || {
                    // The source's own failure is reported on the source stream.
                    let _ = src.wait_for(seq, None);
                    Ok(())
                }),
            );
        }
        Ok(())
    })
}

fn malloc(dev_ptr: *mut *mut c_void, size: usize, policy: i32) -> SimResult<()> {
    acl_rules::malloc(dev_ptr, size, policy)?;
    let d = context::current()?;
    let addr = arena::arena(d)?.alloc(size)?;
    write_out(dev_ptr, addr as *mut c_void, ACL_ERROR_INVALID_PARAM, "devPtr")
}

/// `aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy)`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMalloc(dev_ptr: *mut *mut c_void, size: usize, policy: i32) -> AclError {
    status::acl("aclrtMalloc", || {
        crate::capture::allocation("aclrtMalloc")?;
        malloc(dev_ptr, size, policy)
    })
}

/// `aclError aclrtFree(void *devPtr)`. Frees at once, without waiting for
/// queued work (as documented): work still using the memory fails when it runs.
/// No context is needed: `ApiImpl::DevFree` (`api_impl.cc:2333-2345`) falls
/// back to the NPU driver without one.
#[no_mangle]
pub extern "C" fn aclrtFree(dev_ptr: *mut c_void) -> AclError {
    status::acl("aclrtFree", || {
        crate::capture::allocation("aclrtFree")?;
        let addr = dev_ptr as usize;
        // acl `memory.cpp:442`: `ACL_REQUIRES_NOT_NULL_WITH_INPUT_REPORT(devPtr)`.
        if addr == 0 {
            return fail(ACL_ERROR_INVALID_PARAM, "devPtr is NULL");
        }
        let Some(d) = arena::owner(addr) else {
            let what = if host_bufs().contains_key(&addr) { " (it is aclrtMallocHost memory)" } else { "" };
            return fail(ACL_ERROR_RT_PARAM_INVALID, format!("{addr:#x} is not device memory{what}"));
        };
        arena::arena(d)?.free(addr)
    })
}

/// `aclError aclrtMallocHost(void **hostPtr, size_t size)`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMallocHost(host_ptr: *mut *mut c_void, size: usize) -> AclError {
    status::acl("aclrtMallocHost", || {
        crate::capture::allocation("aclrtMallocHost")?;
        // acl `memory.cpp:458`: `ACL_REQUIRES_NOT_NULL_WITH_INPUT_REPORT(hostPtr)`.
        if host_ptr.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, "hostPtr is NULL");
        }
        // `memory.cpp:460-463`: "malloc size must be greater than zero".
        if size == 0 {
            return fail(ACL_ERROR_INVALID_PARAM, "size must not be 0");
        }
        // `ApiImpl::HostMalloc`, `api_impl.cc:2394-2395`: the thread's context
        // (RT_ERROR_CONTEXT_NULL, `errcode_manage.cc:195`): pinned memory is
        // allocated through the current device's driver (`:2399`).
        context::current().map_err(|mut e| {
            e.msg = format!("aclrtMallocHost needs a current device on this thread: {}", e.msg);
            e
        })?;
        let layout = std::alloc::Layout::from_size_align(size, 64)
            .map_err(|e| SimError::new(ACL_ERROR_INVALID_PARAM, format!("size {size}: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return fail(ACL_ERROR_RT_MEMORY_ALLOCATION, format!("host allocation of {size} bytes failed"));
        }
        host_bufs().insert(p as usize, HostBuf { size, id: arena::next_alloc_id() });
        write_out(host_ptr, p as *mut c_void, ACL_ERROR_INVALID_PARAM, "hostPtr")
    })
}

/// `aclError aclrtFreeHost(void *hostPtr)`.
#[no_mangle]
pub extern "C" fn aclrtFreeHost(host_ptr: *mut c_void) -> AclError {
    status::acl("aclrtFreeHost", || {
        acl_rules::free_host(host_ptr)?;
        crate::capture::allocation("aclrtFreeHost")?;
        let addr = host_ptr as usize;
        // The driver frees only what it allocated; an unknown host pointer is
        // refused with the runtime's invalid-value code (ApiImpl::HostFree).
        let Some(HostBuf { size, .. }) = host_bufs().remove(&addr) else {
            return fail(ACL_ERROR_RT_PARAM_INVALID, format!("{addr:#x} was not returned by aclrtMallocHost"));
        };
        // Invariant: the same layout was accepted by aclrtMallocHost.
        let layout = std::alloc::Layout::from_size_align(size, 64).expect("layout accepted at allocation");
        // SAFETY: `addr` came from std::alloc::alloc with this layout and was
        // removed from the table, so it is freed exactly once.
        unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
        Ok(())
    })
}

/// Where a copy operand lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    Host,
    Device(u32),
}

fn loc(addr: usize) -> Loc {
    arena::owner(addr).map_or(Loc::Host, Loc::Device)
}

fn loc_name(l: Loc) -> String {
    match l {
        Loc::Host => "host memory".into(),
        Loc::Device(d) => format!("device {d} memory"),
    }
}

/// A validated copy: (dst, src) host-visible addresses are computed when it runs.
#[derive(Debug, Clone, Copy)]
struct CopyPlan {
    dst: usize,
    src: usize,
    count: usize,
    dst_dev: bool,
    src_dev: bool,
}

fn kind_name(kind: i32) -> &'static str {
    match kind {
        ACL_MEMCPY_HOST_TO_HOST => "ACL_MEMCPY_HOST_TO_HOST",
        ACL_MEMCPY_HOST_TO_DEVICE => "ACL_MEMCPY_HOST_TO_DEVICE",
        ACL_MEMCPY_DEVICE_TO_HOST => "ACL_MEMCPY_DEVICE_TO_HOST",
        ACL_MEMCPY_DEVICE_TO_DEVICE => "ACL_MEMCPY_DEVICE_TO_DEVICE",
        ACL_MEMCPY_DEFAULT => "ACL_MEMCPY_DEFAULT",
        ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE => "ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE",
        ACL_MEMCPY_INNER_DEVICE_TO_DEVICE => "ACL_MEMCPY_INNER_DEVICE_TO_DEVICE",
        ACL_MEMCPY_INTER_DEVICE_TO_DEVICE => "ACL_MEMCPY_INTER_DEVICE_TO_DEVICE",
        _ => "unknown kind",
    }
}

/// Checks each operand's owner against `kind`. Stricter than CANN: its
/// runtime infers or corrects the direction from the addresses (the API
/// reference of `aclrtMemcpy` calls `kind` reserved since CANN 8.0;
/// `ApiErrorDecorator::MemcpyKindAutoCorrect`), so a wrong kind is refused
/// here to show the caller's mistake. NULL, count and destMax were checked by
/// [`acl_rules`].
///
/// Where `MemcpyKindAutoCorrect` refuses the kind itself (an asynchronous copy
/// with pageable host memory on a side, `kind` outside the set its rule
/// allows: hicann/runtime v8.5.0 `api_error.cc:2010-2028`, `:2075-2079`,
/// reached from `MemcpyAsyncCheckLocation`, `:2131-2137`), the code is its
/// `RT_ERROR_INVALID_VALUE` (107000); every other refusal of a mismatched
/// kind is the simulator's own (100000).
fn plan_copy(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: i32,
    is_async: bool,
) -> SimResult<CopyPlan> {
    // Invariant: every caller runs its `acl_rules` check first.
    debug_assert!(count <= dest_max && !dst.is_null() && !src.is_null());
    let (d, s) = (loc(dst as usize), loc(src as usize));
    let want: Option<(bool, bool)> = match kind {
        ACL_MEMCPY_HOST_TO_HOST => Some((false, false)),
        ACL_MEMCPY_HOST_TO_DEVICE | ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE => Some((true, false)),
        ACL_MEMCPY_DEVICE_TO_HOST => Some((false, true)),
        ACL_MEMCPY_DEVICE_TO_DEVICE => Some((true, true)),
        ACL_MEMCPY_DEFAULT => None,
        _ => return fail(ACL_ERROR_INVALID_PARAM, format!("unknown aclrtMemcpyKind {kind}")),
    };
    let (dst_dev, src_dev) = (d != Loc::Host, s != Loc::Host);
    if let Some((wd, ws)) = want {
        if wd != dst_dev || ws != src_dev {
            let code = if is_async && !pageable_allows(kind, (s, src as usize), (d, dst as usize)) {
                ACL_ERROR_RT_PARAM_INVALID
            } else {
                ACL_ERROR_INVALID_PARAM
            };
            return fail(
                code,
                format!(
                    "{}: dst {:#x} is {} and src {:#x} is {}",
                    kind_name(kind),
                    dst as usize,
                    loc_name(d),
                    src as usize,
                    loc_name(s)
                ),
            );
        }
    }
    let c = CopyPlan { dst: dst as usize, src: src as usize, count, dst_dev, src_dev };
    // Check device extents now, so the caller gets the error synchronously.
    spans(&c)?;
    Ok(c)
}

/// Whether `MemcpyKindAutoCorrect` lets `kind` pass for a copy from `src` to
/// `dst` (location, address) where a side is pageable host memory (host
/// memory `aclrtMallocHost` did not give): its rules 5-9 (`api_error.cc:2010-2028`
/// at v8.5.0) allow host-to-device and device-to-device from pageable memory
/// to the device, device-to-host and device-to-device the other way,
/// host-to-host and host-to-device from pinned host memory into pageable,
/// host-to-host and device-to-host the other way, and any of the four between
/// pageable buffers. True where no side is pageable (the runtime corrects
/// the kind there) and for kinds outside those four (left unchecked).
fn pageable_allows(kind: i32, src: (Loc, usize), dst: (Loc, usize)) -> bool {
    #[derive(PartialEq)]
    enum At {
        Device,
        Pinned,
        Pageable,
    }
    let at = |(l, addr): (Loc, usize)| match l {
        Loc::Device(_) => At::Device,
        Loc::Host if crate::host_bufs::containing(addr).is_some() => At::Pinned,
        Loc::Host => At::Pageable,
    };
    let (s, d) = (at(src), at(dst));
    let four =
        [ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE];
    if (s != At::Pageable && d != At::Pageable) || !four.contains(&kind) {
        return true;
    }
    let allowed: &[i32] = match (s, d) {
        (At::Pageable, At::Device) => &[ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_DEVICE],
        (At::Device, At::Pageable) => &[ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE],
        (At::Pinned, At::Pageable) => &[ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE],
        (At::Pageable, At::Pinned) => &[ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_DEVICE_TO_HOST],
        _ => &four,
    };
    allowed.contains(&kind)
}

/// A copy between the memory of two devices needs the data exchange between
/// them enabled first: on Atlas A2, "to copy between two Devices, first query
/// aclrtDeviceCanAccessPeer and enable it with aclrtDeviceEnablePeerAccess"
/// (hicann/runtime v9.0.0 `docs/api_docs/aclrtMemcpy.md:39-43`; v9.1.0
/// `docs/02_dev_guide/05_多设备编程.md:98-100`, cross-device data exchange). The
/// simulator exports no `aclrtDeviceEnablePeerAccess`, so such a copy is
/// always refused. The runtime hands the copy to the driver, whose code is not
/// open source: the simulator answers 107000, the driver's "invalid value"
/// (`RT_ERROR_DRV_INPUT`).
fn same_device(c: &CopyPlan) -> SimResult<()> {
    if let (Loc::Device(d), Loc::Device(s)) = (loc(c.dst), loc(c.src)) {
        if d != s {
            return fail(
                ACL_ERROR_RT_PARAM_INVALID,
                format!(
                    "a copy from device {s} memory to device {d} memory needs aclrtDeviceEnablePeerAccess, which \
                     the simulator does not provide: stage the bytes through the host"
                ),
            );
        }
    }
    Ok(())
}

fn spans(c: &CopyPlan) -> SimResult<(Option<Span>, Option<Span>)> {
    let d = if c.dst_dev && c.count > 0 { Some(arena::resolve(c.dst, c.count, "dst")?) } else { None };
    let s = if c.src_dev && c.count > 0 { Some(arena::resolve(c.src, c.count, "src")?) } else { None };
    Ok((d, s))
}

fn run_copy(c: CopyPlan) -> SimResult<()> {
    if c.count == 0 {
        return Ok(());
    }
    let (d, s) = spans(&c).map_err(|e| SimError::new(ACL_ERROR_RT_DEVICE_MEM_ERROR, e.msg))?;
    let dst = d.map_or(c.dst as *mut u8, |s| s.host);
    let src = s.map_or(c.src as *const u8, |s| s.host as *const u8);
    // SAFETY: device operands were just checked to lie inside live
    // allocations; host operands are valid for `count` bytes per the caller's
    // contract. `copy` tolerates overlap.
    unsafe { std::ptr::copy(src, dst, c.count) };
    Ok(())
}

/// `aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind)`.
/// Synchronous with respect to the host; it does not wait for any stream.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpy(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: i32,
) -> AclError {
    status::acl("aclrtMemcpy", || {
        crate::capture::count_blocking_copy(dst as usize, src as usize, count);
        if acl_rules::copy("aclrtMemcpy", dst, dest_max, src, count, kind, true)? == Proceed::Done {
            return Ok(());
        }
        // `ApiImpl::MemCopySync`, `api_impl.cc:2691-2694`: the capture mode,
        // after the arguments and the context.
        crate::capture::blocking_copy()?;
        let c = plan_copy(dst, dest_max, src, count, kind, false)?;
        same_device(&c)?;
        run_copy(c)
    })
}

/// `aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind, aclrtStream stream)`.
/// The copy happens when the stream runs it; host memory is read or written then.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpyAsync(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: i32,
    stream: AclrtStream,
) -> AclError {
    status::acl("aclrtMemcpyAsync", || {
        acl_rules::copy("aclrtMemcpyAsync", dst, dest_max, src, count, kind, false)?;
        let c = plan_copy(dst, dest_max, src, count, kind, true)?;
        // API reference: "does not support asynchronous memory copy within the
        // host ... returns ACL_ERROR_RT_FEATURE_NOT_SUPPORT";
        // `ApiErrorDecorator::MemcpyAsync`, `api_error.cc:1656-1657`: "Not
        // support h2h" (RT_ERROR_FEATURE_NOT_SUPPORT, `api_c.cc:1121`).
        if !c.dst_dev && !c.src_dev {
            return fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "asynchronous host-to-host copies are not supported");
        }
        // `api_error.cc:1658-1659`: a copy onto itself succeeds without a task.
        if c.dst == c.src {
            return Ok(());
        }
        // `ApiImpl::MemcpyAsync`, `api_impl.cc:2756-2762`: the stream (NULL:
        // the default stream) must belong to the thread's context
        // (RT_ERROR_STREAM_CONTEXT, `errcode_manage.cc:110`).
        let s = crate::capture::stream_here(stream as usize)?;
        same_device(&c)?;
        crate::capture::async_copy(&s, c.dst, c.src, c.count)?;
        // acl_rt.h (torch-npu 2.9.0 and 2.14.0 headers), aclrtMemcpyAsync:
        // "For on-chip Device-to-Device memory copy, both the source and
        // destination addresses must be 64-byte aligned".
        if c.dst_dev && c.src_dev && loc(c.dst) == loc(c.src) && (c.dst % 64 != 0 || c.src % 64 != 0) {
            return fail(
                ACL_ERROR_RT_ADDR_UNALIGNED,
                format!(
                    "on-chip device-to-device aclrtMemcpyAsync needs 64-byte aligned addresses (dst {:#x}, src {:#x})",
                    c.dst, c.src
                ),
            );
        }
        // The operands' allocations, checked again when the copy runs (see
        // [`crate::lease`]): one freed in between fails the stream.
        let leases: Vec<Lease> = [(c.dst, "dst"), (c.src, "src")]
            .into_iter()
            .map(|(a, what)| Lease::of(a, c.count, what))
            .collect::<SimResult<Vec<_>>>()?
            .into_iter()
            .flatten()
            .collect();
        s.enqueue(
            "aclrtMemcpyAsync",
            Box::new(move || {
                lease::check_all(&leases)?;
                run_copy(c)
            }),
        );
        Ok(())
    })
}

/// NULL, the count and host memory were checked by [`acl_rules`]; device
/// memory must hold the whole range.
fn plan_memset(dev_ptr: *mut c_void, count: usize) -> SimResult<(usize, bool)> {
    let addr = dev_ptr as usize;
    let dev = arena::owner(addr).is_some();
    if dev && count > 0 {
        arena::resolve(addr, count, "devPtr")?;
    }
    Ok((addr, dev))
}

fn run_memset(addr: usize, dev: bool, value: i32, count: usize) -> SimResult<()> {
    if count == 0 {
        return Ok(());
    }
    let p = if dev {
        arena::resolve(addr, count, "devPtr").map_err(|e| SimError::new(ACL_ERROR_RT_DEVICE_MEM_ERROR, e.msg))?.host
    } else {
        addr as *mut u8
    };
    // SAFETY: device memory was checked above; host memory is valid for
    // `count` bytes per the caller's contract.
    unsafe { std::ptr::write_bytes(p, value as u8, count) };
    Ok(())
}

/// `aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count)`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemset(dev_ptr: *mut c_void, max_count: usize, value: i32, count: usize) -> AclError {
    status::acl("aclrtMemset", || {
        crate::counters::host_sync();
        acl_rules::memset(dev_ptr, count)?;
        // `ApiImpl::MemSetSync`, `api_impl.cc:3059-3062`: the capture mode.
        crate::capture::blocking_memset()?;
        acl_rules::memset_range(dev_ptr, max_count, count)?;
        let (addr, dev) = plan_memset(dev_ptr, count)?;
        run_memset(addr, dev, value, count)
    })
}

/// `aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream)`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemsetAsync(
    dev_ptr: *mut c_void,
    max_count: usize,
    value: i32,
    count: usize,
    stream: AclrtStream,
) -> AclError {
    status::acl("aclrtMemsetAsync", || {
        acl_rules::memset_async(dev_ptr, max_count, count)?;
        // `ApiImpl::MemsetAsync`, `api_impl.cc:3074-3080`: the stream (NULL: the
        // default stream) must belong to the thread's context.
        let s = crate::capture::stream_here(stream as usize)?;
        let (addr, dev) = plan_memset(dev_ptr, count)?;
        // `Context::MemsetAsync`, `context.cc:2600-2606`: host memory is set
        // at the call, on the calling thread. No task is queued, so nothing
        // orders it after the stream's work and a capture records nothing.
        if !dev {
            return run_memset(addr, dev, value, count);
        }
        let lease = Lease::of(addr, count, "devPtr")?;
        s.enqueue(
            "aclrtMemsetAsync",
            Box::new(move || {
                lease.iter().try_for_each(Lease::check)?;
                run_memset(addr, dev, value, count)
            }),
        );
        Ok(())
    })
}

/// `aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total)`:
/// the current device's free and total bytes.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetMemInfo(attr: i32, free: *mut usize, total: *mut usize) -> AclError {
    status::acl("aclrtGetMemInfo", || {
        // acl `memory.cpp:742-743`: both out-pointers before the attribute.
        if free.is_null() || total.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, if free.is_null() { "free is NULL" } else { "total is NULL" });
        }
        // `ApiErrorDecorator::MemGetInfoEx`, `api_error.cc:2418-2419` at v8.5.0:
        // outside [RT_MEMORYINFO_DDR, RT_MEMORYINFO_HBM_P2P_HUGE1G], 0..=11
        // (`pkg_inc/runtime/runtime/mem.h:151-164`; the ACL value is cast,
        // `memory.cpp:746`), is RT_ERROR_INVALID_MEMORY_TYPE
        // (`errcode_manage.cc:301`). `ACL_MEM_NORMAL` .. `ACL_MEM_P2P_HUGE1G`
        // (12..=17, `acl_rt.h:192-197`) are accepted only from v9.0.0 on.
        if !(0..=11).contains(&attr) {
            return fail(
                ACL_ERROR_RT_INVALID_MEMORY_TYPE,
                format!("aclrtMemAttr {attr} is outside ACL_DDR_MEM .. ACL_HBM_MEM_P2P_HUGE1G (0..=11)"),
            );
        }
        // `ApiImpl::MemGetInfoEx`, `api_impl.cc:3130-3131`: the thread's context.
        let a = arena::arena(context::current()?)?;
        write_out(free, a.free_bytes(), ACL_ERROR_INVALID_PARAM, "free")?;
        write_out(total, a.total(), ACL_ERROR_INVALID_PARAM, "total")
    })
}

/// `aclError aclrtCreateEvent(aclrtEvent *event)`.
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateEvent(event: *mut AclrtEvent) -> AclError {
    status::acl("aclrtCreateEvent", || {
        crate::counters::bump(|c| c.event_creates += 1);
        if event.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, "event is NULL");
        }
        let d = context::current()?;
        let h = EVENTS.insert(Arc::new(Event::new(d)));
        write_out(event, h as AclrtEvent, ACL_ERROR_INVALID_PARAM, "event")
    })
}

/// `aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag)`:
/// a "new mode" event (`aclrtCreateEventExWithFlagImpl`, runtime
/// `src/acl/aclrt_impl/event.cpp:60-79` at v8.5.0, then `ApiImpl::EventCreateEx`).
/// The flag checks are `ApiErrorDecorator::EventCreateEx`
/// (`src/runtime/feature/src/api_impl/api_error.cc:1186-1207`): `RT_EVENT_EXTERNAL`
/// and `RT_EVENT_IPC` are not OR-able with another bit, and a flag outside
/// `(0, DDSYNC_NS | STREAM_MARK | DDSYNC | TIME_LINE | IPC]` or with none of
/// those bits is `RT_ERROR_INVALID_VALUE` (`ACL_ERROR_RT_PARAM_INVALID`).
/// IPC events are not simulated (refused with `ACL_ERROR_RT_FEATURE_NOT_SUPPORT`).
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateEventExWithFlag(event: *mut AclrtEvent, flag: u32) -> AclError {
    use crate::stream::{
        RT_EVENT_DDSYNC, RT_EVENT_DDSYNC_NS, RT_EVENT_EXTERNAL, RT_EVENT_IPC, RT_EVENT_MC2, RT_EVENT_STREAM_MARK,
        RT_EVENT_TIME_LINE,
    };
    status::acl("aclrtCreateEventExWithFlag", || {
        crate::counters::bump(|c| c.event_creates += 1);
        // event.cpp:65: ACL_REQUIRES_NOT_NULL_WITH_INPUT_REPORT(event).
        if event.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, "event is NULL");
        }
        // RT_EVENT_MC2 (0x10, `pkg_inc/runtime/runtime/event.h:60`) is
        // refused with another bit too (`api_error.cc:1657-1663` at HEAD);
        // alone it has none of the bits of `max` below.
        for solely in [RT_EVENT_MC2, RT_EVENT_EXTERNAL, RT_EVENT_IPC] {
            if flag & solely != 0 && flag & !solely != 0 {
                return fail(
                    ACL_ERROR_RT_PARAM_INVALID,
                    format!("flag {flag:#x}: {solely:#x} does not support OR operations with other flags"),
                );
            }
        }
        let max = RT_EVENT_DDSYNC_NS | RT_EVENT_STREAM_MARK | RT_EVENT_DDSYNC | RT_EVENT_TIME_LINE | RT_EVENT_IPC;
        if flag & max == 0 || flag > max {
            return fail(ACL_ERROR_RT_PARAM_INVALID, format!("flag {flag:#x} is outside (0, {max:#x}]"));
        }
        if flag == RT_EVENT_IPC {
            return fail(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "IPC events are not simulated");
        }
        let d = context::current()?;
        let h = EVENTS.insert(Arc::new(Event::with_flag(d, flag, true)));
        write_out(event, h as AclrtEvent, ACL_ERROR_INVALID_PARAM, "event")
    })
}

/// Events per device that can synchronise streams: "单个Device支持的Event最大数"
/// 65536 on Atlas A2/A3 (API reference, `docs/api_docs/aclrtCreateEvent.md`
/// and `aclrtCreateEventExWithFlag.md` of the runtime at v8.5.0; the runtime's
/// `MAX_EVENT_ID_NUM = 65536U`, `src/runtime/feature/inc/spec/base_info.hpp:272`).
/// The resource is taken by an event's first record (same pages) and given
/// back when the event is destroyed.
pub const MAX_SYNC_EVENTS_PER_DEVICE: usize = 65536;

fn sync_event_counts() -> std::sync::MutexGuard<'static, BTreeMap<u32, usize>> {
    static COUNTS: Mutex<BTreeMap<u32, usize>> = Mutex::new(BTreeMap::new());
    COUNTS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes one of `e`'s device's event resources at its first record. Stricter
/// than CANN: at the limit its runtime "waits for resources to be released"
/// (the pages above), which never happens while every event stays alive, so
/// the simulator fails with `ACL_ERROR_RT_NO_EVENT_RESOURCE` instead of hanging.
fn take_event_resource(e: &Event) -> SimResult<()> {
    use std::sync::atomic::Ordering;
    if e.without_wait_task() || e.holds_resource.load(Ordering::Acquire) {
        return Ok(());
    }
    let mut counts = sync_event_counts();
    let n = counts.entry(e.device).or_default();
    if *n >= MAX_SYNC_EVENTS_PER_DEVICE {
        return fail(
            ACL_ERROR_RT_NO_EVENT_RESOURCE,
            format!(
                "device {} already has {MAX_SYNC_EVENTS_PER_DEVICE} recorded synchronising events alive (the A2/A3 \
                 limit); destroy or reuse events",
                e.device
            ),
        );
    }
    *n += 1;
    e.holds_resource.store(true, Ordering::Release);
    Ok(())
}

fn give_back_event_resource(e: &Event) {
    if e.holds_resource.swap(false, std::sync::atomic::Ordering::AcqRel) {
        if let Some(n) = sync_event_counts().get_mut(&e.device) {
            *n = n.saturating_sub(1);
        }
    }
}

/// `aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn aclrtRecordEvent(event: AclrtEvent, stream: AclrtStream) -> AclError {
    status::acl("aclrtRecordEvent", || {
        acl_rules::record_event(event, stream)?;
        let e = context::event(event as usize)?;
        // ApiImpl::EventRecord: the stream must belong to the thread's context.
        let s = crate::capture::stream_here(stream as usize)?;
        // An event is recorded on a stream of the device it was created on:
        // hicann/runtime v9.1.0 `docs/02_dev_guide/05_多设备编程.md:90` says the
        // record fails otherwise. Its runtime source has no such check, so
        // the code is the simulator's choice.
        if e.device != s.device {
            return fail(
                ACL_ERROR_RT_STREAM_CONTEXT,
                format!("event of device {} recorded on a stream of device {}", e.device, s.device),
            );
        }
        let captured = match crate::capture::check_record(&e, &s)? {
            crate::capture::RecordKind::Skipped => return Ok(()),
            crate::capture::RecordKind::Captured => true,
            crate::capture::RecordKind::Eager => false,
        };
        take_event_resource(&e)?;
        if captured {
            // The model's record task, of the runtime's capture event: the
            // event's own record state is left alone.
            s.enqueue("aclrtRecordEvent", Box::new(|| Ok(())));
        } else {
            e.record(&s);
        }
        crate::capture::record_event(&e, &s);
        Ok(())
    })
}

/// `aclError aclrtSynchronizeEvent(aclrtEvent event)`.
#[no_mangle]
pub extern "C" fn aclrtSynchronizeEvent(event: AclrtEvent) -> AclError {
    status::acl("aclrtSynchronizeEvent", || {
        acl_rules::event_handle(event)?;
        crate::capture::sync_event(event as usize)?;
        let e = context::event(event as usize)?;
        match e.target() {
            None => Ok(()),
            Some((s, seq)) => s.wait_for(seq, None),
        }
    })
}

/// `aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status)`.
/// A query lets the recorded work start (so polling makes progress) and
/// reports whether it has finished.
#[no_mangle]
pub unsafe extern "C" fn aclrtQueryEventStatus(event: AclrtEvent, status_out: *mut i32) -> AclError {
    status::acl("aclrtQueryEventStatus", || {
        acl_rules::query_event_status(event, status_out)?;
        crate::capture::query_event(event as usize)?;
        let e = context::event(event as usize)?;
        if let Some((s, seq)) = e.target() {
            s.release(seq);
        }
        let st =
            if e.query_complete() { ACL_EVENT_RECORDED_STATUS_COMPLETE } else { ACL_EVENT_RECORDED_STATUS_NOT_READY };
        write_out(status_out, st, ACL_ERROR_INVALID_PARAM, "status")
    })
}

/// `aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent)`.
#[no_mangle]
pub unsafe extern "C" fn aclrtEventElapsedTime(ms: *mut f32, start: AclrtEvent, end: AclrtEvent) -> AclError {
    status::acl("aclrtEventElapsedTime", || {
        acl_rules::event_elapsed_time(ms, start, end)?;
        let (a, b) = (context::event(start as usize)?, context::event(end as usize)?);
        // Checked by the rule; a record only ever goes from pending to done.
        let (Some(ta), Some(tb)) = (a.time(), b.time()) else {
            return fail(ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID, "both events must be recorded and complete");
        };
        let v = if tb >= ta { (tb - ta).as_secs_f64() * 1e3 } else { -((ta - tb).as_secs_f64() * 1e3) };
        write_out(ms, v as f32, ACL_ERROR_INVALID_PARAM, "ms")
    })
}

/// `aclError aclrtDestroyEvent(aclrtEvent event)`.
#[no_mangle]
pub extern "C" fn aclrtDestroyEvent(event: AclrtEvent) -> AclError {
    status::acl("aclrtDestroyEvent", || {
        acl_rules::event_handle(event)?;
        EVENTS
            .remove(event as usize)
            .map(|e| give_back_event_resource(&e))
            .ok_or_else(|| SimError::new(ACL_ERROR_RT_INVALID_HANDLE, format!("{event:p} is not a live event")))
    })
}

/// `aclError aclrtGetLastError(aclrtLastErrLevel level)`: the calling thread's
/// last error, then cleared; `aclrtPeekAtLastError` below leaves it. Only
/// `ACL_RT_THREAD_LEVEL` (0) is accepted, anything else is
/// `ACL_ERROR_INVALID_PARAM` (`aclrtGetLastErrorImpl` /
/// `aclrtPeekAtLastErrorImpl`, hicann/runtime `src/acl/aclrt_impl/context.cpp:191-211`
/// at v8.5.0; `ApiImpl::GetLastErr` / `PeekLastErr`, api_impl.cc:7437-7466).
/// The simulator's last error is that of its last failed ACL call on the
/// thread, a kernel launch included. Neither call changes it by failing.
#[no_mangle]
pub extern "C" fn aclrtGetLastError(level: i32) -> AclError {
    last_error("aclrtGetLastError", level, true)
}

/// `aclError aclrtPeekAtLastError(aclrtLastErrLevel level)`: as
/// [`aclrtGetLastError`], without clearing.
#[no_mangle]
pub extern "C" fn aclrtPeekAtLastError(level: i32) -> AclError {
    last_error("aclrtPeekAtLastError", level, false)
}

/// The thread's last error for `aclrtGetLastError` (`clear`) and
/// `aclrtPeekAtLastError`, or the code of their own failure; the boundary
/// does not make that failure the last error.
fn last_error(call: &'static str, level: i32, clear: bool) -> AclError {
    let mut last = ACL_SUCCESS;
    let code = status::guard(call, ACL_ERROR_RT_INTERNAL_ERROR, || {
        if level != 0 {
            return fail(ACL_ERROR_INVALID_PARAM, format!("level {level}: only ACL_RT_THREAD_LEVEL is supported"));
        }
        last = status::last_error(clear);
        Ok(())
    });
    if code != ACL_SUCCESS {
        code
    } else {
        last
    }
}

/// `const char *aclGetRecentErrMsg()`: this thread's most recent error text,
/// or NULL when there is none (`aclGetRecentErrMsgImpl`, hicann/runtime
/// `src/acl/aclrt_impl/acl.cpp:1146-1149` at v8.5.0: "get errorMessage is
/// empty" returns `nullptr`). It takes no argument and refuses nothing, an
/// unknown `CANNSIM_CANN_VERSION` included: it carries that failure's message.
#[no_mangle]
pub extern "C" fn aclGetRecentErrMsg() -> *const c_char {
    status::infallible("aclGetRecentErrMsg", std::ptr::null(), || {
        if status::recent_is_empty() {
            return std::ptr::null();
        }
        status::recent_ptr()
    })
}

/// `const char *aclrtGetSocName()`: `CANNSIM_SOC_NAME`, or NULL when the
/// configuration is refused (CANN returns NULL when it cannot read the SoC
/// version, `acl_rt_impl_base.cpp:192-196`).
#[no_mangle]
pub extern "C" fn aclrtGetSocName() -> *const c_char {
    static NAME: OnceLock<CString> = OnceLock::new();
    status::ptr("aclrtGetSocName", || {
        let name = NAME.get_or_init(|| CString::new(config::get().soc_name.replace('\0', "")).unwrap_or_default());
        Ok(name.as_ptr().cast_mut())
    })
}

/// `aclError aclrtGetVersion(int32_t *majorVersion, int32_t *minorVersion, int32_t *patchVersion)`:
/// 1.16.0, the interface version of CANN 8.5.0 (hicann/runtime v8.5.0
/// `include/external/acl/acl_rt.h:25-27`; 1.17.0 from v9.0.0). The headers of
/// 8.1 and 8.3 are not public source, so those releases report it too.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetVersion(major: *mut i32, minor: *mut i32, patch: *mut i32) -> AclError {
    status::acl("aclrtGetVersion", || {
        // acl `acl_rt_impl_base.cpp:204-206`: all three before any is written.
        for (p, what) in [(major, "majorVersion"), (minor, "minorVersion"), (patch, "patchVersion")] {
            if p.is_null() {
                return fail(ACL_ERROR_INVALID_PARAM, format!("{what} is NULL"));
            }
        }
        write_out(major, 1, ACL_ERROR_INVALID_PARAM, "majorVersion")?;
        write_out(minor, 16, ACL_ERROR_INVALID_PARAM, "minorVersion")?;
        write_out(patch, 0, ACL_ERROR_INVALID_PARAM, "patchVersion")
    })
}
