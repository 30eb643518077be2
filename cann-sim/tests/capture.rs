//! ACL graph capture on the simulator, through CANN's C signatures: work
//! queued on a capturing stream is recorded, not run; a replay reruns it on the
//! same buffers with whatever they hold then; every call CANN forbids during
//! capture fails with its code and invalidates the capture; HCCL collectives
//! captured on 4 devices replay together; the host-side call counters.
//!
//! Capture modes act across threads (GLOBAL forbids unsafe calls on every
//! thread), so the tests of this binary take [`serial`] and never overlap.

mod common;

use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard, OnceLock};

use common::*;

const NULL: Ptr = std::ptr::null_mut();

const GLOBAL: i32 = 0;
const THREAD_LOCAL: i32 = 1;
const RELAXED: i32 = 2;

const STATUS_NONE: i32 = 0;
const STATUS_ACTIVE: i32 = 1;

const INVALID_PARAM: i32 = 100000;
const CONTEXT_NULL: i32 = 107002;
const STREAM_CONTEXT: i32 = 107003;
const MODEL_CONTEXT: i32 = 107004;
const INVALID_HANDLE: i32 = 107017;
const CAPTURE_DEPENDENCY: i32 = 107024;
const STREAM_UNJOINED: i32 = 107025;
const MODEL_CAPTURED: i32 = 107026;
const STREAM_CAPTURED: i32 = 107027;
const EVENT_CAPTURED: i32 = 107028;
const STREAM_NOT_CAPTURED: i32 = 107029;
const CAPTURE_MODE_NOT_SUPPORT: i32 = 107030;
const STREAM_CAPTURE_IMPLICIT: i32 = 107031;
const STREAM_CAPTURE_UNMATCHED: i32 = 107036;
const MODEL_RUNNING: i32 = 107037;
const STREAM_CAPTURE_WRONG_THREAD: i32 = 107038;
const STREAM_CAPTURE_INVALIDATED: i32 = 507903;

/// `CannsimCounters`, field for field.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counters {
    host_syncs: u64,
    device_mallocs: u64,
    device_frees: u64,
    host_mallocs: u64,
    host_frees: u64,
    h2d_copies: u64,
    d2h_copies: u64,
    queries: u64,
    event_creates: u64,
    d2d_copies: u64,
}

/// The capture exports, with their C signatures.
struct Capture {
    begin: unsafe extern "C" fn(Ptr, i32) -> i32,
    get_info: unsafe extern "C" fn(Ptr, *mut i32, *mut Ptr) -> i32,
    end: unsafe extern "C" fn(Ptr, *mut Ptr) -> i32,
    execute: unsafe extern "C" fn(Ptr, Ptr) -> i32,
    destroy: unsafe extern "C" fn(Ptr) -> i32,
    sync_device: unsafe extern "C" fn() -> i32,
    exchange: unsafe extern "C" fn(*mut i32) -> i32,
    counters: unsafe extern "C" fn(*mut Counters) -> i32,
    counters_reset: unsafe extern "C" fn(),
    _lib: libloading::Library,
}

fn cap() -> &'static Capture {
    static C: OnceLock<Capture> = OnceLock::new();
    C.get_or_init(|| {
        sim();
        // SAFETY: the same library `sim()` loaded (dlopen returns the loaded
        // instance); each symbol is read with its C signature.
        unsafe {
            let lib = libloading::Library::new(lib_path()).expect("load libcann_sim.so");
            Capture {
                begin: *lib.get(b"aclmdlRICaptureBegin\0").expect("aclmdlRICaptureBegin"),
                get_info: *lib.get(b"aclmdlRICaptureGetInfo\0").expect("aclmdlRICaptureGetInfo"),
                end: *lib.get(b"aclmdlRICaptureEnd\0").expect("aclmdlRICaptureEnd"),
                execute: *lib.get(b"aclmdlRIExecuteAsync\0").expect("aclmdlRIExecuteAsync"),
                destroy: *lib.get(b"aclmdlRIDestroy\0").expect("aclmdlRIDestroy"),
                sync_device: *lib.get(b"aclrtSynchronizeDevice\0").expect("aclrtSynchronizeDevice"),
                exchange: *lib.get(b"aclmdlRICaptureThreadExchangeMode\0").expect("aclmdlRICaptureThreadExchangeMode"),
                counters: *lib.get(b"cannsim_counters\0").expect("cannsim_counters"),
                counters_reset: *lib.get(b"cannsim_counters_reset\0").expect("cannsim_counters_reset"),
                _lib: lib,
            }
        }
    })
}

fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|e| e.into_inner())
}

fn begin(st: Ptr, mode: i32) {
    let r = unsafe { (cap().begin)(st, mode) };
    assert_eq!(r, 0, "aclmdlRICaptureBegin: {}", err_msg());
}

fn info(st: Ptr) -> (i32, Ptr) {
    let (mut status, mut model) = (-1, NULL);
    let r = unsafe { (cap().get_info)(st, &mut status, &mut model) };
    assert_eq!(r, 0, "aclmdlRICaptureGetInfo: {}", err_msg());
    (status, model)
}

fn end(st: Ptr) -> Ptr {
    let mut model = NULL;
    let r = unsafe { (cap().end)(st, &mut model) };
    assert_eq!(r, 0, "aclmdlRICaptureEnd: {}", err_msg());
    assert!(!model.is_null());
    model
}

fn execute(model: Ptr, st: Ptr) {
    let r = unsafe { (cap().execute)(model, st) };
    assert_eq!(r, 0, "aclmdlRIExecuteAsync: {}", err_msg());
}

fn destroy(model: Ptr) {
    let r = unsafe { (cap().destroy)(model) };
    assert_eq!(r, 0, "aclmdlRIDestroy: {}", err_msg());
}

/// `aclmdlRICaptureThreadExchangeMode`: sets this thread's capture mode to
/// `mode`, returns the one it had.
fn exchange(mode: i32) -> i32 {
    let mut m = mode;
    let r = unsafe { (cap().exchange)(&mut m) };
    assert_eq!(r, 0, "aclmdlRICaptureThreadExchangeMode({mode}): {}", err_msg());
    m
}

fn counters() -> Counters {
    let mut c = Counters::default();
    assert_eq!(unsafe { (cap().counters)(&mut c) }, 0);
    c
}

fn write<T: Copy>(dst: Ptr, v: &[T]) {
    let b = bytes_of(v);
    let r = unsafe { (sim().aclrtMemcpy)(dst, b.len(), b.as_ptr() as *const c_void, b.len(), H2D) };
    assert_eq!(r, 0, "H2D: {}", err_msg());
}

fn malloc_host(bytes: usize) -> Ptr {
    let mut p = NULL;
    assert_eq!(unsafe { (sim().aclrtMallocHost)(&mut p, bytes) }, 0, "{}", err_msg());
    p
}

/// `ACL_EVENT_SYNC` (acl_rt.h).
const ACL_EVENT_SYNC: u32 = 0x1;
/// `ACL_EVENT_TIME_LINE` (acl_rt.h).
const ACL_EVENT_TIME_LINE: u32 = 0x8;
const FEATURE_NOT_SUPPORT: i32 = 207000;
const RT_PARAM_INVALID: i32 = 107000;
const NO_EVENT_RESOURCE: i32 = 207007;

/// An event streams can wait for inside a capture:
/// `aclrtCreateEventExWithFlag(ACL_EVENT_SYNC)`.
fn event() -> Ptr {
    event_with(ACL_EVENT_SYNC)
}

fn event_with(flag: u32) -> Ptr {
    let mut e = NULL;
    assert_eq!(unsafe { (sim().aclrtCreateEventExWithFlag)(&mut e, flag) }, 0, "{}", err_msg());
    e
}

/// An `aclrtCreateEvent` event (the runtime's old mode).
fn old_event() -> Ptr {
    let mut e = NULL;
    assert_eq!(unsafe { (sim().aclrtCreateEvent)(&mut e) }, 0);
    e
}

fn destroy_event(e: Ptr) {
    assert_eq!(unsafe { (sim().aclrtDestroyEvent)(e) }, 0);
}

/// gm[1][i] = gm[0][i]² for i below tiling[0]; block b takes i = b, b + blocks, ...
unsafe extern "C" fn square(block: u32, blocks: u32, gm: *const Ptr, tiling: *const c_void) {
    let n = unsafe { *(tiling as *const u64) } as usize;
    let (x, y) = unsafe { (*gm as *const f32, *gm.add(1) as *mut f32) };
    for i in (block as usize..n).step_by(blocks as usize) {
        let v = unsafe { *x.add(i) };
        unsafe { *y.add(i) = v * v };
    }
}

#[test]
fn a_replay_reruns_memsets_copies_a_kernel_and_aclnn_add_on_the_new_inputs() {
    let _g = serial();
    let s = use_device(0);
    const N: usize = 48;
    let st = stream();
    let (a, b, tmp, k_out, out, flag) =
        (malloc(N * 4), malloc(N * 4), malloc(N * 4), malloc(N * 4), malloc(N * 4), malloc(N));
    let (host_in, host_out) = (malloc_host(N * 4), malloc_host(N * 4));
    let (ta, tb, tc) =
        (tensor(&[N as i64], ACL_FLOAT, k_out), tensor(&[N as i64], ACL_FLOAT, b), tensor(&[N as i64], ACL_FLOAT, out));
    let tiling = [N as u64];

    assert_eq!(info(st), (STATUS_NONE, NULL));
    begin(st, GLOBAL);
    let (status, during) = info(st);
    assert_eq!(status, STATUS_ACTIVE);
    assert!(!during.is_null());
    unsafe {
        // flag = 0 (bytes), tmp = a, b += pinned host input
        assert_eq!((s.aclrtMemsetAsync)(flag, N, 0, N, st), 0, "{}", err_msg());
        assert_eq!((s.aclrtMemcpyAsync)(tmp, N * 4, a, N * 4, D2D, st), 0, "{}", err_msg());
        assert_eq!((s.aclrtMemcpyAsync)(b, N * 4, host_in, N * 4, H2D, st), 0, "{}", err_msg());
        // k_out = tmp²
        let gm = [tmp, k_out];
        let r = (s.cannsim_launch_kernel)(st, 3, Some(square), gm.as_ptr(), 2, tiling.as_ptr() as *const c_void, 8);
        assert_eq!(r, 0, "{}", err_msg());
        // out = k_out + 1 * b
        let mut one = 1.0f32;
        let alpha = (s.aclCreateScalar)(&mut one as *mut f32 as Ptr, ACL_FLOAT);
        let (mut ws, mut ex) = (0u64, NULL);
        assert_eq!((s.aclnnAddGetWorkspaceSize)(ta, tb, alpha, tc, &mut ws, &mut ex), 0, "{}", err_msg());
        assert_eq!((s.aclnnAdd)(NULL, 0, ex, st), 0, "{}", err_msg());
        assert_eq!((s.aclDestroyScalar)(alpha), 0);
        // the executor was consumed by the launch, as in eager mode
        assert_eq!((s.aclnnAdd)(NULL, 0, ex, st), 161002);
        assert_eq!((s.aclrtMemcpyAsync)(host_out, N * 4, out, N * 4, D2H, st), 0, "{}", err_msg());
    }
    let model = end(st);
    assert_eq!(model, during, "GetInfo names the model End returns");
    assert_eq!(info(st), (STATUS_NONE, NULL));
    // Recorded, not run: the outputs still hold the fresh-allocation fill.
    sync(st);
    assert!(download::<u8>(out, N * 4).iter().all(|&v| v == 0xFF));
    assert!(download::<u8>(flag, N).iter().all(|&v| v == 0xFF));

    for round in 0..3 {
        let av: Vec<f32> = (0..N).map(|i| (i as f32 - 7.0) * 0.25 + round as f32).collect();
        let hv: Vec<f32> = (0..N).map(|i| (round * 100 + i) as f32 * 0.125).collect();
        write(a, &av);
        write(flag, &[0x5Au8; N]);
        // SAFETY: host_in is an aclrtMallocHost buffer of N f32.
        unsafe { std::ptr::copy_nonoverlapping(hv.as_ptr(), host_in as *mut f32, N) };
        unsafe { (cap().counters_reset)() };
        execute(model, st);
        assert_eq!(counters(), Counters::default(), "a replay makes no host-side call");
        sync(st);
        let want: Vec<f32> = av.iter().zip(&hv).map(|(x, h)| x * x + h).collect();
        assert_eq!(download::<f32>(out, N), want, "round {round}");
        assert_eq!(download::<f32>(b, N), hv, "round {round}: the H2D copy read the host buffer at replay time");
        assert!(download::<u8>(flag, N).iter().all(|&v| v == 0), "round {round}: the memset ran again");
        // SAFETY: host_out is an aclrtMallocHost buffer of N f32, written by the replay's D2H copy.
        let back = unsafe { std::slice::from_raw_parts(host_out as *const f32, N) }.to_vec();
        assert_eq!(back, want, "round {round}: the D2H copy wrote the host buffer");
    }
    destroy(model);
    assert_eq!(unsafe { (cap().execute)(model, st) }, INVALID_HANDLE, "a destroyed model");
    assert_eq!(unsafe { (cap().destroy)(model) }, INVALID_HANDLE, "destroyed twice");
    for t in [ta, tb, tc] {
        destroy_tensor(t);
    }
    for p in [a, b, tmp, k_out, out, flag] {
        free(p);
    }
    unsafe {
        assert_eq!((s.aclrtFreeHost)(host_in), 0);
        assert_eq!((s.aclrtFreeHost)(host_out), 0);
    }
    destroy_stream(st);
}

#[test]
fn a_replay_whose_operand_was_freed_and_allocated_again_fails_and_spares_the_new_owner() {
    // A captured task keeps its operands' addresses: memory freed while the
    // model lives (guide, restriction 7) fails the replay's stream, with
    // ACL_ERROR_RT_DEVICE_MEM_ERROR, instead of writing to the new owner.
    let _g = serial();
    let s = use_device(1);
    const N: usize = 16;
    let st = stream();
    let x = upload(&[3.0f32; N]);
    let y = malloc(N * 4);
    let tiling = [N as u64];
    begin(st, GLOBAL);
    let gm = [x, y];
    let r = unsafe { (s.cannsim_launch_kernel)(st, 2, Some(square), gm.as_ptr(), 2, tiling.as_ptr().cast(), 8) };
    assert_eq!(r, 0, "{}", err_msg());
    let model = end(st);
    execute(model, st);
    sync(st);
    assert_eq!(download::<f32>(y, N), vec![9.0; N]);
    free(y);
    let again = malloc(N * 4);
    assert_eq!(again, y, "a same-size allocation takes the freed address");
    let mine = vec![0x5Au8; N * 4];
    assert_eq!(unsafe { (s.aclrtMemcpy)(again, N * 4, mine.as_ptr().cast(), N * 4, H2D) }, 0);
    execute(model, st);
    assert_eq!(unsafe { (s.aclrtSynchronizeStream)(st) }, 507053);
    let msg = err_msg();
    assert!(msg.contains("cannsim_launch_kernel") && msg.contains(&format!("gm_dev[1] {:#x}", y as usize)), "{msg}");
    assert_eq!(download::<u8>(again, N * 4), mine, "the new owner's bytes are untouched");
    destroy(model);
    free(again);
    free(x);
    destroy_stream(st);
}

/// Begins a GLOBAL capture on a fresh stream, runs `call`, expects `code`, and
/// checks that the capture is then INVALIDATED, refuses further work, and that
/// End fails and ends it. `scratch` is a 64-byte device buffer.
fn refused_under_capture(what: &str, code: i32, scratch: Ptr, call: impl FnOnce(Ptr) -> i32) {
    let st = stream();
    begin(st, GLOBAL);
    assert_eq!(unsafe { (sim().aclrtMemsetAsync)(scratch, 64, 1, 64, st) }, 0, "{what}: {}", err_msg());
    let r = call(st);
    assert_eq!(r, code, "{what}: {}", err_msg());
    // CANN reports the stream's own status, still ACTIVE (context.cc:5069-5090).
    assert_eq!(info(st).0, STATUS_ACTIVE, "{what}: the stream's status");
    assert_eq!(unsafe { (sim().aclrtMemsetAsync)(scratch, 64, 0, 64, st) }, STREAM_CAPTURE_INVALIDATED, "{what}");
    let mut model = 0x1 as Ptr;
    assert_eq!(unsafe { (cap().end)(st, &mut model) }, STREAM_CAPTURE_INVALIDATED, "{what}: End");
    assert!(model.is_null(), "{what}: no model from an invalidated capture");
    assert_eq!(info(st), (STATUS_NONE, NULL), "{what}: the capture ended");
    // The stream works normally again.
    unsafe { assert_eq!((sim().aclrtMemsetAsync)(scratch, 64, 7, 64, st), 0) };
    sync(st);
    assert!(download::<u8>(scratch, 64).iter().all(|&v| v == 7), "{what}");
    destroy_stream(st);
}

#[test]
fn every_call_cann_forbids_during_capture_fails_with_its_code_and_invalidates_the_capture() {
    let _g = serial();
    let s = use_device(0);
    let dev = malloc(256);
    let host: Vec<u8> = vec![1; 256];
    let pageable = vec![0u8; 256];
    let scratch = malloc(64);
    let pinned = malloc_host(64) as usize;
    type Case = (&'static str, i32, Box<dyn FnOnce(Ptr) -> i32>);
    let cases: Vec<Case> = vec![
        ("aclrtSynchronizeStream", STREAM_CAPTURED, Box::new(|st| unsafe { (s.aclrtSynchronizeStream)(st) })),
        (
            "aclrtSynchronizeStreamWithTimeout",
            STREAM_CAPTURED,
            Box::new(|st| unsafe { (s.aclrtSynchronizeStreamWithTimeout)(st, 100) }),
        ),
        ("aclrtSynchronizeDevice", STREAM_CAPTURED, Box::new(|_| unsafe { (cap().sync_device)() })),
        (
            "aclrtSynchronizeEvent on an event recorded in the capture",
            EVENT_CAPTURED,
            Box::new(|st| unsafe {
                let e = event();
                assert_eq!((s.aclrtRecordEvent)(e, st), 0, "{}", err_msg());
                let r = (s.aclrtSynchronizeEvent)(e);
                destroy_event(e);
                r
            }),
        ),
        (
            "aclrtSynchronizeEvent on an event recorded in the capture, then again outside it",
            EVENT_CAPTURED,
            Box::new(|st| unsafe {
                let e = event();
                let outside = stream();
                assert_eq!((s.aclrtRecordEvent)(e, st), 0, "{}", err_msg());
                assert_eq!((s.aclrtRecordEvent)(e, outside), 0, "{}", err_msg());
                let r = (s.aclrtSynchronizeEvent)(e);
                sync(outside);
                destroy_stream(outside);
                destroy_event(e);
                r
            }),
        ),
        (
            "aclrtQueryEventStatus on an event recorded in the capture",
            EVENT_CAPTURED,
            Box::new(|st| unsafe {
                let e = event();
                assert_eq!((s.aclrtRecordEvent)(e, st), 0, "{}", err_msg());
                let mut status = -1;
                let r = (s.aclrtQueryEventStatus)(e, &mut status);
                destroy_event(e);
                r
            }),
        ),
        (
            "aclrtEventElapsedTime with an event recorded in the capture",
            EVENT_CAPTURED,
            Box::new(|st| unsafe {
                let (before, e) = (event(), event());
                assert_eq!((s.aclrtRecordEvent)(e, st), 0, "{}", err_msg());
                let mut ms = 0f32;
                let r = (s.aclrtEventElapsedTime)(&mut ms, before, e);
                destroy_event(before);
                destroy_event(e);
                r
            }),
        ),
        (
            "aclrtMemcpy",
            CAPTURE_MODE_NOT_SUPPORT,
            Box::new(move |_| unsafe { (s.aclrtMemcpy)(dev, 256, host.as_ptr() as *const c_void, 256, H2D) }),
        ),
        ("aclrtMemset", CAPTURE_MODE_NOT_SUPPORT, Box::new(move |_| unsafe { (s.aclrtMemset)(dev, 256, 0, 256) })),
        (
            "aclrtMalloc",
            CAPTURE_MODE_NOT_SUPPORT,
            Box::new(|_| unsafe {
                let mut p = NULL;
                let r = (s.aclrtMalloc)(&mut p, 64, 0);
                assert!(p.is_null(), "the refused allocation returned no memory");
                r
            }),
        ),
        ("aclrtFree", CAPTURE_MODE_NOT_SUPPORT, Box::new(move |_| unsafe { (s.aclrtFree)(dev) })),
        (
            "aclrtMallocHost",
            CAPTURE_MODE_NOT_SUPPORT,
            Box::new(|_| unsafe {
                let mut p = NULL;
                (s.aclrtMallocHost)(&mut p, 64)
            }),
        ),
        ("aclrtFreeHost", CAPTURE_MODE_NOT_SUPPORT, Box::new(move |_| unsafe { (s.aclrtFreeHost)(pinned as Ptr) })),
        (
            "aclrtMemcpyAsync from pageable host memory on the capturing stream",
            STREAM_CAPTURED,
            Box::new(move |st| unsafe {
                (s.aclrtMemcpyAsync)(dev, 256, pageable.as_ptr() as *const c_void, 256, H2D, st)
            }),
        ),
        (
            "work on the default stream",
            STREAM_CAPTURE_IMPLICIT,
            Box::new(move |_| unsafe { (s.aclrtMemsetAsync)(dev, 256, 0, 256, NULL) }),
        ),
        (
            "aclrtStreamWaitEvent on an event recorded outside the capture",
            CAPTURE_DEPENDENCY,
            Box::new(|st| unsafe {
                let other = stream();
                let e = event();
                assert_eq!((s.aclrtRecordEvent)(e, other), 0, "{}", err_msg());
                let r = (s.aclrtStreamWaitEvent)(st, e);
                destroy_event(e);
                destroy_stream(other);
                r
            }),
        ),
        (
            "aclrtDestroyStream of the capturing stream",
            STREAM_CAPTURED,
            Box::new(|st| unsafe { (s.aclrtDestroyStream)(st) }),
        ),
    ];
    for (what, code, call) in cases {
        refused_under_capture(what, code, scratch, call);
    }
    // The refused frees freed nothing: the buffers are still live.
    free(dev);
    assert_eq!(unsafe { (s.aclrtFreeHost)(pinned as Ptr) }, 0, "{}", err_msg());
    free(scratch);
}

#[test]
fn capture_modes_decide_which_threads_may_call_unsafe_functions() {
    let _g = serial();
    let s = use_device(0);
    let dev = malloc(64);
    let host = [3u8; 64];
    let dev = dev as usize;
    let memcpy = move || unsafe { (s.aclrtMemcpy)(dev as Ptr, 64, host.as_ptr() as *const c_void, 64, H2D) };
    let on_other_thread = |f: &(dyn Fn() -> i32 + Sync)| {
        std::thread::scope(|sc| {
            sc.spawn(|| {
                use_device(0);
                f()
            })
            .join()
            .expect("thread")
        })
    };
    let st = stream();

    // GLOBAL: no thread may.
    begin(st, GLOBAL);
    assert_eq!(on_other_thread(&memcpy), CAPTURE_MODE_NOT_SUPPORT, "GLOBAL, another thread");
    assert_eq!(info(st).0, STATUS_ACTIVE, "the stream's status");
    let mut m = NULL;
    assert_eq!(unsafe { (cap().end)(st, &mut m) }, STREAM_CAPTURE_INVALIDATED);

    // THREAD_LOCAL: the capturing thread may not, others may.
    begin(st, THREAD_LOCAL);
    assert_eq!(on_other_thread(&memcpy), 0, "THREAD_LOCAL, another thread: {}", err_msg());
    assert_eq!(info(st).0, STATUS_ACTIVE);
    assert_eq!(memcpy(), CAPTURE_MODE_NOT_SUPPORT, "THREAD_LOCAL, the capturing thread");
    assert_eq!(info(st).0, STATUS_ACTIVE, "the stream's status");
    assert_eq!(unsafe { (cap().end)(st, &mut m) }, STREAM_CAPTURE_INVALIDATED);

    // RELAXED: every thread may; synchronising the stream is still refused.
    begin(st, RELAXED);
    assert_eq!(memcpy(), 0, "RELAXED: {}", err_msg());
    assert_eq!(on_other_thread(&memcpy), 0, "RELAXED, another thread");
    assert_eq!(info(st).0, STATUS_ACTIVE);
    // Pageable host memory: fine on a stream that does not capture, refused in a
    // captured copy whatever the mode.
    let (side, pageable) = (stream(), [5u8; 64]);
    let copy_on =
        |q: Ptr| unsafe { (s.aclrtMemcpyAsync)(dev as Ptr, 64, pageable.as_ptr() as *const c_void, 64, H2D, q) };
    assert_eq!(copy_on(side), 0, "RELAXED, pageable copy on another stream: {}", err_msg());
    sync(side);
    destroy_stream(side);
    assert_eq!(info(st).0, STATUS_ACTIVE);
    let model = end(st);
    destroy(model);
    begin(st, RELAXED);
    // The runtime synchronises the stream before a pageable copy
    // (api_error.cc:1661-1664), which a capturing stream refuses (:1010-1011).
    assert_eq!(copy_on(st), STREAM_CAPTURED, "RELAXED, pageable copy on the capturing stream");
    assert_eq!(unsafe { (cap().end)(st, &mut m) }, STREAM_CAPTURE_INVALIDATED);
    begin(st, RELAXED);
    assert_eq!(unsafe { (s.aclrtSynchronizeStream)(st) }, STREAM_CAPTURED, "synchronisation is illegal in every mode");
    assert_eq!(unsafe { (cap().end)(st, &mut m) }, STREAM_CAPTURE_INVALIDATED);

    // A GLOBAL/THREAD_LOCAL capture ends on the thread that began it; RELAXED anywhere.
    begin(st, GLOBAL);
    let other_end = |st: Ptr| {
        let st = st as usize;
        std::thread::scope(|sc| {
            sc.spawn(move || {
                use_device(0);
                let mut m = NULL;
                let r = unsafe { (cap().end)(st as Ptr, &mut m) };
                (r, m as usize)
            })
            .join()
            .expect("thread")
        })
    };
    assert_eq!(other_end(st), (STREAM_CAPTURE_WRONG_THREAD, 0));
    // The refusal ended the capture without a model (context.cc:4983-4987,
    // v8.5.0): the right thread finds none, and the stream runs work again.
    assert_eq!(info(st), (STATUS_NONE, NULL));
    assert_eq!(unsafe { (cap().end)(st, &mut m) }, STREAM_NOT_CAPTURED, "{}", err_msg());
    assert_eq!(unsafe { (s.aclrtMemsetAsync)(dev as Ptr, 64, 9, 64, st) }, 0, "{}", err_msg());
    sync(st);
    assert!(download::<u8>(dev as Ptr, 64).iter().all(|&v| v == 9), "the stream ran the memset");
    begin(st, RELAXED);
    let (r, m2) = other_end(st);
    assert_eq!(r, 0, "RELAXED ends on any thread");
    destroy(m2 as Ptr);
    free(dev as Ptr);
    destroy_stream(st);
}

#[test]
fn capture_lifecycle_errors_are_refused_with_cann_codes() {
    let _g = serial();
    let s = use_device(0);
    let st = stream();
    let buf = malloc(64);
    let mut m = NULL;
    unsafe {
        assert_eq!((cap().end)(st, &mut m), STREAM_NOT_CAPTURED, "End without Begin");
        assert_eq!((cap().end)(NULL, &mut m), INVALID_PARAM, "End on the default stream (model_ri.cpp:101)");
        assert_eq!((cap().begin)(NULL, GLOBAL), INVALID_PARAM, "the default stream");
        // NULL before the mode (model_ri.cpp:54, then api_error.cc:5700).
        assert_eq!((cap().begin)(NULL, 3), INVALID_PARAM, "the default stream, before the mode");
        assert_eq!((cap().begin)(st, 3), RT_PARAM_INVALID, "an unknown mode (api_error.cc:5700-5702)");
        assert_eq!((cap().begin)(st, -1), RT_PARAM_INVALID, "a negative mode");
        assert_eq!((cap().execute)(NULL, st), INVALID_PARAM, "a NULL model (model_ri.cpp:24)");
        assert_eq!((cap().destroy)(NULL), INVALID_PARAM, "a NULL model (model_ri.cpp:39)");
        begin(st, THREAD_LOCAL);
        assert_eq!((cap().begin)(st, THREAD_LOCAL), STREAM_CAPTURED, "Begin twice");
        assert_eq!(info(st).0, STATUS_ACTIVE, "a refused Begin leaves the capture alone");
        let (_, during) = info(st);
        let other = stream();
        assert_eq!((cap().execute)(during, other), MODEL_CAPTURED, "replay of a model being captured");
        assert_eq!((cap().destroy)(during), MODEL_CAPTURED, "destroy of a model being captured");
        assert_eq!((s.aclrtMemsetAsync)(buf, 64, 9, 64, st), 0);
        let model = end(st);
        // model_ri.cpp:73-77: the stream must not be NULL, and status and
        // modelRI not both NULL; one of them may be.
        assert_eq!((cap().get_info)(st, std::ptr::null_mut(), std::ptr::null_mut()), INVALID_PARAM);
        let mut status = -1;
        assert_eq!((cap().get_info)(NULL, &mut status, &mut m), INVALID_PARAM, "the default stream");
        assert_eq!((cap().get_info)(st, &mut status, std::ptr::null_mut()), 0, "{}", err_msg());
        assert_eq!(status, STATUS_NONE);
        m = 0x1 as Ptr;
        assert_eq!((cap().get_info)(st, std::ptr::null_mut(), &mut m), 0, "{}", err_msg());
        assert!(m.is_null(), "no model outside a capture");

        // A replay on a capturing stream is refused (api_error.cc:3132-3133).
        begin(other, THREAD_LOCAL);
        assert_eq!((cap().execute)(model, other), STREAM_CAPTURED);
        destroy(end(other));

        // The model belongs to device 0: from device 1 it is in another
        // context (api_impl.cc:4039, :3991), and from device 0 a stream of
        // device 1 is (model.cc:1114).
        assert_eq!((s.aclrtSetDevice)(1), 0);
        let st1 = stream();
        assert_eq!((cap().execute)(model, st1), MODEL_CONTEXT, "device 1 is current");
        assert_eq!((cap().destroy)(model), MODEL_CONTEXT, "device 1 is current");
        assert_eq!((s.aclrtSetDevice)(0), 0);
        assert_eq!((cap().execute)(model, st1), STREAM_CONTEXT, "a stream of device 1");
        assert_eq!((s.aclrtSetDevice)(1), 0);
        destroy_stream(st1);
        assert_eq!((s.aclrtResetDevice)(1), 0);
        assert_eq!((s.aclrtSetDevice)(0), 0);

        // The default stream may replay a model once no capture runs.
        write(buf, &[0u8; 64]);
        execute(model, NULL);
        if std::env::var("CANNSIM_STREAM_MODE").as_deref() != Ok("eager") {
            // Lazy streams: the replay has not run, so the model is still running.
            assert_eq!((cap().destroy)(model), MODEL_RUNNING);
        }
        sync(NULL);
        assert!(download::<u8>(buf, 64).iter().all(|&v| v == 9));
        destroy(model);
        destroy_stream(other);
    }
    free(buf);
    destroy_stream(st);
}

#[test]
fn capture_get_info_needs_a_current_device_and_a_stream_of_it() {
    let _g = serial();
    let s = use_device(0);
    let st = stream();
    let mut status = -1;
    let mut m = NULL;
    unsafe {
        // A thread without a current device (api_impl.cc:7833-7834), also
        // about a capturing stream; the capture stays valid.
        begin(st, THREAD_LOCAL);
        let raw = st as usize;
        let no_device = std::thread::spawn(move || {
            let (mut status, mut m) = (-1, NULL);
            ((cap().get_info)(raw as Ptr, &mut status, &mut m), status)
        })
        .join()
        .expect("thread");
        assert_eq!(no_device, (CONTEXT_NULL, -1), "no current device: nothing written");
        // A stream of device 0 asked about from device 1 (:7835-7836).
        assert_eq!((s.aclrtSetDevice)(1), 0);
        assert_eq!((cap().get_info)(st, &mut status, &mut m), STREAM_CONTEXT, "device 1 is current");
        assert_eq!(status, -1, "nothing written");
        assert_eq!((s.aclrtSetDevice)(0), 0);
        assert_eq!(info(st).0, STATUS_ACTIVE, "the refused queries left the capture alone");
        destroy(end(st));
        assert_eq!((s.aclrtResetDevice)(1), 0);
    }
    destroy_stream(st);
}

#[test]
fn a_stream_joins_a_capture_through_an_event_and_must_be_joined_back() {
    let _g = serial();
    let s = use_device(0);
    let (st, side) = (stream(), stream());
    let (a, b) = (malloc(64), malloc(64));
    let (fork, join) = (event(), event());
    unsafe {
        begin(st, THREAD_LOCAL);
        assert_eq!((s.aclrtMemsetAsync)(a, 64, 1, 64, st), 0);
        assert_eq!((s.aclrtRecordEvent)(fork, st), 0);
        assert_eq!((s.aclrtStreamWaitEvent)(side, fork), 0, "{}", err_msg());
        assert_eq!(info(side).0, STATUS_ACTIVE, "the waiting stream joined the capture");
        assert_eq!((s.aclrtMemcpyAsync)(b, 64, a, 64, D2D, side), 0, "{}", err_msg());
        assert_eq!((s.aclrtRecordEvent)(join, side), 0);
        let mut m = NULL;
        assert_eq!((cap().end)(side, &mut m), STREAM_CAPTURE_UNMATCHED, "End on the joined stream");
        assert_eq!((s.aclrtStreamWaitEvent)(st, join), 0, "{}", err_msg());
        let model = end(st);
        assert_eq!(info(side), (STATUS_NONE, NULL), "End ended the joined stream's capture too");
        write(b, &[0u8; 64]);
        execute(model, st);
        sync(st);
        assert!(download::<u8>(b, 64).iter().all(|&v| v == 1), "the side stream's copy ran after the memset");
        destroy(model);

        // Without the join back, End fails.
        begin(st, THREAD_LOCAL);
        assert_eq!((s.aclrtRecordEvent)(fork, st), 0);
        assert_eq!((s.aclrtStreamWaitEvent)(side, fork), 0);
        assert_eq!((s.aclrtMemsetAsync)(b, 64, 2, 64, side), 0);
        assert_eq!((cap().end)(st, &mut m), STREAM_UNJOINED);
        assert!(m.is_null());
        assert_eq!(info(side), (STATUS_NONE, NULL));

        // The joined stream's last task must be a record the capture waited
        // for (context.cc:4843-4893, v100/capture_adapt.cc:49-53 at v8.5.0):
        // a stream that only waited, or that waits again after its joined
        // record, ends the capture unjoined too.
        begin(st, THREAD_LOCAL);
        assert_eq!((s.aclrtRecordEvent)(fork, st), 0);
        assert_eq!((s.aclrtStreamWaitEvent)(side, fork), 0);
        assert_eq!((cap().end)(st, &mut m), STREAM_UNJOINED, "a stream that joined and only waited");
        begin(st, THREAD_LOCAL);
        assert_eq!((s.aclrtRecordEvent)(fork, st), 0);
        assert_eq!((s.aclrtStreamWaitEvent)(side, fork), 0);
        assert_eq!((s.aclrtMemsetAsync)(b, 64, 3, 64, side), 0);
        assert_eq!((s.aclrtRecordEvent)(join, side), 0);
        assert_eq!((s.aclrtStreamWaitEvent)(st, join), 0);
        assert_eq!((s.aclrtRecordEvent)(fork, st), 0);
        assert_eq!((s.aclrtStreamWaitEvent)(side, fork), 0, "{}", err_msg());
        assert_eq!((cap().end)(st, &mut m), STREAM_UNJOINED, "a joined stream that waits after its last record");
        assert!(m.is_null());
        assert_eq!(info(side), (STATUS_NONE, NULL));
    }
    destroy_event(fork);
    destroy_event(join);
    free(a);
    free(b);
    destroy_stream(st);
    destroy_stream(side);
}

/// A v10 `HcclCommConfig` as `HcclCommConfigInit` leaves it, exec timeout 30 s.
fn comm_config() -> Vec<u8> {
    let mut c = vec![0u8; 2240];
    c[0..8].copy_from_slice(&2240usize.to_le_bytes());
    c[8..12].copy_from_slice(&0xf0f0_f0f0u32.to_le_bytes());
    c[12..16].copy_from_slice(&10u32.to_le_bytes());
    c[24..32].fill(0xff);
    c[316..320].copy_from_slice(&30i32.to_le_bytes());
    c
}

fn rank_data(rank: usize, round: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (rank * 10 + round * 100 + i) as f32 * 0.5).collect()
}

#[test]
fn hccl_collectives_captured_on_four_devices_replay_together() {
    let _g = serial();
    const WORLD: usize = 4;
    const N: usize = 24;
    const G: usize = 5;
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
    let cfg = comm_config();
    std::thread::scope(|sc| {
        for r in 0..WORLD {
            let (root, cfg) = (&root, &cfg);
            sc.spawn(move || {
                let s = use_device(r as i32);
                let mut comm = NULL;
                unsafe {
                    let rc =
                        (s.HcclCommInitRootInfoConfig)(WORLD as u32, root.as_ptr(), r as u32, cfg.as_ptr(), &mut comm);
                    assert_eq!(rc, 0, "rank {r}: {}", err_msg());
                }
                let st = stream();
                let (send, recv, gsend, grecv) = (malloc(N * 4), malloc(N * 4), malloc(G * 4), malloc(G * 4 * WORLD));
                // Each rank's thread captures its own stream; THREAD_LOCAL keeps the
                // other ranks' uploads legal while this one captures.
                begin(st, THREAD_LOCAL);
                unsafe {
                    assert_eq!(
                        (s.HcclAllReduce)(send, recv, N as u64, HCCL_FP32, HCCL_SUM, comm, st),
                        0,
                        "{}",
                        err_msg()
                    );
                    assert_eq!((s.HcclAllGather)(gsend, grecv, G as u64, HCCL_FP32, comm, st), 0, "{}", err_msg());
                }
                let model = end(st);
                sync(st);
                assert!(download::<u8>(recv, N * 4).iter().all(|&v| v == 0xFF), "rank {r}: recorded, not run");
                for round in 0..3 {
                    write(send, &rank_data(r, round, N));
                    write(gsend, &rank_data(r, round, G));
                    execute(model, st);
                    sync(st);
                    let want: Vec<f32> =
                        (0..N).map(|i| (0..WORLD).map(|q| rank_data(q, round, N)[i]).fold(0.0, |a, v| a + v)).collect();
                    assert_eq!(download::<f32>(recv, N), want, "rank {r} round {round}: all-reduce");
                    let gathered: Vec<f32> = (0..WORLD).flat_map(|q| rank_data(q, round, G)).collect();
                    assert_eq!(download::<f32>(grecv, G * WORLD), gathered, "rank {r} round {round}: all-gather");
                }
                destroy(model);
                for p in [send, recv, gsend, grecv] {
                    free(p);
                }
                destroy_stream(st);
                unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0) };
            });
        }
    });
}

/// A model that captured a collective must go before its communicator:
/// `HcclCommDestroy` frees the resources the captured op runs with, so a
/// replay after it faults at the stream's sync instead of running as if the
/// communicator were there (which it did).
#[test]
fn a_collective_replayed_after_its_communicator_was_destroyed_faults() {
    let _g = serial();
    const N: usize = 8;
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
    let cfg = comm_config();
    let mut comm = NULL;
    unsafe {
        assert_eq!((s.HcclCommInitRootInfoConfig)(1, root.as_ptr(), 0, cfg.as_ptr(), &mut comm), 0, "{}", err_msg())
    };
    let st = stream();
    let (send, recv) = (malloc(N * 4), malloc(N * 4));
    begin(st, THREAD_LOCAL);
    unsafe { assert_eq!((s.HcclAllReduce)(send, recv, N as u64, HCCL_FP32, HCCL_SUM, comm, st), 0, "{}", err_msg()) };
    let model = end(st);
    sync(st);
    write(send, &rank_data(0, 0, N));
    execute(model, st);
    sync(st);
    assert_eq!(download::<f32>(recv, N), rank_data(0, 0, N), "a replay before the destroy runs");
    unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0, "{}", err_msg()) };
    execute(model, st);
    let rc = unsafe { (s.aclrtSynchronizeStream)(st) };
    assert_ne!(rc, 0, "a replay after HcclCommDestroy ran");
    assert!(err_msg().contains("after HcclCommDestroy"), "{}", err_msg());
    destroy(model);
    for p in [send, recv] {
        free(p);
    }
    destroy_stream(st);
}

#[test]
fn counters_count_each_host_call_on_the_calling_thread() {
    let _g = serial();
    let s = use_device(0);
    let st = stream();
    let host = [0u8; 64];
    let mut back = [0u8; 64];
    unsafe {
        (cap().counters_reset)();
        assert_eq!(counters(), Counters::default());
        let dev = malloc(128);
        assert_eq!(counters(), Counters { device_mallocs: 1, ..Default::default() });
        sync(st);
        assert_eq!(counters().host_syncs, 1, "aclrtSynchronizeStream");
        assert_eq!((s.aclrtMemcpy)(dev, 64, host.as_ptr() as *const c_void, 64, H2D), 0);
        assert_eq!((counters().host_syncs, counters().h2d_copies), (2, 1), "a blocking H2D copy");
        assert_eq!((s.aclrtMemcpyAsync)(back.as_mut_ptr() as Ptr, 64, dev, 64, D2H, st), 0);
        assert_eq!((counters().host_syncs, counters().d2h_copies), (2, 1), "an async D2H copy syncs nothing");
        assert_eq!((s.aclrtMemcpyAsync)(dev, 64, dev, 64, D2D, st), 0);
        assert_eq!(counters().d2d_copies, 0, "a copy onto itself queues nothing");
        let upper = (dev as usize + 64) as Ptr;
        assert_eq!((s.aclrtMemcpyAsync)(upper, 64, dev, 64, D2D, st), 0);
        assert_eq!((counters().host_syncs, counters().d2d_copies), (2, 1), "an async D2D copy");
        assert_eq!((s.aclrtMemset)(dev, 64, 0, 64), 0);
        assert_eq!(counters().host_syncs, 3, "aclrtMemset blocks");
        assert_eq!((s.aclrtSynchronizeStreamWithTimeout)(st, -1), 0);
        assert_eq!((cap().sync_device)(), 0);
        let e = event();
        assert_eq!(counters().event_creates, 1, "aclrtCreateEventExWithFlag");
        let old = old_event();
        assert_eq!(counters().event_creates, 2, "aclrtCreateEvent");
        destroy_event(old);
        assert_eq!((s.aclrtRecordEvent)(e, st), 0);
        let mut status = -1;
        assert_eq!((s.aclrtQueryEventStatus)(e, &mut status), 0);
        assert_eq!((s.aclrtSynchronizeEvent)(e), 0);
        destroy_event(e);
        let h = malloc_host(64);
        assert_eq!((s.aclrtFreeHost)(h), 0);
        free(dev);
        // Another thread's calls are its own.
        std::thread::scope(|sc| {
            sc.spawn(|| {
                use_device(0);
                free(malloc(64));
                assert_eq!(counters(), Counters { device_mallocs: 1, device_frees: 1, ..Default::default() });
            });
        });
        assert_eq!(
            counters(),
            Counters {
                host_syncs: 6,
                device_mallocs: 1,
                device_frees: 1,
                host_mallocs: 1,
                host_frees: 1,
                h2d_copies: 1,
                d2h_copies: 1,
                queries: 1,
                event_creates: 2,
                d2d_copies: 1,
            }
        );
        assert_eq!((cap().counters)(std::ptr::null_mut()), INVALID_PARAM);
        (cap().counters_reset)();
        assert_eq!(counters(), Counters::default());
    }
    destroy_stream(st);
}

#[test]
fn the_leak_report_lists_live_models() {
    if role().as_deref() == Some("model-leak") {
        use_device(0);
        let st = stream();
        begin(st, RELAXED);
        let _model = end(st);
        destroy_stream(st);
        return;
    }
    let o = run_child("the_leak_report_lists_live_models", "model-leak", &[("CANNSIM_LEAK_REPORT", "fail")]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(97), "{err}");
    assert!(err.contains("1 leaked object(s)") && err.contains("aclmdlRI"), "{err}");
}

#[test]
fn an_aclrt_create_event_event_cannot_take_part_in_a_capture_and_a_sync_event_can() {
    let _g = serial();
    let s = use_device(0);
    let (st, side) = (stream(), stream());
    let buf = malloc(64);
    let (old, other_old) = (old_event(), old_event());
    let timeline = event_with(ACL_EVENT_TIME_LINE);
    unsafe {
        // api_impl.cc:2114: an old-mode event is not recorded on a capturing
        // stream; a warning return, the capture stays valid.
        begin(st, THREAD_LOCAL);
        assert_eq!((s.aclrtMemsetAsync)(buf, 64, 3, 64, st), 0);
        assert_eq!((s.aclrtRecordEvent)(old, st), FEATURE_NOT_SUPPORT, "{}", err_msg());
        assert_eq!(info(st).0, STATUS_ACTIVE);
        // The refused record left the event unrecorded: a wait for it is
        // refused too (Event::Wait, event.cc:597-605) and joins nothing.
        assert_eq!((s.aclrtStreamWaitEvent)(side, old), 107000, "{}", err_msg());
        assert_eq!(info(side).0, STATUS_NONE, "the side stream did not join");

        // api_impl.cc:1549-1555: nor waited for by a capturing stream.
        assert_eq!((s.aclrtRecordEvent)(other_old, side), 0);
        assert_eq!((s.aclrtStreamWaitEvent)(st, other_old), FEATURE_NOT_SUPPORT, "{}", err_msg());
        assert_eq!(info(st).0, STATUS_ACTIVE);

        // api_impl.cc:2122: a new-mode event without ACL_EVENT_SYNC is
        // "recorded" without effect, and nothing can wait for it
        // (api_error.cc:994).
        assert_eq!((s.aclrtRecordEvent)(timeline, st), 0, "{}", err_msg());
        assert_eq!((s.aclrtStreamWaitEvent)(side, timeline), FEATURE_NOT_SUPPORT);
        assert_eq!(info(side).0, STATUS_NONE);
        let model = end(st);
        write(buf, &[0u8; 64]);
        execute(model, st);
        sync(st);
        assert!(download::<u8>(buf, 64).iter().all(|&v| v == 3), "the capture kept its memset");
        destroy(model);
    }
    sync(side);
    for e in [old, other_old, timeline] {
        destroy_event(e);
    }
    free(buf);
    destroy_stream(st);
    destroy_stream(side);
}

#[test]
fn a_captured_record_records_the_runtimes_capture_event_not_the_callers() {
    // ApiImpl::CaptureEventRecord (api_impl.cc:2053-2090, v8.5.0) records an
    // internal event bound to the caller's; the caller's own record state
    // is untouched, however often the graph replays.
    let _g = serial();
    let s = use_device(0);
    let (st, next) = (stream(), stream());
    let buf = malloc(64);
    let (start, end_ev) =
        (event_with(ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE), event_with(ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE));
    let eager = event();
    unsafe {
        // An earlier eager record of `eager`, complete before the capture.
        assert_eq!((s.aclrtRecordEvent)(eager, st), 0, "{}", err_msg());
        sync(st);
        begin(st, THREAD_LOCAL);
        assert_eq!((s.aclrtRecordEvent)(start, st), 0, "{}", err_msg());
        assert_eq!((s.aclrtMemsetAsync)(buf, 64, 5, 64, st), 0);
        assert_eq!((s.aclrtRecordEvent)(end_ev, st), 0, "{}", err_msg());
        assert_eq!((s.aclrtRecordEvent)(eager, st), 0, "{}", err_msg());
        let model = end(st);
        for _ in 0..2 {
            execute(model, st);
        }
        sync(st);
        assert!(download::<u8>(buf, 64).iter().all(|&v| v == 5), "the graph ran");
        // Never recorded by the caller: no timestamps (Event::ElapsedTime,
        // event.cc: RT_ERROR_EVENT_RECORDER_NULL, 507000) ...
        let mut ms = -1f32;
        assert_eq!((s.aclrtEventElapsedTime)(&mut ms, start, end_ev), 507000, "{}", err_msg());
        assert_eq!(ms, -1.0, "nothing written");
        // ... a synchronize returns at once (Event::Synchronize, event.cc:962-969)
        // and a query reports a never-recorded new-mode event as complete.
        assert_eq!((s.aclrtSynchronizeEvent)(end_ev), 0, "{}", err_msg());
        let mut status = -1;
        assert_eq!((s.aclrtQueryEventStatus)(end_ev, &mut status), 0, "{}", err_msg());
        assert_eq!(status, 1);
        // `eager` still reports its eager record.
        assert_eq!((s.aclrtQueryEventStatus)(eager, &mut status), 0, "{}", err_msg());
        assert_eq!(status, 1);
        // A later capture that waits for an event recorded only in an ended
        // capture waits for nothing (`IsCaptureEventWaitNonOp`,
        // `capture_adapt.cc:65-74`, then `Event::Wait` on a new-mode event
        // never recorded): taken, and the capture stays valid.
        begin(next, THREAD_LOCAL);
        assert_eq!((s.aclrtStreamWaitEvent)(next, end_ev), 0, "{}", err_msg());
        assert_eq!((s.aclrtMemsetAsync)(buf, 64, 6, 64, next), 0);
        assert_eq!(info(next).0, STATUS_ACTIVE);
        let second = end(next);
        execute(second, next);
        sync(next);
        assert!(download::<u8>(buf, 64).iter().all(|&v| v == 6), "the second graph ran");
        destroy(second);
        destroy(model);
    }
    for e in [start, end_ev, eager] {
        destroy_event(e);
    }
    free(buf);
    destroy_stream(st);
    destroy_stream(next);
}

#[test]
fn a_wait_across_two_ongoing_captures_invalidates_both() {
    // ApiImpl::CaptureEventWait (api_impl.cc:1502-1503, v8.5.0): the event's
    // capture and the stream's differ, RT_ERROR_STREAM_CAPTURE_CONFLICT;
    // StreamWaitEvent then terminates both captures (:1545).
    let _g = serial();
    let s = use_device(0);
    let (a, b) = (stream(), stream());
    let buf = malloc(64);
    let e = event();
    unsafe {
        begin(a, RELAXED);
        begin(b, RELAXED);
        assert_eq!((s.aclrtMemsetAsync)(buf, 64, 1, 64, a), 0);
        assert_eq!((s.aclrtRecordEvent)(e, a), 0, "{}", err_msg());
        assert_eq!((s.aclrtStreamWaitEvent)(b, e), 107032, "{}", err_msg());
        assert!(err_msg().contains("another ongoing capture"), "{}", err_msg());
        // Both models are terminated; the streams' own status, which the
        // query reports, stays ACTIVE (capture_model_utils.cc:53-67).
        assert_eq!(info(a).0, STATUS_ACTIVE, "the event's capture");
        assert_eq!(info(b).0, STATUS_ACTIVE, "the waiting stream's capture");
        // A stream outside every capture cannot join the invalidated one:
        // Context::StreamAddToCaptureModelProc, RT_ERROR_MODEL_CAPTURE_STATUS
        // (context.cc:4739-4743, v8.5.0), 507000.
        let plain = stream();
        assert_eq!((s.aclrtStreamWaitEvent)(plain, e), 507000, "{}", err_msg());
        assert!(err_msg().contains("invalidated"), "{}", err_msg());
        assert_eq!(info(plain).0, STATUS_NONE, "the stream did not join");
        destroy_stream(plain);
        for st in [a, b] {
            let mut model = NULL;
            assert_eq!((cap().end)(st, &mut model), STREAM_CAPTURE_INVALIDATED, "{}", err_msg());
            assert!(model.is_null());
        }
    }
    destroy_event(e);
    free(buf);
    destroy_stream(a);
    destroy_stream(b);
}

#[test]
fn aclrt_create_event_ex_with_flag_checks_its_arguments_as_the_runtime_does() {
    let _g = serial();
    let s = use_device(0);
    let mut e = NULL;
    unsafe {
        // event.cpp:65, then api_error.cc:1186-1207 (v8.5.0); RT_EVENT_MC2
        // (0x10) alone or with another bit, api_error.cc:1657-1672 at HEAD.
        assert_eq!((s.aclrtCreateEventExWithFlag)(std::ptr::null_mut(), ACL_EVENT_SYNC), INVALID_PARAM);
        for bad in [0u32, 0x80, 0x20 | ACL_EVENT_SYNC, 0x40 | ACL_EVENT_SYNC, 0x10, 0x10 | ACL_EVENT_SYNC, 0x10 | 0x08]
        {
            assert_eq!((s.aclrtCreateEventExWithFlag)(&mut e, bad), RT_PARAM_INVALID, "flag {bad:#x}");
            assert!(e.is_null(), "flag {bad:#x} made no event");
        }
        assert_eq!((s.aclrtCreateEventExWithFlag)(&mut e, ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE), 0, "{}", err_msg());
    }
    destroy_event(e);
}

#[test]
fn a_device_holds_at_most_65536_recorded_sync_events() {
    let _g = serial();
    let s = use_device(0);
    let st = stream();
    // aclrtCreateEventExWithFlag.md: "单个Device支持的Event最大数" 65536 on A2/A3.
    const LIMIT: usize = 65536;
    let events: Vec<Ptr> = (0..=LIMIT).map(|_| event()).collect();
    unsafe {
        for (i, e) in events[..LIMIT].iter().enumerate() {
            let r = (s.aclrtRecordEvent)(*e, st);
            assert_eq!(r, 0, "record {i}: {}", err_msg());
        }
        // Re-recording a held event takes nothing new.
        assert_eq!((s.aclrtRecordEvent)(events[0], st), 0, "{}", err_msg());
        assert_eq!((s.aclrtRecordEvent)(events[LIMIT], st), NO_EVENT_RESOURCE);
        // A timeline-only event needs no synchronising resource.
        let timeline = event_with(ACL_EVENT_TIME_LINE);
        assert_eq!((s.aclrtRecordEvent)(timeline, st), 0, "{}", err_msg());
        destroy_event(timeline);
        // Destroying one gives its resource back.
        destroy_event(events[1]);
        assert_eq!((s.aclrtRecordEvent)(events[LIMIT], st), 0, "{}", err_msg());
    }
    sync(st);
    for (i, e) in events.into_iter().enumerate() {
        if i != 1 {
            destroy_event(e);
        }
    }
    destroy_stream(st);
}

/// A captured launch whose tiling is device memory reads that memory each
/// time the task runs, as a kernel reads its tiling from GM (runtime guide,
/// single-stream capture restriction 7: what a captured task uses must stay
/// valid, because every execution uses it again); a host tiling is the copy
/// made at enqueue.
#[test]
fn a_captured_launch_reads_a_device_tiling_when_it_runs_and_a_host_tiling_at_enqueue() {
    let _g = serial();
    let s = use_device(0);
    const N: usize = 16;
    let st = stream();
    let (x, y_dev, y_host, dev_tiling) = (malloc(N * 4), malloc(N * 4), malloc(N * 4), malloc(8));
    let xv: Vec<f32> = (0..N).map(|i| i as f32 + 1.0).collect();
    write(x, &xv);
    write(dev_tiling, &[4u64]);
    let host_tiling = [4u64];
    begin(st, GLOBAL);
    unsafe {
        let gm = [x, y_dev];
        let r = (s.cannsim_launch_kernel)(st, 2, Some(square), gm.as_ptr(), 2, dev_tiling as *const c_void, 8);
        assert_eq!(r, 0, "{}", err_msg());
        let gm = [x, y_host];
        let r =
            (s.cannsim_launch_kernel)(st, 2, Some(square), gm.as_ptr(), 2, host_tiling.as_ptr() as *const c_void, 8);
        assert_eq!(r, 0, "{}", err_msg());
    }
    let model = end(st);
    for n in [8usize, 12] {
        write(y_dev, &[0f32; N]);
        write(y_host, &[0f32; N]);
        // The device tiling changes between replays; the host one cannot.
        write(dev_tiling, &[n as u64]);
        execute(model, st);
        sync(st);
        let squares =
            |upto: usize| -> Vec<f32> { (0..N).map(|i| if i < upto { xv[i] * xv[i] } else { 0.0 }).collect() };
        assert_eq!(download::<f32>(y_dev, N), squares(n), "device tiling {n} read at the replay");
        assert_eq!(download::<f32>(y_host, N), squares(4), "host tiling copied at enqueue");
    }
    destroy(model);
    for p in [x, y_dev, y_host, dev_tiling] {
        free(p);
    }
    destroy_stream(st);
}

#[test]
fn a_capturing_stream_is_refused_by_sync_and_destroy_before_the_context_is_checked() {
    let _g = serial();
    use_device(0);
    let (a, b) = (stream(), stream());
    begin(a, RELAXED);
    begin(b, RELAXED);
    let (ha, hb) = (a as usize, b as usize);
    std::thread::scope(|sc| {
        sc.spawn(move || {
            let s = sim();
            // A thread without a device: api_error.cc:1010-1011 (sync) and
            // :977-979 (destroy) refuse the capturing stream before
            // ApiImpl asks for a context (api_impl.cc:1581, :1432).
            unsafe {
                assert_eq!((s.aclrtSynchronizeStream)(ha as Ptr), STREAM_CAPTURED, "{}", err_msg());
                assert_eq!((s.aclrtSynchronizeStreamWithTimeout)(hb as Ptr, 1000), STREAM_CAPTURED, "{}", err_msg());
            }
        })
        .join()
        .expect("the thread without a device panicked");
    });
    let mut m = NULL;
    unsafe {
        assert_eq!((cap().end)(a, &mut m), STREAM_CAPTURE_INVALIDATED, "the refused sync invalidated the capture");
        assert_eq!((cap().end)(b, &mut m), STREAM_CAPTURE_INVALIDATED);
    }
    // Destroy, from device 1: the capture check comes before the stream's context.
    begin(a, RELAXED);
    let s = use_device(1);
    unsafe { assert_eq!((s.aclrtDestroyStream)(a), STREAM_CAPTURED, "{}", err_msg()) };
    use_device(0);
    unsafe { assert_eq!((cap().end)(a, &mut m), STREAM_CAPTURE_INVALIDATED) };
    destroy_stream(a);
    destroy_stream(b);
}

/// `aclrtMemsetAsync` on `aclrtMallocHost` memory is done at the call, on the
/// calling thread (`Context::MemsetAsync`, hicann/runtime v8.5.0
/// `context.cc:2600-2606`): a capture records nothing for it, so a replay does
/// not set it again, while a device memset captured beside it is replayed.
#[test]
fn a_memset_async_of_pinned_host_memory_runs_at_the_call_and_is_not_captured() {
    let _g = serial();
    let s = use_device(0);
    const N: usize = 64;
    let (st, host, dev) = (stream(), malloc_host(N), malloc(N));
    // SAFETY: `host` holds N bytes from aclrtMallocHost.
    let host_bytes = || unsafe { std::slice::from_raw_parts(host as *const u8, N).to_vec() };
    begin(st, GLOBAL);
    unsafe {
        assert_eq!((s.aclrtMemsetAsync)(host, N, 7, N, st), 0, "{}", err_msg());
        assert_eq!((s.aclrtMemsetAsync)(dev, N, 9, N, st), 0, "{}", err_msg());
    }
    assert_eq!(host_bytes(), vec![7u8; N], "set at the call, before the capture ends");
    let model = end(st);
    // SAFETY: as above.
    unsafe { std::ptr::write_bytes(host as *mut u8, 1, N) };
    write(dev, &[1u8; N]);
    execute(model, st);
    sync(st);
    assert_eq!(host_bytes(), vec![1u8; N], "the replay does not set host memory");
    assert_eq!(download::<u8>(dev, N), vec![9u8; N], "the replay sets device memory");
    destroy(model);
    assert_eq!(unsafe { (s.aclrtFreeHost)(host) }, 0);
    free(dev);
    destroy_stream(st);
}

/// Runs `body` on this thread while another thread holds a capture of
/// `mode` on a stream of its own (device 0) into which it queued a memset
/// of `dev` (64 bytes) to 7. Returns what `aclmdlRICaptureEnd` answered and,
/// when it made a model, whether replaying it wrote the 7s.
fn during_capture_on_another_thread(mode: i32, dev: usize, body: impl FnOnce()) -> (i32, bool) {
    let (began_tx, began_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|sc| {
        let capturer = sc.spawn(move || {
            let s = use_device(0);
            let st = stream();
            begin(st, mode);
            assert_eq!(unsafe { (s.aclrtMemsetAsync)(dev as Ptr, 64, 7, 64, st) }, 0, "{}", err_msg());
            began_tx.send(()).unwrap();
            // Also when `body` panicked (its sender is gone).
            let _ = done_rx.recv();
            let mut model = NULL;
            let r = unsafe { (cap().end)(st, &mut model) };
            let mut replayed = false;
            if r == 0 {
                assert_eq!(unsafe { (s.aclrtMemset)(dev as Ptr, 64, 0, 64) }, 0, "{}", err_msg());
                execute(model, st);
                sync(st);
                replayed = download::<u8>(dev as Ptr, 64).iter().all(|&v| v == 7);
                destroy(model);
            }
            destroy_stream(st);
            (r, replayed)
        });
        let done = done_tx;
        began_rx.recv().unwrap();
        body();
        drop(done);
        capturer.join().expect("capturing thread")
    })
}

#[test]
fn a_relaxed_thread_reads_device_memory_during_another_threads_global_capture() {
    let _g = serial();
    let s = use_device(0);
    let src = upload(&[0x5au8; 64]);
    let target = malloc(64) as usize;
    let read = || {
        let mut back = [0u8; 64];
        let r = unsafe { (s.aclrtMemcpy)(back.as_mut_ptr() as Ptr, 64, src as *const c_void, 64, D2H) };
        (r, back)
    };

    // In its default mode (GLOBAL) this thread is refused and the capture is lost.
    let (mut refused, mut msg) = (0, String::new());
    let (end_code, _) = during_capture_on_another_thread(GLOBAL, target, || {
        refused = read().0;
        msg = err_msg();
    });
    assert_eq!(refused, CAPTURE_MODE_NOT_SUPPORT, "a blocking copy in GLOBAL mode");
    assert!(msg.contains("aclmdlRICaptureThreadExchangeMode"), "the refusal names the remedy: {msg}");
    assert_eq!(end_code, STREAM_CAPTURE_INVALIDATED, "the refused copy invalidated the other thread's capture");

    // Switched to RELAXED, the same copy runs and the capture stays valid.
    let mut back = [0u8; 64];
    let mut previous = -1;
    let ended = during_capture_on_another_thread(GLOBAL, target, || {
        previous = exchange(RELAXED);
        let (r, b) = read();
        assert_eq!(r, 0, "a blocking copy in RELAXED mode: {}", err_msg());
        back = b;
        assert_eq!(exchange(previous), RELAXED, "the exchange hands back the mode it replaces");
    });
    assert_eq!(previous, GLOBAL, "a thread starts in GLOBAL mode");
    assert!(back.iter().all(|&v| v == 0x5a), "the copy read the source");
    assert_eq!(ended, (0, true), "the capture ended valid and its replay ran the captured memset");

    // Restored to GLOBAL, the thread is refused again.
    let (end_code, _) = during_capture_on_another_thread(GLOBAL, target, || {
        refused = read().0;
    });
    assert_eq!((refused, end_code), (CAPTURE_MODE_NOT_SUPPORT, STREAM_CAPTURE_INVALIDATED), "GLOBAL again");

    // THREAD_LOCAL mode heeds only the captures this thread began.
    let ended = during_capture_on_another_thread(GLOBAL, target, || {
        assert_eq!(exchange(THREAD_LOCAL), GLOBAL);
        refused = read().0;
        assert_eq!(exchange(GLOBAL), THREAD_LOCAL);
    });
    assert_eq!((refused, ended), (0, (0, true)), "THREAD_LOCAL mode, another thread's GLOBAL capture");
    free(src);
    free(target as Ptr);
}

#[test]
fn the_thread_mode_also_frees_or_binds_the_capturing_thread_itself() {
    let _g = serial();
    let s = use_device(0);
    let src = upload(&[1u8; 64]);
    let mut back = [0u8; 64];
    let read =
        |back: &mut [u8; 64]| unsafe { (s.aclrtMemcpy)(back.as_mut_ptr() as Ptr, 64, src as *const c_void, 64, D2H) };
    let st = stream();
    let mut m = NULL;
    for capture_mode in [GLOBAL, THREAD_LOCAL] {
        // RELAXED: even the thread that began the capture may (context.cc:5144-5146).
        begin(st, capture_mode);
        assert_eq!(exchange(RELAXED), GLOBAL);
        assert_eq!(read(&mut back), 0, "capture {capture_mode}, thread RELAXED: {}", err_msg());
        assert_eq!(exchange(GLOBAL), RELAXED);
        destroy(end(st));
        // THREAD_LOCAL: the capturing thread may not (:5155-5160).
        begin(st, capture_mode);
        assert_eq!(exchange(THREAD_LOCAL), GLOBAL);
        assert_eq!(read(&mut back), CAPTURE_MODE_NOT_SUPPORT, "capture {capture_mode}, thread THREAD_LOCAL");
        assert_eq!(exchange(GLOBAL), THREAD_LOCAL);
        assert_eq!(unsafe { (cap().end)(st, &mut m) }, STREAM_CAPTURE_INVALIDATED);
    }
    // A RELAXED capture forbids nothing in any thread mode.
    begin(st, RELAXED);
    for thread_mode in [GLOBAL, THREAD_LOCAL, RELAXED] {
        let previous = exchange(thread_mode);
        assert_eq!(read(&mut back), 0, "RELAXED capture, thread mode {thread_mode}: {}", err_msg());
        exchange(previous);
    }
    destroy(end(st));
    assert_eq!(exchange(GLOBAL), GLOBAL, "every exchange was undone");
    destroy_stream(st);
    free(src);
}

#[test]
fn capture_thread_exchange_mode_checks_its_argument_as_the_runtime_does() {
    let _g = serial();
    use_device(0);
    // NULL: ACL_REQUIRES_NOT_NULL_WITH_INPUT_REPORT (model_ri.cpp:152).
    assert_eq!(unsafe { (cap().exchange)(NULL.cast()) }, INVALID_PARAM);
    // A mode of 3 or more, read unsigned (api_error.cc:5812-5813): refused,
    // and neither *mode nor the thread's mode changes.
    for bad in [3, 4, -1, i32::MIN] {
        let mut m = bad;
        assert_eq!(unsafe { (cap().exchange)(&mut m) }, RT_PARAM_INVALID, "mode {bad}");
        assert_eq!(m, bad, "a refused exchange writes nothing");
    }
    assert_eq!(exchange(GLOBAL), GLOBAL, "the refusals left the thread in GLOBAL mode");
    // The mode is the thread's: another thread starts in GLOBAL, whatever this one set.
    assert_eq!(exchange(RELAXED), GLOBAL);
    let other = std::thread::spawn(|| {
        use_device(0);
        exchange(GLOBAL)
    })
    .join()
    .expect("thread");
    assert_eq!(other, GLOBAL, "a new thread's mode");
    assert_eq!(exchange(GLOBAL), RELAXED, "this thread's mode is its own");
    // No current device: ACL_ERROR_RT_CONTEXT_NULL (api_impl.cc:7918-7919), nothing written.
    let (r, m) = std::thread::spawn(|| {
        let mut m = RELAXED;
        (unsafe { (cap().exchange)(&mut m) }, m)
    })
    .join()
    .expect("thread");
    assert_eq!((r, m), (CONTEXT_NULL, RELAXED), "a thread without a device");
}
