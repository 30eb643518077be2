//! Edge cases of SPEC.md sections 1, 2, 3, 4 and 6 on the CPU backend, bit
//! for bit. Every expected value is either written out by hand or computed by
//! the small references of the SPEC text below (`spec_finalize`, the rank-order
//! sums), never taken from an op's output.

mod moe_common;

use std::time::Duration;

use ascend_moe::backend::{FinalizeArgs, OutputRows};
use ascend_moe::half::{bf16, f16};
use ascend_moe::moe::finalize::{moe_finalize_routing, moe_finalize_routing_output_shape, moe_token_unpermute};
use ascend_moe::moe::layout::SpLayout;
use ascend_moe::moe::pad_reduce::{finalize_and_reduce, maybe_all_gather_and_maybe_unpad, maybe_pad_and_reduce};
use ascend_moe::moe::prepare_finalize::{combine, dispatch, finalize, prepare, MoeContext, MoeGroups};
use ascend_moe::ranks::run_ranks;
use ascend_moe::{CommOptions, CommType, DType, Device, DropPadMode, Error, Tensor};
use moe_common::{bits, from_f32, i32_tensor, Rng};

const MODES: [DropPadMode; 4] =
    [DropPadMode::DropLessColumn, DropPadMode::DropPadColumn, DropPadMode::DropLessRow, DropPadMode::DropPadRow];

fn opts() -> CommOptions {
    CommOptions::with_timeout(Duration::from_secs(30))
}

/// `v` as a tensor of `dtype` holds it: rounded to nearest even, widened back.
fn held(v: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => v.to_vec(),
        DType::F16 => v.iter().map(|x| f16::from_f32(*x).to_f32()).collect(),
        DType::BF16 => v.iter().map(|x| bf16::from_f32(*x).to_f32()).collect(),
        other => panic!("no float values of {other}"),
    }
}

/// The bytes of `acc` rounded once, to nearest even, to `dtype`.
fn rounded(acc: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => acc.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        DType::F16 => acc.iter().flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes()).collect(),
        DType::BF16 => acc.iter().flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes()).collect(),
        other => panic!("no float values of {other}"),
    }
}

/// Asserts the bytes of `got` equal `want`, naming the first differing element.
fn assert_bytes(what: &str, got: &Tensor, want: &[u8]) {
    let g = bits(got);
    let size = got.dtype().size();
    assert_eq!(g.len(), want.len(), "{what}: {} bytes, want {}", g.len(), want.len());
    if let Some(e) = (0..g.len() / size).find(|e| g[e * size..(e + 1) * size] != want[e * size..(e + 1) * size]) {
        panic!(
            "{what}: element {e} is {:02x?}, want {:02x?}",
            &g[e * size..(e + 1) * size],
            &want[e * size..(e + 1) * size]
        );
    }
}

/// One finalize call as host values (already held by their dtypes).
#[derive(Clone)]
struct Fin {
    mode: DropPadMode,
    dtype: DType,
    n: usize,
    k: usize,
    h: usize,
    /// `[N*K, H]` in modes 0/2, `[E, C, H]` in modes 1/3.
    x_shape: Vec<usize>,
    x: Vec<f32>,
    idx: Vec<i32>,
    x1: Option<Vec<f32>>,
    x2: Option<Vec<f32>>,
    /// `[E, H]` and `expert_idx [N, K]`.
    bias: Option<(Vec<f32>, Vec<i32>)>,
    /// `[N, K]` and their dtype.
    scales: Option<(Vec<f32>, DType)>,
}

/// The tensors of a [`Fin`].
struct FinTensors {
    x: Tensor,
    idx: Tensor,
    x1: Option<Tensor>,
    x2: Option<Tensor>,
    bias: Option<Tensor>,
    expert: Option<Tensor>,
    scales: Option<Tensor>,
}

impl FinTensors {
    fn args(&self, mode: DropPadMode) -> FinalizeArgs<&Tensor> {
        FinalizeArgs::new(&self.x, &self.idx, mode)
            .with_x1(self.x1.as_ref())
            .with_x2(self.x2.as_ref())
            .with_bias(self.bias.as_ref())
            .with_expert_idx(self.expert.as_ref())
            .with_scales(self.scales.as_ref())
    }
}

impl Fin {
    /// Drop-less (mode 0/2) or drop-pad (`[e, c, h]`, mode 1/3) call without
    /// optional inputs; values are rounded to `dtype`.
    fn new(mode: DropPadMode, dtype: DType, n: usize, k: usize, h: usize, x_shape: &[usize], x: &[f32]) -> Fin {
        assert_eq!(x_shape.iter().product::<usize>(), x.len());
        Fin {
            mode,
            dtype,
            n,
            k,
            h,
            x_shape: x_shape.to_vec(),
            x: held(x, dtype),
            idx: Vec::new(),
            x1: None,
            x2: None,
            bias: None,
            scales: None,
        }
    }
    fn idx(mut self, idx: &[i32]) -> Fin {
        self.idx = idx.to_vec();
        self
    }
    fn x1(mut self, v: &[f32]) -> Fin {
        self.x1 = Some(held(v, self.dtype));
        self
    }
    fn x2(mut self, v: &[f32]) -> Fin {
        self.x2 = Some(held(v, self.dtype));
        self
    }
    fn bias(mut self, b: &[f32], experts: &[i32]) -> Fin {
        self.bias = Some((held(b, self.dtype), experts.to_vec()));
        self
    }
    fn scales(mut self, s: &[f32], dtype: DType) -> Fin {
        self.scales = Some((held(s, dtype), dtype));
        self
    }

    fn tensors(&self) -> FinTensors {
        let (n, k, h) = (self.n, self.k, self.h);
        FinTensors {
            x: from_f32(&self.x, &self.x_shape, self.dtype),
            idx: i32_tensor(&self.idx, &[self.idx.len()]),
            x1: self.x1.as_ref().map(|v| from_f32(v, &[n, h], self.dtype)),
            x2: self.x2.as_ref().map(|v| from_f32(v, &[n, h], self.dtype)),
            bias: self.bias.as_ref().map(|(b, _)| from_f32(b, &[b.len() / h.max(1), h], self.dtype)),
            expert: self.bias.as_ref().map(|(_, e)| i32_tensor(e, &[n, k])),
            scales: self.scales.as_ref().map(|(s, d)| from_f32(s, &[n, k], *d)),
        }
    }

    fn run(&self) -> Result<Tensor, Error> {
        moe_finalize_routing(&self.tensors().args(self.mode))
    }

    /// SPEC section 1 in f32: `acc = x1 (+ x2)`, then for k = 0..K-1
    /// `acc += s * (row(R(i, k)) + bias[expert_idx[i, k]])` (a dropped slot's
    /// row is zeros, a missing bias adds nothing), before the one rounding.
    fn spec(&self) -> Vec<f32> {
        let (n, k, h) = (self.n, self.k, self.h);
        let row_layout = matches!(self.mode, DropPadMode::DropLessRow | DropPadMode::DropPadRow);
        let mut out = vec![0f32; n * h];
        for i in 0..n {
            for j in 0..h {
                let mut acc = match (&self.x1, &self.x2) {
                    (Some(a), Some(b)) => a[i * h + j] + b[i * h + j],
                    (Some(a), None) | (None, Some(a)) => a[i * h + j],
                    (None, None) => 0.0,
                };
                for kk in 0..k {
                    let r = self.idx[if row_layout { i * k + kk } else { kk * n + i }];
                    let row = if r < 0 { 0.0 } else { self.x[r as usize * h + j] };
                    let s = self.scales.as_ref().map_or(1.0, |(s, _)| s[i * k + kk]);
                    acc += match &self.bias {
                        Some((b, e)) => s * (row + b[e[i * k + kk] as usize * h + j]),
                        None => s * row,
                    };
                }
                out[i * h + j] = acc;
            }
        }
        out
    }

    /// Runs the op and asserts its bytes are [`Fin::spec`] rounded once.
    fn check(&self, what: &str) {
        let out = self.run().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(out.shape(), &[self.n, self.h], "{what}: shape");
        assert_bytes(what, &out, &rounded(&self.spec(), self.dtype));
    }
}

fn expect_index_error(what: &str, res: Result<Tensor, Error>, position: usize, value: i64) {
    match res {
        Err(Error::IndexOutOfRange { arg, position: p, value: v, .. }) => {
            assert_eq!((arg, p, v), ("expanded_row_idx", position, value), "{what}")
        }
        other => panic!("{what}: expected expanded_row_idx[{position}] = {value} refused, got {other:?}"),
    }
}

const TWO_24: f32 = 16_777_216.0;

#[test]
fn accumulation_is_x1_plus_x2_then_each_slot_in_order_in_f32() {
    // acc = 2^24; + 1 rounds back to 2^24; - 2^24 gives 0. Slots in the other
    // order would give 1.
    let base = Fin::new(DropPadMode::DropLessRow, DType::F32, 1, 2, 1, &[2, 1], &[1.0, -TWO_24])
        .x1(&[TWO_24])
        .scales(&[1.0, 1.0], DType::F32);
    base.clone().idx(&[0, 1]).check("x1 then slot 0 then slot 1");
    assert_eq!(base.clone().idx(&[0, 1]).spec(), vec![0.0]);
    assert_eq!(base.clone().idx(&[1, 0]).spec(), vec![1.0]);
    base.idx(&[1, 0]).check("x1 then slot 0 (row 1) then slot 1 (row 0)");

    // s * (row + bias) with one rounding of the sum first: 3 * (1 + 2^-24)
    // = 3 * 1; s * row + s * bias would round to 3 + 2^-22.
    let f = Fin::new(DropPadMode::DropLessRow, DType::F32, 1, 1, 1, &[1, 1], &[1.0])
        .idx(&[0])
        .bias(&[f32::powi(2.0, -24)], &[0])
        .scales(&[3.0], DType::F32);
    assert_eq!(f.spec(), vec![3.0]);
    f.check("s * (row + bias)");

    // x1 + x2 first: (2^24 + 1) + 1 = 2^24; the slot before x2 would give 2^24 + 2.
    let f =
        Fin::new(DropPadMode::DropLessColumn, DType::F32, 1, 1, 1, &[1, 1], &[1.0]).idx(&[0]).x1(&[TWO_24]).x2(&[1.0]);
    assert_eq!(f.spec(), vec![TWO_24]);
    f.check("x1 + x2 before the slots");
}

#[test]
fn row_index_is_read_by_column_in_modes_0_1_and_by_row_in_modes_2_3() {
    // Rows 10, 20, ..., 60; N = 2, K = 3; scales powers of two (exact sums).
    let rows = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0];
    let idx = [5, 0, 3, 1, 4, 2];
    let scales = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0];
    for mode in MODES {
        let shape: &[usize] = if mode.is_drop_pad() { &[2, 3, 1] } else { &[6, 1] };
        // Column layout: R(i, k) = idx[k * N + i]: token 0 takes rows 5, 3, 4,
        // token 1 rows 0, 1, 2. Row layout: R(i, k) = idx[i * K + k]: token 0
        // takes rows 5, 0, 3, token 1 rows 1, 4, 2.
        let want: [f32; 2] = if mode.is_row_layout() {
            [60.0 + 2.0 * 10.0 + 4.0 * 40.0, 8.0 * 20.0 + 16.0 * 50.0 + 32.0 * 30.0]
        } else {
            [60.0 + 2.0 * 40.0 + 4.0 * 50.0, 8.0 * 10.0 + 16.0 * 20.0 + 32.0 * 30.0]
        };
        for dtype in DType::FLOATS {
            let f = Fin::new(mode, dtype, 2, 3, 1, shape, &rows).idx(&idx).scales(&scales, DType::F32);
            let out = f.run().unwrap();
            assert_bytes(&format!("mode {} {dtype}", mode as u32), &out, &rounded(&want, dtype));
        }
    }
}

/// One 16-bit rounding case: `x1 + sum_k s_k * row_k` for one token, every
/// element of a row of `H` the same value.
struct Round {
    dtype: DType,
    x1: f32,
    rows: &'static [f32],
    scales: &'static [f32],
    want: u16,
}

#[test]
fn sixteen_bit_results_are_rounded_once_to_nearest_even_on_every_path() {
    let cases = [
        // 1 + 3 * 2^-9 in f32 -> 1 + 2^-7; rounding after each slot would stay at 1.
        Round { dtype: DType::BF16, x1: 1.0, rows: &[0.001_953_125; 3], scales: &[1.0; 3], want: 0x3f81 },
        // 1 + 2^-8: a tie, to the even 1.0.
        Round { dtype: DType::BF16, x1: 1.0, rows: &[0.003_906_25], scales: &[1.0], want: 0x3f80 },
        // 1 + 2^-7 + 2^-8: a tie, to the even 1 + 2^-6.
        Round { dtype: DType::BF16, x1: 1.007_812_5, rows: &[0.003_906_25], scales: &[1.0], want: 0x3f82 },
        // f16: 65504 + 16 = 65520 is the tie above the largest finite: infinity.
        Round { dtype: DType::F16, x1: 65504.0, rows: &[16.0], scales: &[1.0], want: 0x7c00 },
        // 65504 + 15 stays finite.
        Round { dtype: DType::F16, x1: 65504.0, rows: &[15.0], scales: &[1.0], want: 0x7bff },
        // Subnormals: 0.5 * 2^-24 ties to 0, 0.75 * 2^-24 rounds to 2^-24,
        // 1.5 * 2^-24 ties to 2 * 2^-24.
        Round { dtype: DType::F16, x1: 0.0, rows: &[5.960_464_5e-8], scales: &[0.5], want: 0x0000 },
        Round { dtype: DType::F16, x1: 0.0, rows: &[5.960_464_5e-8], scales: &[0.75], want: 0x0001 },
        Round { dtype: DType::F16, x1: 0.0, rows: &[5.960_464_5e-8], scales: &[1.5], want: 0x0002 },
        // Two slots of 2^-24 * 0.5 each: one rounding of their f32 sum gives 2^-24.
        Round { dtype: DType::F16, x1: 0.0, rows: &[5.960_464_5e-8; 2], scales: &[0.5; 2], want: 0x0001 },
    ];
    // H = 19: a vector body and a tail.
    let h = 19;
    assert_eq!(f16::from_f32(5.960_464_5e-8).to_bits(), 1);
    for (ci, c) in cases.iter().enumerate() {
        let k = c.rows.len();
        let x: Vec<f32> = c.rows.iter().flat_map(|r| vec![*r; h]).collect();
        let base = Fin::new(DropPadMode::DropLessRow, c.dtype, 1, k, h, &[k, h], &x)
            .idx(&(0..k as i32).collect::<Vec<_>>())
            .scales(c.scales, DType::F32);
        let want: Vec<u8> = (0..h).flat_map(|_| c.want.to_le_bytes()).collect();
        // One skip input and no bias; both skip inputs; a zero bias; x2 only;
        // the column layout.
        let variants = [
            ("x1", base.clone().x1(&vec![c.x1; h])),
            ("x1 + x2", base.clone().x1(&vec![c.x1; h]).x2(&vec![0.0; h])),
            ("x1 + zero bias", base.clone().x1(&vec![c.x1; h]).bias(&vec![0.0; h], &vec![0; k])),
            ("x2", base.clone().x2(&vec![c.x1; h])),
            ("column layout", Fin { mode: DropPadMode::DropLessColumn, ..base.clone().x1(&vec![c.x1; h]) }),
        ];
        for (name, f) in variants {
            assert_eq!(rounded(&f.spec(), c.dtype), want, "case {ci} {name}: the reference itself");
            assert_bytes(&format!("case {ci} {} {name}", c.dtype), &f.run().unwrap(), &want);
        }
    }
}

#[test]
fn negative_zero_and_f32_scales_follow_the_formula() {
    // f32: x1 = -0. A zero scale still adds +0 (-0 + +0 = +0); a scale of -0
    // adds -0 (the sum stays -0); a negative scale negates.
    let one = |x1: f32, row: f32, s: f32| {
        Fin::new(DropPadMode::DropLessRow, DType::F32, 1, 1, 1, &[1, 1], &[row])
            .idx(&[0])
            .x1(&[x1])
            .scales(&[s], DType::F32)
            .run()
            .unwrap()
            .to_vec::<f32>()
            .unwrap()[0]
    };
    assert_eq!(one(-0.0, 5.0, 0.0).to_bits(), 0x0000_0000, "zero scale");
    assert_eq!(one(-0.0, 5.0, -0.0).to_bits(), 0x8000_0000, "negative zero scale");
    assert_eq!(one(0.25, 2.0, -1.5), -2.75, "negative scale");
    assert!(one(1.0, f32::INFINITY, 0.0).is_nan(), "0 * inf is NaN, not a skipped slot");

    // 16-bit data with f32 scales: the scale is used at f32 precision.
    // -1 + (1 + 2^-9) * 1 = 2^-9 in bf16 (a bf16 scale would round to 1, giving 0).
    let s = 1.0 + 1.0 / 512.0;
    for (dtype, want) in [(DType::BF16, 0x3b00u16), (DType::F16, 0x1800)] {
        for layout in [DropPadMode::DropLessRow, DropPadMode::DropPadColumn] {
            let shape: &[usize] = if layout.is_drop_pad() { &[1, 2, 3] } else { &[2, 3] };
            let f = Fin::new(layout, dtype, 1, 2, 3, shape, &[1.0, 1.0, 1.0, 9.0, 9.0, 9.0])
                .idx(&[0, 1])
                .x1(&[-1.0; 3])
                .scales(&[s, 0.0], DType::F32);
            let got: Vec<u16> = match dtype {
                DType::BF16 => f.run().unwrap().to_vec::<bf16>().unwrap().iter().map(|v| v.to_bits()).collect(),
                _ => f.run().unwrap().to_vec::<f16>().unwrap().iter().map(|v| v.to_bits()).collect(),
            };
            assert_eq!(got, vec![want; 3], "{dtype} mode {}", layout as u32);
            f.check(&format!("{dtype} f32 scales mode {}", layout as u32));
        }
    }

    // Scales of the data's dtype, negative, with bias: every dtype.
    for dtype in DType::FLOATS {
        let f = Fin::new(DropPadMode::DropPadRow, dtype, 2, 2, 2, &[2, 1, 2], &[3.0, -4.0, 0.5, 6.0])
            .idx(&[0, 1, 1, -1])
            .x1(&[1.0, 2.0, -3.0, 4.0])
            .bias(&[0.25, -0.5, 2.0, 1.0], &[1, 0, 0, 1])
            .scales(&[-0.5, -2.0, 0.0, -1.0], dtype);
        // token 0: [1, 2] - 0.5 * ([3, -4] + [2, 1]) - 2 * ([0.5, 6] + [0.25, -0.5])
        //        = [1 - 2.5 - 1.5, 2 + 1.5 - 11] = [-3, -7.5]
        // token 1: [-3, 4] + 0 * (...) - 1 * ([0, 0] + [2, 1]) = [-5, 3]
        let want = [-3.0, -7.5, -5.0, 3.0];
        assert_eq!(f.spec(), want);
        assert_bytes(&format!("{dtype} negative scales"), &f.run().unwrap(), &rounded(&want, dtype));
    }
}

#[test]
fn dropped_slots_add_scaled_bias_and_unreferenced_rows_never_contribute() {
    let nan = f32::NAN;
    // [E = 2, C = 2, H = 2]; rows 1 and 3 are in no slot and hold NaN.
    let x = [1.0, 2.0, nan, nan, 4.0, 8.0, nan, nan];
    let bias = [100.0, 200.0, 1000.0, 2000.0];
    // token 0: slot 0 -> row 0 (expert 0), slot 1 dropped (expert 1);
    // token 1: slot 0 -> row 2 (expert 1), slot 1 dropped (expert 0).
    let experts = [0, 1, 1, 0];
    let scales = [2.0, -1.0, 0.5, 3.0];
    let x1 = [0.25, 0.5, 0.75, 1.0];
    // token 0: x1 + 2 * (row 0 + bias 0) - 1 * (0 + bias 1)
    // token 1: x1 + 0.5 * (row 2 + bias 1) + 3 * (0 + bias 0)
    let want = [0.25 + 202.0 - 1000.0, 0.5 + 404.0 - 2000.0, 0.75 + 502.0 + 300.0, 1.0 + 1004.0 + 600.0];
    for (mode, idx) in [(DropPadMode::DropPadColumn, [0, 2, -1, -1]), (DropPadMode::DropPadRow, [0, -1, 2, -1])] {
        let f = Fin::new(mode, DType::F32, 2, 2, 2, &[2, 2, 2], &x)
            .idx(&idx)
            .x1(&x1)
            .bias(&bias, &experts)
            .scales(&scales, DType::F32);
        assert_bytes(&format!("mode {}", mode as u32), &f.run().unwrap(), &rounded(&want, DType::F32));
    }

    // Every slot dropped, no bias, no skip inputs: +0 (0 + s * 0), whatever the
    // scales' signs, in every dtype.
    for dtype in DType::FLOATS {
        let f = Fin::new(DropPadMode::DropPadRow, dtype, 2, 2, 3, &[1, 1, 3], &[nan; 3])
            .idx(&[-1, -1, -1, -1])
            .scales(&[-2.0, 3.0, -0.0, -1.0], DType::F32);
        assert_bytes(&format!("{dtype} all dropped"), &f.run().unwrap(), &vec![0u8; 6 * dtype.size()]);
    }

    // Padded EP output: rows of no token are +0, written over NaN.
    let local_sizes = [0usize, 2, 0, 1];
    let slot_rows = 3;
    let f = Fin::new(DropPadMode::DropLessRow, DType::BF16, 3, 1, 2, &[3, 2], &[1.0, 1.5, 2.0, 2.5, 3.0, 3.5])
        .idx(&[2, 0, 1]);
    let t = f.tensors();
    let args = t.args(f.mode);
    let (_, dims) = moe_finalize_routing_output_shape(&args).unwrap();
    let mut out = from_f32(&[nan; 24], &[12, 2], DType::BF16);
    Device::Cpu
        .backend()
        .finalize_routing(&args, &dims, &mut out, OutputRows::Padded { local_sizes: &local_sizes, slot_rows })
        .unwrap();
    // Slot 1 holds tokens 0 and 1 (rows 2 and 0 of x), slot 3 token 2 (row 1).
    let mut want = [0.0f32; 24];
    want[6..10].copy_from_slice(&[3.0, 3.5, 1.0, 1.5]);
    want[18..20].copy_from_slice(&[2.0, 2.5]);
    assert_bytes("padded EP output", &out, &rounded(&want, DType::BF16));
}

#[test]
fn index_range_boundaries_per_mode() {
    // N = 2, K = 2, H = 1; drop-pad [E = 2, C = 3]: 6 rows, drop-less 4 rows.
    for mode in MODES {
        let rows: i32 = if mode.is_drop_pad() { 6 } else { 4 };
        let shape: &[usize] = if mode.is_drop_pad() { &[2, 3, 1] } else { &[4, 1] };
        let x: Vec<f32> = (1..=rows).map(|v| v as f32).collect();
        let base = Fin::new(mode, DType::F32, 2, 2, 1, shape, &x).scales(&[1.0, 10.0, 100.0, 1000.0], DType::F32);
        let what = format!("mode {}", mode as u32);
        // The last row is valid: row `rows - 1` holds `rows`.
        let f = base.clone().idx(&[0, 1, rows - 1, 2]);
        f.check(&format!("{what}: last row"));
        // One past the last row is refused at its position.
        expect_index_error(&what, base.clone().idx(&[0, 1, rows, 2]).run(), 2, rows as i64);
        if mode.is_drop_pad() {
            // -1 is a dropped slot; -2 is out of range.
            let f = base.clone().idx(&[0, -1, -1, 2]);
            f.check(&format!("{what}: -1 dropped"));
            expect_index_error(&what, base.clone().idx(&[0, 1, 2, -2]).run(), 3, -2);
        } else {
            expect_index_error(&what, base.clone().idx(&[0, -1, 1, 2]).run(), 1, -1);
        }
    }
    // Unpermute: an index outside [0, rows) contributes nothing, at either end.
    let permuted = Tensor::from_slice(&[1.0f32, 2.0, 4.0], &[3, 1]).unwrap();
    let idx = i32_tensor(&[2, 3, -1, 0, 1, i32::MAX], &[6]);
    let probs = Tensor::from_slice(&[1.0f32, 5.0, 7.0, 0.5, 0.25, 9.0], &[3, 2]).unwrap();
    let out = moe_token_unpermute(&permuted, &idx, Some(&probs)).unwrap();
    // token 0: 1 * 4; token 1: 0.5 * 1; token 2: 0.25 * 2.
    assert_bytes("unpermute bounds", &out, &rounded(&[4.0, 0.5, 0.5], DType::F32));
}

#[test]
fn zero_tokens_zero_hidden_and_zero_capacity() {
    for mode in MODES {
        let what = format!("mode {}", mode as u32);
        // N = 0 with K = 3: an empty output of the right shape.
        let shape: &[usize] = if mode.is_drop_pad() { &[2, 4, 5] } else { &[0, 5] };
        let n = shape.iter().product::<usize>();
        let f = Fin::new(mode, DType::BF16, 0, 3, 5, shape, &vec![1.0; n]).x1(&[]).scales(&[], DType::F32);
        let out = f.run().unwrap();
        assert_eq!(out.shape(), &[0, 5], "{what}: N = 0");

        // H = 0: an empty [N, 0] output; a bad index is still refused.
        let shape: &[usize] = if mode.is_drop_pad() { &[2, 3, 0] } else { &[6, 0] };
        let f = Fin::new(mode, DType::F16, 3, 2, 0, shape, &[]).scales(&[1.0; 6], DType::F32);
        let out = f.clone().idx(&[0, 1, 2, 3, 4, 5]).run().unwrap();
        assert_eq!(out.shape(), &[3, 0], "{what}: H = 0");
        expect_index_error(&format!("{what}, H = 0"), f.idx(&[0, 1, 2, 3, 4, 6]).run(), 5, 6);
    }
    // Drop-pad with no capacity (C = 0): every slot is dropped and only the
    // scaled bias is left: 0.5 * bias[1] + 2 * bias[0].
    for mode in [DropPadMode::DropPadColumn, DropPadMode::DropPadRow] {
        let f = Fin::new(mode, DType::F32, 1, 2, 4, &[2, 0, 4], &[])
            .idx(&[-1, -1])
            .bias(&[1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0, 40.0], &[1, 0])
            .scales(&[0.5, 2.0], DType::F32);
        assert_bytes(
            &format!("C = 0 mode {}", mode as u32),
            &f.run().unwrap(),
            &rounded(&[7.0, 14.0, 21.0, 28.0], DType::F32),
        );
        expect_index_error("C = 0", f.clone().idx(&[-1, 0]).run(), 1, 0);
    }
    // Unpermute of no rows: every index is out of range, the tokens are zeros.
    let permuted = Tensor::from_slice::<f32>(&[], &[0, 3]).unwrap();
    let out = moe_token_unpermute(&permuted, &i32_tensor(&[0, -1], &[2]), None).unwrap();
    assert_bytes("unpermute of no rows", &out, &[0u8; 24]);
}

/// Values of full f32 precision spread over 2^-6 .. 2^6, so the bits of a sum
/// depend on the order it is taken in.
fn spread(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.unit() * f32::powi(2.0, rng.below(13) as i32 - 6)).collect()
}

#[test]
fn k_of_1_and_large_k_match_the_formula_bitwise() {
    let mut rng = Rng::new(0x5bec);
    let (n, h, e) = (5, 19, 4);
    let mut checked = 0;
    for mode in MODES {
        for dtype in DType::FLOATS {
            for k in [1usize, 9, 33] {
                // (x1, x2, bias, scales): K > 1 needs scales.
                let options: [(bool, bool, bool, Option<DType>); 4] = [
                    (false, false, false, (k > 1).then_some(DType::F32)),
                    (true, false, false, Some(dtype)),
                    (true, true, true, Some(DType::F32)),
                    (false, true, true, Some(dtype)),
                ];
                for (x1, x2, bias, scales) in options {
                    let (rows, shape) = if mode.is_drop_pad() {
                        let c = n * k / e + 1;
                        (e * c, vec![e, c, h])
                    } else {
                        (n * k, vec![n * k, h])
                    };
                    let idx: Vec<i32> = if mode.is_drop_pad() {
                        (0..n * k).map(|_| if rng.below(5) == 0 { -1 } else { rng.below(rows) as i32 }).collect()
                    } else {
                        let mut p: Vec<i32> = (0..rows as i32).collect();
                        rng.shuffle(&mut p);
                        p
                    };
                    let mut f = Fin::new(mode, dtype, n, k, h, &shape, &spread(&mut rng, rows * h)).idx(&idx);
                    if x1 {
                        f = f.x1(&spread(&mut rng, n * h));
                    }
                    if x2 {
                        f = f.x2(&spread(&mut rng, n * h));
                    }
                    if bias {
                        let experts: Vec<i32> = (0..n * k).map(|_| rng.below(e) as i32).collect();
                        f = f.bias(&spread(&mut rng, e * h), &experts);
                    }
                    if let Some(d) = scales {
                        let s: Vec<f32> = (0..n * k).map(|_| rng.unit() * 2.0).collect();
                        f = f.scales(&s, d);
                    }
                    f.check(&format!(
                        "mode {} {dtype} K {k} x1 {x1} x2 {x2} bias {bias} scales {scales:?}",
                        mode as u32
                    ));
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 4 * 3 * 3 * 4);
}

/// Rows of `[rows, h]` f32 values of EP rank `r`, rounded to bf16.
fn shard(seed: u64, r: usize, rows: usize, h: usize) -> Vec<bf16> {
    let mut rng = Rng::new(seed * 101 + r as u64);
    spread(&mut rng, rows * h).into_iter().map(bf16::from_f32).collect()
}

/// The sum over ranks in rank order 0..n-1 in f32 (the first rank's value
/// loaded, the others added), rounded once: SPEC section 8 on the CPU.
fn rank_order_sum(parts: &[Vec<bf16>], e: usize) -> bf16 {
    let mut acc = parts[0][e].to_f32();
    for p in &parts[1..] {
        acc += p[e].to_f32();
    }
    bf16::from_f32(acc)
}

fn bf16_bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn gather_unpad_and_pad_reduce_are_inverse_layouts_over_uneven_and_empty_dp_ranks() {
    // Section 2: local_sizes[d * TP + t] = ceil(T_d / TP), written out.
    let cases: [(&[usize], usize, &[usize]); 3] =
        [(&[5, 0, 2], 2, &[3, 3, 0, 0, 1, 1]), (&[0, 0], 2, &[0, 0, 0, 0]), (&[0, 3, 0, 1], 1, &[0, 3, 0, 1])];
    for (ci, (dp_tokens, tp, sizes)) in cases.iter().enumerate() {
        let l = SpLayout::from_dp_tokens(dp_tokens, *tp).unwrap();
        assert_eq!(l.local_sizes(), *sizes, "case {ci}");
        let ep = sizes.len();
        let total: usize = sizes.iter().sum();
        for h in [3usize, 0] {
            let seed = 10 * ci as u64 + h as u64;
            // Rank q's partial of the gathered rows: gathered * scale(q), in
            // f32, rounded to bf16. Ranks 0 and 1 cancel exactly when summed
            // first, as rank order does; another order loses rank 2's bits.
            let scale = |q: usize| [16_777_216.0f32, -16_777_216.0, 1.0, -0.75, 1.375, 0.5][q];
            let outs = run_ranks(ep, &opts(), |r, comm| {
                let x = Tensor::from_slice(&shard(seed, r, sizes[r], h), &[sizes[r], h])?;
                let gathered = maybe_all_gather_and_maybe_unpad(&x, Some(&l), &comm)?;
                let g = gathered.to_vec::<bf16>()?;
                let part: Vec<bf16> = g.iter().map(|v| bf16::from_f32(v.to_f32() * scale(r))).collect();
                let reduced = maybe_pad_and_reduce(&Tensor::from_slice(&part, gathered.shape())?, Some(&l), &comm)?;
                Ok((gathered.shape().to_vec(), g, reduced.shape().to_vec(), reduced.to_vec::<bf16>()?))
            })
            .unwrap();
            // Section 4: the concatenation of every rank's rows, in EP rank order.
            let all: Vec<bf16> = (0..ep).flat_map(|q| shard(seed, q, sizes[q], h)).collect();
            let parts: Vec<Vec<bf16>> =
                (0..ep).map(|q| all.iter().map(|v| bf16::from_f32(v.to_f32() * scale(q))).collect()).collect();
            let mut offset = 0;
            for (r, (gshape, g, rshape, red)) in outs.iter().enumerate() {
                let what = format!("case {ci} H {h} rank {r}");
                assert_eq!(gshape, &[total, h], "{what}: gathered shape");
                assert_eq!(bf16_bits(g), bf16_bits(&all), "{what}: gathered rows");
                // Section 3: this rank's block of the sum over ranks.
                assert_eq!(rshape, &[sizes[r], h], "{what}: reduced shape");
                let want: Vec<bf16> =
                    (offset * h..(offset + sizes[r]) * h).map(|e| rank_order_sum(&parts, e)).collect();
                assert_eq!(bf16_bits(red), bf16_bits(&want), "{what}: reduced rows");
                offset += sizes[r];
            }
        }
    }
}

/// Token `i`, element `j` of DP rank `d`'s batch.
fn tok(d: usize, i: usize, j: usize) -> f32 {
    (d * 100 + i * 10 + j) as f32 + 0.5
}

/// The routed output rank `rank` hands to finalize, element `e`.
fn routed(rank: usize, e: usize) -> f32 {
    ((rank * 31 + e * 7) % 17) as f32 * 0.375 - 2.25
}

#[test]
fn prepare_and_finalize_pad_split_and_unpad_as_section_6_says() {
    let (dp_tokens, tp, h) = ([5usize, 0, 3], 2usize, 2usize);
    let (dp, world) = (dp_tokens.len(), dp_tokens.len() * tp);
    // DP rank 0 has 4 real tokens of 5 (the fifth is graph padding).
    let actual = [4usize, 0, 3];
    // DP rank d's batch zero-padded to `rows` rows.
    let batch = |d: usize, rows: usize| -> Vec<f32> {
        (0..rows * h).map(|e| if e / h < dp_tokens[d] { tok(d, e / h, e % h) } else { 0.0 }).collect()
    };
    for sp in [false, true] {
        for comm_type in CommType::ALL {
            let what = format!("{comm_type:?} sp {sp}");
            // Rows this rank holds: ceil(T_d / TP) of the TP-padded batch with SP, else the batch.
            let local = |d: usize| if sp { dp_tokens[d].div_ceil(tp) } else { dp_tokens[d] };
            let x_of = |d: usize, t: usize| -> Vec<f32> {
                if sp {
                    batch(d, local(d) * tp)[t * local(d) * h..(t + 1) * local(d) * h].to_vec()
                } else {
                    batch(d, dp_tokens[d])
                }
            };
            let outs = run_ranks(world, &opts(), |rank, comm| {
                let (d, t) = (rank / tp, rank % tp);
                let ctx = MoeContext::new(&dp_tokens, tp, d, t, sp)?.with_num_actual_tokens(actual[d])?;
                let groups = MoeGroups::from_world(&comm, tp)?;
                let x = Tensor::from_slice(&x_of(d, t), &[local(d), h])?;
                let p = prepare(&x, comm_type, &ctx, &groups)?;
                let hidden = p.hidden.to_vec::<f32>()?;
                let y: Vec<f32> = (0..hidden.len()).map(|e| routed(rank, e)).collect();
                let out = finalize(Tensor::from_slice(&y, p.hidden.shape())?, comm_type, &ctx, &groups)?;
                Ok((p.hidden.shape().to_vec(), hidden, p.mc2_mask, y, out.shape().to_vec(), out.to_vec::<f32>()?))
            })
            .unwrap();
            let ys: Vec<&Vec<f32>> = outs.iter().map(|o| &o.3).collect();
            for (rank, (hshape, hidden, mask, _, oshape, out)) in outs.iter().enumerate() {
                let (d, t) = (rank / tp, rank % tp);
                let what = format!("{what} rank {rank}");
                // The prepared rows and which of them are real, from section 6.
                let (want_hidden, real_from): (Vec<f32>, Option<usize>) = match (comm_type, sp) {
                    (CommType::AllGather, false) => {
                        let m = *dp_tokens.iter().max().unwrap();
                        ((0..dp).flat_map(|q| batch(q, m)).collect(), None)
                    }
                    (CommType::AllGather, true) => ((0..world).flat_map(|q| x_of(q / tp, q % tp)).collect(), None),
                    (CommType::Mc2 | CommType::FusedMc2, false) => {
                        let padded = dp_tokens.iter().max().unwrap().div_ceil(tp) * tp;
                        let part = padded / tp;
                        (batch(d, padded)[t * part * h..(t + 1) * part * h].to_vec(), Some(t * part))
                    }
                    (CommType::AllToAll, false) => {
                        let padded = if dp_tokens[d] < tp { tp } else { dp_tokens[d] };
                        let size = |u: usize| padded / tp + usize::from(u < padded % tp);
                        let first: usize = (0..t).map(size).sum();
                        (batch(d, padded)[first * h..(first + size(t)) * h].to_vec(), None)
                    }
                    (CommType::Mc2 | CommType::FusedMc2, true) => (x_of(d, t), Some(t * local(d))),
                    (CommType::AllToAll, true) => (x_of(d, t), None),
                };
                assert_eq!(hshape, &[want_hidden.len() / h, h], "{what}: prepared shape");
                assert_eq!(hidden, &want_hidden, "{what}: prepared rows");
                let want_mask: Option<Vec<bool>> =
                    real_from.map(|first| (0..want_hidden.len() / h).map(|i| first + i < actual[d]).collect());
                assert_eq!(mask, &want_mask, "{what}: mc2_mask");

                // Finalize back to this rank's rows.
                let rows = local(d);
                let want: Vec<f32> = match (comm_type, sp) {
                    (CommType::AllGather, false) => {
                        // DP reduce-scatter (DP ranks of this TP rank, in order),
                        // slot d, first T_d rows.
                        let m = *dp_tokens.iter().max().unwrap();
                        (d * m * h..(d * m + rows) * h)
                            .map(|e| {
                                let mut acc = ys[t][e];
                                for q in 1..dp {
                                    acc += ys[q * tp + t][e];
                                }
                                acc
                            })
                            .collect()
                    }
                    (CommType::AllGather, true) => {
                        // Section 3: this rank's block of the sum over every EP rank.
                        let first: usize = (0..rank).map(|q| local(q / tp)).sum();
                        (first * h..(first + rows) * h)
                            .map(|e| {
                                let mut acc = ys[0][e];
                                for y in &ys[1..] {
                                    acc += y[e];
                                }
                                acc
                            })
                            .collect()
                    }
                    (_, false) => {
                        // TP all-gather of this DP rank's parts, first T_d rows.
                        let full: Vec<f32> = (0..tp).flat_map(|u| ys[d * tp + u].iter().copied()).collect();
                        full[..rows * h].to_vec()
                    }
                    (_, true) => ys[rank].clone(),
                };
                assert_eq!(oshape, &[rows, h], "{what}: finalized shape");
                let (got, want): (Vec<u32>, Vec<u32>) =
                    (out.iter().map(|v| v.to_bits()).collect(), want.iter().map(|v| v.to_bits()).collect());
                assert_eq!(got, want, "{what}: finalized rows");
            }
        }
    }
}

#[test]
fn dispatch_then_combine_weights_each_experts_output_once_per_slot() {
    let (h, experts) = (3usize, 8usize);
    // Tokens per rank: rank 1 has none.
    let tokens = [5usize, 0, 7, 2];
    let gain = |e: i32| 0.5 + 0.25 * e as f32;
    for (world, k) in [(1usize, 1usize), (2, 10), (4, 1), (4, 3)] {
        let results = run_ranks(world, &opts(), |rank, comm| {
            let n = tokens[rank];
            let mut rng = Rng::new(900 + rank as u64 + 10 * k as u64);
            let x: Vec<bf16> = spread(&mut rng, n * h).into_iter().map(bf16::from_f32).collect();
            // Slot 1 repeats slot 0's expert: one token, the same expert twice.
            let ids: Vec<i32> = (0..n * k)
                .map(|s| {
                    let (i, kk) = (s / k, s % k);
                    let kk = if kk == 1 { 0 } else { kk };
                    ((i * 5 + kk * 3 + rank) % experts) as i32
                })
                .collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.unit() * 2.0).collect();
            let mask: Vec<bool> = (0..n).map(|i| i % 4 != 3).collect();
            let d = dispatch(&Tensor::from_slice(&x, &[n, h])?, &ids, k, Some(mask.as_slice()), experts, &comm)?;
            let per = experts / world;
            assert!(d.experts.iter().all(|e| *e as usize / per == rank), "rank {rank}: {:?}", d.experts);
            assert_eq!(d.rows.shape(), &[d.experts.len(), h]);
            // Expert e scales its rows by gain(e), in f32, rounded to bf16.
            let got_rows = d.rows.to_vec::<bf16>()?;
            let y: Vec<bf16> =
                got_rows.iter().enumerate().map(|(e, v)| bf16::from_f32(v.to_f32() * gain(d.experts[e / h]))).collect();
            let out = combine(&Tensor::from_slice(&y, d.rows.shape())?, &d, &Tensor::from_slice(&w, &[n, k])?, &comm)?;
            assert_eq!(out.shape(), &[n, h], "rank {rank}");
            // Section 1 in mode 3: acc = 0, then acc += w * expert_k(x) for
            // k = 0..K-1; a masked token's slots are dropped (+0).
            let want: Vec<bf16> = (0..n * h)
                .map(|e| {
                    let (i, j) = (e / h, e % h);
                    let mut acc = 0f32;
                    for kk in 0..k {
                        let row = if mask[i] {
                            bf16::from_f32(x[i * h + j].to_f32() * gain(ids[i * k + kk])).to_f32()
                        } else {
                            0.0
                        };
                        acc += w[i * k + kk] * row;
                    }
                    bf16::from_f32(acc)
                })
                .collect();
            let got = bf16_bits(&out.to_vec::<bf16>()?);
            Ok((
                got == bf16_bits(&want),
                format!("rank {rank}: got {got:?}, want {:?}", bf16_bits(&want)),
                d.experts.len(),
            ))
        })
        .unwrap();
        for (ok, msg, _) in &results {
            assert!(ok, "world {world} K {k} {msg}");
        }
        // Every real slot reaches exactly one rank.
        let received: usize = results.iter().map(|r| r.2).sum();
        let sent: usize = (0..world).map(|r| (0..tokens[r]).filter(|i| i % 4 != 3).count() * k).sum();
        assert_eq!(received, sent, "world {world} K {k}");
    }
}

#[test]
fn finalize_and_reduce_with_empty_ranks_is_section_1_then_section_3() {
    let l = SpLayout::from_dp_tokens(&[3, 0, 1], 2).unwrap();
    let sizes = l.local_sizes().to_vec();
    assert_eq!(sizes, [2, 2, 0, 0, 1, 1]);
    let (ep, n, k, h) = (sizes.len(), l.total_rows(), 3usize, 5usize);
    let rank_fin = |r: usize| {
        let mut rng = Rng::new(77 + r as u64);
        let mut idx: Vec<i32> = (0..(n * k) as i32).collect();
        rng.shuffle(&mut idx);
        let s: Vec<f32> = (0..n * k).map(|_| rng.unit()).collect();
        // Ranks 0 and 1 add +-2^24 times the same skip input: their outputs
        // cancel when summed first, as rank order does.
        let big: Vec<f32> = spread(&mut Rng::new(76), n * h).iter().map(|v| v * 16_777_216.0).collect();
        let x1 = match r {
            0 => big,
            1 => big.iter().map(|v| -v).collect(),
            _ => spread(&mut rng, n * h),
        };
        Fin::new(DropPadMode::DropLessRow, DType::BF16, n, k, h, &[n * k, h], &spread(&mut rng, n * k * h))
            .idx(&idx)
            .x1(&x1)
            .scales(&s, DType::F32)
    };
    let outs = run_ranks(ep, &opts(), |r, comm| {
        let f = rank_fin(r);
        let t = f.tensors();
        let out = finalize_and_reduce(&t.args(f.mode), Some(&l), &comm)?;
        Ok((out.shape().to_vec(), out.to_vec::<bf16>()?))
    })
    .unwrap();
    // Every rank's finalize rounded once to bf16, then summed in rank order.
    let parts: Vec<Vec<bf16>> = (0..ep).map(|q| rank_fin(q).spec().into_iter().map(bf16::from_f32).collect()).collect();
    for (r, (shape, got)) in outs.iter().enumerate() {
        assert_eq!(shape, &[sizes[r], h], "rank {r}");
        let first = l.offset(r);
        let want: Vec<bf16> = (first * h..(first + sizes[r]) * h).map(|e| rank_order_sum(&parts, e)).collect();
        assert_eq!(bf16_bits(got), bf16_bits(&want), "rank {r}");
    }
}

#[test]
fn a_masked_token_adds_weight_times_zero_per_slot() {
    // One rank, H = 2, K = 2, f32 data. Token 0 is real; tokens 1-3 are
    // masked, with finite, infinite and NaN weights.
    let (h, k, experts) = (2usize, 2usize, 4usize);
    let x = [1.5f32, -2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
    let ids = [0i32, 1, 2, 3, 1, 2, 0, 3];
    let w = [0.5f32, 0.25, 2.0, -3.0, f32::INFINITY, 1.0, 1.0, f32::NAN];
    let mask = [true, false, false, false];
    let out = run_ranks(1, &opts(), |_, comm| {
        let d = dispatch(&Tensor::from_slice(&x, &[4, h])?, &ids, k, Some(mask.as_slice()), experts, &comm)?;
        // Only token 0's two slots travel; the experts are identities.
        assert_eq!(d.experts, [0, 1]);
        let y = d.rows.to_vec::<f32>()?;
        combine(&Tensor::from_slice(&y, d.rows.shape())?, &d, &Tensor::from_slice(&w, &[4, k])?, &comm)?.to_vec::<f32>()
    })
    .unwrap()
    .remove(0);
    // Token 0: 0.5 * x0 + 0.25 * x0; token 1: 2 * 0 + (-3) * 0 = +0 (the f32
    // sum of +0 and -0); tokens 2 and 3: inf * 0 and NaN * 0 are NaN.
    let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(b(&out[..4]), b(&[1.125, -1.5, 0.0, 0.0]), "{out:?}");
    assert!(out[4..].iter().all(|v| v.is_nan()), "{out:?}");
}
