//! The ACL runtime rules of `src/acl_rules.rs` (and the checks in acl.rs and
//! context.rs they complete): one test per rule, each proving the refusal
//! through CANN's C signatures with the code real CANN returns. The sources
//! are cited next to each check and in README.md's rules table.
//!
//! The current device is per thread, so every test sets its own device, and
//! the tests about a thread without a device spawn a fresh thread.

mod common;

use std::ffi::c_void;

use common::*;

const NULL: Ptr = std::ptr::null_mut();

const ACL_ERROR_INVALID_PARAM: i32 = 100000;
const ACL_ERROR_RT_PARAM_INVALID: i32 = 107000;
const ACL_ERROR_RT_CONTEXT_NULL: i32 = 107002;
const ACL_ERROR_RT_STREAM_CONTEXT: i32 = 107003;
const ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID: i32 = 107006;
const ACL_ERROR_RT_INVALID_MEMORY_TYPE: i32 = 107016;
const ACL_ERROR_RT_INTERNAL_ERROR: i32 = 507000;
const ACL_ERROR_RT_FEATURE_NOT_SUPPORT: i32 = 207000;

/// Runs `f` on a new thread that never called `aclrtSetDevice` (after this
/// process's `aclInit`, which the caller's `use_device` did).
fn on_a_thread_without_a_device(f: impl FnOnce(&'static Api) + Send) {
    std::thread::scope(|sc| {
        sc.spawn(|| f(sim())).join().expect("the thread without a device panicked");
    });
}

#[test]
fn a_size_that_overflows_with_the_malloc_padding_is_refused() {
    let s = use_device(0);
    let mut p = NULL;
    unsafe {
        assert_eq!((s.aclrtMalloc)(&mut p, usize::MAX - 10, 0), ACL_ERROR_INVALID_PARAM);
        assert!(err_msg().contains("overflows"), "{}", err_msg());
        assert_eq!((s.aclrtMalloc)(NULL as *mut Ptr, 64, 0), ACL_ERROR_INVALID_PARAM, "devPtr NULL");
    }
    assert!(p.is_null(), "nothing was written through devPtr");
}

#[test]
fn free_host_refuses_null_and_memory_it_did_not_allocate() {
    let s = use_device(0);
    let mut host = [0u8; 64];
    unsafe {
        assert_eq!((s.aclrtFreeHost)(NULL), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtFreeHost)(host.as_mut_ptr() as Ptr), ACL_ERROR_RT_PARAM_INVALID, "malloc'd host memory");
        let mut pinned = NULL;
        assert_eq!((s.aclrtMallocHost)(&mut pinned, 64), 0);
        assert_eq!((s.aclrtFreeHost)(pinned), 0);
        assert_eq!((s.aclrtFreeHost)(pinned), ACL_ERROR_RT_PARAM_INVALID, "double free");
    }
}

#[test]
fn a_copy_needs_a_current_device_even_between_host_buffers() {
    use_device(0);
    on_a_thread_without_a_device(|s| {
        let (src, mut dst) = ([1u8; 16], [0u8; 16]);
        unsafe {
            let r = (s.aclrtMemcpy)(dst.as_mut_ptr() as Ptr, 16, src.as_ptr() as *const c_void, 16, H2H);
            assert_eq!(r, ACL_ERROR_RT_CONTEXT_NULL, "{}", err_msg());
        }
        assert_eq!(dst, [0u8; 16], "nothing was copied");
    });
}

#[test]
fn a_count_above_dest_max_is_refused_by_both_copies() {
    let s = use_device(1);
    let dev = malloc(128);
    let st = stream();
    let host = [0u8; 128];
    unsafe {
        let hp = host.as_ptr() as *const c_void;
        assert_eq!((s.aclrtMemcpy)(dev, 64, hp, 65, H2D), ACL_ERROR_RT_PARAM_INVALID);
        assert!(err_msg().contains("destMax"), "{}", err_msg());
        assert_eq!((s.aclrtMemcpyAsync)(dev, 64, hp, 65, H2D, st), ACL_ERROR_RT_PARAM_INVALID);
        assert_eq!((s.aclrtMemcpyAsync)(dev, 0, hp, 1, H2D, st), ACL_ERROR_RT_PARAM_INVALID, "destMax 0");
    }
    destroy_stream(st);
    free(dev);
}

#[test]
fn copy_kinds_outside_the_acl_mapping_are_refused() {
    let s = use_device(1);
    let (a, b) = (malloc(64), malloc(64));
    let st = stream();
    unsafe {
        // ACL_MEMCPY_INNER_DEVICE_TO_DEVICE (6), ACL_MEMCPY_INTER_DEVICE_TO_DEVICE (7), and beyond.
        for kind in [6, 7, 8, -1] {
            assert_eq!((s.aclrtMemcpy)(a, 64, b, 64, kind), ACL_ERROR_INVALID_PARAM, "aclrtMemcpy kind {kind}");
            assert_eq!(
                (s.aclrtMemcpyAsync)(a, 64, b, 64, kind, st),
                ACL_ERROR_INVALID_PARAM,
                "aclrtMemcpyAsync kind {kind}"
            );
        }
        assert!(err_msg().contains("aclrtMemcpyKind"), "{}", err_msg());
        // ACL_MEMCPY_DEVICE_TO_DEVICE itself is fine.
        assert_eq!((s.aclrtMemcpyAsync)(a, 64, b, 64, D2D, st), 0, "{}", err_msg());
    }
    sync(st);
    destroy_stream(st);
    free(a);
    free(b);
}

#[test]
fn zero_byte_copies_and_memsets_are_refused_after_the_null_checks() {
    let s = use_device(1);
    let st = stream();
    let dev = malloc(64);
    let host = [7u8; 64];
    let hp = host.as_ptr() as *const c_void;
    unsafe {
        // acl memory.cpp:528-529, :572-573, :552, :627: NULL first, whatever the count.
        assert_eq!((s.aclrtMemcpy)(NULL, 0, NULL, 0, H2D), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtMemcpyAsync)(NULL, 0, NULL, 0, H2D, st), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtMemset)(NULL, 0, 0, 0), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtMemsetAsync)(NULL, 0, 0, 0, st), ACL_ERROR_INVALID_PARAM);
        // api_error.cc:1570, :1612, :2362, :2373: ZERO_RETURN_AND_MSG_OUTER(cnt).
        assert_eq!((s.aclrtMemcpy)(dev, 64, hp, 0, H2D), ACL_ERROR_RT_PARAM_INVALID);
        assert!(err_msg().contains("count is 0"), "{}", err_msg());
        assert_eq!((s.aclrtMemcpyAsync)(dev, 64, hp, 0, H2D, st), ACL_ERROR_RT_PARAM_INVALID);
        assert_eq!((s.aclrtMemset)(dev, 64, 0, 0), ACL_ERROR_RT_PARAM_INVALID);
        assert_eq!((s.aclrtMemsetAsync)(dev, 64, 0, 0, st), ACL_ERROR_RT_PARAM_INVALID);
        // api_error.cc:1569: the synchronous copy also refuses destMax 0.
        assert_eq!((s.aclrtMemcpy)(dev, 0, hp, 0, H2D), ACL_ERROR_RT_PARAM_INVALID);
        assert!(err_msg().contains("destMax is 0"), "{}", err_msg());
    }
    sync(st);
    assert_eq!(download::<u8>(dev, 64), vec![0xFF; 64], "nothing was touched");
    free(dev);
    destroy_stream(st);
}

#[test]
fn a_synchronous_copy_onto_itself_succeeds_before_the_context_is_looked_for() {
    use_device(0);
    on_a_thread_without_a_device(|s| {
        let mut buf = [3u8; 16];
        let p = buf.as_mut_ptr() as Ptr;
        unsafe {
            // api_error.cc:1577 returns success before ApiImpl::MemCopySync
            // (api_impl.cc:2685) asks for a context.
            assert_eq!((s.aclrtMemcpy)(p, 16, p, 16, H2H), 0, "{}", err_msg());
            // A copy between two buffers still needs one.
            let q = (p as usize + 8) as Ptr;
            assert_eq!((s.aclrtMemcpy)(p, 8, q, 8, H2H), ACL_ERROR_RT_CONTEXT_NULL);
        }
        assert_eq!(buf, [3u8; 16]);
    });
}

#[test]
fn an_async_host_to_host_copy_is_refused_before_the_streams_device_is_checked() {
    let s = use_device(1);
    let other = stream();
    let s = {
        let _ = s;
        use_device(0)
    };
    let (a, b) = ([1u8; 64], [0u8; 64]);
    let dev = malloc(64);
    unsafe {
        // api_error.cc:1656-1657 (h2h) comes before ApiImpl::MemcpyAsync's
        // stream context (api_impl.cc:2761-2762).
        let r = (s.aclrtMemcpyAsync)(b.as_ptr() as Ptr, 64, a.as_ptr() as *const c_void, 64, H2H, other);
        assert_eq!(r, ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "{}", err_msg());
        // api_error.cc:1658-1659: a device copy onto itself queues nothing, so
        // the stream is not looked at.
        assert_eq!((s.aclrtMemcpyAsync)(dev, 64, dev, 64, D2D, other), 0, "{}", err_msg());
        // Another copy on that stream is refused.
        let r = (s.aclrtMemcpyAsync)(dev, 64, a.as_ptr() as *const c_void, 64, H2D, other);
        assert_eq!(r, ACL_ERROR_RT_STREAM_CONTEXT);
    }
    assert_eq!(b, [0u8; 64]);
    free(dev);
    use_device(1);
    destroy_stream(other);
    use_device(0);
}

#[test]
fn a_memset_needs_a_current_device() {
    use_device(2);
    let dev = malloc(64) as usize;
    on_a_thread_without_a_device(|s| unsafe {
        assert_eq!((s.aclrtMemset)(dev as Ptr, 64, 0, 64), ACL_ERROR_RT_CONTEXT_NULL, "{}", err_msg());
    });
    assert_eq!(download::<u8>(dev as Ptr, 64), vec![0xFF; 64], "the memory was not touched");
    free(dev as Ptr);
}

#[test]
fn a_memset_count_above_max_count_is_refused() {
    let s = use_device(2);
    let dev = malloc(128);
    let st = stream();
    unsafe {
        assert_eq!((s.aclrtMemset)(dev, 64, 0, 65), ACL_ERROR_RT_PARAM_INVALID);
        assert!(err_msg().contains("maxCount"), "{}", err_msg());
        assert_eq!((s.aclrtMemsetAsync)(dev, 64, 0, 65, st), ACL_ERROR_RT_PARAM_INVALID);
    }
    sync(st);
    assert_eq!(download::<u8>(dev, 128), vec![0xFF; 128], "nothing was set");
    destroy_stream(st);
    free(dev);
}

#[test]
fn a_memset_of_host_memory_not_from_malloc_host_is_refused() {
    let s = use_device(2);
    let mut host = [7u8; 64];
    let st = stream();
    unsafe {
        let hp = host.as_mut_ptr() as Ptr;
        assert_eq!((s.aclrtMemset)(hp, 64, 0, 64), ACL_ERROR_RT_PARAM_INVALID);
        assert!(err_msg().contains("aclrtMallocHost"), "{}", err_msg());
        assert_eq!((s.aclrtMemsetAsync)(hp, 64, 0, 64, st), ACL_ERROR_RT_PARAM_INVALID);
        // aclrtMallocHost memory may be set, but only inside the buffer.
        let mut pinned = NULL;
        assert_eq!((s.aclrtMallocHost)(&mut pinned, 64), 0);
        assert_eq!((s.aclrtMemset)(pinned, 64, 3, 64), 0, "{}", err_msg());
        assert_eq!(std::slice::from_raw_parts(pinned as *const u8, 64), &[3u8; 64][..]);
        assert_eq!((s.aclrtMemset)((pinned as usize + 32) as Ptr, 64, 0, 64), ACL_ERROR_RT_PARAM_INVALID, "overrun");
        assert_eq!((s.aclrtFreeHost)(pinned), 0);
    }
    assert_eq!(host, [7u8; 64]);
    destroy_stream(st);
}

#[test]
fn a_stream_is_destroyed_only_from_its_own_device() {
    let s = use_device(3);
    let st = stream() as usize;
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let s = use_device(2);
            unsafe { assert_eq!((s.aclrtDestroyStream)(st as Ptr), ACL_ERROR_RT_STREAM_CONTEXT, "{}", err_msg()) };
        });
    });
    on_a_thread_without_a_device(|s| unsafe {
        assert_eq!((s.aclrtDestroyStream)(st as Ptr), ACL_ERROR_RT_CONTEXT_NULL);
    });
    unsafe {
        assert_eq!((s.aclrtDestroyStream)(NULL), ACL_ERROR_INVALID_PARAM, "the default stream");
        assert_eq!((s.aclrtDestroyStream)(st as Ptr), 0, "the stream survived the refusals");
    }
}

#[test]
fn a_stream_sync_needs_a_current_device() {
    use_device(3);
    let st = stream() as usize;
    on_a_thread_without_a_device(|s| unsafe {
        assert_eq!((s.aclrtSynchronizeStream)(st as Ptr), ACL_ERROR_RT_CONTEXT_NULL);
        assert_eq!((s.aclrtSynchronizeStreamWithTimeout)(st as Ptr, 1000), ACL_ERROR_RT_CONTEXT_NULL);
    });
    destroy_stream(st as Ptr);
}

#[test]
fn a_sync_timeout_is_minus_one_or_positive() {
    let s = use_device(3);
    let st = stream();
    unsafe {
        assert_eq!((s.aclrtSynchronizeStreamWithTimeout)(st, 0), ACL_ERROR_RT_PARAM_INVALID);
        assert_eq!((s.aclrtSynchronizeStreamWithTimeout)(st, -2), ACL_ERROR_RT_PARAM_INVALID);
        assert!(err_msg().contains("timeout -2"), "{}", err_msg());
        assert_eq!((s.aclrtSynchronizeStreamWithTimeout)(st, -1), 0);
        assert_eq!((s.aclrtSynchronizeStreamWithTimeout)(st, 1), 0);
    }
    destroy_stream(st);
}

#[test]
fn event_calls_refuse_null_handles() {
    let s = use_device(0);
    let st = stream();
    let mut e = NULL;
    unsafe {
        assert_eq!((s.aclrtCreateEvent)(NULL as *mut Ptr), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtCreateEvent)(&mut e), 0);
        let mut status = 0;
        let mut ms = 0f32;
        assert_eq!((s.aclrtRecordEvent)(NULL, st), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtStreamWaitEvent)(st, NULL), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtSynchronizeEvent)(NULL), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtQueryEventStatus)(NULL, &mut status), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtQueryEventStatus)(e, std::ptr::null_mut()), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtEventElapsedTime)(&mut ms, NULL, e), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtEventElapsedTime)(&mut ms, e, NULL), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtEventElapsedTime)(std::ptr::null_mut(), e, e), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtDestroyEvent)(NULL), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtDestroyEvent)(e), 0);
    }
    destroy_stream(st);
}

#[test]
fn elapsed_time_needs_two_recorded_and_completed_events() {
    let s = use_device(0);
    let st = stream();
    let (mut a, mut b) = (NULL, NULL);
    let mut ms = -1f32;
    unsafe {
        assert_eq!((s.aclrtCreateEvent)(&mut a), 0);
        assert_eq!((s.aclrtCreateEvent)(&mut b), 0);
        // Never recorded: Event::ElapsedTime's RT_ERROR_EVENT_RECORDER_NULL.
        assert_eq!((s.aclrtEventElapsedTime)(&mut ms, a, b), ACL_ERROR_RT_INTERNAL_ERROR);
        assert!(err_msg().contains("never recorded"), "{}", err_msg());
        assert_eq!((s.aclrtRecordEvent)(a, st), 0);
        assert_eq!((s.aclrtEventElapsedTime)(&mut ms, a, b), ACL_ERROR_RT_INTERNAL_ERROR, "end never recorded");
        assert_eq!((s.aclrtRecordEvent)(b, st), 0);
        // Recorded, not run yet (lazy stream): no timestamp.
        assert_eq!((s.aclrtEventElapsedTime)(&mut ms, a, b), ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID);
        assert_eq!(ms, -1.0, "ms untouched on failure");
    }
    sync(st);
    unsafe {
        assert_eq!((s.aclrtEventElapsedTime)(&mut ms, a, b), 0, "{}", err_msg());
        assert!(ms >= 0.0, "{ms}");
        assert_eq!((s.aclrtDestroyEvent)(a), 0);
        assert_eq!((s.aclrtDestroyEvent)(b), 0);
    }
    destroy_stream(st);
}

/// `ACL_EVENT_SYNC` (acl_rt.h).
const ACL_EVENT_SYNC: u32 = 0x1;
/// `ACL_EVENT_TIME_LINE` (acl_rt.h).
const ACL_EVENT_TIME_LINE: u32 = 0x8;

/// Only events that keep a timestamp time: `aclrtCreateEvent`'s, and those
/// created with `ACL_EVENT_TIME_LINE`. Two recorded and completed
/// `ACL_EVENT_SYNC` events, or one of them with a timed event, are refused
/// with the code of a missing timestamp, naming the event without it.
#[test]
fn elapsed_time_needs_events_that_keep_a_timestamp() {
    let s = use_device(0);
    let st = stream();
    let (mut timed, mut sync_only, mut sync_timed) = (NULL, NULL, NULL);
    let mut ms = -1f32;
    unsafe {
        assert_eq!((s.aclrtCreateEvent)(&mut timed), 0);
        assert_eq!((s.aclrtCreateEventExWithFlag)(&mut sync_only, ACL_EVENT_SYNC), 0);
        assert_eq!((s.aclrtCreateEventExWithFlag)(&mut sync_timed, ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE), 0);
        for e in [timed, sync_only, sync_timed] {
            assert_eq!((s.aclrtRecordEvent)(e, st), 0, "{}", err_msg());
        }
    }
    sync(st);
    unsafe {
        for (a, b, what) in [(sync_only, sync_only, "startEvent"), (timed, sync_only, "endEvent")] {
            assert_eq!((s.aclrtEventElapsedTime)(&mut ms, a, b), ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID);
            assert!(err_msg().contains(what) && err_msg().contains("ACL_EVENT_TIME_LINE"), "{}", err_msg());
            assert_eq!(ms, -1.0, "ms untouched on failure");
        }
        assert_eq!((s.aclrtEventElapsedTime)(&mut ms, timed, sync_timed), 0, "{}", err_msg());
        assert!(ms >= 0.0, "{ms}");
        for e in [timed, sync_only, sync_timed] {
            assert_eq!((s.aclrtDestroyEvent)(e), 0);
        }
    }
    destroy_stream(st);
}

/// An old-mode event (`aclrtCreateEvent`) and a new-mode one
/// (`aclrtCreateEventExWithFlag`, `ACL_EVENT_SYNC`), neither recorded.
fn old_and_new_events(s: &Api) -> (Ptr, Ptr) {
    let (mut old, mut new) = (NULL, NULL);
    unsafe {
        assert_eq!((s.aclrtCreateEvent)(&mut old), 0);
        assert_eq!((s.aclrtCreateEventExWithFlag)(&mut new, ACL_EVENT_SYNC), 0);
    }
    (old, new)
}

fn destroy_events(s: &Api, events: &[Ptr]) {
    for &e in events {
        assert_eq!(unsafe { (s.aclrtDestroyEvent)(e) }, 0);
    }
}

#[test]
fn a_stream_waits_for_an_aclrt_create_event_event_only_once_it_is_recorded() {
    let s = use_device(0);
    let st = stream();
    let (old, new) = old_and_new_events(s);
    unsafe {
        // Event::Wait: "the wait event cannot be submitted before the record event".
        assert_eq!((s.aclrtStreamWaitEvent)(st, old), ACL_ERROR_RT_PARAM_INVALID, "{}", err_msg());
        assert!(err_msg().contains("before it is recorded"), "{}", err_msg());
        // A new-mode event never recorded: the wait does nothing.
        assert_eq!((s.aclrtStreamWaitEvent)(st, new), 0, "{}", err_msg());
        assert_eq!((s.aclrtRecordEvent)(old, st), 0);
        assert_eq!((s.aclrtStreamWaitEvent)(st, old), 0, "{}", err_msg());
    }
    sync(st);
    destroy_events(s, &[old, new]);
    destroy_stream(st);
}

#[test]
fn a_never_recorded_event_is_complete_in_new_mode_only() {
    let s = use_device(0);
    let st = stream();
    let (old, new) = old_and_new_events(s);
    let status = |e: Ptr| {
        let mut v = -1;
        assert_eq!(unsafe { (s.aclrtQueryEventStatus)(e, &mut v) }, 0, "{}", err_msg());
        v
    };
    // Event::QueryEventStatus: RT_EVENT_INIT (not ready) for the old mode,
    // RT_EVENT_RECORDED (complete) for the new one.
    assert_eq!(status(old), 0, "an aclrtCreateEvent event never recorded is not ready");
    assert_eq!(status(new), 1, "an aclrtCreateEventExWithFlag event never recorded is complete");
    unsafe { assert_eq!((s.aclrtRecordEvent)(old, st), 0) };
    sync(st);
    assert_eq!(status(old), 1, "recorded and run");
    destroy_events(s, &[old, new]);
    destroy_stream(st);
}

#[test]
fn an_event_is_recorded_only_on_a_stream_of_its_device() {
    let s = use_device(1);
    let mut e = NULL;
    unsafe { assert_eq!((s.aclrtCreateEvent)(&mut e), 0) };
    let e_u = e as usize;
    std::thread::scope(|sc| {
        sc.spawn(move || {
            let s = use_device(2);
            let st = stream();
            unsafe { assert_eq!((s.aclrtRecordEvent)(e_u as Ptr, st), ACL_ERROR_RT_STREAM_CONTEXT, "{}", err_msg()) };
            destroy_stream(st);
        });
    });
    unsafe { assert_eq!((s.aclrtDestroyEvent)(e), 0) };
}

#[test]
fn a_stream_waits_only_for_an_event_of_its_device() {
    // Guide `05_multi_device_programming.md:91-92`: a wait across devices
    // fails; a synchronize or a query of another device's event succeeds.
    let s = use_device(1);
    let src = stream();
    let mut e = NULL;
    unsafe {
        assert_eq!((s.aclrtCreateEvent)(&mut e), 0);
        assert_eq!((s.aclrtRecordEvent)(e, src), 0, "{}", err_msg());
    }
    let e_u = e as usize;
    std::thread::scope(|sc| {
        sc.spawn(move || {
            let s = use_device(2);
            let st = stream();
            let e = e_u as Ptr;
            unsafe {
                assert_eq!((s.aclrtStreamWaitEvent)(st, e), ACL_ERROR_RT_STREAM_CONTEXT, "{}", err_msg());
                assert!(err_msg().contains("device 2 cannot wait for an event of device 1"), "{}", err_msg());
                assert_eq!((s.aclrtSynchronizeEvent)(e), 0, "{}", err_msg());
                let mut v = -1;
                assert_eq!((s.aclrtQueryEventStatus)(e, &mut v), 0, "{}", err_msg());
                assert_eq!(v, 1, "recorded and synchronized");
            }
            destroy_stream(st);
        });
    });
    unsafe {
        // The same wait on a stream of the event's device is taken.
        let other = stream();
        assert_eq!((s.aclrtStreamWaitEvent)(other, e), 0, "{}", err_msg());
        sync(other);
        destroy_stream(other);
        assert_eq!((s.aclrtDestroyEvent)(e), 0);
    }
    destroy_stream(src);
}

#[test]
fn mem_info_refuses_an_unknown_memory_attribute() {
    let s = use_device(1);
    let (mut free_b, mut total) = (0usize, 0usize);
    unsafe {
        // api_error.cc:2418 at v8.5.0: ACL_DDR_MEM .. ACL_HBM_MEM_P2P_HUGE1G
        // (0..=11); ACL_MEM_NORMAL (12) and above arrive with v9.0.0.
        assert_eq!((s.aclrtGetMemInfo)(12, &mut free_b, &mut total), ACL_ERROR_RT_INVALID_MEMORY_TYPE);
        assert_eq!((s.aclrtGetMemInfo)(17, &mut free_b, &mut total), ACL_ERROR_RT_INVALID_MEMORY_TYPE);
        assert_eq!((s.aclrtGetMemInfo)(-1, &mut free_b, &mut total), ACL_ERROR_RT_INVALID_MEMORY_TYPE);
        assert_eq!((total, free_b), (0, 0), "nothing written");
        assert_eq!((s.aclrtGetMemInfo)(1, std::ptr::null_mut(), &mut total), ACL_ERROR_INVALID_PARAM);
        // memory.cpp:742-743: the out-pointers come before the attribute.
        assert_eq!((s.aclrtGetMemInfo)(12, &mut free_b, std::ptr::null_mut()), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtGetMemInfo)(11, &mut free_b, &mut total), 0);
        assert_eq!((s.aclrtGetMemInfo)(1, &mut free_b, &mut total), 0);
    }
    assert!(total > 0);
}

#[test]
fn out_pointers_and_host_sizes_are_checked_before_anything_is_created() {
    let s = use_device(2);
    let mut p = NULL;
    unsafe {
        assert_eq!((s.aclrtMallocHost)(NULL as *mut Ptr, 64), ACL_ERROR_INVALID_PARAM, "hostPtr NULL");
        assert_eq!((s.aclrtMallocHost)(&mut p, 0), ACL_ERROR_INVALID_PARAM, "size 0");
        assert!(p.is_null());
        assert_eq!((s.aclrtCreateStream)(NULL as *mut Ptr), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtGetDevice)(std::ptr::null_mut()), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtGetDeviceCount)(std::ptr::null_mut()), ACL_ERROR_INVALID_PARAM);
        let (mut a, mut b) = (0, 0);
        assert_eq!((s.aclrtGetVersion)(&mut a, &mut b, std::ptr::null_mut()), ACL_ERROR_INVALID_PARAM);
        // acl_rt_impl_base.cpp:204-206: every pointer is checked before any is written.
        assert_eq!((a, b), (0, 0), "nothing written");
    }
}

#[test]
fn get_device_checks_its_pointer_before_the_context_and_malloc_host_needs_a_device() {
    use_device(0);
    on_a_thread_without_a_device(|s| unsafe {
        // device.cpp:139 before ApiImpl::GetDevice (api_impl.cc:3320).
        assert_eq!((s.aclrtGetDevice)(std::ptr::null_mut()), ACL_ERROR_INVALID_PARAM);
        let mut d = -1;
        assert_eq!((s.aclrtGetDevice)(&mut d), ACL_ERROR_RT_CONTEXT_NULL);
        // ApiImpl::HostMalloc, api_impl.cc:2394-2395.
        let mut p = NULL;
        assert_eq!((s.aclrtMallocHost)(&mut p, 64), ACL_ERROR_RT_CONTEXT_NULL, "{}", err_msg());
        assert!(p.is_null());
    });
}

#[test]
fn a_failed_launch_stays_the_threads_last_error_until_aclrt_get_last_error_reads_it() {
    let s = use_device(0);
    unsafe {
        let _earlier = (s.aclrtGetLastError)(0);
        assert_eq!((s.aclrtGetLastError)(0), 0, "a read cleared it");
        // A launch on a stream handle that is not one fails; the launcher
        // returns the code and the thread keeps it as its last error.
        let bogus = 0x7 as Ptr;
        let r = (s.cannsim_launch_kernel)(bogus, 1, None, std::ptr::null(), 0, std::ptr::null(), 0);
        assert_ne!(r, 0);
        assert_eq!((s.aclrtPeekAtLastError)(0), r, "peek reports it");
        assert_eq!((s.aclrtPeekAtLastError)(0), r, "and leaves it");
        // context.cpp:194, 205: only ACL_RT_THREAD_LEVEL.
        assert_eq!((s.aclrtGetLastError)(1), ACL_ERROR_INVALID_PARAM);
        assert_eq!((s.aclrtGetLastError)(0), r, "get reports it");
        assert_eq!((s.aclrtGetLastError)(0), 0, "and clears it");
        // The error of another thread is not this one's.
        let r2 = (s.cannsim_launch_kernel)(bogus, 1, None, std::ptr::null(), 0, std::ptr::null(), 0);
        std::thread::scope(|sc| {
            sc.spawn(|| assert_eq!((sim().aclrtPeekAtLastError)(0), 0)).join().expect("thread");
        });
        assert_eq!((s.aclrtGetLastError)(0), r2);
    }
}

#[test]
fn the_recent_error_message_is_null_until_a_call_fails_on_the_thread() {
    use_device(0);
    on_a_thread_without_a_device(|s| unsafe {
        // acl.cpp:1146-1149: no message is NULL, not "".
        assert!((s.aclGetRecentErrMsg)().is_null(), "a fresh thread has no message");
        assert_eq!((s.aclrtFree)(NULL), ACL_ERROR_INVALID_PARAM);
        let p = (s.aclGetRecentErrMsg)();
        assert!(!p.is_null());
        assert!(std::ffi::CStr::from_ptr(p).to_string_lossy().contains("devPtr is NULL"));
    });
}

#[test]
fn a_copy_between_two_devices_is_refused_without_peer_access() {
    // aclrtMemcpy API reference (Atlas A2): a copy between two devices needs
    // aclrtDeviceEnablePeerAccess first, which the simulator does not export.
    use_device(1);
    let other = malloc(128);
    let s = use_device(0);
    let (mine, st) = (malloc(128), stream());
    unsafe {
        for kind in [D2D, 4] {
            assert_eq!((s.aclrtMemcpy)(mine, 128, other, 128, kind), ACL_ERROR_RT_PARAM_INVALID, "{}", err_msg());
            assert!(err_msg().contains("aclrtDeviceEnablePeerAccess"), "{}", err_msg());
            assert_eq!((s.aclrtMemcpy)(other, 128, mine, 128, kind), ACL_ERROR_RT_PARAM_INVALID, "kind {kind}");
            assert_eq!(
                (s.aclrtMemcpyAsync)(mine, 128, other, 128, kind, st),
                ACL_ERROR_RT_PARAM_INVALID,
                "kind {kind}"
            );
            assert_eq!(
                (s.aclrtMemcpyAsync)(other, 128, mine, 128, kind, st),
                ACL_ERROR_RT_PARAM_INVALID,
                "kind {kind}"
            );
        }
        // On one device the same copies run.
        let mine2 = malloc(128);
        assert_eq!((s.aclrtMemcpy)(mine2, 128, mine, 128, D2D), 0, "{}", err_msg());
        assert_eq!((s.aclrtMemcpyAsync)(mine2, 128, mine, 128, D2D, st), 0, "{}", err_msg());
        sync(st);
        free(mine2);
    }
    free(mine);
    destroy_stream(st);
    use_device(1);
    free(other);
}

/// What `ASCEND_RT_VISIBLE_DEVICES` (value, on a host of 4 devices) makes of
/// the device count: `Ok(n)` devices, or `Err(reason)` (none, the count
/// refused). hicann/runtime v8.5.0 `runtime.cc:4648-4690` (`SplitString`),
/// `:4836-4947` (`GetVisibleDevices`), `api_impl.cc:3239-3276`; the runtime
/// guide `docs/zh/env_vars/ASCEND_RT_VISIBLE_DEVICES.md`.
const VISIBLE_CASES: &[(&str, Result<u32, &str>)] = &[
    ("1", Ok(1)),
    ("1,2,3", Ok(3)),
    // The guide: "1, 2,3" reads 1 (a space ends the list)...
    ("1, 2,3", Ok(1)),
    // ... and an id that is no device of the host ends it too.
    ("1,3,8", Ok(2)),
    ("0,,1", Ok(1)),
    ("1;2", Ok(1)),
    ("0,1,2,3,4", Ok(4)),
    ("0001,2", Ok(2)),
    ("2,1", Err("ascending order")),
    ("1,1", Err("cannot be duplicated")),
    ("", Err("no device id")),
    (" 1", Err("no device id")),
    ("x1", Err("no device id")),
    ("9", Err("no device id")),
    ("99999999999", Err("no device id")),
];

#[test]
fn visible_devices_are_read_as_the_runtime_reads_them() {
    const ACL_ERROR_RT_INVALID_DEVICEID: i32 = 107001;
    const ACL_ERROR_RT_NO_DEVICE: i32 = 207004;
    let name = "visible_devices_are_read_as_the_runtime_reads_them";
    if role().as_deref() == Some("visible") {
        let case: usize = std::env::var("CASE").unwrap().parse().unwrap();
        let (value, expected) = VISIBLE_CASES[case];
        let s = sim();
        let mut count = u32::MAX;
        unsafe {
            // A refused list does not fail the initialisation (runtime.cc:930).
            assert_eq!((s.aclInit)(std::ptr::null()), 0, "{value:?}: {}", err_msg());
            let rc = (s.aclrtGetDeviceCount)(&mut count);
            match expected {
                Ok(n) => {
                    assert_eq!((rc, count), (0, n), "{value:?}: {}", err_msg());
                    // The ids are 0..n, whatever host devices are behind them.
                    assert_eq!((s.aclrtSetDevice)(n as i32 - 1), 0, "{value:?}: {}", err_msg());
                    assert_eq!((s.aclrtResetDevice)(n as i32 - 1), 0, "{value:?}: {}", err_msg());
                    assert_eq!((s.aclrtSetDevice)(n as i32), ACL_ERROR_RT_INVALID_DEVICEID, "{value:?}");
                    assert!(err_msg().contains(&format!("{n} of the host's 4 are visible")), "{}", err_msg());
                }
                Err(why) => {
                    assert_eq!(rc, ACL_ERROR_RT_NO_DEVICE, "{value:?}");
                    assert_eq!(count, u32::MAX, "{value:?}: a refused count is not written");
                    assert!(
                        err_msg().contains("ASCEND_RT_VISIBLE_DEVICES") && err_msg().contains(why),
                        "{}",
                        err_msg()
                    );
                    assert_eq!((s.aclrtSetDevice)(0), ACL_ERROR_RT_INVALID_DEVICEID, "{value:?}");
                    assert!(err_msg().contains(why), "{}", err_msg());
                }
            }
        }
        return;
    }
    for (case, (value, _)) in VISIBLE_CASES.iter().enumerate() {
        let case = case.to_string();
        let env = [("CASE", case.as_str()), ("CANNSIM_DEVICES", "4"), ("ASCEND_RT_VISIBLE_DEVICES", value)];
        assert_child_passed(&run_child(name, "visible", &env), &format!("ASCEND_RT_VISIBLE_DEVICES={value:?}"));
    }
}
