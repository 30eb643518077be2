//! Each HCCL rule the simulator enforces (cann-sim/README.md, "Rules"), one
//! test per rule proving the violation is refused with HCCL's code, called
//! through HCCL's C signatures. Rules that depend on the emulated CANN release
//! run in a child process with `CANNSIM_CANN_VERSION` set.

mod common;

use common::*;

const NULL: Ptr = std::ptr::null_mut();
const E_PARA: i32 = 1;
const E_PTR: i32 = 2;
const E_MEMORY: i32 = 3;
const E_NOT_SUPPORT: i32 = 5;
const FP32: i32 = 4;

/// An `HcclCommConfig` of layout `version` as that version's
/// `HcclCommConfigInit` writes it (sizes 300 / 312 / 2104 / 2240; version 5
/// writes a 200 MB buffer and deterministic 0, later versions "not set").
fn config(version: u32) -> Vec<u8> {
    let size = match version {
        5 => 300usize,
        6 => 312,
        8 => 2104,
        _ => 2240,
    };
    let mut c = vec![0u8; 2240];
    c[0..8].copy_from_slice(&size.to_le_bytes());
    c[8..12].copy_from_slice(&0xf0f0_f0f0u32.to_le_bytes());
    c[12..16].copy_from_slice(&version.to_le_bytes());
    let (buffer, det) = if version == 5 { (200u32, 0u32) } else { (u32::MAX, u32::MAX) };
    c[24..28].copy_from_slice(&buffer.to_le_bytes());
    c[28..32].copy_from_slice(&det.to_le_bytes());
    c
}

fn set_u32(c: &mut [u8], off: usize, v: u32) {
    c[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

/// `HcclCommInitRootInfoConfig` of a one-rank world with `cfg` (the comm is
/// destroyed again on success).
fn init_one(cfg: *const u8) -> i32 {
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
    let mut comm = NULL;
    let rc = unsafe { (s.HcclCommInitRootInfoConfig)(1, root.as_ptr(), 0, cfg, &mut comm) };
    if rc == 0 {
        unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0) };
    }
    rc
}

/// Runs `f(rank, comm)` on `world` rank threads of one fresh global communicator.
fn with_world<R: Send>(world: u32, f: impl Fn(u32, Ptr) -> R + Sync) -> Vec<R> {
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
    let cfg = config(10);
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (root, cfg, f) = (&root, &cfg, &f);
                sc.spawn(move || {
                    let s = use_device(r as i32);
                    let mut comm = NULL;
                    let rc =
                        unsafe { (s.HcclCommInitRootInfoConfig)(world, root.as_ptr(), r, cfg.as_ptr(), &mut comm) };
                    assert_eq!(rc, 0, "rank {r}: {}", err_msg());
                    let out = f(r, comm);
                    unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0) };
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

fn split(comm: Ptr, ids: &[u32], id: u64, sub_rank: u32) -> (i32, Ptr) {
    let s = sim();
    let (mut parent, mut sub) = (comm, NULL);
    let mut ids = ids.to_vec();
    let mut cfg = config(10);
    let p = if ids.is_empty() { NULL.cast() } else { ids.as_mut_ptr() };
    let rc = unsafe {
        (s.HcclCreateSubCommConfig)(&mut parent, ids.len() as u32, p, id, sub_rank, cfg.as_mut_ptr(), &mut sub)
    };
    (rc, sub)
}

fn child_ok(test: &str, version: &str) {
    let o = run_child(test, "version", &[("CANNSIM_CANN_VERSION", version)]);
    assert_child_passed(&o, &format!("child ({version})"));
}

#[test]
fn capability_and_config_rules_follow_the_emulated_release() {
    if role().is_none() {
        for v in ["8.1", "8.3", "8.5"] {
            child_ok("capability_and_config_rules_follow_the_emulated_release", v);
        }
        return;
    }
    let s = use_device(0);
    let version = std::env::var("CANNSIM_CANN_VERSION").expect("set by the parent");
    let cap = unsafe { (s.HcclGetCommConfigCapability)() };
    match version.as_str() {
        "8.1" => {
            // hccl_types.h of CANN 8.1.RC1: capabilities 0..=3, config version 5.
            assert_eq!(cap, 4);
            assert_eq!(init_one(config(5).as_ptr()), 0, "{}", err_msg());
            // Its HCCL has no "not set": deterministic 0xffffffff is > 1.
            let mut c = config(10);
            set_u32(&mut c, 24, 200);
            assert_eq!(init_one(c.as_ptr()), E_PARA, "deterministic 0xffffffff");
            // ... and a 0xffffffff MB buffer cannot be allocated.
            let mut c = config(10);
            set_u32(&mut c, 28, 0);
            assert_eq!(init_one(c.as_ptr()), E_MEMORY, "buffer 0xffffffff MB");
        }
        "8.3" => {
            assert_eq!(cap, 7);
            assert_eq!(init_one(config(6).as_ptr()), 0, "{}", err_msg());
            let mut c = config(6);
            set_u32(&mut c, 28, 2);
            assert_eq!(init_one(c.as_ptr()), E_PARA, "deterministic 2 before strict mode existed");
        }
        _ => {
            // hicann/hcomm v8.5.0 include/hccl/hccl_types.h:154-165: capabilities
            // 0..=10 (up to RETRY); its own config is version 8, and a newer one
            // (torch-npu 2.11's version 10) is read as far as its CommConfig goes.
            assert_eq!(cap, 11);
            assert_eq!(init_one(config(8).as_ptr()), 0, "{}", err_msg());
            assert_eq!(init_one(config(10).as_ptr()), 0, "{}", err_msg());
            let mut c = config(10);
            set_u32(&mut c, 28, 2);
            assert_eq!(init_one(c.as_ptr()), 0, "strict deterministic: {}", err_msg());
            set_u32(&mut c, 28, 3);
            assert_eq!(init_one(c.as_ptr()), E_PARA, "deterministic 3");
            // aclGraphZeroCopyEnable (byte 312, config version 7 on): 0 or 1.
            let mut c = config(10);
            c[312] = 1;
            assert_eq!(init_one(c.as_ptr()), 0, "zero copy 1: {}", err_msg());
            c[312] = 2;
            assert_eq!(init_one(c.as_ptr()), E_PARA, "zero copy 2");
            assert!(err_msg().contains("aclGraphZeroCopyEnable 2"), "{}", err_msg());
            // A version-6 config has no such field: its byte 312 is never read.
            let mut c = config(6);
            c[312] = 2;
            assert_eq!(init_one(c.as_ptr()), 0, "version 6: {}", err_msg());
        }
    }
}

#[test]
fn a_config_not_initialised_by_hccl_comm_config_init_is_refused() {
    let mut c = config(10);
    c[8..12].copy_from_slice(&0u32.to_le_bytes());
    assert_eq!(init_one(c.as_ptr()), E_PARA);
    assert!(err_msg().contains("magic"), "{}", err_msg());
}

#[test]
fn a_null_config_is_refused() {
    assert_eq!(init_one(std::ptr::null()), E_PTR);
}

#[test]
fn a_buffer_below_one_megabyte_is_refused() {
    let mut c = config(10);
    set_u32(&mut c, 24, 0);
    assert_eq!(init_one(c.as_ptr()), E_PARA);
    assert!(err_msg().contains("hcclBufferSize"), "{}", err_msg());
}

#[test]
fn sub_comm_rank_ids_must_be_ascending() {
    let rcs = with_world(2, |r, comm| {
        // Rank 1 first: rank r is at index 1 - r.
        let (rc, _) = split(comm, &[1, 0], 7, 1 - r);
        (rc, err_msg())
    });
    for (rc, msg) in rcs {
        assert_eq!(rc, E_PARA, "{msg}");
        assert!(msg.contains("ascending"), "{msg}");
    }
}

#[test]
fn sub_comm_rank_id_must_be_the_index_in_rank_ids() {
    let rcs = with_world(2, |r, comm| split(comm, &[0, 1], 7, 1 - r).0);
    assert_eq!(rcs, vec![E_PARA, E_PARA]);
}

#[test]
fn a_sub_communicator_cannot_be_split_again() {
    let rcs = with_world(2, |r, comm| {
        let (rc, sub) = split(comm, &[0, 1], 7, r);
        assert_eq!(rc, 0, "{}", err_msg());
        let (nested, _) = split(sub, &[0, 1], 8, r);
        let msg = err_msg();
        unsafe { assert_eq!((sim().HcclCommDestroy)(sub), 0) };
        (nested, msg)
    });
    for (rc, msg) in rcs {
        assert_eq!(rc, E_NOT_SUPPORT, "{msg}");
        assert!(msg.contains("nesting"), "{msg}");
    }
}

#[test]
fn a_sub_comm_id_is_used_once_per_global_communicator() {
    let rcs = with_world(2, |r, comm| {
        let (rc, sub) = split(comm, &[0, 1], 9, r);
        assert_eq!(rc, 0, "{}", err_msg());
        unsafe { assert_eq!((sim().HcclCommDestroy)(sub), 0) };
        split(comm, &[0, 1], 9, r).0
    });
    assert_eq!(rcs, vec![E_PARA, E_PARA]);
}

#[test]
fn ranks_outside_the_group_pass_null_rank_ids_and_the_reserved_id() {
    let rcs = with_world(2, |r, comm| {
        if r == 0 {
            let (rc, sub) = split(comm, &[0], 11, 0);
            assert_eq!(rc, 0, "{}", err_msg());
            unsafe { assert_eq!((sim().HcclCommDestroy)(sub), 0) };
            (0, 0)
        } else {
            // NULL rankIds with the reserved id: a non-member, success.
            let ok = split(comm, &[], 0xFFFF_FFFF, 0).0;
            // NULL rankIds with any other id is refused, and so are rankIds
            // with the reserved id.
            let bad = split(comm, &[], 11, 0).0;
            let reserved = split(comm, &[1], 0xFFFF_FFFF, 0).0;
            assert_eq!(reserved, E_PARA, "rankIds with subCommId 0xFFFFFFFF: {}", err_msg());
            // The current device comes first (op_base.cc:762-770), for a
            // non-member too: a thread without one is refused.
            let handle = comm as usize;
            let deviceless = std::thread::spawn(move || split(handle as Ptr, &[], 0xFFFF_FFFF, 0).0).join().unwrap();
            assert_eq!(deviceless, E_RUNTIME, "a non-member on a thread without a device");
            (ok, bad)
        }
    });
    assert_eq!(rcs[1], (0, E_PARA));
}

#[test]
fn collective_buffers_must_not_be_null_even_with_count_zero() {
    // One rank: a peer would wait for the refused rank at link setup until
    // the connect timeout.
    let rcs = with_world(1, |r, comm| {
        let s = sim();
        let st = stream();
        // The rank sends nothing, but its send buffer must still be a real address.
        let counts = [0u64];
        let displs = [0u64];
        let recv = malloc(64);
        let send = NULL;
        let rc = unsafe {
            (s.HcclAllGatherV)(
                send,
                counts[r as usize],
                recv,
                counts.as_ptr().cast(),
                displs.as_ptr().cast(),
                FP32,
                comm,
                st,
            )
        };
        free(recv);
        destroy_stream(st);
        rc
    });
    assert_eq!(rcs[0], E_PTR);
}

#[test]
fn host_memory_is_refused_as_a_collective_buffer() {
    let rcs = with_world(1, |_, comm| {
        let st = stream();
        let mut host = [0f32; 4];
        let dev = malloc(64);
        let rc = unsafe { (sim().HcclAllReduce)(host.as_mut_ptr().cast(), dev, 4, FP32, 0, comm, st) };
        let msg = err_msg();
        free(dev);
        destroy_stream(st);
        (rc, msg)
    });
    assert_eq!(rcs[0].0, E_PTR, "{}", rcs[0].1);
    assert!(rcs[0].1.contains("device memory"), "{}", rcs[0].1);
}

#[test]
fn a_null_stream_is_refused_by_collectives() {
    let rcs = with_world(1, |_, comm| {
        let dev = malloc(64);
        let rc = unsafe { (sim().HcclAllReduce)(dev, dev, 4, FP32, 0, comm, NULL) };
        free(dev);
        rc
    });
    assert_eq!(rcs[0], E_PTR);
}

#[test]
fn a_collective_needs_its_streams_device_current_on_the_calling_thread() {
    // The collective's tasks go on the stream through the runtime, which
    // needs a current context and refuses a stream outside it (v8.5.0
    // api_impl.cc ApiImpl::NotifyRecord :4606-4616, ApiImpl::MemcpyAsync
    // :2753-2762); HCCL returns HCCL_E_RUNTIME.
    let (refused, ran) = with_world(1, |_, comm| {
        let st = stream();
        let dev = malloc(64);
        let (c, s, d) = (comm as usize, st as usize, dev as usize);
        let from = |device: Option<i32>| {
            std::thread::spawn(move || {
                let api = device.map_or_else(sim, use_device);
                let rc = unsafe { (api.HcclAllReduce)(d as Ptr, d as Ptr, 4, FP32, 0, c as Ptr, s as Ptr) };
                let msg = err_msg();
                if let Some(x) = device {
                    unsafe { assert_eq!((api.aclrtResetDevice)(x), 0) };
                }
                (rc, msg)
            })
            .join()
            .expect("caller thread")
        };
        let refused = [from(None), from(Some(1))];
        let ran = unsafe { (sim().HcclAllReduce)(dev, dev, 4, FP32, 0, comm, st) };
        sync(st);
        destroy_stream(st);
        free(dev);
        (refused, ran)
    })
    .remove(0);
    let [(none_rc, none_msg), (other_rc, other_msg)] = refused;
    assert_eq!(none_rc, E_RUNTIME, "{none_msg}");
    assert!(none_msg.contains("aclrtSetDevice"), "{none_msg}");
    assert_eq!(other_rc, E_RUNTIME, "{other_msg}");
    assert!(other_msg.contains("belongs to device 0 but the calling thread's current device is 1"), "{other_msg}");
    assert_eq!(ran, 0, "on the stream's device the collective runs");
}

#[test]
fn a_null_communicator_is_hccl_e_ptr() {
    // HCCL's CHK_PTR_NULL(comm) in every call that takes one (op_base.cc
    // :1462 HcclAllReduce, :2726 HcclGetRankSize, :2741 HcclGetRankId, :3490
    // HcclGetCommAsyncError, HongminTan/ACNC2025-HCCL).
    let s = use_device(0);
    let st = stream();
    let dev = malloc(64);
    let mut out = 0u32;
    let mut err = 0i32;
    let mut name = [0 as std::ffi::c_char; 128];
    unsafe {
        assert_eq!((s.HcclAllReduce)(dev, dev, 4, FP32, 0, NULL, st), E_PTR, "{}", err_msg());
        assert!(err_msg().contains("comm is NULL"), "{}", err_msg());
        assert_eq!((s.HcclGetRankSize)(NULL, &mut out), E_PTR);
        assert_eq!((s.HcclGetRankId)(NULL, &mut out), E_PTR);
        assert_eq!((s.HcclGetCommAsyncError)(NULL, &mut err), E_PTR);
        assert_eq!((s.HcclGetCommName)(NULL, name.as_mut_ptr()), E_PTR);
    }
    free(dev);
}

#[test]
fn the_v_collectives_need_distinct_send_and_receive_buffers() {
    let rcs = with_world(1, |_, comm| {
        let st = stream();
        let (dev, other) = (malloc(64), malloc(64));
        let s = sim();
        let mut rcs = Vec::new();
        // Counts 4 and 0: AlltoAllV refuses the same address even when nothing moves.
        for n in [4u64, 0] {
            let (counts, displs) = ([n], [0u64]);
            let (c, d) = (counts.as_ptr().cast(), displs.as_ptr().cast());
            // SAFETY: device buffers of 64 bytes, host arrays of world length.
            unsafe {
                rcs.push((s.HcclAllGatherV)(dev, n, dev, c, d, FP32, comm, st));
                rcs.push((s.HcclReduceScatterV)(dev, c, d, dev, n, FP32, 0, comm, st));
                rcs.push((s.HcclAlltoAllV)(dev, c, d, FP32, dev, c, d, FP32, comm, st));
                // The same calls over two buffers are accepted.
                rcs.push(-(s.HcclAlltoAllV)(dev, c, d, FP32, other, c, d, FP32, comm, st));
                rcs.push(-(s.HcclReduceScatterV)(dev, c, d, other, n, FP32, 0, comm, st));
            }
        }
        assert_eq!(unsafe { (s.aclrtSynchronizeStream)(st) }, 0, "{}", err_msg());
        free(dev);
        free(other);
        destroy_stream(st);
        rcs
    });
    assert_eq!(rcs[0], [E_PARA, E_PARA, E_PARA, 0, 0, E_PARA, E_PARA, E_PARA, 0, 0]);
}

#[test]
fn a_sub_communicator_needs_at_least_one_rank() {
    let rcs = with_world(1, |_, comm| {
        let (mut parent, mut sub) = (comm, NULL);
        let mut ids = [0u32];
        let mut cfg = config(10);
        unsafe { (sim().HcclCreateSubCommConfig)(&mut parent, 0, ids.as_mut_ptr(), 5, 0, cfg.as_mut_ptr(), &mut sub) }
    });
    assert_eq!(rcs, vec![E_PARA]);
}

const INT64: i32 = 5;
const SUM: i32 = 0;

#[test]
fn reduce_scatter_v_takes_no_int64_on_a2_while_all_reduce_and_all_gather_do() {
    // HCCL API reference (hicann/hccl v9.1.0 docs/zh/api_ref/comm_op_interface):
    // HcclReduceScatterV.md:51 lists no int64 for Atlas A2; HcclAllReduce.md:49,
    // HcclReduceScatter.md:49 and HcclAllGather.md:51 do.
    with_world(1, |_, comm| {
        let s = sim();
        let st = stream();
        let (a, b) = (malloc(64), malloc(64));
        let counts = [2u64];
        let displs = [0u64];
        unsafe {
            let p = |v: &[u64; 1]| v.as_ptr() as *const std::ffi::c_void;
            let rc = (s.HcclReduceScatterV)(a, p(&counts), p(&displs), b, 2, INT64, SUM, comm, st);
            assert_eq!(rc, E_NOT_SUPPORT, "{}", err_msg());
            assert!(err_msg().contains("HcclReduceScatterV") && err_msg().contains("Atlas A2"), "{}", err_msg());
            // fp32 is in the table: the same call runs.
            assert_eq!(
                (s.HcclReduceScatterV)(a, p(&counts), p(&displs), b, 2, FP32, SUM, comm, st),
                0,
                "{}",
                err_msg()
            );
            assert_eq!((s.HcclAllReduce)(a, b, 2, INT64, SUM, comm, st), 0, "{}", err_msg());
            assert_eq!((s.HcclReduceScatter)(a, b, 2, INT64, SUM, comm, st), 0, "{}", err_msg());
            assert_eq!((s.HcclAllGather)(a, b, 2, INT64, comm, st), 0, "{}", err_msg());
            // prod is not a ReduceScatterV op on A2 (HcclReduceScatterV.md:58).
            let rc = (s.HcclReduceScatterV)(a, p(&counts), p(&displs), b, 2, FP32, 1, comm, st);
            assert_eq!(rc, E_NOT_SUPPORT, "{}", err_msg());
        }
        sync(st);
        free(a);
        free(b);
        destroy_stream(st);
    });
}

#[test]
fn a_barrier_is_refused_on_a_capturing_stream() {
    // HCCL's A2 operator list names no barrier in aclgraph capture mode
    // (hicann/hccl v9.1.0 docs/zh/user_guide/comm_ops_support_list/comm_ops_support_a2.md:13).
    let lib = unsafe { libloading::Library::new(lib_path()).expect("load libcann_sim.so") };
    type Begin = unsafe extern "C" fn(Ptr, i32) -> i32;
    type End = unsafe extern "C" fn(Ptr, *mut Ptr) -> i32;
    type Destroy = unsafe extern "C" fn(Ptr) -> i32;
    let (begin, end, destroy): (Begin, End, Destroy) = unsafe {
        (
            *lib.get(b"aclmdlRICaptureBegin\0").unwrap(),
            *lib.get(b"aclmdlRICaptureEnd\0").unwrap(),
            *lib.get(b"aclmdlRIDestroy\0").unwrap(),
        )
    };
    with_world(1, |_, comm| {
        let s = sim();
        let st = stream();
        // Outside a capture the barrier runs.
        unsafe { assert_eq!((s.HcclBarrier)(comm, st), 0, "{}", err_msg()) };
        sync(st);
        unsafe {
            // Relaxed mode (2): the capture forbids nothing else here.
            assert_eq!(begin(st, 2), 0, "{}", err_msg());
            let rc = (s.HcclBarrier)(comm, st);
            assert_eq!(rc, E_NOT_SUPPORT, "{}", err_msg());
            assert!(err_msg().contains("capturing"), "{}", err_msg());
            let mut model = NULL;
            assert_eq!(end(st, &mut model), 0, "{}", err_msg());
            assert_eq!(destroy(model), 0, "{}", err_msg());
        }
        destroy_stream(st);
    });
}

const E_RUNTIME: i32 = 15;

/// The `rc`, recent error and communicator of `HcclCommInitRootInfo[Config]`
/// (with `config` when given) of each rank of a `devices.len()`-rank world,
/// rank `r` a thread on `devices[r]`; every communicator made is destroyed.
fn init_on(devices: &[i32], config: Option<&[u8]>) -> Vec<(i32, String, bool)> {
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
    let world = devices.len() as u32;
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let root = &root;
                sc.spawn(move || {
                    let s = use_device(devices[r as usize]);
                    let mut comm = NULL;
                    let rc = unsafe {
                        match config {
                            Some(c) => (s.HcclCommInitRootInfoConfig)(world, root.as_ptr(), r, c.as_ptr(), &mut comm),
                            None => (s.HcclCommInitRootInfo)(world, root.as_ptr(), r, &mut comm),
                        }
                    };
                    let msg = err_msg();
                    let made = !comm.is_null();
                    if made {
                        unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0) };
                    }
                    (rc, msg, made)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

#[test]
fn two_ranks_on_one_device_are_refused_by_every_rank() {
    // hicann/hcomm v8.5.0 topoinfo_exchange_agent.cc:822-849
    // (VerifyServerDevicePhysicID), run by every rank on the gathered rank
    // table while HcclCommInitRootInfo[Config] creates the communicator.
    let cfg = config(10);
    for config in [None, Some(cfg.as_slice())] {
        // Ranks 0 and 2 on device 1, rank 1 on device 0.
        let outs = init_on(&[1, 0, 1], config);
        for (r, (rc, msg, made)) in outs.iter().enumerate() {
            assert_eq!(*rc, E_PARA, "rank {r} (config {}): {msg}", config.is_some());
            assert!(msg.contains("rank 0 and rank 2") && msg.contains("device 1"), "rank {r}: {msg}");
            assert!(!made, "rank {r} got a communicator");
        }
    }
    // The same ranks on three devices make a communicator.
    let outs = init_on(&[1, 0, 2], None);
    assert!(outs.iter().all(|(rc, _, made)| *rc == 0 && *made), "{outs:?}");
}

#[test]
fn hccl_comm_destroy_needs_a_current_device_and_takes_null_as_nothing() {
    // hicann/hcomm v8.5.0 op_base.cc:2358-2360: the device first
    // (HCCL_E_RUNTIME without one), then NULL is a success.
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    let mut comm = NULL;
    unsafe {
        assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg());
        assert_eq!((s.HcclCommInitRootInfo)(1, root.as_ptr(), 0, &mut comm), 0, "{}", err_msg());
    }
    let handle = comm as usize;
    // A thread that never set a device.
    let (null_rc, live_rc, msg) = std::thread::spawn(move || {
        let s = sim();
        unsafe {
            let r = (s.aclInit)(std::ptr::null());
            assert!(r == 0 || r == 100002, "aclInit: {r}");
            let null_rc = (s.HcclCommDestroy)(NULL);
            let live_rc = (s.HcclCommDestroy)(handle as Ptr);
            (null_rc, live_rc, err_msg())
        }
    })
    .join()
    .expect("thread without a device");
    assert_eq!((null_rc, live_rc), (E_RUNTIME, E_RUNTIME), "{msg}");
    assert!(msg.contains("aclrtSetDevice"), "{msg}");
    unsafe {
        // The refused destroy left the communicator alive.
        let mut size = 0u32;
        assert_eq!((s.HcclGetRankSize)(comm, &mut size), 0, "{}", err_msg());
        assert_eq!(size, 1);
        // With a device: NULL does nothing and succeeds; the live one goes.
        assert_eq!((s.HcclCommDestroy)(NULL), 0, "{}", err_msg());
        assert_eq!((s.HcclCommDestroy)(comm), 0, "{}", err_msg());
        assert_eq!((s.HcclCommDestroy)(comm), E_PARA, "a destroyed communicator is not live");
    }
}

/// `count` f32 values of rank `r` (distinct per rank and element).
fn vals(r: u32, count: usize) -> Vec<f32> {
    (0..count).map(|i| 10.0 * r as f32 + i as f32 + 0.5).collect()
}

/// Every collective of ours on the one-rank communicator `comm` of rank
/// `r`: each leaves the rank's own data (a reduction of one rank is its
/// input, a gather of one rank its block).
fn one_rank_collectives(r: u32, comm: Ptr) {
    let s = sim();
    let st = stream();
    let mine = vals(r, 4);
    let send = upload(&mine);
    let recv = malloc(16);
    let (counts, displs) = ([4u64], [0u64]);
    let (c, d) = (counts.as_ptr().cast(), displs.as_ptr().cast());
    let mut size = 0u32;
    unsafe { assert_eq!((s.HcclGetRankSize)(comm, &mut size), 0, "{}", err_msg()) };
    assert_eq!(size, 1);
    let calls: [(&str, &dyn Fn() -> i32); 6] = [
        ("HcclAllReduce", &|| unsafe { (s.HcclAllReduce)(send, recv, 4, FP32, SUM, comm, st) }),
        ("HcclReduceScatter", &|| unsafe { (s.HcclReduceScatter)(send, recv, 4, FP32, SUM, comm, st) }),
        ("HcclReduceScatterV", &|| unsafe { (s.HcclReduceScatterV)(send, c, d, recv, 4, FP32, SUM, comm, st) }),
        ("HcclAllGather", &|| unsafe { (s.HcclAllGather)(send, recv, 4, FP32, comm, st) }),
        ("HcclAllGatherV", &|| unsafe { (s.HcclAllGatherV)(send, 4, recv, c, d, FP32, comm, st) }),
        ("HcclAlltoAllV", &|| unsafe { (s.HcclAlltoAllV)(send, c, d, FP32, recv, c, d, FP32, comm, st) }),
    ];
    for (call, f) in calls {
        unsafe { assert_eq!((s.aclrtMemset)(recv, 16, 0, 16), 0, "{}", err_msg()) };
        assert_eq!(f(), 0, "{call}: {}", err_msg());
        sync(st);
        assert_eq!(download::<f32>(recv, 4), mine, "{call} of rank {r} alone");
    }
    unsafe {
        assert_eq!((s.HcclBroadcast)(send, 4, FP32, 0, comm, st), 0, "{}", err_msg());
        assert_eq!((s.HcclBarrier)(comm, st), 0, "{}", err_msg());
    }
    sync(st);
    assert_eq!(download::<f32>(send, 4), mine, "a broadcast from the only rank");
    free(send);
    free(recv);
    destroy_stream(st);
}

#[test]
fn a_one_rank_communicator_and_a_one_rank_sub_communicator_run_every_collective() {
    // Accepted by HCCL: hicann/hcomm v8.5.0 op_base.cc:1311-1315 and :823-826
    // refuse only nRanks / rankNum 0; one-rank collectives take the
    // single-rank executors (e.g. all_reduce_operator.cc:118-122), which copy
    // sendBuf to recvBuf.
    with_world(1, one_rank_collectives);
    // Each rank of a world of 2 splits itself off (rankNum 1, its own id).
    with_world(2, |r, comm| {
        let (rc, sub) = split(comm, &[r], 40 + r as u64, 0);
        assert_eq!(rc, 0, "rank {r}: {}", err_msg());
        one_rank_collectives(r, sub);
        unsafe { assert_eq!((sim().HcclCommDestroy)(sub), 0, "{}", err_msg()) };
    });
}

#[test]
fn a_one_rank_all_to_all_v_takes_displacements_zero_only() {
    // Stricter than HCCL, whose one-rank all-to-all ignores the
    // displacements (hicann/hcomm v8.5.0
    // coll_all_to_all_single_rank_executor.cc:50-76).
    let rcs = with_world(1, |_, comm| {
        let s = sim();
        let st = stream();
        let (send, recv) = (upload(&vals(0, 8)), malloc(32));
        let counts = [4u64];
        let mut rcs = Vec::new();
        for (sd, rd) in [([2u64], [0u64]), ([0], [2]), ([0], [0])] {
            let c = counts.as_ptr().cast();
            let rc = unsafe {
                (s.HcclAlltoAllV)(send, c, sd.as_ptr().cast(), FP32, recv, c, rd.as_ptr().cast(), FP32, comm, st)
            };
            if rc != 0 {
                assert!(err_msg().contains("ignores the displacements"), "{}", err_msg());
            }
            rcs.push(rc);
        }
        sync(st);
        free(send);
        free(recv);
        destroy_stream(st);
        rcs
    });
    assert_eq!(rcs[0], [E_PARA, E_PARA, 0]);
}

const BF16: i32 = 11;
const FP16: i32 = 3;

#[test]
fn reductions_refuse_buffers_not_aligned_to_their_elements() {
    // HcclAllReduce.md:69-73, HcclReduceScatter.md:70-74,
    // HcclReduceScatterV.md:71-75 (hicann/hccl v9.1.0): 2-byte types at
    // 2-byte addresses, 4-byte at 4, 8-byte at 8; the gathers state nothing.
    let rcs = with_world(1, |_, comm| {
        let s = sim();
        let st = stream();
        let (a, b) = (malloc(256), malloc(256));
        let at = |p: Ptr, off: usize| p.cast::<u8>().wrapping_add(off).cast::<std::ffi::c_void>();
        let (counts, displs) = ([4u64], [0u64]);
        let (c, d) = (counts.as_ptr().cast(), displs.as_ptr().cast());
        let mut rcs = Vec::new();
        // SAFETY: device buffers of 256 bytes, every call within them; host
        // arrays of world length.
        unsafe {
            for (dt, off) in [(BF16, 1), (FP32, 2), (INT64, 4)] {
                rcs.push((s.HcclAllReduce)(at(a, off), b, 4, dt, SUM, comm, st));
                rcs.push((s.HcclAllReduce)(a, at(b, off), 4, dt, SUM, comm, st));
                rcs.push((s.HcclReduceScatter)(at(a, off), b, 4, dt, SUM, comm, st));
            }
            rcs.push((s.HcclReduceScatterV)(a, c, d, at(b, 2), 4, FP32, SUM, comm, st));
            let refused = err_msg();
            assert!(refused.contains("recvBuf") && refused.contains("4-byte elements"), "{refused}");
            // Aligned to their elements they run; so does a gather at an odd
            // address.
            rcs.push(-(s.HcclAllReduce)(at(a, 2), at(b, 4), 4, BF16, SUM, comm, st));
            rcs.push(-(s.HcclReduceScatterV)(at(a, 2), c, d, at(b, 6), 4, FP16, SUM, comm, st));
            rcs.push(-(s.HcclAllGather)(at(a, 1), at(b, 3), 4, FP32, comm, st));
        }
        sync(st);
        free(a);
        free(b);
        destroy_stream(st);
        rcs
    });
    assert_eq!(rcs[0][..10], [E_PARA; 10], "{:?}", rcs[0]);
    assert_eq!(rcs[0][10..], [0, 0, 0], "{:?}", rcs[0]);
}

/// HCCL's largest count, SYS_MAX_COUNT = 0x7FFFFFFFF (hicann/hccl
/// `src/common/hccl_common.h:42`), checked by every collective's CheckCount /
/// HcomCheckCount.
const MAX: u64 = 0x7_FFFF_FFFF;

#[test]
fn counts_above_hccls_largest_count_are_refused() {
    let rcs = with_world(1, |_, comm| {
        let s = sim();
        let st = stream();
        let (a, b) = (malloc(256), malloc(256));
        let big = MAX + 1;
        let (counts, displs, zero) = ([big], [0u64], [0u64]);
        let (c, d, z) = (counts.as_ptr().cast(), displs.as_ptr().cast(), zero.as_ptr().cast());
        let mut rcs = Vec::new();
        // SAFETY: device buffers of 256 bytes; host arrays of world length.
        // Every call is refused before it touches a buffer.
        unsafe {
            rcs.push((s.HcclAllReduce)(a, b, big, FP32, SUM, comm, st));
            assert!(err_msg().contains("largest count"), "{}", err_msg());
            rcs.push((s.HcclReduceScatter)(a, b, big, FP32, SUM, comm, st));
            rcs.push((s.HcclReduceScatterV)(a, c, d, b, big, FP32, SUM, comm, st));
            rcs.push((s.HcclAllGather)(a, b, big, FP32, comm, st));
            rcs.push((s.HcclAllGatherV)(a, big, b, c, d, FP32, comm, st));
            rcs.push((s.HcclBroadcast)(a, big, FP32, 0, comm, st));
            rcs.push((s.HcclAlltoAllV)(a, c, d, FP32, b, c, z, FP32, comm, st));
            // The largest count itself passes this check; its buffers are too
            // small for it.
            rcs.push((s.HcclAllReduce)(a, b, MAX, FP32, SUM, comm, st));
        }
        sync(st);
        free(a);
        free(b);
        destroy_stream(st);
        rcs
    });
    assert_eq!(rcs[0][..7], [E_PARA; 7], "{:?}", rcs[0]);
    assert_eq!(rcs[0][7], E_PTR, "{:?}", rcs[0]);
}

#[test]
fn a_v_collective_with_any_count_above_the_largest_is_refused_on_every_rank() {
    // hicann/hcomm v8.5.0 op_base.cc:1745-1749 / :2066-2070: every entry of
    // the counts array is checked, so the rank whose own count is small is
    // refused too (it would otherwise queue and wait for the refused peer).
    let rcs = with_world(2, |rank, comm| {
        let s = sim();
        let st = stream();
        let (a, b) = (malloc(256), malloc(256));
        let (counts, displs) = ([1u64, MAX + 1], [0u64, 1]);
        let own = counts[rank as usize];
        let (c, d) = (counts.as_ptr().cast(), displs.as_ptr().cast());
        // SAFETY: device buffers of 256 bytes; host arrays of world length.
        let rcs = unsafe {
            [
                (s.HcclReduceScatterV)(a, c, d, b, own, FP32, SUM, comm, st),
                (s.HcclAllGatherV)(a, own, b, c, d, FP32, comm, st),
            ]
        };
        let msg = err_msg();
        sync(st);
        free(a);
        free(b);
        destroy_stream(st);
        (rcs, msg)
    });
    for (rank, (rcs, msg)) in rcs.iter().enumerate() {
        assert_eq!(*rcs, [E_PARA; 2], "rank {rank}: {msg}");
        assert!(msg.contains("largest count"), "rank {rank}: {msg}");
        if rank == 0 {
            // Its own count is 1: the peer's entry is what it is refused for.
            assert!(msg.contains("recvCounts[1] 34359738368"), "rank {rank}: {msg}");
        }
    }
}

#[test]
fn a_v_collective_whose_own_count_is_not_its_entry_is_refused() {
    // hicann/hcomm v8.5.0 op_base.cc:1784-1788 (recvCount == sendCounts[rank])
    // and :2105-2109 (sendCount == recvCounts[rank]).
    let rcs = with_world(1, |_, comm| {
        let s = sim();
        let st = stream();
        let (a, b) = (malloc(256), malloc(256));
        let (counts, displs) = ([2u64], [0u64]);
        let (c, d) = (counts.as_ptr().cast(), displs.as_ptr().cast());
        // SAFETY: device buffers of 256 bytes; host arrays of world length.
        let rcs = unsafe {
            let rs = (s.HcclReduceScatterV)(a, c, d, b, 1, FP32, SUM, comm, st);
            let rs_msg = err_msg();
            let ag = (s.HcclAllGatherV)(a, 3, b, c, d, FP32, comm, st);
            (rs, rs_msg, ag, err_msg())
        };
        sync(st);
        free(a);
        free(b);
        destroy_stream(st);
        rcs
    });
    let (rs, rs_msg, ag, ag_msg) = &rcs[0];
    assert_eq!((*rs, *ag), (E_PARA, E_PARA), "{rs_msg} / {ag_msg}");
    assert!(rs_msg.contains("recvCount 1 but sendCounts[0] = 2"), "{rs_msg}");
    assert!(ag_msg.contains("sendCount 3 but recvCounts[0] = 2"), "{ag_msg}");
}

#[test]
fn ranks_are_told_apart_by_the_host_device_behind_their_visible_one() {
    // HCCL compares the physical ids of the ranks' current devices
    // (topoinfo_exchange_agent.cc:822-849, as above); the runtime maps a
    // process's device ids onto the host's through ASCEND_RT_VISIBLE_DEVICES
    // (hicann/runtime v8.5.0 runtime.cc:4836-4947, ChgUserDevIdToDeviceId
    // :4721-4737). One process a rank, each with its own list.
    let name = "ranks_are_told_apart_by_the_host_device_behind_their_visible_one";
    if role().as_deref() == Some("visible-rank") {
        let var = |k: &str| std::env::var(k).unwrap();
        let (rank, device): (u32, i32) = (var("RANK").parse().unwrap(), var("DEVICE").parse().unwrap());
        let s = use_device(device);
        let mut comm = NULL;
        let rc = unsafe { (s.HcclCommInitRootInfo)(2, unhex(&var("ROOT")).as_ptr(), rank, &mut comm) };
        let msg = err_msg();
        match var("EXPECT").as_str() {
            "apart" => {
                assert_eq!(rc, 0, "rank {rank}: {msg}");
                unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0) };
            }
            _ => {
                assert_eq!(rc, E_PARA, "rank {rank}: {msg}");
                assert!(msg.contains("physical device 1"), "rank {rank}: {msg}");
                assert!(comm.is_null(), "rank {rank} got a communicator");
            }
        }
        return;
    }
    let s = use_device(0);
    // (visible list, device id) of ranks 0 and 1.
    let cases: [(&str, [(&str, &str); 2]); 2] = [
        // vLLM's pattern: each worker sees one device and uses id 0.
        ("apart", [("0", "0"), ("1", "0")]),
        // Different ids, one host device (1).
        ("together", [("1", "0"), ("0,1", "1")]),
    ];
    for (expect, ranks) in cases {
        let mut root = vec![0u8; 4108];
        unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
        let root = hex(&root);
        let kids: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(r, (visible, device))| {
                let rank = r.to_string();
                let env = [
                    ("RANK", rank.as_str()),
                    ("ROOT", &root),
                    ("EXPECT", expect),
                    ("ASCEND_RT_VISIBLE_DEVICES", visible),
                    ("DEVICE", device),
                ];
                child(name, "visible-rank", &env).spawn().unwrap()
            })
            .collect();
        for (r, k) in kids.into_iter().enumerate() {
            assert_child_passed(&k.wait_with_output().unwrap(), &format!("{expect}, rank {r}"));
        }
    }
}

#[test]
fn a_comm_name_is_taken_on_its_device_until_the_communicator_is_destroyed() {
    // HCCL keeps each device's communicators by name from creation to
    // HcclCommDestroy and refuses a second one of a live name with
    // HCCL_E_PARA before meeting any peer (op_base.cc `InitCommRootInfo`,
    // HongminTan/ACNC2025-HCCL :1048-1057). The name is the root info's
    // identifier, or the config's hcclCommName.
    let s = use_device(0);
    let root = |s: &Api| {
        let mut root = vec![0u8; 4108];
        unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
        root
    };
    let init = |root: &[u8], cfg: Option<&[u8]>| {
        let mut comm = NULL;
        let rc = unsafe {
            match cfg {
                Some(c) => (s.HcclCommInitRootInfoConfig)(1, root.as_ptr(), 0, c.as_ptr(), &mut comm),
                None => (s.HcclCommInitRootInfo)(1, root.as_ptr(), 0, &mut comm),
            }
        };
        (rc, comm, err_msg())
    };
    let r = root(s);
    let (rc, first, msg) = init(&r, None);
    assert_eq!(rc, 0, "{msg}");
    // The same root info again on this device, the first still alive:
    // refused at once, nothing written.
    let (rc, again, msg) = init(&r, None);
    assert_eq!(rc, E_PARA, "{msg}");
    assert!(again.is_null() && msg.contains("already exists on device 0"), "{msg}");
    // On another device the name is free (each device keeps its own).
    let other = std::thread::scope(|sc| {
        sc.spawn(|| {
            let s = use_device(1);
            let mut comm = NULL;
            let rc = unsafe { (s.HcclCommInitRootInfo)(1, r.as_ptr(), 0, &mut comm) };
            let msg = err_msg();
            if rc == 0 {
                unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0) };
            }
            (rc, msg)
        })
        .join()
        .unwrap()
    });
    assert_eq!(other.0, 0, "device 1: {}", other.1);
    // Destroyed, the name is free again.
    unsafe { assert_eq!((s.HcclCommDestroy)(first), 0) };
    let (rc, second, msg) = init(&r, None);
    assert_eq!(rc, 0, "{msg}");
    unsafe { assert_eq!((s.HcclCommDestroy)(second), 0) };
    // A config's hcclCommName is the name: two roots, one name.
    let mut named = config(10);
    named[32..37].copy_from_slice(b"moe-g");
    let (rc, a, msg) = init(&root(s), Some(&named));
    assert_eq!(rc, 0, "{msg}");
    let (rc, b, msg) = init(&root(s), Some(&named));
    assert_eq!(rc, E_PARA, "{msg}");
    assert!(b.is_null() && msg.contains("\"moe-g\""), "{msg}");
    unsafe { assert_eq!((s.HcclCommDestroy)(a), 0) };
}

#[test]
fn root_info_calls_check_their_arguments_in_hccls_order() {
    // op_base.cc (HongminTan/ACNC2025-HCCL): HcclGetRootInfo :826-833 (the
    // device, then the pointer); HcclCommInitRootInfoInner :1210-1241 (the
    // device, rootInfo, nRanks, rank, comm, the environment);
    // HcclCommInitRootInfoConfigInner :1283-1330 (rootInfo, config, the
    // device, nRanks, rank, comm, the environment, the config's rules).
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
    let good = config(10);
    let mut bad_magic = config(10);
    set_u32(&mut bad_magic, 8, 0);
    let (r, g, b) = (root.as_ptr(), good.as_ptr(), bad_magic.as_ptr());
    let mut comm = NULL;
    let c: *mut Ptr = &mut comm;
    let null_root: *const u8 = std::ptr::null();
    let null_cfg: *const u8 = std::ptr::null();
    let (r, g, b, c) = (r as usize, g as usize, b as usize, c as usize);
    // Without a current device.
    let deviceless = std::thread::spawn(move || {
        let s = sim();
        let (r, g, c) = (r as *const u8, g as *const u8, c as *mut Ptr);
        let (null_root, null_cfg): (*const u8, *const u8) = (std::ptr::null(), std::ptr::null());
        unsafe {
            let get = (s.HcclGetRootInfo)(std::ptr::null_mut());
            let init = (s.HcclCommInitRootInfo)(1, null_root, 0, c);
            let cfg_null = (s.HcclCommInitRootInfoConfig)(1, r, 0, null_cfg, c);
            let cfg_ok = (s.HcclCommInitRootInfoConfig)(1, r, 0, g, c);
            (get, init, cfg_null, cfg_ok)
        }
    })
    .join()
    .unwrap();
    // The device first, except that the config variant checks rootInfo and
    // config before it.
    assert_eq!(deviceless, (E_RUNTIME, E_RUNTIME, E_PTR, E_RUNTIME));
    let (r, b) = (r as *const u8, b as *const u8);
    let null_comm: *mut Ptr = std::ptr::null_mut();
    unsafe {
        assert_eq!((s.HcclCommInitRootInfo)(0, null_root, 0, null_comm), E_PTR, "rootInfo before nRanks");
        assert_eq!((s.HcclCommInitRootInfo)(0, r, 0, null_comm), E_PARA, "nRanks before comm");
        assert!(err_msg().contains("nRanks 0"), "{}", err_msg());
        assert_eq!((s.HcclCommInitRootInfo)(1, r, 1, null_comm), E_PARA, "rank before comm");
        assert!(err_msg().contains("rank 1 should be less than nRanks 1"), "{}", err_msg());
        assert_eq!((s.HcclCommInitRootInfoConfig)(0, null_root, 0, null_cfg, null_comm), E_PTR);
        assert!(err_msg().contains("rootInfo"), "rootInfo before config: {}", err_msg());
        // The config's own rules come last: nRanks and comm are named first.
        assert_eq!((s.HcclCommInitRootInfoConfig)(0, r, 0, b, null_comm), E_PARA);
        assert!(err_msg().contains("nRanks 0"), "nRanks before the config's magic: {}", err_msg());
        assert_eq!((s.HcclCommInitRootInfoConfig)(1, r, 0, b, null_comm), E_PTR, "comm before the config's magic");
        assert_eq!((s.HcclCommInitRootInfoConfig)(1, r, 0, b, &mut comm), E_PARA);
        assert!(err_msg().contains("magic"), "{}", err_msg());
        assert!(comm.is_null());
    }
}
