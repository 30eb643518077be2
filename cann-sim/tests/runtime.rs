//! ACL runtime behaviour of the simulator: memory, copy kinds, pointer
//! mix-ups, streams, staleness, events, aclnn ops and the kernel hook.
//! Every test sets its own device on its own thread.

mod common;

use std::ffi::c_void;

use common::*;
use half::{bf16, f16};

const NULL: Ptr = std::ptr::null_mut();

#[test]
fn copies_round_trip_through_every_kind() {
    let s = use_device(0);
    let data: Vec<u32> = (0..1000).map(|i| i * 7 + 1).collect();
    let a = upload(&data);
    let b = malloc(4000);
    unsafe {
        assert_eq!((s.aclrtMemcpy)(b, 4000, a, 4000, D2D), 0, "{}", err_msg());
        let mut host2 = vec![0u32; 1000];
        assert_eq!((s.aclrtMemcpy)(host2.as_mut_ptr() as Ptr, 4000, data.as_ptr() as *const c_void, 4000, H2H), 0);
        assert_eq!(host2, data);
        // ACL_MEMCPY_DEFAULT infers the direction from the addresses.
        let mut back = vec![0u32; 1000];
        assert_eq!((s.aclrtMemcpy)(back.as_mut_ptr() as Ptr, 4000, b, 4000, 4), 0);
        assert_eq!(back, data);
    }
    assert_eq!(download::<u32>(b, 1000), data);
    free(a);
    free(b);
}

#[test]
fn copy_kind_and_pointer_mixups_are_rejected() {
    let s = use_device(0);
    let dev = malloc(64);
    let mut host = [0u8; 64];
    let hp = host.as_mut_ptr() as Ptr;
    unsafe {
        // Host pointer where a device pointer belongs, and the reverse.
        let hp2 = (hp as usize + 32) as Ptr;
        assert_eq!((s.aclrtMemcpy)(hp, 32, hp2, 32, H2D), 100000);
        assert!(err_msg().contains("HOST_TO_DEVICE"), "{}", err_msg());
        assert_eq!((s.aclrtMemcpy)(dev, 32, (dev as usize + 32) as Ptr, 32, H2D), 100000);
        assert_eq!((s.aclrtMemcpy)(hp, 32, hp2, 32, D2H), 100000);
        assert_eq!((s.aclrtMemcpy)(dev, 64, hp, 64, D2D), 100000);
        assert_eq!((s.aclrtMemcpy)(hp, 64, dev, 64, H2H), 100000);
        let st = stream();
        assert_eq!((s.aclrtMemcpyAsync)(hp, 64, hp, 64, H2H, st), 207000, "async host-to-host is unsupported");
        // An async copy with pageable host memory on a side and a kind its
        // rule does not allow is the runtime's own refusal
        // (MemcpyKindAutoCorrect, api_error.cc:2010-2028, :2075-2079 at
        // v8.5.0): 107000; a kind the runtime would correct (pinned host
        // memory) is the simulator's stricter refusal, 100000.
        assert_eq!((s.aclrtMemcpyAsync)(hp, 64, dev, 64, H2D, st), 107000, "device to pageable as H2D");
        assert_eq!((s.aclrtMemcpyAsync)(dev, 64, hp, 64, D2H, st), 107000, "pageable to device as D2H");
        let mut pinned = NULL;
        assert_eq!((s.aclrtMallocHost)(&mut pinned, 64), 0);
        assert_eq!((s.aclrtMemcpyAsync)(pinned, 64, dev, 64, H2D, st), 100000, "device to pinned as H2D");
        assert_eq!((s.aclrtFreeHost)(pinned), 0);
        // On-chip device-to-device async copies need 64-byte aligned addresses.
        assert_eq!((s.aclrtMemcpyAsync)((dev as usize + 8) as Ptr, 32, dev, 32, D2D, st), 107008);
        destroy_stream(st);
        assert_eq!((s.aclrtMemcpy)(dev, 64, hp, 64, 99), 100000);
        // count > destMax (ApiErrorDecorator::MemCopySync: RT_ERROR_INVALID_VALUE),
        // and an access past the allocation.
        assert_eq!((s.aclrtMemcpy)(dev, 32, hp, 64, H2D), 107000);
        assert_eq!((s.aclrtMemcpy)(dev, 65, hp, 65, H2D), 107000);
        assert!(err_msg().contains("overrun"), "{}", err_msg());
        // Frees: host pointer, interior pointer, double free, FreeHost of device memory.
        assert_eq!((s.aclrtFree)(hp), 107000);
        assert_eq!((s.aclrtFree)((dev as usize + 32) as Ptr), 107000);
        assert_eq!((s.aclrtFreeHost)(dev), 107000);
        assert!(err_msg().contains("device memory"), "{}", err_msg());
        assert_eq!((s.aclrtFree)(NULL), 100000);
        assert_eq!((s.aclrtFree)(dev), 0);
        assert_eq!((s.aclrtFree)(dev), 107000, "double free must fail");
        // A freed buffer is no longer device memory one may copy to.
        assert_eq!((s.aclrtMemcpy)(dev, 64, hp, 64, H2D), 107000);
    }
}

#[test]
fn malloc_follows_the_documented_alignment_and_padding() {
    let s = use_device(1);
    let sizes = [1usize, 31, 32, 33, 100, 4096, 5000];
    let ptrs: Vec<Ptr> = sizes.iter().map(|&n| malloc(n)).collect();
    for (p, n) in ptrs.iter().zip(sizes) {
        assert_eq!(*p as usize % 64, 0, "aclrtMalloc({n}) returned {p:?}");
    }
    // Footprints never overlap: ALIGN_UP(size, 32) + 32 bytes each.
    let mut spans: Vec<(usize, usize)> =
        ptrs.iter().zip(sizes).map(|(p, n)| (*p as usize, n.div_ceil(32) * 32 + 32)).collect();
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?} overlap");
    }
    let mut p = NULL;
    unsafe {
        assert_eq!((s.aclrtMalloc)(&mut p, 0, 0), 100000, "size 0 is invalid");
        // An out-of-range policy falls back to the default (acl memory.cpp,
        // aclMallocMemInner; API reference of aclrtMallocAlign32).
        assert_eq!((s.aclrtMalloc)(&mut p, 16, 0x77), 0, "unknown policy: {}", err_msg());
        assert_eq!(p as usize % 64, 0);
        assert_eq!((s.aclrtFree)(p), 0);
        let (mut free_b, mut total) = (0usize, 0usize);
        assert_eq!((s.aclrtGetMemInfo)(1, &mut free_b, &mut total), 0);
        assert!(free_b < total && total > 0);
    }
    // Fresh memory is not zeroed (real device memory is not either).
    let fresh = malloc(16);
    assert_eq!(download::<u8>(fresh, 16), vec![0xFF; 16]);
    for p in ptrs.into_iter().chain([fresh]) {
        free(p);
    }
}

#[test]
fn async_results_are_stale_until_the_stream_is_synchronised() {
    let s = use_device(0);
    let st = stream();
    let dev = upload(&[1.0f32; 256]);
    let newer = vec![2.0f32; 256];
    unsafe {
        assert_eq!((s.aclrtMemcpyAsync)(dev, 1024, newer.as_ptr() as *const c_void, 1024, H2D, st), 0);
    }
    // The copy is queued, not done: a synchronous read sees the old bytes.
    assert_eq!(download::<f32>(dev, 256), vec![1.0; 256], "the read before the sync must be stale");
    let mut host = vec![0f32; 256];
    unsafe {
        assert_eq!((s.aclrtMemcpyAsync)(host.as_mut_ptr() as Ptr, 1024, dev, 1024, D2H, st), 0);
    }
    assert_eq!(host, vec![0.0; 256], "the async D2H has not happened yet");
    sync(st);
    assert_eq!(host, vec![2.0; 256]);
    assert_eq!(download::<f32>(dev, 256), vec![2.0; 256]);
    // Memset on the stream is ordered too.
    unsafe { assert_eq!((s.aclrtMemsetAsync)(dev, 1024, 0, 1024, st), 0) };
    assert_eq!(download::<f32>(dev, 256), vec![2.0; 256]);
    unsafe { assert_eq!((s.aclrtSynchronizeStreamWithTimeout)(st, 10_000), 0) };
    assert_eq!(download::<f32>(dev, 256), vec![0.0; 256]);
    free(dev);
    destroy_stream(st);
}

#[test]
fn default_stream_is_the_null_handle() {
    let s = use_device(2);
    let dev = upload(&[5u8; 128]);
    let src = [9u8; 128];
    unsafe {
        assert_eq!((s.aclrtMemcpyAsync)(dev, 128, src.as_ptr() as *const c_void, 128, H2D, NULL), 0);
        assert_eq!(download::<u8>(dev, 128), vec![5; 128]);
        assert_eq!((s.aclrtSynchronizeStream)(NULL), 0);
    }
    assert_eq!(download::<u8>(dev, 128), vec![9; 128]);
    free(dev);
}

#[test]
fn a_stream_waits_for_an_event_recorded_on_another() {
    let s = use_device(0);
    let (s1, s2) = (stream(), stream());
    let (a, b) = (upload(&[0u32; 64]), upload(&[0u32; 64]));
    let payload: Vec<u32> = (100..164).collect();
    let (mut e0, mut e1) = (NULL, NULL);
    unsafe {
        assert_eq!((s.aclrtCreateEvent)(&mut e0), 0);
        assert_eq!((s.aclrtCreateEvent)(&mut e1), 0);
        // A never-recorded aclrtCreateEvent event is not ready.
        let mut st = -1;
        assert_eq!((s.aclrtQueryEventStatus)(e1, &mut st), 0);
        assert_eq!(st, 0);
        assert_eq!((s.aclrtRecordEvent)(e0, s1), 0);
        assert_eq!((s.aclrtMemcpyAsync)(a, 256, payload.as_ptr() as *const c_void, 256, H2D, s1), 0);
        assert_eq!((s.aclrtRecordEvent)(e1, s1), 0);
        // Neither record has run: no timestamp, so no elapsed time yet.
        let mut ms = 0f32;
        assert_eq!((s.aclrtEventElapsedTime)(&mut ms, e0, e1), 107006);
        // s2 copies a -> b only after e1: synchronising s2 alone must pull s1's copy through.
        assert_eq!((s.aclrtStreamWaitEvent)(s2, e1), 0);
        assert_eq!((s.aclrtMemcpyAsync)(b, 256, a, 256, D2D, s2), 0);
    }
    sync(s2);
    assert_eq!(download::<u32>(b, 64), payload);
    unsafe {
        assert_eq!((s.aclrtSynchronizeEvent)(e1), 0);
        let mut st = 0;
        assert_eq!((s.aclrtQueryEventStatus)(e1, &mut st), 0);
        assert_eq!(st, 1);
        let mut ms = -1f32;
        assert_eq!((s.aclrtEventElapsedTime)(&mut ms, e0, e1), 0, "{}", err_msg());
        assert!(ms >= 0.0, "{ms}");
        // Polling a pending event makes progress: it completes without a sync.
        assert_eq!((s.aclrtMemsetAsync)(a, 256, 0, 256, s1), 0);
        assert_eq!((s.aclrtRecordEvent)(e0, s1), 0);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let mut st = 0;
            assert_eq!((s.aclrtQueryEventStatus)(e0, &mut st), 0);
            if st == 1 {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "polling never completed the event");
            std::thread::yield_now();
        }
        assert_eq!(download::<u32>(a, 64), vec![0; 64]);
        assert_eq!((s.aclrtDestroyEvent)(e0), 0);
        assert_eq!((s.aclrtDestroyEvent)(e1), 0);
        assert_eq!((s.aclrtDestroyEvent)(e1), 107017, "double destroy");
        assert_eq!((s.aclrtRecordEvent)(e1, s1), 107017);
    }
    free(a);
    free(b);
    destroy_stream(s1);
    destroy_stream(s2);
}

#[test]
fn a_failed_task_is_reported_by_the_sync_and_sticks() {
    let s = use_device(3);
    let st = stream();
    let dev = malloc(256);
    let src = [1u8; 256];
    unsafe {
        assert_eq!((s.aclrtMemcpyAsync)(dev, 256, src.as_ptr() as *const c_void, 256, H2D, st), 0);
        // Freed before the stream used it: aclrtFree does not wait (as documented).
        assert_eq!((s.aclrtFree)(dev), 0);
        assert_eq!((s.aclrtSynchronizeStream)(st), 507053);
        assert!(err_msg().contains("aclrtMemcpyAsync"), "{}", err_msg());
        assert_eq!((s.aclrtSynchronizeStream)(st), 507053, "the error is sticky");
        assert_eq!((s.aclrtDestroyStream)(st), 0);
        assert_eq!((s.aclrtDestroyStream)(st), 107017);
        assert_eq!((s.aclrtSynchronizeStream)(st), 107017);
    }
}

#[test]
fn streams_belong_to_their_device() {
    let s = use_device(0);
    let st = stream();
    let dev = malloc(64);
    let src = [0u8; 64];
    let (st_u, dev_u) = (st as usize, dev as usize);
    std::thread::scope(|sc| {
        sc.spawn(move || {
            let s = use_device(1);
            let (st, dev) = (st_u as Ptr, dev_u as Ptr);
            unsafe {
                assert_eq!((s.aclrtMemcpyAsync)(dev, 64, src.as_ptr() as *const c_void, 64, H2D, st), 107003);
            }
        });
        sc.spawn(|| {
            // No device set on this thread at all.
            let s = sim();
            let mut p = NULL;
            unsafe { assert_eq!((s.aclrtMalloc)(&mut p, 64, 0), 107002) };
        });
    });
    unsafe {
        let mut d = -1;
        assert_eq!((s.aclrtGetDevice)(&mut d), 0);
        assert_eq!(d, 0);
        let mut n = 0;
        assert_eq!((s.aclrtGetDeviceCount)(&mut n), 0);
        assert_eq!(n, 4);
        assert_eq!((s.aclrtSetDevice)(n as i32), 107001);
        let (mut a, mut b, mut c) = (0, 0, 0);
        assert_eq!((s.aclrtGetVersion)(&mut a, &mut b, &mut c), 0);
        assert_eq!((a, b, c), (1, 16, 0), "acl_rt.h of CANN 8.5.0");
        assert!(!(s.aclrtGetSocName)().is_null());
    }
    free(dev);
    destroy_stream(st);
}

// ---------- aclnn ----------

fn enc(v: &[f32], dt: i32) -> Vec<u8> {
    match dt {
        ACL_FLOAT => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ACL_FLOAT16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
        ACL_BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
        _ => unreachable!(),
    }
}

fn dec(b: &[u8], dt: i32) -> Vec<f32> {
    match dt {
        ACL_FLOAT => b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        ACL_FLOAT16 => b.chunks(2).map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
        ACL_BF16 => b.chunks(2).map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f32()).collect(),
        _ => unreachable!(),
    }
}

/// Values representable in `dt` (so the reference sees what the device sees).
fn rand_vals(rng: &mut Rng, n: usize, dt: i32) -> Vec<f32> {
    let v: Vec<f32> = (0..n).map(|_| rng.f32() * 4.0).collect();
    dec(&enc(&v, dt), dt)
}

/// A device tensor holding `v` in dtype `dt`.
fn dev_tensor(dims: &[i64], v: &[f32], dt: i32) -> (Ptr, Ptr) {
    let buf = upload(&enc(v, dt));
    (tensor(dims, dt, buf), buf)
}

fn idx_tensor(dims: &[i64], v: &[i32]) -> (Ptr, Ptr) {
    let buf = upload(v);
    (tensor(dims, ACL_INT32, buf), buf)
}

struct Case {
    n: usize,
    k: usize,
    h: usize,
    e: usize,
    c: usize,
    mode: i64,
    dt: i32,
    scale_dt: Option<i32>,
    skips: usize,
    bias: bool,
}

/// The simulated aclnn ops' order (README "Order"): the K terms in pairs from
/// the last, `(t[K-1] + t[K-2]) + (t[K-3] + t[K-4]) + ...`, in f32.
fn pairs_from_the_last(t: &[f32]) -> f32 {
    let pair = |c: &[f32]| if c.len() == 2 { c[1] + c[0] } else { c[0] };
    let mut chunks = t.rchunks(2);
    let first = chunks.next().map_or(0.0, pair);
    chunks.fold(first, |a, c| a + pair(c))
}

/// SPEC section 1's terms, written out naively, in the simulator's order:
/// `x1 (+ x2) + pairs_from_the_last(s * (row + bias) for each k)`.
#[allow(clippy::too_many_arguments)]
fn finalize_reference(
    cs: &Case,
    x: &[f32],
    ridx: &[i32],
    x1: Option<&[f32]>,
    x2: Option<&[f32]>,
    bias: Option<&[f32]>,
    scales: Option<&[f32]>,
    experts: &[i32],
) -> Vec<f32> {
    let (n, k, h) = (cs.n, cs.k, cs.h);
    let mut out = Vec::with_capacity(n * h);
    for i in 0..n {
        for j in 0..h {
            let skips = match (x1, x2) {
                (Some(a), Some(b)) => a[i * h + j] + b[i * h + j],
                (Some(a), None) => a[i * h + j],
                _ => 0.0,
            };
            let terms: Vec<f32> = (0..k)
                .map(|kk| {
                    let slot = if cs.mode >= 2 { i * k + kk } else { kk * n + i };
                    let r = ridx[slot];
                    let row = if r == -1 { 0.0 } else { x[r as usize * h + j] };
                    let term = match bias {
                        Some(b) => row + b[experts[i * k + kk] as usize * h + j],
                        None => row,
                    };
                    scales.map_or(1.0, |s| s[i * k + kk]) * term
                })
                .collect();
            out.push(skips + pairs_from_the_last(&terms));
        }
    }
    out
}

fn run_finalize(cs: &Case, seed: u64) {
    let s = use_device(1);
    let mut rng = Rng(seed);
    let (n, k, h) = (cs.n, cs.k, cs.h);
    let drop_pad = cs.mode % 2 == 1;
    let rows = if drop_pad { cs.e * cs.c } else { n * k };
    let x = rand_vals(&mut rng, rows * h, cs.dt);
    let ridx: Vec<i32> =
        if drop_pad { (0..n * k).map(|_| rng.below(rows + 1) as i32 - 1).collect() } else { rng.perm(n * k) };
    let x1 = (cs.skips >= 1).then(|| rand_vals(&mut rng, n * h, cs.dt));
    let x2 = (cs.skips >= 2).then(|| rand_vals(&mut rng, n * h, cs.dt));
    let bias = cs.bias.then(|| rand_vals(&mut rng, cs.e * h, cs.dt));
    let scales = cs.scale_dt.map(|sdt| rand_vals(&mut rng, n * k, sdt));
    let experts: Vec<i32> = (0..n * k).map(|_| rng.below(cs.e) as i32).collect();

    let x_dims: Vec<i64> =
        if drop_pad { vec![cs.e as i64, cs.c as i64, h as i64] } else { vec![rows as i64, h as i64] };
    let (tx, bx) = dev_tensor(&x_dims, &x, cs.dt);
    let (tr, br) = idx_tensor(&[(n * k) as i64], &ridx);
    let nh = [n as i64, h as i64];
    let t1 = x1.as_ref().map(|v| dev_tensor(&nh, v, cs.dt));
    let t2 = x2.as_ref().map(|v| dev_tensor(&nh, v, cs.dt));
    let tb = bias.as_ref().map(|v| dev_tensor(&[cs.e as i64, h as i64], v, cs.dt));
    let tsc = scales.as_ref().map(|v| dev_tensor(&[n as i64, k as i64], v, cs.scale_dt.unwrap()));
    let te = cs.bias.then(|| idx_tensor(&[n as i64, k as i64], &experts));
    let out_buf = malloc(n * h * 4);
    let tout = tensor(&nh, cs.dt, out_buf);
    let opt = |t: &Option<(Ptr, Ptr)>| t.map_or(NULL, |t| t.0);
    let st = stream();
    let (mut ws, mut exec) = (0u64, NULL);
    unsafe {
        let r = (s.aclnnMoeFinalizeRoutingV2GetWorkspaceSize)(
            tx,
            tr,
            opt(&t1),
            opt(&t2),
            opt(&tb),
            opt(&tsc),
            opt(&te),
            cs.mode,
            tout,
            &mut ws,
            &mut exec,
        );
        assert_eq!(r, 0, "{}", err_msg());
        let wsp = if ws > 0 { malloc(ws as usize) } else { NULL };
        assert_eq!((s.aclnnMoeFinalizeRoutingV2)(wsp, ws, exec, st), 0, "{}", err_msg());
        sync(st);
        if ws > 0 {
            free(wsp);
        }
    }
    let esz = if cs.dt == ACL_FLOAT { 4 } else { 2 };
    let got = download::<u8>(out_buf, n * h * esz);
    let want =
        finalize_reference(cs, &x, &ridx, x1.as_deref(), x2.as_deref(), bias.as_deref(), scales.as_deref(), &experts);
    assert_eq!(got, enc(&want, cs.dt), "mode {} dtype {} skips {} bias {}", cs.mode, cs.dt, cs.skips, cs.bias);
    for t in [Some((tx, bx)), Some((tr, br)), t1, t2, tb, tsc, te].into_iter().flatten() {
        destroy_tensor(t.0);
        free(t.1);
    }
    destroy_tensor(tout);
    free(out_buf);
    destroy_stream(st);
}

#[test]
fn finalize_matches_a_naive_reference_in_the_simulators_order_bit_for_bit() {
    let mut seed = 1;
    for mode in 0..4 {
        for dt in [ACL_FLOAT, ACL_BF16, ACL_FLOAT16] {
            for (skips, bias, scale_dt) in
                [(2, true, Some(dt)), (0, false, None), (1, true, Some(ACL_FLOAT)), (2, false, Some(dt))]
            {
                // float16 data with float32 scales is not a registered dtype
                // combination (tests/aclnn_rules.rs checks it is refused).
                if dt == ACL_FLOAT16 && scale_dt == Some(ACL_FLOAT) {
                    continue;
                }
                seed += 1;
                let cs = Case {
                    n: 5,
                    k: if scale_dt.is_some() { 3 } else { 1 },
                    h: 7,
                    e: 4,
                    c: 4,
                    mode,
                    dt,
                    scale_dt,
                    skips,
                    bias,
                };
                run_finalize(&cs, seed * 7919);
            }
        }
    }
}

#[test]
fn finalize_rejects_bad_arguments_and_out_of_range_indices() {
    let s = use_device(1);
    let (n, k, h) = (2usize, 2usize, 4usize);
    let (tx, bx) = dev_tensor(&[(n * k) as i64, h as i64], &[1.0; 16], ACL_FLOAT);
    let (tr, br) = idx_tensor(&[4], &[0, 1, 2, 9]);
    let (tsc, bsc) = dev_tensor(&[n as i64, k as i64], &[1.0; 4], ACL_FLOAT);
    let ob = malloc(n * h * 4);
    let tout = tensor(&[n as i64, h as i64], ACL_FLOAT, ob);
    let wb = malloc(3 * h * 4);
    let wrong = tensor(&[3, h as i64], ACL_FLOAT, wb);
    let (mut ws, mut ex) = (0u64, NULL);
    unsafe {
        let f = s.aclnnMoeFinalizeRoutingV2GetWorkspaceSize;
        assert_eq!(f(NULL, tr, NULL, NULL, NULL, tsc, NULL, 0, tout, &mut ws, &mut ex), 161001);
        // The attribute and the shapes are the tiling's checks (561002).
        assert_eq!(f(tx, tr, NULL, NULL, NULL, tsc, NULL, 4, tout, &mut ws, &mut ex), 561002);
        assert_eq!(f(tx, tr, NULL, NULL, NULL, tsc, NULL, 1, tout, &mut ws, &mut ex), 561002, "mode 1 needs 3-D");
        assert_eq!(f(tx, tr, NULL, NULL, NULL, tsc, NULL, 0, wrong, &mut ws, &mut ex), 561002);
        assert!(err_msg().contains("out"), "{}", err_msg());
        assert_eq!(f(tx, tr, NULL, NULL, tx, tsc, NULL, 0, tout, &mut ws, &mut ex), 561002, "bias needs expertIdx");
        // Index 9 is outside [0, 4): the launch succeeds, the stream reports it.
        assert_eq!(f(tx, tr, NULL, NULL, NULL, tsc, NULL, 0, tout, &mut ws, &mut ex), 0, "{}", err_msg());
        let st = stream();
        assert_eq!((s.aclnnMoeFinalizeRoutingV2)(NULL, 0, ex, st), 161002, "missing workspace");
        assert_eq!((s.aclnnMoeFinalizeRoutingV2)(NULL, 0, ex, st), 161002, "the executor was consumed");
        assert_eq!(f(tx, tr, NULL, NULL, NULL, tsc, NULL, 0, tout, &mut ws, &mut ex), 0);
        let mut host_ws = vec![0u8; ws as usize];
        assert_eq!((s.aclnnMoeFinalizeRoutingV2)(host_ws.as_mut_ptr() as Ptr, ws, ex, st), 161002, "host workspace");
        assert_eq!(f(tx, tr, NULL, NULL, NULL, tsc, NULL, 0, tout, &mut ws, &mut ex), 0);
        let wsp = malloc(ws as usize);
        assert_eq!((s.aclnnMoeFinalizeRoutingV2)(wsp, ws, ex, st), 0);
        assert_eq!((s.aclrtSynchronizeStream)(st), 507015, "a trap of the kernel: a runtime code");
        let m = err_msg();
        assert!(m.contains("expandedRowIdx[3] = 9") && m.contains("[0, 4)"), "{m}");
        free(wsp);
        destroy_stream(st);
        // A tensor over host memory is refused at creation.
        let host = [0f32; 8];
        let dims = [8i64];
        let t = (s.aclCreateTensor)(
            dims.as_ptr(),
            1,
            ACL_FLOAT,
            std::ptr::null(),
            0,
            ND,
            dims.as_ptr(),
            1,
            host.as_ptr() as Ptr,
        );
        assert!(t.is_null());
        assert!(err_msg().contains("not device memory"), "{}", err_msg());
        assert_eq!((s.aclDestroyTensor)(wrong), 0);
        assert_eq!((s.aclDestroyTensor)(wrong), 161002, "double destroy");
    }
    free(wb);
    for (t, b) in [(tx, bx), (tr, br), (tsc, bsc), (tout, ob)] {
        destroy_tensor(t);
        free(b);
    }
}

#[test]
fn unpermute_and_add_match_naive_references() {
    let s = use_device(2);
    let mut rng = Rng(42);
    let (t, k, h) = (6usize, 2usize, 5usize);
    let dt = ACL_BF16;
    let x = rand_vals(&mut rng, t * k * h, dt);
    // A permutation: in range and without repeats, as the op requires
    // (tests/aclnn_rules.rs checks both are refused otherwise).
    let idx = rng.perm(t * k);
    let probs = rand_vals(&mut rng, t * k, ACL_FLOAT);
    let (tx, bx) = dev_tensor(&[(t * k) as i64, h as i64], &x, dt);
    let (ti, bi) = idx_tensor(&[(t * k) as i64], &idx);
    let (tp, bp) = dev_tensor(&[t as i64, k as i64], &probs, ACL_FLOAT);
    let ob = malloc(t * h * 2);
    let to = tensor(&[t as i64, h as i64], dt, ob);
    let st = stream();
    let (mut ws, mut ex) = (0u64, NULL);
    unsafe {
        assert_eq!(
            (s.aclnnMoeTokenUnpermuteGetWorkspaceSize)(tx, ti, tp, false, NULL, to, &mut ws, &mut ex),
            0,
            "{}",
            err_msg()
        );
        let wsp = malloc(ws.max(1) as usize);
        assert_eq!((s.aclnnMoeTokenUnpermute)(wsp, ws, ex, st), 0, "{}", err_msg());
        sync(st);
        free(wsp);
        assert_eq!((s.aclnnMoeTokenUnpermuteGetWorkspaceSize)(tx, ti, tp, true, NULL, to, &mut ws, &mut ex), 161002);
    }
    let mut want = vec![0f32; t * h];
    for i in 0..t {
        for j in 0..h {
            let terms: Vec<f32> = (0..k).map(|kk| probs[i * k + kk] * x[idx[i * k + kk] as usize * h + j]).collect();
            want[i * h + j] = pairs_from_the_last(&terms);
        }
    }
    assert_eq!(download::<u8>(ob, t * h * 2), enc(&want, dt));

    // aclnnAdd: out = self + alpha * other, one rounding.
    let a = rand_vals(&mut rng, 40, ACL_FLOAT16);
    let b = rand_vals(&mut rng, 40, ACL_FLOAT16);
    let (ta, ba) = dev_tensor(&[8, 5], &a, ACL_FLOAT16);
    let (tb, bb) = dev_tensor(&[8, 5], &b, ACL_FLOAT16);
    let oc = malloc(80);
    let tc = tensor(&[8, 5], ACL_FLOAT16, oc);
    for alpha in [1.0f32, 0.5] {
        let mut av = alpha;
        unsafe {
            let sc = (s.aclCreateScalar)(&mut av as *mut f32 as Ptr, ACL_FLOAT);
            assert!(!sc.is_null());
            assert_eq!((s.aclnnAddGetWorkspaceSize)(ta, tb, sc, tc, &mut ws, &mut ex), 0, "{}", err_msg());
            assert_eq!(ws, 0);
            assert_eq!((s.aclnnAdd)(NULL, 0, ex, st), 0, "{}", err_msg());
            assert_eq!((s.aclDestroyScalar)(sc), 0);
        }
        sync(st);
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + alpha * y).collect();
        assert_eq!(download::<u8>(oc, 80), enc(&want, ACL_FLOAT16), "alpha {alpha}");
    }
    unsafe {
        let mut one = 1.0f32;
        let sc = (s.aclCreateScalar)(&mut one as *mut f32 as Ptr, ACL_FLOAT);
        assert_eq!((s.aclnnAddGetWorkspaceSize)(ta, tx, sc, tc, &mut ws, &mut ex), 161002, "shape mismatch");
        assert_eq!((s.aclDestroyScalar)(sc), 0);
    }
    for (t, b) in [(tx, bx), (ti, bi), (tp, bp), (to, ob), (ta, ba), (tb, bb), (tc, oc)] {
        destroy_tensor(t);
        free(b);
    }
    destroy_stream(st);
}

// ---------- kernel hook ----------

/// out[i] = 2 * in[i] + tiling.bias, each block taking a contiguous chunk.
unsafe extern "C" fn double_kernel(block: u32, blocks: u32, gm: *const Ptr, tiling: *const c_void) {
    let t = unsafe { &*(tiling as *const [u64; 2]) };
    let (n, bias) = (t[0] as usize, f32::from_bits(t[1] as u32));
    let input = unsafe { *gm.add(0) } as *const f32;
    let out = unsafe { *gm.add(1) } as *mut f32;
    let chunk = n.div_ceil(blocks as usize);
    let lo = block as usize * chunk;
    for i in lo..(lo + chunk).min(n) {
        unsafe { *out.add(i) = 2.0 * *input.add(i) + bias };
    }
}

#[test]
fn launched_kernels_run_in_stream_order_over_device_memory() {
    let s = use_device(3);
    let n = 1000usize;
    let input = malloc(n * 4);
    let out = upload(&vec![0f32; n]);
    let st = stream();
    let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let tiling = [n as u64, 0.5f32.to_bits() as u64];
    let gm = [input, out];
    unsafe {
        // The input arrives by an async copy queued before the kernel on the same stream.
        assert_eq!((s.aclrtMemcpyAsync)(input, n * 4, src.as_ptr() as *const c_void, n * 4, H2D, st), 0);
        let r =
            (s.cannsim_launch_kernel)(st, 7, Some(double_kernel), gm.as_ptr(), 2, tiling.as_ptr() as *const c_void, 16);
        assert_eq!(r, 0, "{}", err_msg());
        assert_eq!(download::<f32>(out, n), vec![0.0; n], "not run before the sync");
        sync(st);
        let host = [input, src.as_ptr() as Ptr];
        let r = (s.cannsim_launch_kernel)(
            st,
            1,
            Some(double_kernel),
            host.as_ptr(),
            2,
            tiling.as_ptr() as *const c_void,
            16,
        );
        assert_eq!(r, 107000, "a host pointer is not device memory");
        assert_eq!((s.cannsim_launch_kernel)(st, 1, None, gm.as_ptr(), 2, NULL, 0), 100000);
    }
    let want: Vec<f32> = src.iter().map(|x| 2.0 * x + 0.5).collect();
    assert_eq!(download::<f32>(out, n), want);
    free(input);
    free(out);
    destroy_stream(st);
}

/// The aclnn MoE ops accumulate in an order of their own, not SPEC.md §1's
/// (`acc = x1; acc += t0; acc += t1; ...`): CANN promises none. With terms
/// `2^14` (x1 or the first), `-2^14` and `2^-24`, SPEC's order gives
/// `(2^14 - 2^14) + 2^-24 = 2^-24`; the simulator's pairs from the last give
/// `2^14 + (2^-24 + -2^14) = 0` (2^-24 is absorbed in f32). Both values are
/// exact in f32, f16 and bf16, so the bytes differ in all three.
#[test]
fn the_aclnn_moe_ops_do_not_accumulate_in_spec_order() {
    let s = use_device(1);
    let tiny = f32::powi(2.0, -24);
    for dt in [ACL_FLOAT, ACL_FLOAT16, ACL_BF16] {
        let st = stream();
        let esz = if dt == ACL_FLOAT { 4 } else { 2 };
        // Finalize, mode 2, N = 1, K = 2, H = 1: x1 = 2^14, rows -2^14 and 2^-24.
        let (tx, bx) = dev_tensor(&[2, 1], &[-16384.0, tiny], dt);
        let (tr, br) = idx_tensor(&[2], &[0, 1]);
        let (t1, b1) = dev_tensor(&[1, 1], &[16384.0], dt);
        let (tsc, bsc) = dev_tensor(&[1, 2], &[1.0, 1.0], dt);
        let ob = malloc(esz);
        let tout = tensor(&[1, 1], dt, ob);
        let (mut ws, mut exec) = (0u64, NULL);
        unsafe {
            let r = (s.aclnnMoeFinalizeRoutingV2GetWorkspaceSize)(
                tx, tr, t1, NULL, NULL, tsc, NULL, 2, tout, &mut ws, &mut exec,
            );
            assert_eq!(r, 0, "{}", err_msg());
            let wsp = malloc(ws.max(1) as usize);
            assert_eq!((s.aclnnMoeFinalizeRoutingV2)(wsp, ws, exec, st), 0, "{}", err_msg());
            sync(st);
            free(wsp);
        }
        let spec_order = (16384.0f32 + -16384.0) + tiny;
        assert_eq!(spec_order, tiny);
        assert_eq!(download::<u8>(ob, esz), enc(&[0.0], dt), "finalize dtype {dt}");
        assert_ne!(enc(&[0.0], dt), enc(&[spec_order], dt));
        // Unpermute, T = 1, K = 3, H = 1: terms 2^-24, -2^14, 2^14. SPEC:
        // (2^-24 - 2^14) + 2^14 = 0; pairs from the last: (2^14 - 2^14) + 2^-24.
        let (px, pbx) = dev_tensor(&[3, 1], &[tiny, -16384.0, 16384.0], dt);
        let (pi, pbi) = idx_tensor(&[3], &[0, 1, 2]);
        let (pp, pbp) = dev_tensor(&[1, 3], &[1.0, 1.0, 1.0], ACL_FLOAT);
        let pob = malloc(esz);
        let pout = tensor(&[1, 1], dt, pob);
        unsafe {
            assert_eq!(
                (s.aclnnMoeTokenUnpermuteGetWorkspaceSize)(px, pi, pp, false, NULL, pout, &mut ws, &mut exec),
                0,
                "{}",
                err_msg()
            );
            let wsp = malloc(ws.max(1) as usize);
            assert_eq!((s.aclnnMoeTokenUnpermute)(wsp, ws, exec, st), 0, "{}", err_msg());
            sync(st);
            free(wsp);
        }
        assert_eq!((tiny + -16384.0f32) + 16384.0, 0.0, "SPEC order");
        assert_eq!(download::<u8>(pob, esz), enc(&[tiny], dt), "unpermute dtype {dt}");
        for (t, b) in
            [(tx, bx), (tr, br), (t1, b1), (tsc, bsc), (tout, ob), (px, pbx), (pi, pbi), (pp, pbp), (pout, pob)]
        {
            destroy_tensor(t);
            free(b);
        }
        destroy_stream(st);
    }
}
