//! The finalize case generator of the finalize tests: a case (shape, drop-pad
//! mode, dtypes, which optional inputs), its host inputs, a run on any
//! device through the backend trait, and SPEC section 1 in f64 with the
//! terms' magnitudes for [`assert_within_rounding`].

use ascend_moe::backend::{DropPadMode, FinalizeArgs, FinalizeDims, OutputRows};
use ascend_moe::half::{bf16, f16};
use ascend_moe::testing::SplitMix;
use ascend_moe::{DType, Device, Result, Tensor};

use super::{assert_within_rounding, to_f64};

/// Every drop-pad mode.
pub const MODES: [DropPadMode; 4] =
    [DropPadMode::DropLessColumn, DropPadMode::DropPadColumn, DropPadMode::DropLessRow, DropPadMode::DropPadRow];

/// Values in [-2, 2) with a full f32 significand from the crate's generator,
/// as a tensor of `dtype`: products and sums of such values round, so a sum
/// taken in another order than SPEC section 1's gives other bits.
pub fn data(dtype: DType, seed: u64, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v = SplitMix::new(seed).vec(n, 2.0);
    match dtype {
        DType::F32 => Tensor::from_slice(&v, shape),
        DType::F16 => Tensor::from_slice(&v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), shape),
        DType::BF16 => Tensor::from_slice(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), shape),
        other => panic!("no float data of {other}"),
    }
}

/// One finalize case: `n` tokens, `k` slots each, rows of `h`, `e` experts;
/// data of `dtype`, scales of their own dtype (or none), and which of the
/// optional skip and bias inputs are present.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub n: usize,
    pub k: usize,
    pub h: usize,
    pub e: usize,
    pub mode: DropPadMode,
    pub dtype: DType,
    pub scales: Option<DType>,
    pub x1: bool,
    pub x2: bool,
    pub bias: bool,
}

/// The host inputs of a case (rounded to their dtypes) and its dimensions.
pub struct Host {
    pub x: Tensor,
    pub idx: Tensor,
    pub x1: Option<Tensor>,
    pub x2: Option<Tensor>,
    pub bias: Option<Tensor>,
    pub scales: Option<Tensor>,
    pub expert: Option<Tensor>,
    pub dims: FinalizeDims,
}

/// The inputs of `c`: a permutation of the slots for drop-less, some slots
/// dropped (-1) for drop-pad.
pub fn host_inputs(c: &Case) -> Result<Host> {
    let (n, k, h, e) = (c.n, c.k, c.h, c.e);
    let (rows, x_shape) = if c.mode.is_drop_pad() {
        let cap = n * k / e + 2;
        (e * cap, vec![e, cap, h])
    } else {
        (n * k, vec![n * k, h])
    };
    let mut idx: Vec<i32> = (0..n * k).map(|s| ((s * 7 + 3) % (n * k)) as i32).collect();
    if c.mode.is_drop_pad() {
        for (s, v) in idx.iter_mut().enumerate() {
            *v = if s % 3 == 1 { -1 } else { ((*v as usize * 5) % rows) as i32 };
        }
    }
    let expert: Vec<i32> = (0..n * k).map(|s| ((s * 11) % e) as i32).collect();
    Ok(Host {
        x: data(c.dtype, 1, &x_shape)?,
        idx: Tensor::from_slice(&idx, &[n * k])?,
        x1: c.x1.then(|| data(c.dtype, 2, &[n, h])).transpose()?,
        x2: c.x2.then(|| data(c.dtype, 3, &[n, h])).transpose()?,
        bias: c.bias.then(|| data(c.dtype, 4, &[e, h])).transpose()?,
        scales: c.scales.map(|d| data(d, 5, &[n, k])).transpose()?,
        expert: c.bias.then(|| Tensor::from_slice(&expert, &[n, k])).transpose()?,
        dims: FinalizeDims { n, k, h, expanded_rows: rows, experts: if c.bias { e } else { 0 } },
    })
}

/// Runs the case on `dev` (the backend trait's finalize routing) and returns
/// the output bytes.
pub fn run(dev: &Device, c: &Case, hi: &Host, rows: OutputRows<'_>) -> Result<Vec<u8>> {
    let up = |t: &Tensor| t.to_device(dev);
    let upo = |t: &Option<Tensor>| t.as_ref().map(up).transpose();
    let (x, idx) = (up(&hi.x)?, up(&hi.idx)?);
    let (x1, x2, bias, scales, expert) =
        (upo(&hi.x1)?, upo(&hi.x2)?, upo(&hi.bias)?, upo(&hi.scales)?, upo(&hi.expert)?);
    let args = FinalizeArgs::new(&x, &idx, c.mode)
        .with_x1(x1.as_ref())
        .with_x2(x2.as_ref())
        .with_bias(bias.as_ref())
        .with_scales(scales.as_ref())
        .with_expert_idx(expert.as_ref());
    let out_rows = match rows {
        OutputRows::Dense => c.n,
        OutputRows::Padded { local_sizes, slot_rows } => local_sizes.len() * slot_rows,
    };
    // Start from NaN so a row the op forgets to write shows up.
    let nan: Vec<f32> = vec![f32::NAN; out_rows * c.h];
    let mut out = match c.dtype {
        DType::F32 => Tensor::from_slice(&nan, &[out_rows, c.h])?,
        DType::F16 => Tensor::from_slice(&nan.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), &[out_rows, c.h])?,
        _ => Tensor::from_slice(&nan.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), &[out_rows, c.h])?,
    }
    .to_device(dev)?;
    dev.backend().finalize_routing(&args, &hi.dims, &mut out, rows)?;
    Ok(out.to_cpu()?.cpu_bytes()?.to_vec())
}

/// SPEC section 1 in f64 over the case's inputs as rounded to their dtypes:
/// `out[i] = x1[i] + x2[i] + sum_k s(i,k) * (row(R(i,k)) + bias[expert_idx[i,k]])`,
/// laid out as `rows` says (padding rows zero), with the sum of the terms'
/// magnitudes per element (for the tolerance).
pub fn reference(c: &Case, hi: &Host, rows: OutputRows<'_>) -> (Vec<f64>, Vec<f64>) {
    let (n, k, h) = (c.n, c.k, c.h);
    let opt = |t: &Option<Tensor>| t.as_ref().map(to_f64);
    let (x, x1, x2, bias, scales) = (to_f64(&hi.x), opt(&hi.x1), opt(&hi.x2), opt(&hi.bias), opt(&hi.scales));
    let idx = hi.idx.to_vec::<i32>().unwrap();
    let expert = hi.expert.as_ref().map(|e| e.to_vec::<i32>().unwrap());
    let row_layout = matches!(c.mode, DropPadMode::DropLessRow | DropPadMode::DropPadRow);
    let mut dense = vec![(0f64, 0f64); n * h];
    for i in 0..n {
        for j in 0..h {
            let (mut acc, mut mag) = (0f64, 0f64);
            for skip in [&x1, &x2].into_iter().flatten() {
                acc += skip[i * h + j];
                mag += skip[i * h + j].abs();
            }
            for kk in 0..k {
                let r = idx[if row_layout { i * k + kk } else { kk * n + i }];
                let row = if r < 0 { 0.0 } else { x[r as usize * h + j] };
                let b = match (&bias, &expert) {
                    (Some(b), Some(e)) => b[e[i * k + kk] as usize * h + j],
                    _ => 0.0,
                };
                let term = scales.as_ref().map_or(1.0, |s| s[i * k + kk]) * (row + b);
                acc += term;
                mag += term.abs();
            }
            dense[i * h + j] = (acc, mag);
        }
    }
    let out: Vec<(f64, f64)> = match rows {
        OutputRows::Dense => dense,
        OutputRows::Padded { local_sizes, slot_rows } => {
            let mut out = vec![(0f64, 0f64); local_sizes.len() * slot_rows * h];
            let mut token = 0;
            for (slot, &size) in local_sizes.iter().enumerate() {
                let at = slot * slot_rows * h;
                out[at..at + size * h].copy_from_slice(&dense[token * h..(token + size) * h]);
                token += size;
            }
            out
        }
    };
    out.into_iter().unzip()
}

/// Asserts `got` (output bytes of dtype `dt`) is within rounding of SPEC
/// section 1's f64 value `want` ([`assert_within_rounding`], the terms'
/// magnitudes `mag`).
pub fn expect_close(what: &str, dt: DType, got: &[u8], want: &[f64], mag: &[f64]) {
    let mut t = Tensor::zeros_cpu(&[want.len()], dt);
    t.cpu_bytes_mut().unwrap().copy_from_slice(got);
    assert_within_rounding(what, dt, &to_f64(&t), want, mag);
}

/// The padded EP layout of the golden matrix: three rank slots of 4 rows.
pub const GOLDEN_LOCAL_SIZES: [usize; 3] = [2, 0, 3];

/// The golden matrix: every drop-pad mode; f32 / f16 / bf16 data with scales
/// of the data's dtype, f32 scales with 16-bit data, and no scales; four
/// combinations of the optional inputs; (N, K, H) of (5, 2, 300), (3, 1, 20)
/// and (5, 3, 16): fewer tokens than cores, K = 1, H not a multiple of a
/// tile; dense output for every shape and the padded EP output for the
/// shapes of 5 tokens. 400 runs.
pub fn golden_matrix() -> Vec<(Case, OutputRows<'static>)> {
    let mut v = Vec::new();
    for mode in MODES {
        for (dtype, scales) in [
            (DType::F32, Some(DType::F32)),
            (DType::F16, Some(DType::F16)),
            (DType::F16, Some(DType::F32)),
            (DType::BF16, Some(DType::F32)),
            (DType::BF16, None),
        ] {
            for (x1, x2, bias) in [(true, true, true), (false, false, false), (true, false, true), (false, true, false)]
            {
                for (n, k, h) in [(5usize, 2usize, 300usize), (3, 1, 20), (5, 3, 16)] {
                    let c = Case { n, k, h, e: 3, mode, dtype, scales, x1, x2, bias };
                    v.push((c, OutputRows::Dense));
                    if n == 5 {
                        v.push((c, OutputRows::Padded { local_sizes: &GOLDEN_LOCAL_SIZES, slot_rows: 4 }));
                    }
                }
            }
        }
    }
    v
}
