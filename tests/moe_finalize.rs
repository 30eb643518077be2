//! The finalize-routing and token-unpermute ops (SPEC section 1) against an
//! independent naive f64 implementation written here, plus determinism and
//! bad-input checks; and (`every_backend`) the backend trait's finalize and
//! unpermute against a naive f64 reference, one body per test on the CPU and
//! (ignored without an NPU) on NPU 0.

mod common;
mod moe_common;

use ascend_moe::backend::cpu::{set_num_threads, set_streaming_stores, set_wide_simd};
use ascend_moe::backend::{FinalizeArgs, OutputRows};
use ascend_moe::moe::finalize::*;
use ascend_moe::{DType, Device, DropPadMode, Error, Tensor};
use moe_common::*;

const MODES: [DropPadMode; 4] =
    [DropPadMode::DropLessColumn, DropPadMode::DropPadColumn, DropPadMode::DropLessRow, DropPadMode::DropPadRow];

/// One random finalize problem with its inputs.
struct Problem {
    mode: DropPadMode,
    n: usize,
    k: usize,
    trailing: Vec<usize>,
    x: Tensor,
    idx: Tensor,
    x1: Option<Tensor>,
    x2: Option<Tensor>,
    bias: Option<Tensor>,
    scales: Option<Tensor>,
    expert: Option<Tensor>,
}

#[derive(Clone, Copy)]
struct Opts {
    x1: bool,
    x2: bool,
    bias: bool,
    /// None: no scales; Some(d): scales of dtype d.
    scales: Option<DType>,
    expert_without_bias: bool,
}

fn problem(rng: &mut Rng, mode: DropPadMode, dtype: DType, n: usize, k: usize, trailing: &[usize], o: Opts) -> Problem {
    let k = if o.scales.is_some() { k } else { 1 };
    let experts = 5;
    let mut xshape;
    let idx: Vec<i32> = if mode.is_drop_pad() {
        let cap = 4;
        xshape = vec![experts, cap];
        // Random slots, about a quarter of them dropped.
        (0..n * k).map(|_| if rng.below(4) == 0 { -1 } else { rng.below(experts * cap) as i32 }).collect()
    } else {
        xshape = vec![n * k];
        let mut p: Vec<i32> = (0..(n * k) as i32).collect();
        rng.shuffle(&mut p);
        p
    };
    xshape.extend_from_slice(trailing);
    let mut oshape = vec![n];
    oshape.extend_from_slice(trailing);
    let mut bshape = vec![experts];
    bshape.extend_from_slice(trailing);
    let x = random(rng, &xshape, dtype);
    let x1 = o.x1.then(|| random(rng, &oshape, dtype));
    let x2 = o.x2.then(|| random(rng, &oshape, dtype));
    let bias = o.bias.then(|| random(rng, &bshape, dtype));
    let scales = o.scales.map(|d| random(rng, &[n, k], d));
    let expert = (o.bias || o.expert_without_bias).then(|| {
        let e: Vec<i32> = (0..n * k).map(|_| rng.below(experts) as i32).collect();
        i32_tensor(&e, &[n, k])
    });
    Problem {
        mode,
        n,
        k,
        trailing: trailing.to_vec(),
        x,
        idx: i32_tensor(&idx, &[n * k]),
        x1,
        x2,
        bias,
        scales,
        expert,
    }
}

impl Problem {
    fn args(&self) -> FinalizeArgs<&Tensor> {
        FinalizeArgs::new(&self.x, &self.idx, self.mode)
            .with_x1(self.x1.as_ref())
            .with_x2(self.x2.as_ref())
            .with_bias(self.bias.as_ref())
            .with_scales(self.scales.as_ref())
            .with_expert_idx(self.expert.as_ref())
    }

    /// The formula of SPEC section 1 evaluated naively in f64. Returns the
    /// result and, per element, the sum of magnitudes of its terms (to bound
    /// the f32 accumulation error).
    fn naive(&self) -> (Vec<f64>, Vec<f64>) {
        let (n, k) = (self.n, self.k);
        let h: usize = self.trailing.iter().product();
        let x = to_f64(&self.x);
        let idx = self.idx.to_vec::<i32>().unwrap();
        let x1 = self.x1.as_ref().map(to_f64);
        let x2 = self.x2.as_ref().map(to_f64);
        let bias = self.bias.as_ref().map(to_f64);
        let scales = self.scales.as_ref().map(to_f64);
        let expert = self.expert.as_ref().map(|e| e.to_vec::<i32>().unwrap());
        let mut out = vec![0f64; n * h];
        let mut mag = vec![0f64; n * h];
        for i in 0..n {
            for j in 0..h {
                let mut acc = 0.0;
                let mut m = 0.0;
                for s in [&x1, &x2].into_iter().flatten() {
                    acc += s[i * h + j];
                    m += s[i * h + j].abs();
                }
                for kk in 0..k {
                    let pos = match self.mode {
                        DropPadMode::DropLessColumn | DropPadMode::DropPadColumn => kk * n + i,
                        DropPadMode::DropLessRow | DropPadMode::DropPadRow => i * k + kk,
                    };
                    let r = idx[pos];
                    let row = if r < 0 { 0.0 } else { x[r as usize * h + j] };
                    let b = match (&bias, &expert) {
                        (Some(b), Some(e)) => b[e[i * k + kk] as usize * h + j],
                        _ => 0.0,
                    };
                    let s = scales.as_ref().map_or(1.0, |s| s[i * k + kk]);
                    acc += s * (row + b);
                    m += (s * (row + b)).abs() + s.abs() * (row.abs() + b.abs());
                }
                out[i * h + j] = acc;
                mag[i * h + j] = m;
            }
        }
        (out, mag)
    }

    fn check(&self, what: &str) {
        let dtype = self.x.dtype();
        let (shape, dims) = moe_finalize_routing_output_shape(&self.args()).unwrap();
        let out = moe_finalize_routing(&self.args()).unwrap();
        assert_eq!(out.shape(), shape.as_slice(), "{what}: real vs meta shape");
        let mut want_shape = vec![self.n];
        want_shape.extend_from_slice(&self.trailing);
        assert_eq!(out.shape(), want_shape.as_slice(), "{what}: output shape");
        assert_eq!((dims.n, dims.k), (self.n, self.k), "{what}: dims");
        assert_eq!(out.dtype(), dtype);
        let (want, mag) = self.naive();
        assert_within_rounding(what, Rounding::once(dtype), &to_f64(&out), &want, &mag);
    }
}

#[test]
fn finalize_matches_naive_for_every_mode_option_and_dtype() {
    let mut rng = Rng::new(1);
    let mut cases = 0;
    for mode in MODES {
        for dtype in DType::FLOATS {
            for bits in 0..16u32 {
                for scale_f32 in [false, true] {
                    let has_scales = bits & 8 != 0;
                    if scale_f32 && !has_scales {
                        continue;
                    }
                    let o = Opts {
                        x1: bits & 1 != 0,
                        x2: bits & 2 != 0,
                        bias: bits & 4 != 0,
                        scales: has_scales.then_some(if scale_f32 { DType::F32 } else { dtype }),
                        expert_without_bias: bits == 0,
                    };
                    // Odd H; every other case with a 2-D trailing shape.
                    let trailing: &[usize] = if bits % 2 == 0 { &[37] } else { &[3, 7] };
                    let p = problem(&mut rng, mode, dtype, 11, 3, trailing, o);
                    p.check(&format!("mode {} {dtype} options {bits:04b} f32-scales {scale_f32}", mode as u32));
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 4 * 3 * 24);
}

/// Large results come from the host pool: a dropped result's memory serves
/// the next one (poisoned first in debug builds), so every element must be
/// written; a result still held is never handed out again.
#[test]
fn large_results_reuse_dropped_memory_only_and_are_written_entirely() {
    let mut rng = Rng::new(21);
    let all = Opts { x1: true, x2: false, bias: true, scales: Some(DType::F32), expert_without_bias: false };
    for mode in MODES {
        // [600, 512] f32: 1.2 MiB, above the size the pool serves.
        let p = problem(&mut rng, mode, DType::F32, 600, 3, &[512], all);
        let what = format!("mode {}", mode as u32);
        let first = moe_finalize_routing(&p.args()).unwrap();
        let first_bytes = first.cpu_bytes().unwrap().to_vec();
        let held = moe_finalize_routing(&p.args()).unwrap();
        let (a, b) = (first.cpu_bytes().unwrap().as_ptr(), held.cpu_bytes().unwrap().as_ptr());
        assert_ne!(a, b, "{what}: two live results share memory");
        drop(first);
        // Reuses `first`'s block, whose old bytes are the same result: poison
        // (debug) or not, the check below compares with the naive sum.
        p.check(&format!("{what}, reused block"));
        assert_eq!(held.cpu_bytes().unwrap(), first_bytes.as_slice(), "{what}: a held result changed");
    }
    let permuted = random(&mut rng, &[1200, 512], DType::F32);
    let idx: Vec<i32> = (0..1200).rev().collect();
    let sorted = i32_tensor(&idx, &[1200]);
    let (want, _) = naive_unpermute(&permuted, &idx, None, 1);
    for round in 0..2 {
        let got = moe_token_unpermute(&permuted, &sorted, None).unwrap();
        // A permutation without probabilities moves values: exact.
        assert_eq!(to_f64(&got), want, "unpermute round {round}");
    }
}

#[test]
fn finalize_edge_sizes() {
    let mut rng = Rng::new(2);
    let all = Opts { x1: true, x2: true, bias: true, scales: Some(DType::F32), expert_without_bias: false };
    for mode in MODES {
        // N = 0 tokens, H = 1, K = 1 with scales, long K.
        for (n, k, h) in [(0usize, 2usize, 5usize), (3, 1, 1), (2, 9, 3), (1, 2, 64)] {
            let p = problem(&mut rng, mode, DType::BF16, n, k, &[h], all);
            p.check(&format!("mode {} n {n} k {k} h {h}", mode as u32));
        }
    }
}

#[test]
fn finalize_is_bitwise_identical_across_runs_and_thread_counts() {
    let mut rng = Rng::new(3);
    let with_bias = Opts { x1: true, x2: true, bias: true, scales: Some(DType::F32), expert_without_bias: false };
    // Without bias the kernel streams several rows per pass: test that path too.
    let no_bias = Opts { bias: false, ..with_bias };
    // One skip input and K <= 8: the one-pass path.
    let one_pass = Opts { x2: false, ..no_bias };
    for (mode, dtype, o) in [
        (DropPadMode::DropLessRow, DType::BF16, with_bias),
        (DropPadMode::DropLessRow, DType::BF16, no_bias),
        (DropPadMode::DropLessRow, DType::BF16, one_pass),
        (DropPadMode::DropLessColumn, DType::F32, one_pass),
        (DropPadMode::DropPadColumn, DType::F16, with_bias),
        (DropPadMode::DropLessRow, DType::F16, one_pass),
        (DropPadMode::DropPadRow, DType::BF16, no_bias),
        (DropPadMode::DropLessColumn, DType::F32, no_bias),
    ] {
        let k = if o.x2 { 11 } else { 5 };
        let p = problem(&mut rng, mode, dtype, 301, k, &[129], o);
        set_num_threads(Some(1));
        let reference = bits(&moe_finalize_routing(&p.args()).unwrap());
        for threads in [1, 2, 3, 7, 64] {
            set_num_threads(Some(threads));
            for _ in 0..2 {
                let got = bits(&moe_finalize_routing(&p.args()).unwrap());
                assert!(got == reference, "mode {} {dtype}: {threads} threads differ", mode as u32);
            }
        }
        set_num_threads(None);
        assert!(bits(&moe_finalize_routing(&p.args()).unwrap()) == reference);
        // The baseline code path gives the same bits as the wide-SIMD one.
        set_wide_simd(false);
        let baseline = bits(&moe_finalize_routing(&p.args()).unwrap());
        set_wide_simd(true);
        assert!(baseline == reference, "mode {} {dtype}: SIMD paths differ", mode as u32);
        // Streaming stores (taken by bf16 and f16 calls larger than the cache)
        // give the same bits. f32 has no streaming kernel.
        for threads in [1, 3].into_iter().filter(|_| dtype != DType::F32) {
            set_num_threads(Some(threads));
            set_streaming_stores(Some(true));
            let streamed = bits(&moe_finalize_routing(&p.args()).unwrap());
            set_streaming_stores(None);
            assert!(
                streamed == reference,
                "mode {} {dtype}: streaming stores on {threads} threads differ",
                mode as u32
            );
        }
        set_num_threads(None);
    }
}

#[test]
fn padded_output_places_blocks_and_zeroes_padding() {
    let mut rng = Rng::new(4);
    let o = Opts { x1: true, x2: false, bias: false, scales: Some(DType::BF16), expert_without_bias: false };
    let local = [3usize, 0, 5, 1];
    let n: usize = local.iter().sum();
    let m = 5;
    let p = problem(&mut rng, DropPadMode::DropLessRow, DType::BF16, n, 2, &[9], o);
    let (_, dims) = moe_finalize_routing_output_shape(&p.args()).unwrap();
    let dense = to_f64(&moe_finalize_routing(&p.args()).unwrap());
    for threads in [1, 3] {
        set_num_threads(Some(threads));
        // Start from garbage so the test sees that padding is written.
        let mut out = from_f32(&vec![7.0; local.len() * m * 9], &[local.len() * m, 9], DType::BF16);
        Device::Cpu
            .backend()
            .finalize_routing(&p.args(), &dims, &mut out, OutputRows::Padded { local_sizes: &local, slot_rows: m })
            .unwrap();
        let got = to_f64(&out);
        let mut tok = 0;
        for (r, &l) in local.iter().enumerate() {
            for off in 0..m {
                let row = &got[(r * m + off) * 9..(r * m + off + 1) * 9];
                if off < l {
                    assert_eq!(row, &dense[tok * 9..(tok + 1) * 9], "slot {r} row {off}");
                    tok += 1;
                } else {
                    assert!(row.iter().all(|v| *v == 0.0), "slot {r} padding row {off} not zero");
                }
            }
        }
    }
    set_num_threads(None);
}

#[test]
fn scales_of_another_dtype_name_the_dtypes_they_may_have() {
    let mut rng = Rng::new(8);
    let o = Opts { x1: false, x2: false, bias: false, scales: Some(DType::F16), expert_without_bias: false };
    for (data, want) in
        [(DType::F32, "f32 (the dtype of the data)"), (DType::BF16, "bf16 (the dtype of the data) or f32")]
    {
        let p = problem(&mut rng, DropPadMode::DropLessRow, data, 3, 2, &[4], o);
        match moe_finalize_routing(&p.args()) {
            Err(Error::DType { arg: "scales", expected, actual: DType::F16, .. }) => assert_eq!(expected, want),
            other => panic!("{data} data with f16 scales: {other:?}"),
        }
    }
}

fn expect_index_error(res: Result<Tensor, Error>, arg: &str, position: usize, value: i64) {
    match res {
        Err(Error::IndexOutOfRange { arg: a, position: p, value: v, ref valid, .. }) => {
            assert_eq!((a, p, v), (arg, position, value), "valid {valid}");
            let msg = res.unwrap_err().to_string();
            assert!(msg.contains(&position.to_string()) && msg.contains(&value.to_string()), "{msg}");
        }
        other => panic!("expected an index error on {arg}[{position}] = {value}, got {other:?}"),
    }
}

#[test]
fn out_of_range_indices_name_position_and_value() {
    let mut rng = Rng::new(5);
    let o = Opts { x1: false, x2: false, bias: true, scales: Some(DType::F32), expert_without_bias: false };
    for mode in MODES {
        let mut p = problem(&mut rng, mode, DType::F32, 6, 2, &[4], o);
        let rows = p.x.shape()[..if mode.is_drop_pad() { 2 } else { 1 }].iter().product::<usize>() as i32;
        for (pos, bad) in [(7usize, rows), (3, -2), (0, i32::MAX)] {
            let mut idx = p.idx.to_vec::<i32>().unwrap();
            idx[pos] = bad;
            p.idx = i32_tensor(&idx, &[12]);
            expect_index_error(moe_finalize_routing(&p.args()), "expanded_row_idx", pos, bad as i64);
            // Restore a valid index for the next probe.
            idx[pos] = 0;
            p.idx = i32_tensor(&idx, &[12]);
        }
        if !mode.is_drop_pad() {
            let mut idx = p.idx.to_vec::<i32>().unwrap();
            idx[5] = -1;
            p.idx = i32_tensor(&idx, &[12]);
            expect_index_error(moe_finalize_routing(&p.args()), "expanded_row_idx", 5, -1);
            idx[5] = 0;
            p.idx = i32_tensor(&idx, &[12]);
        }
        let mut e = p.expert.as_ref().unwrap().to_vec::<i32>().unwrap();
        e[9] = 5;
        p.expert = Some(i32_tensor(&e, &[6, 2]));
        expect_index_error(moe_finalize_routing(&p.args()), "expert_idx", 9, 5);
    }
}

/// Asserts an error that names `arg` and mentions every `needles` string.
fn expect_err<T: std::fmt::Debug>(res: Result<T, Error>, arg: &str, needles: &[&str]) {
    let err = res.expect_err("bad input accepted");
    let msg = err.to_string();
    assert!(msg.contains(&format!("`{arg}`")), "error does not name `{arg}`: {msg}");
    for n in needles {
        assert!(msg.contains(n), "error lacks {n:?}: {msg}");
    }
}

#[test]
fn bad_finalize_input_names_argument_expected_and_actual() {
    let mut rng = Rng::new(6);
    let o = Opts { x1: true, x2: true, bias: true, scales: Some(DType::F32), expert_without_bias: false };
    let p = problem(&mut rng, DropPadMode::DropLessRow, DType::BF16, 4, 2, &[8], o);
    let a = p.args();

    let bad = random(&mut rng, &[4, 8], DType::F16);
    expect_err(moe_finalize_routing(&FinalizeArgs { x1: Some(&bad), ..a }), "x1", &["f16", "bf16"]);
    let bad = random(&mut rng, &[4, 7], DType::BF16);
    expect_err(moe_finalize_routing(&FinalizeArgs { x2: Some(&bad), ..a }), "x2", &["[4, 7]", "[4, 8]"]);
    let bad = i32_tensor(&[0; 8], &[4, 2]);
    expect_err(moe_finalize_routing(&FinalizeArgs { scales: Some(&bad), ..a }), "scales", &["i32", "f32"]);
    let bad = random(&mut rng, &[8], DType::F32);
    expect_err(moe_finalize_routing(&FinalizeArgs { scales: Some(&bad), ..a }), "scales", &["[8]", "[N, K]"]);
    let bad = random(&mut rng, &[4, 3], DType::F32);
    expect_err(moe_finalize_routing(&FinalizeArgs { scales: Some(&bad), ..a }), "expanded_row_idx", &["[12]", "[8]"]);
    expect_err(moe_finalize_routing(&FinalizeArgs { expert_idx: None, ..a }), "expert_idx", &["bias"]);
    let bad = i32_tensor(&[0; 8], &[2, 4]);
    expect_err(
        moe_finalize_routing(&FinalizeArgs { expert_idx: Some(&bad), ..a }),
        "expert_idx",
        &["[4, 2]", "[2, 4]"],
    );
    let bad = random(&mut rng, &[5, 9], DType::BF16);
    expect_err(moe_finalize_routing(&FinalizeArgs { bias: Some(&bad), ..a }), "bias", &["[E, 8]", "[5, 9]"]);
    let bad = random(&mut rng, &[8], DType::F32);
    expect_err(
        moe_finalize_routing(&FinalizeArgs { expanded_row_idx: &bad, ..a }),
        "expanded_row_idx",
        &["f32", "i32"],
    );
    let bad = i32_tensor(&[0; 64], &[8, 8]);
    expect_err(moe_finalize_routing(&FinalizeArgs { expanded_x: &bad, ..a }), "expanded_x", &["i32"]);
    let bad = random(&mut rng, &[9, 8], DType::BF16);
    expect_err(moe_finalize_routing(&FinalizeArgs { expanded_x: &bad, ..a }), "expanded_x", &["[9, 8]", "[8, ...]"]);
    // Drop-pad mode needs [E, C, H].
    let a3 = FinalizeArgs { drop_pad_mode: DropPadMode::DropPadRow, ..a };
    expect_err(moe_finalize_routing(&a3), "expanded_x", &["[E, C, H]", "[8, 8]"]);
    // In drop-pad mode the bias has one row per expert of expanded_x [E, C, H]:
    // 5 rows (E = 5) is taken; 6 rows, where every expert index is in range,
    // is refused like 4.
    let p = problem(&mut rng, DropPadMode::DropPadColumn, DType::F32, 4, 2, &[8], o);
    let a = p.args();
    assert!(moe_finalize_routing(&a).is_ok());
    for rows in [6, 4] {
        let bad = random(&mut rng, &[rows, 8], DType::F32);
        expect_err(
            moe_finalize_routing(&FinalizeArgs { bias: Some(&bad), ..a }),
            "bias",
            &[&format!("[{rows}, 8]"), "[5, 8]", "drop-pad"],
        );
    }
    // An unknown mode, through the shape-only function the C ABI uses.
    let meta = FinalizeMeta { drop_pad_mode: 7, ..FinalizeMeta::of(&a) };
    expect_err(moe_finalize_routing_shape(&meta), "drop_pad_mode", &["7", "0..=3"]);
    let meta = FinalizeMeta { drop_pad_mode: -1, ..FinalizeMeta::of(&a) };
    expect_err(moe_finalize_routing_shape(&meta), "drop_pad_mode", &["-1"]);
}

#[test]
fn shape_only_function_agrees_with_real_op() {
    let mut rng = Rng::new(7);
    let o = Opts { x1: true, x2: false, bias: false, scales: Some(DType::BF16), expert_without_bias: false };
    for mode in MODES {
        for n in [0, 1, 5] {
            let p = problem(&mut rng, mode, DType::BF16, n, 3, &[2, 3], o);
            let (meta, _) = moe_finalize_routing_shape(&FinalizeMeta::of(&p.args())).unwrap();
            assert_eq!(moe_finalize_routing(&p.args()).unwrap().shape(), meta.as_slice());
            assert_eq!(meta, vec![n, 2, 3]);
        }
    }
}

/// The unpermute formula, naively in f64.
/// Section 1 (mode 2, no extras) in f64, and each element's terms' magnitudes.
fn naive_unpermute(permuted: &Tensor, idx: &[i32], probs: Option<&Tensor>, k: usize) -> (Vec<f64>, Vec<f64>) {
    let x = to_f64(permuted);
    let h = permuted.row_len();
    let rows = permuted.shape()[0];
    let p = probs.map(to_f64);
    let t = idx.len() / k;
    let mut out = vec![0f64; t * h];
    let mut mag = vec![0f64; t * h];
    for ti in 0..t {
        for kk in 0..k {
            let r = idx[ti * k + kk];
            if r < 0 || r as usize >= rows {
                continue;
            }
            let s = p.as_ref().map_or(1.0, |p| p[ti * k + kk]);
            for j in 0..h {
                out[ti * h + j] += s * x[r as usize * h + j];
                mag[ti * h + j] += (s * x[r as usize * h + j]).abs();
            }
        }
    }
    (out, mag)
}

#[test]
fn unpermute_matches_naive_and_skips_out_of_range() {
    let mut rng = Rng::new(8);
    for dtype in DType::FLOATS {
        for probs_dtype in [None, Some(DType::F32), Some(dtype)] {
            let (t, k, h) = (13, if probs_dtype.is_some() { 3 } else { 1 }, 33);
            let permuted = random(&mut rng, &[t * k, h], dtype);
            let mut idx: Vec<i32> = (0..(t * k) as i32).collect();
            rng.shuffle(&mut idx);
            // Out-of-range entries contribute nothing.
            idx[2] = -1;
            idx[t * k - 1] = (t * k) as i32 + 4;
            let probs = probs_dtype.map(|d| random(&mut rng, &[t, k], d));
            let it = i32_tensor(&idx, &[t * k]);
            let (shape, _) = moe_token_unpermute_output_shape(&permuted, &it, probs.as_ref()).unwrap();
            let out = moe_token_unpermute(&permuted, &it, probs.as_ref()).unwrap();
            assert_eq!(out.shape(), shape.as_slice());
            assert_eq!(out.shape(), &[t, h]);
            let (want, mag) = naive_unpermute(&permuted, &idx, probs.as_ref(), k);
            assert_within_rounding(
                &format!("unpermute {dtype} {probs_dtype:?}"),
                Rounding::once(dtype),
                &to_f64(&out),
                &want,
                &mag,
            );
        }
    }
}

#[test]
fn unpermute_equals_finalize_mode_2_without_skips() {
    let mut rng = Rng::new(9);
    let (t, k, h) = (17, 2, 24);
    let permuted = random(&mut rng, &[t * k, h], DType::BF16);
    let mut idx: Vec<i32> = (0..(t * k) as i32).collect();
    rng.shuffle(&mut idx);
    let it = i32_tensor(&idx, &[t * k]);
    let probs = random(&mut rng, &[t, k], DType::F32);
    let u = moe_token_unpermute(&permuted, &it, Some(&probs)).unwrap();
    let f =
        moe_finalize_routing(&FinalizeArgs::new(&permuted, &it, DropPadMode::DropLessRow).with_scales(&probs)).unwrap();
    assert!(bits(&u) == bits(&f));
}

#[test]
fn bad_unpermute_input_is_named() {
    let mut rng = Rng::new(10);
    let p = random(&mut rng, &[6, 4], DType::F32);
    let idx = i32_tensor(&[0, 1, 2, 3, 4, 5], &[6]);
    let probs = random(&mut rng, &[2, 4], DType::F32);
    expect_err(moe_token_unpermute(&p, &idx, Some(&probs)), "sorted_indices", &["[8]", "[6]"]);
    let probs = random(&mut rng, &[3, 2], DType::BF16);
    expect_err(moe_token_unpermute(&p, &idx, Some(&probs)), "probs", &["bf16", "f32"]);
    let flat = random(&mut rng, &[6], DType::F32);
    expect_err(moe_token_unpermute(&flat, &idx, None), "permuted", &["[6]"]);
    let bad_idx = i32_tensor(&[0; 6], &[3, 2]);
    expect_err(moe_token_unpermute(&p, &bad_idx, None), "sorted_indices", &["1-D", "[3, 2]"]);
}

#[test]
fn overflowing_shapes_are_errors_naming_the_argument_not_panics() {
    let mut rng = Rng::new(77);
    let idx_shape = [0usize];
    let idx = TensorMeta { shape: &idx_shape, dtype: DType::I32 };
    for case in 0..200 {
        // Dims of at least 2^32: any two of them overflow usize.
        let ndims = 2 + rng.below(3);
        let mut dims: Vec<usize> = (0..ndims).map(|_| (1usize << 32) + rng.below(1 << 40)).collect();
        let mode = rng.below(4) as i64;
        let dtype = [DType::F32, DType::F16, DType::BF16][rng.below(3)];
        let drop_pad = mode == 1 || mode == 3;
        let mut shape = vec![0usize];
        if drop_pad && rng.below(2) == 0 {
            // E * C overflows with H = 1.
            shape = vec![dims[0], dims[1]];
            dims = vec![1];
        } else if drop_pad {
            shape.push(1);
        }
        shape.extend_from_slice(&dims);
        let meta = FinalizeMeta {
            expanded_x: TensorMeta { shape: &shape, dtype },
            expanded_row_idx: idx,
            x1: None,
            x2: None,
            bias: None,
            scales: None,
            expert_idx: None,
            drop_pad_mode: mode,
        };
        let res = std::panic::catch_unwind(|| moe_finalize_routing_shape(&meta))
            .unwrap_or_else(|_| panic!("case {case}: finalize shape {shape:?} mode {mode} panicked"));
        expect_err(res, "expanded_x", &[&format!("{shape:?}")]);

        let mut permuted = vec![0usize];
        permuted.extend_from_slice(&shape[1..]);
        permuted.push(1 << 40);
        let res =
            std::panic::catch_unwind(|| moe_token_unpermute_shape(TensorMeta { shape: &permuted, dtype }, idx, None))
                .unwrap_or_else(|_| panic!("case {case}: unpermute shape {permuted:?} panicked"));
        expect_err(res, "permuted", &[&format!("{permuted:?}")]);

        // The tensor constructors refuse the same shapes.
        let e = Tensor::try_zeros_cpu(&permuted, dtype).expect_err("overflowing zeros");
        assert!(e.to_string().contains("`shape`"), "{e}");
        let e = Tensor::from_slice::<f32>(&[], &permuted).expect_err("overflowing from_slice");
        assert!(e.to_string().contains("`shape`"), "{e}");
    }
}

/// The backend trait's finalize routing and token unpermute, one body per
/// test for every backend (`backend_test!`), the finalize cases from the
/// shared case generator (`moe_common::finalize`).
mod every_backend {
    use crate::backend_test;
    use crate::common::values;
    use crate::moe_common::assert_within_rounding;
    use crate::moe_common::finalize::{expect_close, golden_matrix, host_inputs, reference, run, Case, MODES};
    use ascend_moe::backend::{DropPadMode, FinalizeArgs, FinalizeDims, OutputRows};
    use ascend_moe::{DType, Device, Element, Error, Tensor};

    /// `n` 7, `k` 3, `h` 16, 4 experts, every optional input, scales of the data's dtype.
    fn full_case(mode: DropPadMode, dtype: DType) -> Case {
        Case { n: 7, k: 3, h: 16, e: 4, mode, dtype, scales: Some(dtype), x1: true, x2: true, bias: true }
    }

    backend_test!(finalize_matches_the_formula_in_every_mode, |dev| {
        for mode in MODES {
            for dtype in [DType::F32, DType::BF16] {
                let c = full_case(mode, dtype);
                let hi = host_inputs(&c)?;
                let (want, mag) = reference(&c, &hi, OutputRows::Dense);
                let got = run(dev, &c, &hi, OutputRows::Dense)?;
                expect_close(&format!("{dtype} mode {mode:?}"), dtype, &got, &want, &mag);
            }
        }
        Ok(())
    });

    backend_test!(finalize_into_padded_slots_zeroes_the_padding, |dev| {
        let c = Case { n: 6, k: 2, h: 8, e: 3, ..full_case(DropPadMode::DropLessRow, DType::F32) };
        let hi = host_inputs(&c)?;
        let rows = OutputRows::Padded { local_sizes: &[2, 0, 3, 1], slot_rows: 3 };
        let (want, mag) = reference(&c, &hi, rows);
        expect_close("padded", DType::F32, &run(dev, &c, &hi, rows)?, &want, &mag);
        Ok(())
    });

    backend_test!(finalize_golden_matrix_is_within_rounding_of_the_formula, |dev| {
        // aclnnMoeFinalizeRoutingV2 takes K from the scales' shape: without
        // scales it can only express K = 1.
        let aclnn = match dev {
            Device::Npu(n) => n.finalize_impl()? == "aclnn",
            Device::Cpu => false,
        };
        let mut checked = 0;
        for (c, rows) in golden_matrix() {
            if aclnn && c.scales.is_none() && c.k > 1 {
                continue;
            }
            let hi = host_inputs(&c)?;
            let (want, mag) = reference(&c, &hi, rows);
            expect_close(&format!("{c:?} {rows:?}"), c.dtype, &run(dev, &c, &hi, rows)?, &want, &mag);
            checked += 1;
        }
        // 400 runs; aclnn skips, per mode and optional-input set, the 4 runs
        // of K > 1 without scales.
        assert_eq!(checked, if aclnn { 400 - 4 * 4 * 4 } else { 400 });
        Ok(())
    });

    backend_test!(finalize_rejects_an_out_of_range_row_index, |dev| {
        let (n, k, h) = (3usize, 2usize, 4usize);
        let x = Tensor::zeros(&[n * k, h], DType::F32, dev)?;
        let idx = Tensor::from_slice(&[0i32, 1, 2, 3, 6, 5], &[n * k])?.to_device(dev)?;
        let args = FinalizeArgs::new(&x, &idx, DropPadMode::DropLessColumn);
        let dims = FinalizeDims { n: n * k, k: 1, h, expanded_rows: n * k, experts: 0 };
        let mut out = Tensor::zeros(&[n * k, h], DType::F32, dev)?;
        let result = dev.backend().finalize_routing(&args, &dims, &mut out, OutputRows::Dense);
        let err = match dev {
            // Where the native kernel launches, it finds the index on the device
            // (for aclnn too, into checked copies): the op queues the work and
            // the stream's check reports it (once).
            Device::Npu(n) if n.checks_indices_on_device() => {
                result.expect("queued");
                let err = n.check().expect_err("index 6 of 6 rows");
                n.check().expect("reported once");
                err
            }
            _ => result.expect_err("index 6 of 6 rows"),
        };
        match err {
            Error::IndexOutOfRange { arg, position, value, .. } => {
                assert_eq!((arg, position, value), ("expanded_row_idx", 4, 6));
            }
            other => panic!("expected IndexOutOfRange, got {other:?}"),
        }
        Ok(())
    });

    backend_test!(token_unpermute_weights_rows_and_skips_bad_indices, |dev| {
        let (t, k, h, rows) = (5usize, 2usize, 6usize, 10usize);
        let permuted = values(21, rows * h);
        let probs = values(22, t * k);
        let mut idx: Vec<i32> = (0..t * k).map(|s| ((s * 3 + 1) % rows) as i32).collect();
        idx[3] = rows as i32; // outside [0, rows): contributes nothing
        idx[6] = -1;
        let (mut want, mut mag) = (vec![0f64; t * h], vec![0f64; t * h]);
        for tok in 0..t {
            for kk in 0..k {
                let r = idx[tok * k + kk];
                if r < 0 || r as usize >= rows {
                    continue;
                }
                for j in 0..h {
                    let term = probs[tok * k + kk] as f64 * permuted[r as usize * h + j] as f64;
                    want[tok * h + j] += term;
                    mag[tok * h + j] += term.abs();
                }
            }
        }
        let p = Tensor::from_slice(&permuted, &[rows, h])?.to_device(dev)?;
        let s = Tensor::from_slice(&idx, &[t * k])?.to_device(dev)?;
        let w = Tensor::from_slice(&probs, &[t, k])?.to_device(dev)?;
        let mut out = Tensor::zeros(&[t, h], DType::F32, dev)?;
        dev.backend().token_unpermute(&p, &s, Some(&w), k, &mut out)?;
        let got: Vec<f64> = out.to_vec::<f32>()?.iter().map(|v| v.to_f64()).collect();
        assert_within_rounding("unpermute", DType::F32, &got, &want, &mag);
        Ok(())
    });
}
