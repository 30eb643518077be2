//! Behaviour that needs its own process: out-of-memory and allocation-failure
//! injection (configuration is read once per process), a host dereference of a
//! device pointer, collective timeouts and dying ranks, ranks that are
//! processes, and the leak report at exit.
//!
//! Each test re-runs this binary as a child (`CANNSIM_TEST_ROLE` set) with the
//! environment under test, and checks the child's exit status and output.

mod common;

use common::*;

const NULL: Ptr = std::ptr::null_mut();

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout)
}

#[test]
fn device_memory_runs_out_at_the_configured_size() {
    if role().as_deref() == Some("oom") {
        let s = use_device(0);
        let a = malloc(600 << 10);
        let mut p = NULL;
        unsafe {
            assert_eq!((s.aclrtMalloc)(&mut p, 600 << 10, 0), 207001);
            assert!(err_msg().contains("out of memory"), "{}", err_msg());
            // Other devices have their own memory.
            assert_eq!((s.aclrtSetDevice)(1), 0);
            let b = malloc(600 << 10);
            free(b);
            assert_eq!((s.aclrtSetDevice)(0), 0);
        }
        free(a);
        let again = malloc(900 << 10);
        free(again);
        return;
    }
    let o = run_child("device_memory_runs_out_at_the_configured_size", "oom", &[("CANNSIM_DEVICE_MEM", "1M")]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn allocation_failure_is_injected_after_n_allocations() {
    if role().as_deref() == Some("fail-malloc") {
        let s = use_device(0);
        let (a, b) = (malloc(64), malloc(64));
        let mut p = NULL;
        unsafe {
            assert_eq!((s.aclrtMalloc)(&mut p, 64, 0), 207001);
            assert!(err_msg().contains("CANNSIM_FAIL_MALLOC_AFTER"), "{}", err_msg());
        }
        free(a);
        free(b);
        return;
    }
    let o = run_child(
        "allocation_failure_is_injected_after_n_allocations",
        "fail-malloc",
        &[("CANNSIM_FAIL_MALLOC_AFTER", "2")],
    );
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn failed_allocations_do_not_count_towards_fail_malloc_after() {
    if role().as_deref() == Some("fail-malloc-oom") {
        let s = use_device(0);
        let mut p = NULL;
        unsafe {
            // More than the device has: fails on its own, and is no success.
            assert_eq!((s.aclrtMalloc)(&mut p, 2 << 20, 0), 207001);
            assert!(err_msg().contains("out of memory"), "{}", err_msg());
        }
        // So two allocations still succeed before the injected failure.
        let (a, b) = (malloc(10), malloc(10));
        unsafe {
            assert_eq!((s.aclrtMalloc)(&mut p, 10, 0), 207001);
            assert!(err_msg().contains("CANNSIM_FAIL_MALLOC_AFTER"), "{}", err_msg());
        }
        free(a);
        free(b);
        return;
    }
    let o = run_child(
        "failed_allocations_do_not_count_towards_fail_malloc_after",
        "fail-malloc-oom",
        &[("CANNSIM_DEVICE_MEM", "1M"), ("CANNSIM_FAIL_MALLOC_AFTER", "2")],
    );
    assert_child_passed(&o, "child");
}

/// The exports [`an_unknown_cann_version_fails_every_call_without_aborting`]
/// calls, each first in a process of its own.
const BAD_VERSION_CALLS: [&str; 14] = [
    "aclInit",
    "aclFinalize",
    "aclrtGetLastError",
    "aclrtPeekAtLastError",
    "aclrtGetSocName",
    "aclrtGetVersion",
    "aclrtGetDeviceCount",
    "aclCreateTensor",
    "aclnnAdd",
    "HcclGetRootInfo",
    "HcclGetCommConfigCapability",
    "HcclGetErrorString",
    "cannsim_counters",
    "cannsim_counters_reset",
];

#[test]
fn an_unknown_cann_version_fails_every_call_without_aborting() {
    const NAME: &str = "an_unknown_cann_version_fails_every_call_without_aborting";
    if role().as_deref() == Some("bad-version") {
        let s = sim();
        let call = std::env::var("BAD_VERSION_CALL").unwrap();
        let named = || {
            let m = err_msg();
            assert!(m.contains("CANNSIM_CANN_VERSION") && m.contains("9.9"), "{call}: {m:?}");
        };
        let lib = unsafe { libloading::Library::new(lib_path()) }.unwrap();
        // SAFETY: each call with the arguments its C signature takes; the
        // counters functions are looked up in the library `sim()` loaded.
        unsafe {
            let acl = match call.as_str() {
                "aclInit" => (s.aclInit)(std::ptr::null()),
                "aclFinalize" => (s.aclFinalize)(),
                // Even with no failure before it: the call itself fails.
                "aclrtGetLastError" => (s.aclrtGetLastError)(0),
                "aclrtPeekAtLastError" => (s.aclrtPeekAtLastError)(0),
                "aclrtGetVersion" => {
                    let mut v = [0i32; 3];
                    (s.aclrtGetVersion)(&mut v[0], &mut v[1], &mut v[2])
                }
                "aclrtGetDeviceCount" => (s.aclrtGetDeviceCount)(&mut 0),
                "cannsim_counters" => {
                    let f = lib.get::<unsafe extern "C" fn(*mut [u64; 9]) -> i32>(b"cannsim_counters\0").unwrap();
                    f(&mut [0; 9])
                }
                "aclrtGetSocName" => {
                    assert!((s.aclrtGetSocName)().is_null(), "a SoC name");
                    507000
                }
                "aclCreateTensor" => {
                    let dims = [4i64];
                    let t = (s.aclCreateTensor)(
                        dims.as_ptr(),
                        1,
                        ACL_FLOAT,
                        std::ptr::null(),
                        0,
                        ND,
                        dims.as_ptr(),
                        1,
                        NULL,
                    );
                    assert!(t.is_null(), "a tensor");
                    507000
                }
                "aclnnAdd" => {
                    assert_eq!((s.aclnnAdd)(NULL, 0, NULL, NULL), 561000, "ACLNN_ERR_INNER");
                    507000
                }
                "HcclGetRootInfo" => {
                    assert_eq!((s.HcclGetRootInfo)(vec![0u8; 4108].as_mut_ptr()), 4, "HCCL_E_INTERNAL");
                    507000
                }
                "HcclGetCommConfigCapability" => {
                    assert_eq!((s.HcclGetCommConfigCapability)(), 0, "a capability");
                    507000
                }
                // What explains a failure, and what cannot report one, keep answering.
                "HcclGetErrorString" => {
                    let e = (s.HcclGetErrorString)(4);
                    assert!(!e.is_null() && std::ffi::CStr::from_ptr(e).to_bytes().starts_with(b"HCCL_E_INTERNAL"));
                    assert_eq!((s.aclInit)(std::ptr::null()), 507000);
                    named();
                    return;
                }
                "cannsim_counters_reset" => {
                    lib.get::<unsafe extern "C" fn()>(b"cannsim_counters_reset\0").unwrap()();
                    assert_eq!((s.aclInit)(std::ptr::null()), 507000);
                    named();
                    return;
                }
                other => panic!("unknown call {other}"),
            };
            assert_eq!(acl, 507000, "ACL_ERROR_RT_INTERNAL_ERROR");
        }
        named();
        // The process then exits: the leak report at exit must not abort it.
        return;
    }
    let mut failed = Vec::new();
    for call in BAD_VERSION_CALLS {
        let o = run_child(NAME, "bad-version", &[("CANNSIM_CANN_VERSION", "9.9"), ("BAD_VERSION_CALL", call)]);
        let out = String::from_utf8_lossy(&o.stdout);
        if !(o.status.success() && out.contains("1 passed")) {
            let why = stderr(&o)
                .lines()
                .filter(|l| {
                    l.contains("panicked")
                        || l.contains("assert")
                        || l.contains("left")
                        || l.contains("right")
                        || l.contains(": ")
                })
                .take(4)
                .collect::<Vec<_>>()
                .join(" | ");
            failed.push(format!("{call}: {:?}: {why}", o.status));
        }
    }
    assert!(failed.is_empty(), "with CANNSIM_CANN_VERSION=9.9:\n{}", failed.join("\n"));
}

#[test]
fn dereferencing_a_device_pointer_on_the_host_faults() {
    if role().as_deref() == Some("deref") {
        use_device(0);
        let p = upload(&[7u8; 64]);
        // SAFETY: deliberately not safe: this must crash the child.
        let v = unsafe { std::ptr::read_volatile(p as *const u8) };
        println!("read {v} through a device pointer");
        return;
    }
    let o = run_child("dereferencing_a_device_pointer_on_the_host_faults", "deref", &[]);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(o.status.signal(), Some(libc_sigsegv()), "child: {:?} {}", o.status, stderr(&o));
    assert!(!stderr(&o).contains("read 7"));
}

fn libc_sigsegv() -> i32 {
    11
}

#[test]
fn leak_report_lists_live_objects_and_fails_the_process() {
    match role().as_deref() {
        Some("leak") => {
            let s = use_device(0);
            let _buf = malloc(1234);
            let _st = stream();
            let mut ev = NULL;
            unsafe { assert_eq!((s.aclrtCreateEvent)(&mut ev), 0) };
            let data = malloc(64);
            let _t = tensor(&[4, 4], ACL_FLOAT, data);
            let mut host = NULL;
            unsafe { assert_eq!((s.aclrtMallocHost)(&mut host, 100), 0) };
            return;
        }
        Some("clean") => {
            let s = use_device(0);
            let st = stream();
            let b = malloc(64);
            let t = tensor(&[16], ACL_FLOAT, b);
            destroy_tensor(t);
            free(b);
            destroy_stream(st);
            unsafe { assert_eq!((s.aclrtResetDevice)(0), 0) };
            return;
        }
        _ => {}
    }
    let name = "leak_report_lists_live_objects_and_fails_the_process";
    let o = run_child(name, "leak", &[("CANNSIM_LEAK_REPORT", "fail")]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(97), "{err}");
    for what in [
        "6 leaked object(s)",
        "device buffer",
        "(1234 bytes, device 0)",
        "stream ",
        "event ",
        "aclTensor",
        "shape [4, 4]",
        "host buffer",
        "device 0 still set",
    ] {
        assert!(err.contains(what), "missing {what:?} in:\n{err}");
    }
    let o = run_child(name, "clean", &[("CANNSIM_LEAK_REPORT", "fail")]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("0 leaked object(s)"), "{err}");
    // Without CANNSIM_LEAK_REPORT the leaking child exits normally and quietly.
    let o = run_child(name, "leak", &[]);
    assert!(o.status.success() && !stderr(&o).contains("leak report"), "{}", stderr(&o));
}

/// Root info as hex, to hand to child processes.
/// One process rank: init from the root info, all-reduce [rank+1; 8], report.
fn process_rank(world: u32) -> (i32, Vec<f32>, i32) {
    let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
    let root = unhex(&std::env::var("ROOT").unwrap());
    let s = use_device(rank as i32);
    let mut comm = NULL;
    unsafe { assert_eq!((s.HcclCommInitRootInfo)(world, root.as_ptr(), rank, &mut comm), 0, "{}", err_msg()) };
    let st = stream();
    let v = vec![rank as f32 + 1.0; 8];
    let send = upload(&v);
    let recv = malloc(32);
    unsafe { assert_eq!((s.HcclAllReduce)(send, recv, 8, HCCL_FP32, HCCL_SUM, comm, st), 0) };
    let r = unsafe { (s.aclrtSynchronizeStream)(st) };
    let out = download::<f32>(recv, 8);
    let mut async_err = -1;
    unsafe { assert_eq!((s.HcclGetCommAsyncError)(comm, &mut async_err), 0) };
    println!("rank {rank}: sync {r} async {async_err} out {out:?} msg {}", err_msg());
    (r, out, async_err)
}

/// Runs `world` ranks of the test `test` as child processes with `role`
/// and `env`, one root info, all at once; returns their outputs by rank.
fn run_ranks(test: &str, role: &str, world: u32, env: &[(&str, &str)]) -> Vec<std::process::Output> {
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0) };
    let root = hex(&root);
    let kids: Vec<_> = (0..world)
        .map(|r| child(test, role, env).env("RANK", r.to_string()).env("ROOT", &root).spawn().unwrap())
        .collect();
    kids.into_iter().map(|k| k.wait_with_output().unwrap()).collect()
}

#[test]
fn ranks_can_be_processes() {
    if role().as_deref() == Some("proc-rank") {
        let (r, out, e) = process_rank(3);
        assert_eq!((r, e), (0, 0));
        assert_eq!(out, vec![6.0; 8]);
        return;
    }
    for o in run_ranks("ranks_can_be_processes", "proc-rank", 3, &[]) {
        assert!(o.status.success(), "{}", stderr(&o));
    }
}

#[test]
fn a_dying_rank_process_makes_its_peer_fail_not_hang() {
    if role().as_deref() == Some("die") {
        let (r, _, e) = process_rank(2);
        // Only rank 0 gets here: rank 1 exits inside its collective. Within
        // the one-second bound either the liveness check sees the exited
        // peer (HCCL_E_REMOTE, the only asynchronous error) or, on a host
        // slow enough that the bound passes first, the round times out: a
        // failure either way, never a hang.
        assert_eq!(r, 507046, "the peer's death must fail the sync");
        assert!(e == 21 || e == 0, "async error {e}: HCCL_E_REMOTE or none");
        return;
    }
    let outs = run_ranks(
        "a_dying_rank_process_makes_its_peer_fail_not_hang",
        "die",
        2,
        &[("CANNSIM_DIE_RANK", "1"), ("HCCL_EXEC_TIMEOUT", "1")],
    );
    assert!(outs[0].status.success(), "rank 0: {}", stderr(&outs[0]));
    assert_eq!(outs[1].status.code(), Some(77), "rank 1: {}", stderr(&outs[1]));
    assert!(stderr(&outs[1]).contains("CANNSIM_DIE_RANK"));
}

#[test]
fn a_dying_rank_process_is_reported_as_a_dead_peer_before_the_timeout() {
    if role().as_deref() == Some("die-remote") {
        let (r, _, e) = process_rank(2);
        // Only rank 0 gets here. With a timeout of a minute, only the
        // liveness check of the exited peer (an unreaped zombie until this
        // process ends) can give HCCL_E_REMOTE.
        assert_eq!(e, 21, "HCCL_E_REMOTE");
        assert_eq!(r, 507046, "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT");
        return;
    }
    let outs = run_ranks(
        "a_dying_rank_process_is_reported_as_a_dead_peer_before_the_timeout",
        "die-remote",
        2,
        &[("CANNSIM_DIE_RANK", "1"), ("HCCL_EXEC_TIMEOUT", "60")],
    );
    assert!(outs[0].status.success(), "rank 0: {}", stderr(&outs[0]));
    assert_eq!(outs[1].status.code(), Some(77), "rank 1: {}", stderr(&outs[1]));
}

#[test]
fn a_rank_that_never_joins_times_out_its_peers() {
    if role().as_deref() == Some("timeout") {
        let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
        let (r, _, e) = process_rank(2);
        // A timeout is the stream's error; HcclGetCommAsyncError reports only
        // an error CQE (HCCL_E_REMOTE).
        assert_eq!(e, 0, "no async error on rank {rank}");
        assert_eq!(r, 507046, "rank {rank}");
        // The communicator stays failed: the next collective is refused at once.
        return;
    }
    let outs = run_ranks(
        "a_rank_that_never_joins_times_out_its_peers",
        "timeout",
        2,
        &[("CANNSIM_HCCL_TIMEOUT_RANK", "1"), ("HCCL_EXEC_TIMEOUT", "0.5")],
    );
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}: {}\n\nother rank: {}", stderr(o), stderr(&outs[1 - r]));
    }
}

/// HCCL's barrier waits without its execution timeout (an all-reduce in
/// HCCL's unlimited wait mode): with rank 1 never at a second barrier and
/// HCCL_EXEC_TIMEOUT 0.5 s, rank 0's barrier is still waiting, not
/// failed, four timeouts later (an all-reduce has failed by then:
/// [`a_rank_that_never_joins_times_out_its_peers`]).
#[test]
fn a_barrier_waits_for_a_missing_peer_past_the_execution_timeout() {
    if role().as_deref() == Some("barrier") {
        let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
        let root = unhex(&std::env::var("ROOT").unwrap());
        let done = std::path::PathBuf::from(std::env::var("DONE").unwrap());
        let s = use_device(rank as i32);
        let mut comm = NULL;
        unsafe { assert_eq!((s.HcclCommInitRootInfo)(2, root.as_ptr(), rank, &mut comm), 0, "{}", err_msg()) };
        // One barrier together: its first call sets up the links, on the host.
        let st = stream();
        unsafe {
            assert_eq!((s.HcclBarrier)(comm, st), 0, "{}", err_msg());
            assert_eq!((s.aclrtSynchronizeStream)(st), 0, "{}", err_msg());
        }
        if rank == 1 {
            // Alive (a dead peer is another error) until rank 0 is done.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while !done.exists() {
                assert!(std::time::Instant::now() < deadline, "rank 0 never finished");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            return;
        }
        unsafe { assert_eq!((s.HcclBarrier)(comm, st), 0, "{}", err_msg()) };
        let r = unsafe { (s.aclrtSynchronizeStreamWithTimeout)(st, 2000) };
        let msg = err_msg();
        let mut async_err = -1;
        unsafe { assert_eq!((s.HcclGetCommAsyncError)(comm, &mut async_err), 0) };
        std::fs::write(&done, b"").unwrap();
        assert_eq!((r, async_err), (507046, 0), "{msg}");
        assert!(msg.contains("did not finish task") && !msg.contains("HCCL error"), "{msg}");
        // The waiting task keeps the stream: leave without tearing it down.
        std::process::exit(0);
    }
    let done = std::env::temp_dir().join(format!("cannsim-barrier-{}", std::process::id()));
    let _ = std::fs::remove_file(&done);
    let d = done.to_str().unwrap();
    let outs = run_ranks(
        "a_barrier_waits_for_a_missing_peer_past_the_execution_timeout",
        "barrier",
        2,
        &[("HCCL_EXEC_TIMEOUT", "0.5"), ("DONE", d)],
    );
    let _ = std::fs::remove_file(&done);
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}: {}\n\nother rank: {}", stderr(o), stderr(&outs[1 - r]));
    }
}

#[test]
fn acl_init_and_finalize_follow_the_documented_lifecycle() {
    if role().as_deref() == Some("lifecycle") {
        let s = sim();
        unsafe {
            assert_eq!((s.aclrtSetDevice)(0), 100001, "aclInit first");
            assert_eq!((s.aclFinalize)(), 100001);
            assert_eq!((s.aclInit)(std::ptr::null()), 0);
            assert_eq!((s.aclInit)(std::ptr::null()), 100002);
            assert_eq!((s.aclrtSetDevice)(0), 0);
            assert_eq!((s.aclrtResetDevice)(0), 0);
            // ApiErrorDecorator::DeviceReset: RT_ERROR_CONTEXT_DEL -> ACL_ERROR_RT_CONTEXT_RELEASE_ERROR.
            assert_eq!((s.aclrtResetDevice)(0), 507007, "reset of a device that is not set");
            let mut d = 0;
            assert_eq!((s.aclrtGetDevice)(&mut d), 107002, "no current device after the reset");
            assert_eq!((s.aclFinalize)(), 0);
            assert_eq!((s.aclFinalize)(), 100037);
            assert_eq!((s.aclrtSetDevice)(0), 100001, "finalized");
        }
        return;
    }
    let o = run_child("acl_init_and_finalize_follow_the_documented_lifecycle", "lifecycle", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn eager_streams_run_work_without_being_waited_on() {
    if role().as_deref() == Some("eager") {
        let s = use_device(0);
        let st = stream();
        let dev = upload(&[0u32; 32]);
        let src: Vec<u32> = (0..32).collect();
        let mut ev = NULL;
        unsafe {
            assert_eq!((s.aclrtCreateEvent)(&mut ev), 0);
            assert_eq!((s.aclrtMemcpyAsync)(dev, 128, src.as_ptr() as *const std::ffi::c_void, 128, H2D, st), 0);
            assert_eq!((s.aclrtRecordEvent)(ev, st), 0);
        }
        // Nothing waits on the stream: the worker still finishes the copy.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while download::<u32>(dev, 32) != src {
            assert!(std::time::Instant::now() < deadline, "the eager stream never ran the copy");
            std::thread::yield_now();
        }
        unsafe {
            let mut status = 0;
            assert_eq!((s.aclrtQueryEventStatus)(ev, &mut status), 0);
            assert_eq!((s.aclrtDestroyEvent)(ev), 0);
        }
        sync(st);
        destroy_stream(st);
        free(dev);
        return;
    }
    let name = "eager_streams_run_work_without_being_waited_on";
    let o = run_child(name, "eager", &[("CANNSIM_STREAM_MODE", "eager")]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A 2240-byte (version 10) `HcclCommConfig` that every emulated release
/// accepts (buffer 200 MB, deterministic off), with `hcclExecTimeOut` set.
fn config_with_exec_timeout(secs: i32) -> Vec<u8> {
    config_of_layout(secs, 10, 2240)
}

/// [`config_with_exec_timeout`] whose header says layout `version` of
/// `size` bytes (`hcclExecTimeOut`'s bytes are written whatever the size).
fn config_of_layout(secs: i32, version: u32, size: usize) -> Vec<u8> {
    let mut c = vec![0u8; 2240];
    c[0..8].copy_from_slice(&size.to_le_bytes());
    c[8..12].copy_from_slice(&0xf0f0_f0f0u32.to_le_bytes());
    c[12..16].copy_from_slice(&version.to_le_bytes());
    c[24..28].copy_from_slice(&200u32.to_le_bytes());
    c[316..320].copy_from_slice(&secs.to_le_bytes());
    c
}

/// One process rank of a world of 2 whose rank 1 hangs
/// (`CANNSIM_HCCL_TIMEOUT_RANK`), made with an `hcclExecTimeOut` of `EXEC_CFG`
/// seconds: rank 0 prints the error of its all-reduce, which names the
/// execution timeout the communicator took.
fn timed_out_rank() {
    let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
    let layout = std::env::var("EXEC_LAYOUT").unwrap();
    let (version, size) = layout.split_once('/').unwrap();
    let secs = std::env::var("EXEC_CFG").unwrap().parse().unwrap();
    let cfg = config_of_layout(secs, version.parse().unwrap(), size.parse().unwrap());
    let root = unhex(&std::env::var("ROOT").unwrap());
    let s = use_device(rank as i32);
    let mut comm = NULL;
    unsafe {
        assert_eq!((s.HcclCommInitRootInfoConfig)(2, root.as_ptr(), rank, cfg.as_ptr(), &mut comm), 0, "{}", err_msg())
    };
    let st = stream();
    let buf = malloc(32);
    unsafe { assert_eq!((s.HcclAllReduce)(buf, buf, 8, HCCL_FP32, HCCL_SUM, comm, st), 0, "{}", err_msg()) };
    let r = unsafe { (s.aclrtSynchronizeStream)(st) };
    println!("rank {rank}: sync {r}: {}", err_msg());
}

#[test]
fn the_execution_timeout_is_hccls_own_setting_per_release() {
    if role().as_deref() == Some("exec-timeout") {
        timed_out_rank();
        return;
    }
    const NAME: &str = "the_execution_timeout_is_hccls_own_setting_per_release";
    // (release, hcclExecTimeOut, the config's version and size,
    // HCCL_EXEC_TIMEOUT, the timeout rank 0 takes): only CANN 8.5 reads
    // hcclExecTimeOut, there it wins over the variable, and only from a
    // config of version 8 (its own) or later (hicann/hcomm v8.5.0
    // comm_config.cc:204-206): bytes past a version 6 config's end, or the
    // field of a version 7 one, are never read. Older releases never read it.
    for (version, cfg, layout, env, want) in [
        ("8.1", "600", "10/2240", "0.5", "500ms"),
        ("8.3", "600", "10/2240", "0.5", "500ms"),
        ("8.5", "1", "10/2240", "600", "1s"),
        ("8.5", "1", "8/2104", "600", "1s"),
        ("8.5", "2", "7/2104", "0.5", "500ms"),
        ("8.5", "2", "6/312", "0.5", "500ms"),
    ] {
        let outs = run_ranks(
            NAME,
            "exec-timeout",
            2,
            &[
                ("CANNSIM_CANN_VERSION", version),
                ("CANNSIM_HCCL_TIMEOUT_RANK", "1"),
                ("HCCL_EXEC_TIMEOUT", env),
                ("EXEC_CFG", cfg),
                ("EXEC_LAYOUT", layout),
                // Never read by HCCL: it must not shorten anything.
                ("ASCEND_MOE_COMM_TIMEOUT", "3600"),
            ],
        );
        let out0 = stderr(&outs[0]);
        assert!(outs[0].status.success(), "{version}: {out0}");
        assert!(
            out0.contains("sync 507046") && out0.contains(&format!("execution timeout {want})")),
            "{version} {layout}: {out0}"
        );
    }
}

/// A fresh root info of this process, as hex digits for a child.
fn root_hex() -> String {
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
    hex(&root)
}

/// The child of [`hccl_timeout_variables_are_read_as_hccl_reads_them`]:
/// creates a one-rank communicator from each of the parent's root infos
/// (`HcclCommInitRootInfo`, then `HcclCommInitRootInfoConfig` with an
/// `hcclExecTimeOut` of its own), then asks for a root info, and prints the
/// three codes and the messages. The creations come first: HCCL parses the
/// variables until a parse succeeds, so a process whose first call failed
/// fails the later ones too, and one whose first call succeeded passes them.
fn timeout_env_child() {
    let s = use_device(0);
    let roots = [unhex(&std::env::var("ROOT").unwrap()), unhex(&std::env::var("ROOT2").unwrap())];
    let cfg = config_with_exec_timeout(30);
    let mut codes = Vec::new();
    let mut msgs = Vec::new();
    for (i, root) in roots.iter().enumerate() {
        let mut comm = NULL;
        let rc = unsafe {
            match i {
                0 => (s.HcclCommInitRootInfo)(1, root.as_ptr(), 0, &mut comm),
                _ => (s.HcclCommInitRootInfoConfig)(1, root.as_ptr(), 0, cfg.as_ptr(), &mut comm),
            }
        };
        codes.push(rc);
        msgs.push(err_msg());
        if rc == 0 {
            unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0) };
        } else {
            assert!(comm.is_null());
        }
    }
    let mut mine = vec![0u8; 4108];
    codes.push(unsafe { (s.HcclGetRootInfo)(mine.as_mut_ptr()) });
    msgs.push(err_msg());
    println!("codes {codes:?} messages {}", msgs.join(" | "));
}

#[test]
fn hccl_timeout_variables_are_read_as_hccl_reads_them() {
    if role().as_deref() == Some("timeout-env") {
        timeout_env_child();
        return;
    }
    const NAME: &str = "hccl_timeout_variables_are_read_as_hccl_reads_them";
    // hicann/hcomm v8.5.0 src/platform/common/externalinput.cc. Both: at most
    // MAX_LEN_OF_DIGIT_ENV = 10 bytes (externalinput.h:20; :563-567, :581-584),
    // set but empty is a value (GET_ENV, :32-36). HCCL_EXEC_TIMEOUT:
    // ^\d+(\.\d{1,2})?$ (:543-552), at most 2147483647 on a 910B (:980-992).
    // HCCL_CONNECT_TIMEOUT: IsAllDigit (sal.cc:563-581, a leading '-' only),
    // std::stoi, [120, 7200] (:586-595).
    let cases: &[(&str, &str, bool)] = &[
        ("HCCL_EXEC_TIMEOUT", "0000000300", true),
        ("HCCL_EXEC_TIMEOUT", "2147483647", true),
        ("HCCL_EXEC_TIMEOUT", "0", true),
        ("HCCL_EXEC_TIMEOUT", "12.25", true),
        ("HCCL_EXEC_TIMEOUT", "00000000300", false),
        ("HCCL_EXEC_TIMEOUT", "2147483648", false),
        ("HCCL_EXEC_TIMEOUT", "+300", false),
        ("HCCL_EXEC_TIMEOUT", "abc", false),
        ("HCCL_EXEC_TIMEOUT", "-1", false),
        ("HCCL_EXEC_TIMEOUT", "1.234", false),
        ("HCCL_EXEC_TIMEOUT", " 300", false),
        ("HCCL_EXEC_TIMEOUT", "", false),
        ("HCCL_CONNECT_TIMEOUT", "0000000120", true),
        ("HCCL_CONNECT_TIMEOUT", "120", true),
        ("HCCL_CONNECT_TIMEOUT", "7200", true),
        ("HCCL_CONNECT_TIMEOUT", "00000000120", false),
        ("HCCL_CONNECT_TIMEOUT", "2147483647", false),
        ("HCCL_CONNECT_TIMEOUT", "0", false),
        ("HCCL_CONNECT_TIMEOUT", "119", false),
        ("HCCL_CONNECT_TIMEOUT", "7201", false),
        ("HCCL_CONNECT_TIMEOUT", "+300", false),
        ("HCCL_CONNECT_TIMEOUT", "300s", false),
        ("HCCL_CONNECT_TIMEOUT", " 300", false),
        ("HCCL_CONNECT_TIMEOUT", "", false),
    ];
    let kids: Vec<_> = cases
        .iter()
        .map(|(var, value, _)| {
            let (root, root2) = (root_hex(), root_hex());
            child(NAME, "timeout-env", &[("ROOT", &root), ("ROOT2", &root2), (var, value)]).spawn().unwrap()
        })
        .collect();
    let mut wrong = Vec::new();
    for ((var, value, ok), kid) in cases.iter().zip(kids) {
        let o = kid.wait_with_output().unwrap();
        let out = stderr(&o);
        assert_child_passed(&o, &format!("{var}={value:?}"));
        // HcclCommInitRootInfo, HcclCommInitRootInfoConfig, HcclGetRootInfo:
        // success, or HCCL_E_PARA naming the variable.
        let want = if *ok { "codes [0, 0, 0]" } else { "codes [1, 1, 1]" };
        if !out.contains(want) || !(*ok || out.matches(&format!("{var}={value:?}")).count() == 3) {
            wrong.push(format!(
                "{var}={value:?} (want {want}): {}",
                out.lines().find(|l| l.contains("codes")).unwrap_or("")
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn hccls_inconsistent_op_check_reports_a_later_disagreeing_call_as_an_async_error() {
    if role().as_deref() == Some("inconsistent") {
        let rank: u32 = std::env::var("RANK").unwrap().parse().unwrap();
        let root = unhex(&std::env::var("ROOT").unwrap());
        let s = use_device(rank as i32);
        let mut comm = NULL;
        unsafe { assert_eq!((s.HcclCommInitRootInfo)(2, root.as_ptr(), rank, &mut comm), 0, "{}", err_msg()) };
        let st = stream();
        let send = upload(&[1f32; 8]);
        let recv = malloc(32);
        // The first call matches (its links are set up); the second differs
        // in its count, which only the check on the device sees.
        let n = if rank == 0 { 4 } else { 8 };
        unsafe {
            assert_eq!((s.HcclAllReduce)(send, recv, 4, HCCL_FP32, HCCL_SUM, comm, st), 0);
            assert_eq!((s.aclrtSynchronizeStream)(st), 0, "{}", err_msg());
            assert_eq!((s.HcclAllReduce)(send, recv, n, HCCL_FP32, HCCL_SUM, comm, st), 0);
        }
        let r = unsafe { (s.aclrtSynchronizeStream)(st) };
        let mut e = -1;
        unsafe { assert_eq!((s.HcclGetCommAsyncError)(comm, &mut e), 0) };
        println!("rank {rank}: sync {r} async {e}");
        return;
    }
    let name = "hccls_inconsistent_op_check_reports_a_later_disagreeing_call_as_an_async_error";
    // HCCL_E_PARA (1) with the check on (spaces and case as HCCL reads
    // them); nothing while it is off (its default) or the heartbeat is off.
    for (dfs, async_err) in [
        (Some(" Inconsistent_Check : ON "), 1),
        (Some("cluster_heartbeat:on,inconsistent_check:on"), 1),
        (Some("inconsistent_check:on,cluster_heartbeat:off"), 0),
        (Some("inconsistent_check:yes"), 0),
        (None, 0),
    ] {
        let mut env = vec![("HCCL_EXEC_TIMEOUT", "60")];
        env.extend(dfs.map(|v| ("HCCL_DFS_CONFIG", v)));
        let outs = run_ranks(name, "inconsistent", 2, &env);
        for (r, o) in outs.iter().enumerate() {
            let out = stderr(o);
            assert!(o.status.success(), "{dfs:?} rank {r}: {out}");
            // The stream fails at once either way: the simulator does not
            // wait out the execution timeout.
            assert!(out.contains(&format!("rank {r}: sync 507046 async {async_err}")), "{dfs:?} rank {r}: {out}");
        }
    }
}
