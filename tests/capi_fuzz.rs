//! Property test of the C ABI's argument validation: random descriptors (NULL
//! pointers, unknown dtypes and device kinds, too many dims, huge and
//! overflowing shapes, non-contiguous strides, mismatched sizes, random index
//! bytes) fed to every export must give a clean status with a message, never
//! `AMOE_STATUS_PANIC`, a crash or a hang.
//!
//! Memory the descriptors point to is always real and as large as they say
//! (that part is the caller's contract, not something the library can check);
//! everything else is random. Bounded by default (100 000 cases or 30 s; CI
//! runs it alone for a minute, printing the cases per second); run longer with
//! `AMOE_FUZZ_SECS=300 AMOE_FUZZ_CASES=10000000000 AMOE_FUZZ_SEED=7 cargo test --test capi_fuzz -- --nocapture`.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CString};
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

use ascend_moe::capi::*;
use ascend_moe::testing::SplitMix as Rng;

/// A descriptor plus the memory it points to.
struct Desc {
    c: amoe_tensor,
    _shape: Vec<usize>,
    _strides: Vec<isize>,
    _data: Vec<u64>,
    null_desc: bool,
}

impl Desc {
    fn ptr(&self) -> *const amoe_tensor {
        if self.null_desc {
            null()
        } else {
            &self.c
        }
    }
}

fn dim(rng: &mut Rng) -> usize {
    match rng.below(100) {
        0..=79 => rng.below(7) as usize,
        80..=89 => rng.below(40) as usize,
        90..=94 => 1 << (20 + rng.below(24)),
        95..=97 => usize::MAX / (1 + rng.below(8) as usize),
        _ => usize::MAX,
    }
}

/// A random descriptor, usually near `hint` (a plausible shape for the argument).
/// `noise` (percent) is how often each property strays from the hint.
fn desc(rng: &mut Rng, hint: &[usize], dtype_hint: u32, optional: bool, noise: u64) -> Desc {
    let ndim = if !rng.chance(noise) {
        hint.len()
    } else {
        match rng.below(10) {
            0..=6 => rng.below(4) as usize,
            7..=8 => rng.below(AMOE_MAX_NDIM as u64 + 1) as usize,
            _ => AMOE_MAX_NDIM + 1 + rng.below(1 << 20) as usize,
        }
    };
    // Always AMOE_MAX_NDIM readable entries, so a descriptor with ndim <= 8 is
    // within the contract; larger ndim must be rejected before the shape is read.
    let mut shape = vec![0usize; AMOE_MAX_NDIM];
    for (i, s) in shape.iter_mut().enumerate() {
        *s = if i < hint.len() && !rng.chance(noise) { hint[i] } else { dim(rng) };
    }
    let dtype = if !rng.chance(noise) {
        dtype_hint
    } else if rng.chance(80) {
        rng.below(5) as u32
    } else {
        rng.next_u64() as u32
    };
    let device_kind = if !rng.chance(noise / 3) {
        0
    } else if rng.chance(50) {
        1
    } else {
        rng.next_u64() as u32
    };
    let n = ndim.min(AMOE_MAX_NDIM);
    let numel = shape[..n].iter().try_fold(1usize, |a, &s| a.checked_mul(s));
    let bytes = numel.and_then(|e| e.checked_mul(8));
    let mut strides = Vec::new();
    if rng.chance(noise / 2) {
        strides = (0..AMOE_MAX_NDIM).map(|_| rng.below(20) as isize - 2).collect();
        if rng.chance(50) {
            // Contiguous strides (valid).
            let mut acc = 1isize;
            for i in (0..n).rev() {
                strides[i] = acc;
                acc = acc.wrapping_mul(shape[i] as isize);
            }
        }
    }
    // Real memory of the described size (8 bytes per element covers every dtype)
    // when it is small; otherwise, and sometimes anyway, NULL.
    let mut data = Vec::new();
    let mut data_ptr: *mut c_void = null_mut();
    if let Some(b) = bytes.filter(|&b| b <= 1 << 16) {
        if !rng.chance(noise / 6) {
            data = (0..b.div_ceil(8).max(1)).map(|_| small_value(rng)).collect();
            data_ptr = data.as_mut_ptr() as *mut c_void;
        }
    }
    let shape_ptr = if n > 0 && rng.chance(noise / 10) { null() } else { shape.as_ptr() };
    let c = amoe_tensor {
        data: data_ptr,
        dtype,
        ndim,
        shape: shape_ptr,
        strides: if strides.is_empty() { null() } else { strides.as_ptr() },
        device_kind,
        device_ordinal: rng.below(4) as i32,
    };
    Desc {
        c,
        _shape: shape,
        _strides: strides,
        _data: data,
        null_desc: rng.chance(if optional { 40 } else { noise / 8 }),
    }
}

/// Mostly small integers / floats (valid indices and values), sometimes random bits.
fn small_value(rng: &mut Rng) -> u64 {
    match rng.below(10) {
        0..=5 => {
            let a = rng.below(8) as u32;
            let b = rng.below(8) as u32;
            a as u64 | ((b as u64) << 32)
        }
        6..=7 => {
            let f = (rng.below(200) as f32 - 100.0) / 16.0;
            let bits = f.to_bits() as u64;
            bits | (bits << 32)
        }
        _ => rng.next_u64(),
    }
}

fn sizes(rng: &mut Rng, n: usize) -> Vec<usize> {
    (0..n).map(|_| if rng.chance(90) { rng.below(6) as usize } else { dim(rng) }).collect()
}

fn sizes_upto(rng: &mut Rng, max_len: u64) -> Vec<usize> {
    let n = rng.below(max_len) as usize;
    sizes(rng, n)
}

fn maybe_null<T>(rng: &mut Rng, v: &[T]) -> *const T {
    if rng.chance(5) {
        null()
    } else {
        v.as_ptr()
    }
}

fn shape_call(rng: &mut Rng) -> (Vec<usize>, usize) {
    let cap = if rng.chance(10) { rng.below(3) as usize } else { AMOE_MAX_NDIM };
    (vec![0usize; AMOE_MAX_NDIM], cap)
}

/// One random call; returns the export's name and status.
fn one_case(rng: &mut Rng, comm: *const amoe_comm, groups: *const amoe_moe_groups) -> (&'static str, amoe_status) {
    let dt = rng.below(3) as u32; // a float dtype for data tensors
    let (n, k, h) = (rng.below(5) as usize, 1 + rng.below(3) as usize, 1 + rng.below(4) as usize);
    let i32_t = 3u32;
    // Most cases are noisy; some stay close to a valid call so the ops run.
    let noise = if rng.chance(35) { 3 } else { 35 };
    let comm = if rng.chance(noise / 10) { null() } else { comm };
    // SAFETY (every call below): all descriptors point to memory that is real
    // and as large as they declare, and every out-pointer is writable, which
    // is the ABI's contract; everything else is deliberately random.
    unsafe {
        match rng.below(18) {
            16 | 17 => {
                // Sometimes a batch far larger than memory, of zero-width rows
                // (no bytes): nothing may be held per row.
                let huge = rng.chance(5);
                let dp = if huge {
                    vec![1usize << (40 + rng.below(8))]
                } else if rng.chance(85) {
                    vec![rng.below(5) as usize]
                } else {
                    sizes_upto(rng, 4)
                };
                let h = if huge { 0 } else { h };
                let ctx = amoe_moe_context {
                    dp_tokens: maybe_null(rng, &dp),
                    dp_size: dp.len(),
                    tp_size: if rng.chance(85) { 1 } else { dim(rng) },
                    dp_rank: if rng.chance(85) { 0 } else { dim(rng) },
                    tp_rank: if rng.chance(85) { 0 } else { dim(rng) },
                    sp: rng.next_u64() as u8,
                    num_actual_tokens: if rng.chance(85) { AMOE_ALL_TOKENS } else { dim(rng) },
                    pcp_size: if rng.chance(85) { 1 } else { dim(rng) },
                    pcp_rank: if rng.chance(85) { 0 } else { dim(rng) },
                    padded_num_tokens: if rng.chance(85) { 0 } else { dim(rng) },
                    struct_size: if rng.chance(90) { std::mem::size_of::<amoe_moe_context>() } else { dim(rng) },
                };
                let c = if rng.chance(noise / 10) { null() } else { &ctx as *const _ };
                let g = if rng.chance(noise / 10) { null() } else { groups };
                let ct = if rng.chance(85) { rng.below(4) as u32 } else { rng.next_u64() as u32 };
                let rows = dp.first().copied().unwrap_or(0);
                let x = desc(rng, &[rows, h], dt, false, noise);
                let out = desc(rng, &[rows, h], dt, false, noise);
                let (mut s, cap) = shape_call(rng);
                let mut nd = 0usize;
                match rng.below(4) {
                    0 => (
                        "amoe_token_prepare_output_shape",
                        amoe_token_prepare_output_shape(x.ptr(), ct, c, s.as_mut_ptr(), cap, &mut nd),
                    ),
                    1 => (
                        "amoe_token_finalize_output_shape",
                        amoe_token_finalize_output_shape(x.ptr(), ct, c, s.as_mut_ptr(), cap, &mut nd),
                    ),
                    2 => {
                        let rows = rng.below(9) as usize;
                        let mask = desc(rng, &[rows], amoe_dtype::Bool as u32, true, noise);
                        ("amoe_token_prepare", amoe_token_prepare(x.ptr(), ct, c, g, out.ptr(), mask.ptr(), null()))
                    }
                    _ => ("amoe_token_finalize", amoe_token_finalize(x.ptr(), ct, c, g, out.ptr(), null())),
                }
            }
            0 | 1 => {
                let ex = desc(rng, &[n * k, h], dt, false, noise);
                let idx = desc(rng, &[n * k], i32_t, false, noise);
                let x1 = desc(rng, &[n, h], dt, true, noise);
                let x2 = desc(rng, &[n, h], dt, true, noise);
                let bias = desc(rng, &[3, h], dt, true, noise);
                let sdt = if rng.chance(50) { 0 } else { dt };
                let sc = desc(rng, &[n, k], sdt, true, noise);
                let ei = desc(rng, &[n, k], i32_t, true, noise);
                let out = desc(rng, &[n, h], dt, false, noise);
                let args = amoe_finalize_args {
                    expanded_x: ex.ptr(),
                    expanded_row_idx: idx.ptr(),
                    x1: x1.ptr(),
                    x2: x2.ptr(),
                    bias: bias.ptr(),
                    scales: sc.ptr(),
                    expert_idx: ei.ptr(),
                    drop_pad_mode: if rng.chance(90) { rng.below(4) as u32 } else { rng.next_u64() as u32 },
                };
                let a = if rng.chance(3) { null() } else { &args as *const _ };
                if rng.chance(50) {
                    let (mut s, cap) = shape_call(rng);
                    let mut nd = 0usize;
                    (
                        "amoe_moe_finalize_routing_output_shape",
                        amoe_moe_finalize_routing_output_shape(a, s.as_mut_ptr(), cap, &mut nd),
                    )
                } else {
                    ("amoe_moe_finalize_routing", amoe_moe_finalize_routing(a, out.ptr(), null()))
                }
            }
            2 | 3 => {
                let p = desc(rng, &[n * k, h], dt, false, noise);
                let idx = desc(rng, &[n * k], i32_t, false, noise);
                let probs = desc(rng, &[n, k], dt, true, noise);
                let out = desc(rng, &[n, h], dt, false, noise);
                if rng.chance(50) {
                    let (mut s, cap) = shape_call(rng);
                    let mut nd = 0usize;
                    let st = amoe_moe_token_unpermute_output_shape(
                        p.ptr(),
                        idx.ptr(),
                        probs.ptr(),
                        s.as_mut_ptr(),
                        cap,
                        &mut nd,
                    );
                    ("amoe_moe_token_unpermute_output_shape", st)
                } else {
                    (
                        "amoe_moe_token_unpermute",
                        amoe_moe_token_unpermute(p.ptr(), idx.ptr(), probs.ptr(), out.ptr(), null()),
                    )
                }
            }
            4 => {
                let x = desc(rng, &[n, h], dt, false, noise);
                let ls = sizes_upto(rng, 4);
                let (mut s, cap) = shape_call(rng);
                let mut nd = 0usize;
                let (r, w) = (rng.below(3) as usize, rng.below(4) as usize);
                if rng.chance(50) {
                    let st = amoe_maybe_pad_and_reduce_output_shape(
                        x.ptr(),
                        maybe_null(rng, &ls),
                        ls.len(),
                        r,
                        w,
                        s.as_mut_ptr(),
                        cap,
                        &mut nd,
                    );
                    ("amoe_maybe_pad_and_reduce_output_shape", st)
                } else {
                    let st = amoe_maybe_all_gather_and_maybe_unpad_output_shape(
                        x.ptr(),
                        maybe_null(rng, &ls),
                        ls.len(),
                        r,
                        w,
                        s.as_mut_ptr(),
                        cap,
                        &mut nd,
                    );
                    ("amoe_maybe_all_gather_and_maybe_unpad_output_shape", st)
                }
            }
            5 => {
                let x = desc(rng, &[n, h], dt, false, noise);
                let out = desc(rng, &[n, h], dt, false, noise);
                let ls = sizes(rng, 1);
                if rng.chance(50) {
                    let st =
                        amoe_maybe_pad_and_reduce(x.ptr(), maybe_null(rng, &ls), ls.len(), comm, out.ptr(), null());
                    ("amoe_maybe_pad_and_reduce", st)
                } else {
                    let st = amoe_maybe_all_gather_and_maybe_unpad(
                        x.ptr(),
                        maybe_null(rng, &ls),
                        ls.len(),
                        comm,
                        out.ptr(),
                        null(),
                    );
                    ("amoe_maybe_all_gather_and_maybe_unpad", st)
                }
            }
            6 | 7 => {
                let sdt = if rng.chance(20) { rng.below(5) as u32 } else { dt };
                let src = desc(rng, &[n, h], sdt, false, noise);
                let dst = desc(rng, &[n, h], dt, false, noise);
                let op = if rng.chance(90) { rng.below(3) as u32 } else { rng.next_u64() as u32 };
                match rng.below(4) {
                    0 => ("amoe_all_reduce", amoe_all_reduce(comm, src.ptr(), dst.ptr(), op, null())),
                    1 => ("amoe_reduce_scatter", amoe_reduce_scatter(comm, src.ptr(), dst.ptr(), op, null())),
                    2 => ("amoe_all_gather", amoe_all_gather(comm, src.ptr(), dst.ptr(), null())),
                    _ => ("amoe_broadcast", amoe_broadcast(comm, src.ptr(), rng.below(2) as usize, null())),
                }
            }
            8 => {
                let src = desc(rng, &[n, h], dt, false, noise);
                let dst = desc(rng, &[n, h], dt, false, noise);
                let c1 = sizes_upto(rng, 3);
                let c2 = sizes_upto(rng, 3);
                match rng.below(3) {
                    0 => {
                        let st = amoe_reduce_scatter_v(
                            comm,
                            src.ptr(),
                            dst.ptr(),
                            maybe_null(rng, &c1),
                            c1.len(),
                            0,
                            null(),
                        );
                        ("amoe_reduce_scatter_v", st)
                    }
                    1 => {
                        let st = amoe_all_gather_v(comm, src.ptr(), dst.ptr(), maybe_null(rng, &c1), c1.len(), null());
                        ("amoe_all_gather_v", st)
                    }
                    _ => {
                        let st = amoe_all_to_all_v(
                            comm,
                            src.ptr(),
                            maybe_null(rng, &c1),
                            c1.len(),
                            dst.ptr(),
                            maybe_null(rng, &c2),
                            c2.len(),
                            null(),
                        );
                        ("amoe_all_to_all_v", st)
                    }
                }
            }
            9 => {
                let dp = sizes_upto(rng, 4);
                let tp = if rng.chance(80) { rng.below(4) as usize } else { dim(rng) };
                let cap = rng.below(12) as usize;
                let mut out = vec![0usize; 12];
                let mut len = 0usize;
                let out_len = if rng.chance(5) { null_mut() } else { &mut len as *mut usize };
                if rng.chance(50) {
                    let pcp = if rng.chance(80) { rng.below(4) as usize } else { dim(rng) };
                    let (d, o) = (maybe_null(rng, &dp), out.as_mut_ptr());
                    (
                        "amoe_sp_layout_from_dp_tokens_pcp",
                        amoe_sp_layout_from_dp_tokens_pcp(d, dp.len(), pcp, tp, o, cap, out_len),
                    )
                } else {
                    let st = amoe_sp_layout_from_dp_tokens(
                        maybe_null(rng, &dp),
                        dp.len(),
                        tp,
                        out.as_mut_ptr(),
                        cap,
                        out_len,
                    );
                    ("amoe_sp_layout_from_dp_tokens", st)
                }
            }
            10 => {
                let mut out = 0u8;
                let ct = if rng.chance(80) { rng.below(4) as u32 } else { rng.next_u64() as u32 };
                let o = if rng.chance(5) { null_mut() } else { &mut out as *mut u8 };
                ("amoe_routed_is_reduced", amoe_routed_is_reduced(ct, rng.next_u64() as u8, o))
            }
            11 | 12 => {
                let pol = amoe_reduce_policy {
                    shared_mode: if rng.chance(85) { rng.below(5) as u32 } else { rng.next_u64() as u32 },
                    has_routed_transform: rng.next_u64() as u8,
                    sp: rng.next_u64() as u8,
                    tp_size: if rng.chance(85) { 1 + rng.below(2) as usize } else { dim(rng) },
                    ep_size: if rng.chance(85) { 1 + rng.below(4) as usize } else { dim(rng) },
                };
                let p = if rng.chance(4) { null() } else { &pol as *const _ };
                let ct = if rng.chance(85) { rng.below(4) as u32 } else { rng.next_u64() as u32 };
                let x = desc(rng, &[n, h], dt, false, noise);
                let out = desc(rng, &[n, h], dt, false, noise);
                match rng.below(4) {
                    0 => {
                        let (mut a, mut b) = (0u8, 0u8);
                        let st = amoe_reduce_policy_decisions(p, ct, &mut a, null_mut(), &mut b, null_mut());
                        ("amoe_reduce_policy_decisions", st)
                    }
                    1 => {
                        ("amoe_reduce_routed_early", amoe_reduce_routed_early(p, x.ptr(), ct, comm, out.ptr(), null()))
                    }
                    2 => ("amoe_reduce_shared", amoe_reduce_shared(p, x.ptr(), ct, comm, out.ptr(), null())),
                    _ => ("amoe_reduce_final", amoe_reduce_final(p, x.ptr(), ct, comm, out.ptr(), null())),
                }
            }
            13 => {
                let ranks = sizes_upto(rng, 3);
                let mut out: *mut amoe_comm = null_mut();
                let st = amoe_comm_split(comm, maybe_null(rng, &ranks), ranks.len(), &mut out);
                amoe_comm_free(out);
                ("amoe_comm_split", st)
            }
            14 => {
                // Invalid worlds only (a valid multi-rank world would wait for peers).
                let name = CString::new(format!("fuzz-{}", rng.next_u64())).expect("no NUL");
                let (w, r) =
                    if rng.chance(50) { (0, 0) } else { (1 + rng.below(3) as usize, 4 + rng.below(9) as usize) };
                let nm: *const c_char = if rng.chance(10) { null() } else { name.as_ptr() };
                let mut out: *mut amoe_comm = null_mut();
                let o = if rng.chance(10) { null_mut() } else { &mut out as *mut _ };
                let st = amoe_comm_cpu_new(nm, w, r, 0.5, o);
                amoe_comm_free(out);
                ("amoe_comm_cpu_new", st)
            }
            _ => {
                let ex = desc(rng, &[n * k, h], dt, false, noise);
                let idx = desc(rng, &[n * k], i32_t, false, noise);
                let sc = desc(rng, &[n, k], dt, true, noise);
                let out = desc(rng, &[n, h], dt, false, noise);
                let args = amoe_finalize_args {
                    expanded_x: ex.ptr(),
                    expanded_row_idx: idx.ptr(),
                    x1: null(),
                    x2: null(),
                    bias: null(),
                    scales: sc.ptr(),
                    expert_idx: null(),
                    drop_pad_mode: rng.below(5) as u32,
                };
                let ls = sizes(rng, 1);
                if rng.chance(50) {
                    let (mut s, cap) = shape_call(rng);
                    let mut nd = 0usize;
                    let st = amoe_finalize_and_reduce_output_shape(
                        &args,
                        maybe_null(rng, &ls),
                        1,
                        0,
                        1,
                        s.as_mut_ptr(),
                        cap,
                        &mut nd,
                    );
                    ("amoe_finalize_and_reduce_output_shape", st)
                } else {
                    (
                        "amoe_finalize_and_reduce",
                        amoe_finalize_and_reduce(&args, maybe_null(rng, &ls), 1, comm, out.ptr(), null()),
                    )
                }
            }
        }
    }
}

fn last_error() -> String {
    let mut buf = vec![0u8; amoe_last_error_length()];
    let mut n = 0usize;
    // SAFETY: `buf` is writable for its length; `n` is writable.
    unsafe { amoe_last_error_message(buf.as_mut_ptr() as *mut c_char, buf.len(), &mut n) };
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn random_descriptors_give_clean_errors() {
    // CI: a fixed number of cases from a fixed seed (the same cases on every
    // machine), with a time cap. Longer runs set AMOE_FUZZ_SECS and a huge
    // AMOE_FUZZ_CASES.
    let secs: f64 = std::env::var("AMOE_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(30.0);
    let max_cases: u64 = std::env::var("AMOE_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let seed: u64 = std::env::var("AMOE_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed);
    let name = CString::new(format!("capi-fuzz-{}", std::process::id())).expect("no NUL");
    let mut comm: *mut amoe_comm = null_mut();
    // SAFETY: valid name and out-pointer.
    let st = unsafe { amoe_comm_cpu_new(name.as_ptr(), 1, 0, 5.0, &mut comm) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());

    let mut groups: *mut amoe_moe_groups = null_mut();
    // SAFETY: a live world of one rank; valid out-pointer.
    let st = unsafe { amoe_moe_groups_new(comm, 1, 1, &mut groups) };
    assert_eq!(st, amoe_status::Ok, "{}", last_error());
    let trace = std::env::var_os("AMOE_FUZZ_TRACE").is_some();
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut rng = Rng::new(seed);
    let mut hist: BTreeMap<(&str, u32), u64> = BTreeMap::new();
    let mut cases = 0u64;
    let start = Instant::now();
    while cases < max_cases && Instant::now() < deadline {
        let case_seed = rng.next_u64();
        if trace {
            eprintln!("case {cases} seed {case_seed:#x}");
        }
        // A failing call no case makes leaves a message of its own: a case
        // that fails without setting one is seen, not hidden by an earlier
        // case's message (a message is kept until the next failure).
        // SAFETY: NULL is refused before anything is written.
        assert_eq!(unsafe { amoe_moe_context_init(null_mut()) }, amoe_status::NullArgument);
        let before = last_error();
        let (func, st) = one_case(&mut Rng::new(case_seed), comm, groups);
        assert_ne!(st, amoe_status::Panic, "{func} panicked (case seed {case_seed:#x}): {}", last_error());
        if st != amoe_status::Ok {
            let msg = last_error();
            assert!(
                msg != before && msg.starts_with(&format!("{func}: ")),
                "{func} returned {st:?} without a message of its own starting with its name (case seed \
                 {case_seed:#x}): {msg}"
            );
        }
        *hist.entry((func, st as u32)).or_default() += 1;
        cases += 1;
    }
    // SAFETY: live handles, not used afterwards.
    unsafe {
        amoe_moe_groups_free(groups);
        amoe_comm_free(comm);
    }
    let ok: u64 = hist.iter().filter(|((_, s), _)| *s == 0).map(|(_, c)| c).sum();
    let took = start.elapsed().as_secs_f64();
    println!(
        "capi fuzz: {cases} cases in {took:.1} s ({:.0} cases/s), {ok} OK, seed {seed:#x}, {secs} s budget",
        cases as f64 / took.max(1e-9)
    );
    for ((f, s), c) in &hist {
        println!("  {f:50} status {s:2}: {c}");
    }
    assert!(cases >= 200, "only {cases} cases ran");
    assert!(ok > 0, "no case succeeded: the generator never produced a valid call");
    let distinct: std::collections::BTreeSet<u32> = hist.keys().map(|(_, s)| *s).collect();
    assert!(distinct.len() >= 5, "too few distinct statuses {distinct:?}: the generator is not exploring");
}
