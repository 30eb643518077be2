//! HCCL over the simulator with ranks as threads: every collective against a
//! naive reference, sub-communicators, and mismatched calls failing with an
//! error code instead of hanging.

mod common;

use std::ffi::{c_void, CStr};

use common::*;

const NULL: Ptr = std::ptr::null_mut();

/// A v10 `HcclCommConfig` (2240 bytes) as `HcclCommConfigInit` leaves it
/// (buffer size and deterministic "not set"), with an exec timeout in seconds.
fn config(timeout_s: i32) -> Vec<u8> {
    let mut c = vec![0u8; 2240];
    c[0..8].copy_from_slice(&2240usize.to_le_bytes());
    c[8..12].copy_from_slice(&0xf0f0_f0f0u32.to_le_bytes());
    c[12..16].copy_from_slice(&10u32.to_le_bytes());
    // hcclBufferSize and hcclDeterministic "not set".
    c[24..32].fill(0xff);
    c[316..320].copy_from_slice(&timeout_s.to_le_bytes());
    c
}

/// Runs `f(rank, comm, stream)` on `world` threads, each on device `rank`.
fn with_ranks<R: Send>(world: u32, timeout_s: i32, f: impl Fn(u32, Ptr, Ptr) -> R + Sync) -> Vec<R> {
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
    let cfg = config(timeout_s);
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
                    let st = stream();
                    let out = f(r, comm, st);
                    destroy_stream(st);
                    unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0) };
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

fn data(rank: u32, n: usize) -> Vec<f32> {
    (0..n).map(|i| (rank as f32 + 1.0) * 0.25 + i as f32).collect()
}

#[test]
fn collectives_match_naive_references() {
    for world in [2u32, 3, 4] {
        let w = world as usize;
        let n = 6usize;
        with_ranks(world, 20, |r, comm, st| {
            let s = sim();
            let mine = data(r, n * w);
            let all: Vec<Vec<f32>> = (0..world).map(|q| data(q, n * w)).collect();
            // all_reduce (sum, then max)
            let send = upload(&mine);
            let recv = malloc(n * w * 4);
            unsafe { assert_eq!((s.HcclAllReduce)(send, recv, (n * w) as u64, HCCL_FP32, HCCL_SUM, comm, st), 0) };
            sync(st);
            let want: Vec<f32> = (0..n * w).map(|i| all.iter().fold(0f32, |a, v| a + v[i])).collect();
            assert_eq!(download::<f32>(recv, n * w), want, "all_reduce world {world} rank {r}");
            unsafe { assert_eq!((s.HcclAllReduce)(send, recv, (n * w) as u64, HCCL_FP32, HCCL_MAX, comm, st), 0) };
            sync(st);
            assert_eq!(download::<f32>(recv, n * w), all[w - 1], "max");
            // reduce_scatter: block r of the sum
            let rs = malloc(n * 4);
            unsafe { assert_eq!((s.HcclReduceScatter)(send, rs, n as u64, HCCL_FP32, HCCL_SUM, comm, st), 0) };
            sync(st);
            assert_eq!(download::<f32>(rs, n), want[r as usize * n..][..n].to_vec(), "reduce_scatter");
            // all_gather of int32
            let ints: Vec<i32> = (0..n as i32).map(|i| i * 10 + r as i32).collect();
            let isend = upload(&ints);
            let igath = malloc(n * w * 4);
            unsafe { assert_eq!((s.HcclAllGather)(isend, igath, n as u64, HCCL_INT32, comm, st), 0) };
            sync(st);
            let want_g: Vec<i32> = (0..world).flat_map(|q| (0..n as i32).map(move |i| i * 10 + q as i32)).collect();
            assert_eq!(download::<i32>(igath, n * w), want_g, "all_gather");
            // all_gather_v with per-rank counts q + 1, displacements leaving a gap of 1
            let counts: Vec<u64> = (0..world as u64).map(|q| q + 1).collect();
            let displs: Vec<u64> = counts
                .iter()
                .scan(0u64, |acc, c| {
                    let d = *acc;
                    *acc += c + 1;
                    Some(d)
                })
                .collect();
            let total = (displs[w - 1] + counts[w - 1]) as usize;
            let vsend = upload(&vec![r as f32 + 0.5; r as usize + 1]);
            let vrecv = upload(&vec![-1f32; total]);
            unsafe {
                let rc = (s.HcclAllGatherV)(
                    vsend,
                    (r + 1) as u64,
                    vrecv,
                    counts.as_ptr() as *const c_void,
                    displs.as_ptr() as *const c_void,
                    HCCL_FP32,
                    comm,
                    st,
                );
                assert_eq!(rc, 0, "{}", err_msg());
            }
            sync(st);
            let mut want_v = vec![-1f32; total];
            for q in 0..w {
                for j in 0..counts[q] as usize {
                    want_v[displs[q] as usize + j] = q as f32 + 0.5;
                }
            }
            assert_eq!(download::<f32>(vrecv, total), want_v, "all_gather_v");
            // reduce_scatter_v with the same counts/displacements
            let rsv_send = upload(&(0..total).map(|i| i as f32 * (r as f32 + 1.0)).collect::<Vec<_>>());
            let rsv_recv = malloc((r as usize + 1) * 4);
            unsafe {
                let rc = (s.HcclReduceScatterV)(
                    rsv_send,
                    counts.as_ptr() as *const c_void,
                    displs.as_ptr() as *const c_void,
                    rsv_recv,
                    (r + 1) as u64,
                    HCCL_FP32,
                    HCCL_SUM,
                    comm,
                    st,
                );
                assert_eq!(rc, 0, "{}", err_msg());
            }
            sync(st);
            let factor: f32 = (1..=world).map(|q| q as f32).sum();
            let want_rsv: Vec<f32> =
                (0..=r as usize).map(|j| (displs[r as usize] as usize + j) as f32 * factor).collect();
            assert_eq!(download::<f32>(rsv_recv, r as usize + 1), want_rsv, "reduce_scatter_v");
            // all_to_all_v: rank r sends (r*10 + j) repeated j+1 times to rank j
            let sc: Vec<u64> = (0..world as u64).map(|j| j + 1).collect();
            let sd: Vec<u64> = sc
                .iter()
                .scan(0u64, |a, c| {
                    let d = *a;
                    *a += c;
                    Some(d)
                })
                .collect();
            let rcnt: Vec<u64> = vec![r as u64 + 1; w];
            let rd: Vec<u64> = (0..world as u64).map(|q| q * (r as u64 + 1)).collect();
            let a2a_in: Vec<i32> = (0..world).flat_map(|j| vec![(r * 10 + j) as i32; j as usize + 1]).collect();
            let a_send = upload(&a2a_in);
            let a_recv = malloc(w * (r as usize + 1) * 4);
            unsafe {
                let rc = (s.HcclAlltoAllV)(
                    a_send,
                    sc.as_ptr() as *const c_void,
                    sd.as_ptr() as *const c_void,
                    HCCL_INT32,
                    a_recv,
                    rcnt.as_ptr() as *const c_void,
                    rd.as_ptr() as *const c_void,
                    HCCL_INT32,
                    comm,
                    st,
                );
                assert_eq!(rc, 0, "{}", err_msg());
            }
            sync(st);
            let want_a: Vec<i32> = (0..world).flat_map(|q| vec![(q * 10 + r) as i32; r as usize + 1]).collect();
            assert_eq!(download::<i32>(a_recv, w * (r as usize + 1)), want_a, "all_to_all_v");
            // broadcast from the last rank, then a barrier
            let b = upload(&data(r, 5));
            unsafe {
                assert_eq!((s.HcclBroadcast)(b, 5, HCCL_FP32, world - 1, comm, st), 0);
                assert_eq!((s.HcclBarrier)(comm, st), 0);
            }
            sync(st);
            assert_eq!(download::<f32>(b, 5), data(world - 1, 5), "broadcast");
            unsafe {
                let (mut id, mut size, mut e) = (99u32, 0u32, -1);
                assert_eq!((s.HcclGetRankId)(comm, &mut id), 0);
                assert_eq!((s.HcclGetRankSize)(comm, &mut size), 0);
                assert_eq!((s.HcclGetCommAsyncError)(comm, &mut e), 0);
                assert_eq!((id, size, e), (r, world, 0));
            }
            for p in [send, recv, rs, isend, igath, vsend, vrecv, rsv_send, rsv_recv, a_send, a_recv, b] {
                free(p);
            }
        });
    }
}

#[test]
fn collective_results_are_stale_before_the_sync() {
    with_ranks(2, 20, |r, comm, st| {
        let s = sim();
        let send = upload(&[1i32 + r as i32; 4]);
        let recv = upload(&[0i32; 4]);
        unsafe { assert_eq!((s.HcclAllReduce)(send, recv, 4, HCCL_INT32, HCCL_SUM, comm, st), 0) };
        assert_eq!(download::<i32>(recv, 4), vec![0; 4], "rank {r}: read before the sync");
        sync(st);
        assert_eq!(download::<i32>(recv, 4), vec![3; 4]);
        free(send);
        free(recv);
    });
}

#[test]
fn sub_communicators_split_the_world() {
    with_ranks(4, 20, |r, comm, st| {
        let s = sim();
        // Even and odd ranks, each list ascending (HcclCreateSubCommConfig:
        // "the array should be ordered"); the sub-rank is the position in it.
        let mut ids: Vec<u32> = if r % 2 == 0 { vec![0, 2] } else { vec![1, 3] };
        let pos = ids.iter().position(|&x| x == r).unwrap() as u32;
        let mut parent = comm;
        let mut sub = NULL;
        let mut cfg = config(20);
        unsafe {
            let rc = (s.HcclCreateSubCommConfig)(
                &mut parent,
                2,
                ids.as_mut_ptr(),
                7 + (r % 2) as u64,
                pos,
                cfg.as_mut_ptr(),
                &mut sub,
            );
            assert_eq!(rc, 0, "rank {r}: {}", err_msg());
            let mut name = [0 as std::ffi::c_char; 128];
            assert_eq!((s.HcclGetCommName)(sub, name.as_mut_ptr()), 0);
            assert!(!CStr::from_ptr(name.as_ptr()).to_bytes().is_empty());
            let (mut id, mut size) = (9u32, 9u32);
            assert_eq!((s.HcclGetRankId)(sub, &mut id), 0);
            assert_eq!((s.HcclGetRankSize)(sub, &mut size), 0);
            assert_eq!((id, size), (pos, 2));
        }
        let send = upload(&[r as f32 * 10.0; 3]);
        let recv = malloc(12);
        unsafe { assert_eq!((s.HcclAllReduce)(send, recv, 3, HCCL_FP32, HCCL_SUM, sub, st), 0) };
        sync(st);
        let want = ids.iter().map(|&q| q as f32 * 10.0).sum::<f32>();
        assert_eq!(download::<f32>(recv, 3), vec![want; 3], "rank {r}");
        unsafe {
            // This rank is not where the list says it is.
            let mut bad = NULL;
            let rc =
                (s.HcclCreateSubCommConfig)(&mut parent, 2, ids.as_mut_ptr(), 99, 1 - pos, cfg.as_mut_ptr(), &mut bad);
            assert_eq!(rc, 1, "HCCL_E_PARA");
            assert_eq!((s.HcclCommDestroy)(sub), 0);
        }
        free(send);
        free(recv);
    });
}

#[test]
fn a_first_call_that_differs_between_ranks_is_refused_by_the_call_on_every_rank() {
    let results = with_ranks(2, 2, |r, comm, st| {
        let s = sim();
        let n = if r == 0 { 4 } else { 8 };
        let send = upload(&vec![1f32; n]);
        let recv = malloc(n * 4);
        let enq = unsafe { (s.HcclAllReduce)(send, recv, n as u64, HCCL_FP32, HCCL_SUM, comm, st) };
        let msg = err_msg();
        let sync_rc = unsafe { (s.aclrtSynchronizeStream)(st) };
        let mut e = -1;
        unsafe { assert_eq!((s.HcclGetCommAsyncError)(comm, &mut e), 0) };
        // The links were not set up: matching calls set them up and run.
        let ok = unsafe { (s.HcclAllReduce)(send, recv, 4, HCCL_FP32, HCCL_SUM, comm, st) };
        sync(st);
        let out = download::<f32>(recv, 4);
        free(send);
        free(recv);
        (enq, sync_rc, e, ok, out, msg)
    });
    for (r, (enq, sync_rc, e, ok, out, msg)) in results.into_iter().enumerate() {
        assert_eq!(enq, E_PARA, "rank {r}: the call itself fails (EI0005): {msg}");
        assert!(msg.contains("EI0005") && msg.contains("count 4") && msg.contains("count 8"), "rank {r}: {msg}");
        assert_eq!((sync_rc, e), (0, 0), "rank {r}: nothing was queued, no async error");
        assert_eq!((ok, out), (0, vec![2.0; 4]), "rank {r}");
    }
}

#[test]
fn a_later_call_that_differs_between_ranks_fails_the_stream_without_an_async_error() {
    let results = with_ranks(2, 2, |r, comm, st| {
        let s = sim();
        let send = upload(&[1f32; 8]);
        let recv = malloc(32);
        // The first all-reduce matches: its links are set up and checked.
        unsafe { assert_eq!((s.HcclAllReduce)(send, recv, 4, HCCL_FP32, HCCL_SUM, comm, st), 0) };
        sync(st);
        // HCCL checks no later all-reduce: this one is queued on both ranks.
        let n = if r == 0 { 4 } else { 8 };
        let enq = unsafe { (s.HcclAllReduce)(send, recv, n, HCCL_FP32, HCCL_SUM, comm, st) };
        let sync_rc = unsafe { (s.aclrtSynchronizeStream)(st) };
        let msg = err_msg();
        let mut e = -1;
        unsafe { assert_eq!((s.HcclGetCommAsyncError)(comm, &mut e), 0) };
        // The failed communicator refuses further work at once.
        let again = unsafe { (s.HcclAllReduce)(send, recv, 4, HCCL_FP32, HCCL_SUM, comm, st) };
        free(send);
        free(recv);
        (enq, sync_rc, e, again, msg)
    });
    for (r, (enq, sync_rc, e, again, msg)) in results.into_iter().enumerate() {
        assert_eq!(enq, 0, "rank {r}: queued");
        assert_ne!(sync_rc, 0, "rank {r}: the sync must fail, never a silent result");
        assert_eq!(e, 0, "rank {r}: no async error while HCCL's inconsistent-op check is off (its default)");
        assert_eq!(again, 9, "rank {r}: HCCL_E_TIMEOUT");
        assert!(msg.contains("HcclAllReduce"), "rank {r}: {msg}");
    }
}

#[test]
fn bad_hccl_arguments_are_rejected_when_queued() {
    with_ranks(2, 20, |r, comm, st| {
        let s = sim();
        let dev = malloc(16);
        let host = [0f32; 4];
        unsafe {
            // Host buffer, too-large count, unknown dtype and op, unknown comm.
            assert_eq!((s.HcclAllReduce)(host.as_ptr() as Ptr, dev, 4, HCCL_FP32, HCCL_SUM, comm, st), 2);
            assert_eq!((s.HcclAllReduce)(dev, dev, 5, HCCL_FP32, HCCL_SUM, comm, st), 2);
            assert_eq!((s.HcclAllReduce)(dev, dev, 4, 255, HCCL_SUM, comm, st), 5);
            assert_eq!((s.HcclAllReduce)(dev, dev, 4, HCCL_FP32, 1, comm, st), 5);
            assert_eq!((s.HcclAllReduce)(dev, dev, 4, HCCL_FP32, HCCL_SUM, 0x1234 as Ptr, st), 1);
            assert_eq!((s.HcclBroadcast)(dev, 4, HCCL_FP32, 2, comm, st), 1);
            assert!(!(s.HcclGetErrorString)(9).is_null());
            assert!((s.HcclGetCommConfigCapability)() > 8);
        }
        let _ = r;
        free(dev);
    });
}

const HCCL_FP16: i32 = 3;
const HCCL_BF16: i32 = 11;
const HCCL_INT64: i32 = 5;
const HCCL_INT8: i32 = 0;
const HCCL_UINT8: i32 = 7;
const HCCL_MIN: i32 = 3;
const E_PARA: i32 = 1;

/// A float dtype's element bytes for `x` (rounded to nearest-even) and back.
fn float_bytes(dt: i32, x: f64) -> Vec<u8> {
    match dt {
        HCCL_FP16 => half::f16::from_f64(x).to_le_bytes().to_vec(),
        HCCL_BF16 => half::bf16::from_f64(x).to_le_bytes().to_vec(),
        _ => (x as f32).to_le_bytes().to_vec(),
    }
}

fn float_value(dt: i32, b: &[u8]) -> f64 {
    match dt {
        HCCL_FP16 => half::f16::from_le_bytes([b[0], b[1]]).to_f64(),
        HCCL_BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
    }
}

/// Rank r's float at i: multiples of 1/8 in [-1.5, 2.25], plus 96 at every
/// third position, so sums reach [64, 256) where bf16 must round them.
fn fval(r: u32, i: usize) -> f64 {
    let big = if (r as usize + i) % 3 == 0 { 96.0 } else { 0.0 };
    big + ((r as usize * 5 + i * 3) % 11) as f64 * 0.375 - 1.5
}

/// Rank r's integer at i: near the type's limits, so sums wrap.
fn ival(dt: i32, r: u32, i: usize) -> i64 {
    let step = (r as i64 * 13 + i as i64 * 5) % 17 - 8;
    match dt {
        HCCL_INT32 => i32::MAX as i64 / 2 + step * 1000,
        _ => (1i64 << 62) + step * 1_000_000_007,
    }
}

fn int_bytes(dt: i32, v: i64) -> Vec<u8> {
    if dt == HCCL_INT32 {
        (v as i32).to_le_bytes().to_vec()
    } else {
        v.to_le_bytes().to_vec()
    }
}

/// The reduction of `xs` (the ranks' values at one position) under `op`:
/// floats exactly in f64 then rounded once to the dtype, integers wrapping.
fn expected(dt: i32, op: i32, floats: Option<&[f64]>, ints: &[i64]) -> Vec<u8> {
    if let Some(xs) = floats {
        let x = match op {
            HCCL_SUM => xs.iter().sum(),
            HCCL_MAX => xs.iter().cloned().fold(f64::MIN, f64::max),
            _ => xs.iter().cloned().fold(f64::MAX, f64::min),
        };
        return float_bytes(dt, x);
    }
    let v = match (op, dt) {
        (HCCL_SUM, HCCL_INT32) => ints.iter().fold(0i32, |a, &x| a.wrapping_add(x as i32)) as i64,
        (HCCL_SUM, _) => ints.iter().fold(0i64, |a, &x| a.wrapping_add(x)),
        (HCCL_MAX, _) => *ints.iter().max().unwrap(),
        _ => *ints.iter().min().unwrap(),
    };
    int_bytes(dt, v)
}

#[test]
fn reductions_combine_every_rank_in_every_dtype_and_op() {
    let (world, n) = (3u32, 5usize);
    let w = world as usize;
    with_ranks(world, 20, |r, comm, st| {
        let s = sim();
        for dt in [HCCL_FP32, HCCL_FP16, HCCL_BF16, HCCL_INT32, HCCL_INT64] {
            let is_float = matches!(dt, HCCL_FP32 | HCCL_FP16 | HCCL_BF16);
            // Each rank's inputs as the dtype holds them, for the references.
            let floats: Vec<Vec<f64>> = (0..world)
                .map(|q| (0..n * w).map(|i| float_value(dt, &float_bytes(dt, fval(q, i)))).collect())
                .collect();
            let ints: Vec<Vec<i64>> = (0..world).map(|q| (0..n * w).map(|i| ival(dt, q, i)).collect()).collect();
            let mine: Vec<u8> = (0..n * w)
                .flat_map(|i| if is_float { float_bytes(dt, fval(r, i)) } else { int_bytes(dt, ival(dt, r, i)) })
                .collect();
            let es = mine.len() / (n * w);
            let send = upload(&mine);
            let recv = malloc(mine.len());
            let block = malloc(n * es);
            for op in [HCCL_SUM, HCCL_MAX, HCCL_MIN] {
                let want: Vec<u8> = (0..n * w)
                    .flat_map(|i| {
                        let fs: Vec<f64> = floats.iter().map(|v| v[i]).collect();
                        let is: Vec<i64> = ints.iter().map(|v| v[i]).collect();
                        expected(dt, op, is_float.then_some(fs.as_slice()), &is)
                    })
                    .collect();
                unsafe {
                    assert_eq!((s.HcclAllReduce)(send, recv, (n * w) as u64, dt, op, comm, st), 0, "{}", err_msg());
                    assert_eq!((s.HcclReduceScatter)(send, block, n as u64, dt, op, comm, st), 0, "{}", err_msg());
                }
                sync(st);
                assert_eq!(download::<u8>(recv, mine.len()), want, "all_reduce dtype {dt} op {op} rank {r}");
                let mine_block = want[r as usize * n * es..][..n * es].to_vec();
                assert_eq!(download::<u8>(block, n * es), mine_block, "reduce_scatter dtype {dt} op {op} rank {r}");
            }
            for p in [send, recv, block] {
                free(p);
            }
        }
    });
}

/// Each rank's four int8 values: rank `r` sends row `r` (the first `world`
/// rows take part).
const INT8_IN: [[i8; 4]; 4] = [[100, -100, -128, 5], [27, -28, -1, -7], [1, -1, 0, 2], [-50, 60, 127, -3]];

/// The int8 sum, max and min of the first `world` rows of [`INT8_IN`], worked
/// out by hand. Sums wrap in eight bits: on 2 ranks -128 - 1 = -129 is 127;
/// on 3 ranks 100 + 27 + 1 = 128 is -128 and -100 - 28 - 1 = -129 is 127; on
/// 4 ranks the partial sum 128 wraps on the way and the total, 78, does not
/// (a wrapping sum does not depend on the order the ranks are added in).
fn int8_want(world: u32, op: i32) -> [i8; 4] {
    match (world, op) {
        (2, HCCL_SUM) => [127, -128, 127, -2],
        (2, HCCL_MAX) => [100, -28, -1, 5],
        (2, _) => [27, -100, -128, -7],
        (3, HCCL_SUM) => [-128, 127, 127, 0],
        (3, HCCL_MAX) => [100, -1, 0, 5],
        (3, _) => [1, -100, -128, -7],
        (_, HCCL_SUM) => [78, -69, -2, -3],
        (_, HCCL_MAX) => [100, 60, 127, 5],
        (_, _) => [-50, -100, -128, -7],
    }
}

#[test]
fn int8_all_reduce_and_reduce_scatters_sum_max_and_min_with_eight_bit_wrapping() {
    // HCCL reduces int8 with sum, max and min on Atlas A2 (hicann/hcomm v8.5.0
    // hccl_communicator_host.cc:787-803, param_check.cc:318-338; hicann/hccl
    // v8.5.0 docs/api/context/HcclAllReduce.md:78, HcclReduceScatter.md:80,
    // HcclReduceScatterV.md:99).
    for world in [2u32, 3, 4] {
        with_ranks(world, 20, |r, comm, st| {
            let s = sim();
            let send = upload(&INT8_IN[r as usize]);
            let recv = malloc(4);
            // Reduce-scatter: 4 / world elements each (world 3 sends the first 3).
            let rc = 4 / world as usize;
            // Reduce-scatter-v: uneven blocks, not in rank order for world 4.
            let (counts, displs): (Vec<u64>, Vec<u64>) = match world {
                2 => (vec![1, 3], vec![0, 1]),
                3 => (vec![1, 2, 1], vec![0, 1, 3]),
                _ => (vec![1; 4], vec![3, 2, 1, 0]),
            };
            let (mine, at) = (counts[r as usize] as usize, displs[r as usize] as usize);
            let block = malloc(rc);
            let vblock = malloc(mine);
            for op in [HCCL_SUM, HCCL_MAX, HCCL_MIN] {
                let want = int8_want(world, op);
                unsafe {
                    assert_eq!((s.HcclAllReduce)(send, recv, 4, HCCL_INT8, op, comm, st), 0, "{}", err_msg());
                    assert_eq!(
                        (s.HcclReduceScatter)(send, block, rc as u64, HCCL_INT8, op, comm, st),
                        0,
                        "{}",
                        err_msg()
                    );
                    let rc = (s.HcclReduceScatterV)(
                        send,
                        counts.as_ptr() as *const c_void,
                        displs.as_ptr() as *const c_void,
                        vblock,
                        mine as u64,
                        HCCL_INT8,
                        op,
                        comm,
                        st,
                    );
                    assert_eq!(rc, 0, "{}", err_msg());
                }
                sync(st);
                let what = format!("world {world} op {op} rank {r}");
                assert_eq!(download::<i8>(recv, 4), want, "all_reduce {what}");
                assert_eq!(download::<i8>(block, rc), want[r as usize * rc..][..rc], "reduce_scatter {what}");
                assert_eq!(download::<i8>(vblock, mine), want[at..][..mine], "reduce_scatter_v {what}");
            }
            for p in [send, recv, block, vblock] {
                free(p);
            }
        });
    }
}

#[test]
fn gathers_and_broadcasts_place_every_rank_in_its_block_for_every_element_size() {
    let (world, bytes) = (3u32, 24usize);
    with_ranks(world, 20, |r, comm, st| {
        let s = sim();
        let pattern = |q: u32| -> Vec<u8> { (0..bytes).map(|i| (q as usize * 37 + i * 11) as u8).collect() };
        for (dt, size) in [(HCCL_INT8, 1usize), (HCCL_UINT8, 1), (HCCL_BF16, 2), (HCCL_FP32, 4), (HCCL_INT64, 8)] {
            let count = (bytes / size) as u64;
            let send = upload(&pattern(r));
            let all = malloc(bytes * world as usize);
            let b = upload(&pattern(r));
            unsafe {
                assert_eq!((s.HcclAllGather)(send, all, count, dt, comm, st), 0, "{}", err_msg());
                assert_eq!((s.HcclBroadcast)(b, count, dt, 1, comm, st), 0, "{}", err_msg());
            }
            sync(st);
            let want: Vec<u8> = (0..world).flat_map(pattern).collect();
            assert_eq!(download::<u8>(all, bytes * world as usize), want, "all_gather dtype {dt} rank {r}");
            assert_eq!(download::<u8>(b, bytes), pattern(1), "broadcast dtype {dt} rank {r}");
            for p in [send, all, b] {
                free(p);
            }
        }
    });
}

/// What each rank of a 3-rank world calls in one mismatch scenario:
/// `(rank, comm, stream, sendBuf, recvBuf)`, both buffers 64 bytes.
type Call = fn(u32, Ptr, Ptr, Ptr, Ptr) -> i32;

fn all_reduce_of(count: u64, dt: i32, op: i32, comm: Ptr, st: Ptr, send: Ptr, recv: Ptr) -> i32 {
    unsafe { (sim().HcclAllReduce)(send, recv, count, dt, op, comm, st) }
}

#[test]
fn a_first_call_that_differs_between_ranks_fails_on_every_rank_without_waiting_for_the_timeout() {
    let scenarios: [(&str, Call); 9] = [
        ("count", |r, c, st, a, b| all_reduce_of(if r == 2 { 5 } else { 4 }, HCCL_FP32, HCCL_SUM, c, st, a, b)),
        ("dtype", |r, c, st, a, b| {
            all_reduce_of(4, if r == 1 { HCCL_INT32 } else { HCCL_FP32 }, HCCL_SUM, c, st, a, b)
        }),
        ("op", |r, c, st, a, b| all_reduce_of(4, HCCL_FP32, if r == 0 { HCCL_MAX } else { HCCL_SUM }, c, st, a, b)),
        ("collective", |r, c, st, a, b| {
            if r == 1 {
                unsafe { (sim().HcclAllGather)(a, b, 4, HCCL_FP32, c, st) }
            } else {
                all_reduce_of(12, HCCL_FP32, HCCL_SUM, c, st, a, b)
            }
        }),
        ("root", |r, c, st, a, _| unsafe { (sim().HcclBroadcast)(a, 4, HCCL_FP32, if r == 2 { 1 } else { 0 }, c, st) }),
        ("recvCounts", |r, c, st, a, b| {
            // Rank 1 says rank 0 sends 2 elements; ranks 0 and 2 say 1.
            let counts: [u64; 3] = if r == 1 { [2, 1, 1] } else { [1, 1, 1] };
            let displs: [u64; 3] = [0, 2, 3];
            let p = |v: &[u64; 3]| v.as_ptr() as *const c_void;
            unsafe { (sim().HcclAllGatherV)(a, counts[r as usize], b, p(&counts), p(&displs), HCCL_FP32, c, st) }
        }),
        ("recvDispls", |r, c, st, a, b| {
            // Same counts; rank 1 places rank 1's element at 2, the others at 1
            // (the API reference: every rank passes the same recvDispls).
            let counts: [u64; 3] = [1, 1, 1];
            let displs: [u64; 3] = if r == 1 { [0, 2, 3] } else { [0, 1, 2] };
            let p = |v: &[u64; 3]| v.as_ptr() as *const c_void;
            unsafe { (sim().HcclAllGatherV)(a, 1, b, p(&counts), p(&displs), HCCL_FP32, c, st) }
        }),
        ("sendDispls", |r, c, st, a, b| {
            let counts: [u64; 3] = [1, 1, 1];
            let displs: [u64; 3] = if r == 2 { [0, 2, 3] } else { [0, 1, 2] };
            let p = |v: &[u64; 3]| v.as_ptr() as *const c_void;
            unsafe { (sim().HcclReduceScatterV)(a, p(&counts), p(&displs), b, 1, HCCL_FP32, HCCL_SUM, c, st) }
        }),
        ("all-to-all counts", |r, c, st, a, b| {
            // Everyone sends 1 element to every rank, but rank 2 expects 2 from rank 0.
            let sc: [u64; 3] = [1, 1, 1];
            let rcnt: [u64; 3] = if r == 2 { [2, 1, 1] } else { [1, 1, 1] };
            let d: [u64; 3] = [0, 2, 4];
            let p = |v: &[u64; 3]| v.as_ptr() as *const c_void;
            unsafe { (sim().HcclAlltoAllV)(a, p(&sc), p(&d), HCCL_INT32, b, p(&rcnt), p(&d), HCCL_INT32, c, st) }
        }),
    ];
    for (what, call) in scenarios {
        // A timeout of a minute: a mismatch seen only by waiting would fail
        // with HCCL_E_TIMEOUT (9) after it, not HCCL_E_PARA at once.
        let results = with_ranks(3, 60, |r, comm, st| {
            let (send, recv) = (malloc(64), malloc(64));
            let enq = call(r, comm, st, send, recv);
            let msg = err_msg();
            let sync_rc = unsafe { (sim().aclrtSynchronizeStream)(st) };
            let mut e = -1;
            unsafe { assert_eq!((sim().HcclGetCommAsyncError)(comm, &mut e), 0) };
            free(send);
            free(recv);
            (enq, sync_rc, e, msg)
        });
        for (r, (enq, sync_rc, e, msg)) in results.into_iter().enumerate() {
            // HCCL's consistency check at link setup, inside the first call.
            assert_eq!(enq, E_PARA, "{what}: rank {r}'s call fails: {msg}");
            assert!(msg.contains("EI0005") || msg.contains("expects"), "{what}: rank {r}: {msg}");
            if what.ends_with("Displs") {
                assert!(
                    msg.contains("displs [0, 1, 2]") && msg.contains("displs [0, 2, 3]"),
                    "{what}: rank {r}: {msg}"
                );
            }
            assert_eq!((sync_rc, e), (0, 0), "{what}: rank {r}: nothing queued, no async error");
        }
    }
}

#[test]
fn a_communicator_leaves_no_file_behind_once_every_rank_joined() {
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
    let end = root[16..].iter().position(|&b| b == 0).unwrap();
    let name = String::from_utf8(root[16..16 + end].to_vec()).unwrap();
    let ours = || -> Vec<String> {
        let dir = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|f| f.contains(&name))
            .collect()
    };
    let mut comm = NULL;
    unsafe { assert_eq!((s.HcclCommInitRootInfo)(1, root.as_ptr(), 0, &mut comm), 0, "{}", err_msg()) };
    assert_eq!(ours(), Vec::<String>::new(), "files of {name} after the join");
    let st = stream();
    let buf = upload(&[2.5f32; 4]);
    unsafe { assert_eq!((s.HcclAllReduce)(buf, buf, 4, HCCL_FP32, HCCL_SUM, comm, st), 0) };
    sync(st);
    assert_eq!(download::<f32>(buf, 4), vec![2.5; 4], "a one-rank sum is the input");
    assert_eq!(ours(), Vec::<String>::new(), "files of {name} after a collective");
    free(buf);
    destroy_stream(st);
    unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0) };
}
