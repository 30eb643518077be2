//! The NPU backend's finalize routing on both implementations over a golden
//! matrix: every drop-pad mode, optional inputs present and absent, f32 / f16
//! / bf16 data, f32 scales with 16-bit data, H not a multiple of the tile and
//! H over one tile, fewer tokens than cores, K = 1, -1 slots, and the padded
//! EP output. The native kernel accumulates in SPEC section 1's order, so it
//! must equal the CPU backend bit for bit; aclnnMoeFinalizeRoutingV2 and
//! aclnnMoeTokenUnpermute promise no accumulation order, so they are checked
//! against an f64 reference of SPEC section 1 within the dtype's rounding.
//!
//! NPU-only (the simulated runtime launches the host build of the kernel
//! through `cannsim_launch_kernel`; `ci/sim.sh` runs these).

use ascend_moe::backend::npu::{FinalizeImpl, NpuDevice};
use ascend_moe::backend::{DropPadMode, FinalizeArgs, FinalizeDims, OutputRows};
use ascend_moe::half::{bf16, f16};
use ascend_moe::{DType, Device, Error, Result, Tensor};

mod moe_common;
use moe_common::{assert_within_rounding, to_f64};

const MODES: [DropPadMode; 4] =
    [DropPadMode::DropLessColumn, DropPadMode::DropPadColumn, DropPadMode::DropLessRow, DropPadMode::DropPadRow];

/// A deterministic value in [-2, 2) with a full f32 significand, per (seed,
/// i): products and sums of such values round, so a sum taken in another
/// order than SPEC section 1's gives other bits.
fn val(seed: u64, i: usize) -> f32 {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 31;
    z = z.wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 29;
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
}

fn data(dtype: DType, seed: u64, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| val(seed, i)).collect();
    match dtype {
        DType::F32 => Tensor::from_slice(&v, shape),
        DType::F16 => Tensor::from_slice(&v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), shape),
        DType::BF16 => Tensor::from_slice(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), shape),
        other => panic!("no float data of {other}"),
    }
}

struct Case {
    n: usize,
    k: usize,
    h: usize,
    e: usize,
    mode: DropPadMode,
    dtype: DType,
    scales: Option<DType>,
    x1: bool,
    x2: bool,
    bias: bool,
}

struct Host {
    x: Tensor,
    idx: Tensor,
    x1: Option<Tensor>,
    x2: Option<Tensor>,
    bias: Option<Tensor>,
    scales: Option<Tensor>,
    expert: Option<Tensor>,
    dims: FinalizeDims,
}

fn host_inputs(c: &Case) -> Result<Host> {
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

/// Runs the case on `dev` and returns the output bytes.
fn run(dev: &Device, c: &Case, hi: &Host, rows: OutputRows<'_>) -> Result<Vec<u8>> {
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
fn reference(c: &Case, hi: &Host, rows: OutputRows<'_>) -> (Vec<f64>, Vec<f64>) {
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
fn expect_close(what: &str, dt: DType, got: &[u8], want: &[f64], mag: &[f64]) {
    let mut t = Tensor::zeros_cpu(&[want.len()], dt);
    t.cpu_bytes_mut().unwrap().copy_from_slice(got);
    assert_within_rounding(what, dt, &to_f64(&t), want, mag);
}

fn npu(imp: FinalizeImpl) -> Device {
    let d = NpuDevice::open(0).unwrap_or_else(|e| panic!("npu:0: {e}\n{}", ascend_moe::backend::npu::probe_report()));
    let d = d.with_finalize_impl(imp);
    assert_eq!(d.finalize_impl().unwrap(), imp.name());
    Device::Npu(d)
}

/// The NPU handle behind an NPU [`Device`].
fn npu_device(d: &Device) -> &NpuDevice {
    match d {
        Device::Npu(n) => n,
        Device::Cpu => panic!("an NPU device"),
    }
}

fn golden_matrix(imp: FinalizeImpl) {
    let dev = npu(imp);
    let cpu = Device::Cpu;
    let local_sizes = [2usize, 0, 3];
    let (mut checked, mut skipped) = (0, 0);
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
                    // aclnnMoeFinalizeRoutingV2 takes K from the scales' shape:
                    // without scales it can only express K = 1.
                    if imp == FinalizeImpl::Aclnn && scales.is_none() && k > 1 {
                        skipped += 2;
                        continue;
                    }
                    let hi = host_inputs(&c).unwrap();
                    let mut layouts = vec![OutputRows::Dense];
                    if n == 5 {
                        layouts.push(OutputRows::Padded { local_sizes: &local_sizes, slot_rows: 4 });
                    }
                    for rows in layouts {
                        let what = format!(
                            "{} {mode:?} {dtype} scales {scales:?} x1 {x1} x2 {x2} bias {bias} n {n} k {k} h {h} {rows:?}",
                            imp.name()
                        );
                        let got = run(&dev, &c, &hi, rows).unwrap_or_else(|e| panic!("{what}: {e}"));
                        if imp == FinalizeImpl::Native {
                            let want = run(&cpu, &c, &hi, rows).unwrap_or_else(|e| panic!("cpu {what}: {e}"));
                            assert!(got == want, "{what}: differs from the CPU backend");
                        } else {
                            let (want, mag) = reference(&c, &hi, rows);
                            expect_close(&what, dtype, &got, &want, &mag);
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    // modes x dtypes x optionals x (dense for 3 shapes + padded for the 2 with n = 5)
    assert_eq!(checked + skipped, 4 * 5 * 4 * 5);
    if imp == FinalizeImpl::Native {
        assert_eq!(skipped, 0);
    }
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn native_finalize_equals_the_cpu_backend_bit_for_bit() {
    golden_matrix(FinalizeImpl::Native);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn aclnn_finalize_matches_an_f64_reference() {
    golden_matrix(FinalizeImpl::Aclnn);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn native_finalize_spans_several_tiles_of_h() {
    // 20000 elements per row: more than one 9824-element f32 tile, with a tail.
    for imp in [FinalizeImpl::Native, FinalizeImpl::Aclnn] {
        let c = Case {
            n: 3,
            k: 2,
            h: 20000,
            e: 2,
            mode: DropPadMode::DropPadRow,
            dtype: DType::F32,
            scales: Some(DType::F32),
            x1: true,
            x2: false,
            bias: true,
        };
        let hi = host_inputs(&c).unwrap();
        let got = run(&npu(imp), &c, &hi, OutputRows::Dense).unwrap();
        if imp == FinalizeImpl::Native {
            assert!(got == run(&Device::Cpu, &c, &hi, OutputRows::Dense).unwrap(), "native");
        } else {
            let (want, mag) = reference(&c, &hi, OutputRows::Dense);
            expect_close(imp.name(), c.dtype, &got, &want, &mag);
        }
    }
}

/// A bad index is found on the device on both paths (the native kernel, and
/// the index check the aclnn path launches before aclnn, which then reads
/// checked copies: the simulated aclnn would fail its task on an index
/// outside its range): the op only queues, and the stream's check reports
/// the index, once, with its argument, position and value.
fn reports_an_out_of_range_index(imp: FinalizeImpl) {
    let dev = npu(imp);
    let (n, h) = (6usize, 40usize);
    let x = Tensor::zeros(&[n, h], DType::F32, &dev).unwrap();
    let expect = |what: &str, arg: &str, position: usize, value: i64| match npu_device(&dev).check() {
        Err(Error::IndexOutOfRange { arg: a, position: p, value: v, .. }) => {
            assert_eq!((a, p, v), (arg, position, value), "{} {what}", imp.name());
            npu_device(&dev).check().expect("reported once");
        }
        other => panic!("{} {what}: expected IndexOutOfRange, got {other:?}", imp.name()),
    };
    for (mode, idx, arg, position, value) in [
        (DropPadMode::DropLessColumn, vec![0i32, 1, 2, 3, 6, 5], "expanded_row_idx", 4, 6),
        (DropPadMode::DropLessRow, vec![0i32, 1, -1, 3, 4, 5], "expanded_row_idx", 2, -1),
        (DropPadMode::DropPadRow, vec![0i32, 1, -2, 3, 4, 5], "expanded_row_idx", 2, -2),
    ] {
        let idx = Tensor::from_slice(&idx, &[n]).unwrap().to_device(&dev).unwrap();
        let args = FinalizeArgs::new(&x, &idx, mode);
        let dims = FinalizeDims { n, k: 1, h, expanded_rows: n, experts: 0 };
        let mut out = Tensor::zeros(&[n, h], DType::F32, &dev).unwrap();
        dev.backend().finalize_routing(&args, &dims, &mut out, OutputRows::Dense).expect("queued");
        expect(&format!("{mode:?}"), arg, position, value);
    }
    // A bad expert index too.
    let idx = Tensor::from_slice(&[0i32, 1, 2, 3, 4, 5], &[n]).unwrap().to_device(&dev).unwrap();
    let bias = Tensor::zeros(&[2, h], DType::F32, &dev).unwrap();
    let expert = Tensor::from_slice(&[0i32, 1, 0, 2, 1, 0], &[n, 1]).unwrap().to_device(&dev).unwrap();
    let args = FinalizeArgs::new(&x, &idx, DropPadMode::DropLessRow).with_bias(&bias).with_expert_idx(&expert);
    let dims = FinalizeDims { n, k: 1, h, expanded_rows: n, experts: 2 };
    let mut out = Tensor::zeros(&[n, h], DType::F32, &dev).unwrap();
    dev.backend().finalize_routing(&args, &dims, &mut out, OutputRows::Dense).expect("queued");
    expect("expert", "expert_idx", 3, 2);
    // More slots than one core's chunk: the bad index sits in the last
    // core's second chunk, and the first bad position is the one reported.
    let (n, h) = (40_000usize, 1usize);
    let x = Tensor::zeros(&[n, h], DType::F32, &dev).unwrap();
    let mut v: Vec<i32> = (0..n as i32).collect();
    v[38_000] = -7;
    v[39_999] = n as i32;
    let idx = Tensor::from_slice(&v, &[n]).unwrap().to_device(&dev).unwrap();
    let args = FinalizeArgs { expanded_x: &x, expanded_row_idx: &idx, bias: None, expert_idx: None, ..args };
    let dims = FinalizeDims { n, k: 1, h, expanded_rows: n, experts: 0 };
    let mut out = Tensor::zeros(&[n, h], DType::F32, &dev).unwrap();
    dev.backend().finalize_routing(&args, &dims, &mut out, OutputRows::Dense).expect("queued");
    expect("large", "expanded_row_idx", 38_000, -7);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn native_finalize_reports_an_out_of_range_index() {
    reports_an_out_of_range_index(FinalizeImpl::Native);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn aclnn_finalize_checks_indices_on_the_device() {
    reports_an_out_of_range_index(FinalizeImpl::Aclnn);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn the_simulated_runtime_defaults_to_the_native_kernel() {
    let d = NpuDevice::open(0).unwrap();
    let sim = ascend_moe::backend::npu::probe().runtime.is_some_and(|r| r.simulator);
    if std::env::var_os(ascend_moe::backend::npu::FINALIZE_ENV).is_none() && sim {
        assert_eq!(d.finalize_impl().unwrap(), "native");
    }
}

/// Token unpermute on the device (SPEC section 1: `out[t] = sum_k probs[t,k] *
/// permuted[S[t*K + k]]`, an index outside `[0, rows)` contributing nothing)
/// on implementation `imp`: indices in range and distinct (what
/// aclnnMoeTokenUnpermute takes), repeated, negative and past the end, a
/// permuted buffer without T*K rows, probs absent, of the data type and f32,
/// H over one tile. The native kernel must equal the CPU backend bit for bit;
/// the aclnn path (the op where its contract holds, the host otherwise) must
/// be within rounding of an f64 reference of the formula.
fn token_unpermute_matrix(imp: FinalizeImpl) {
    let cpu = Device::Cpu;
    let mut checked = 0;
    {
        let dev = npu(imp);
        for (dtype, probs) in [
            (DType::F32, Some(DType::F32)),
            (DType::F16, Some(DType::F16)),
            (DType::BF16, Some(DType::F32)),
            (DType::BF16, Some(DType::BF16)),
            (DType::F16, None),
        ] {
            for (t, k, h) in [(5usize, 2usize, 24usize), (3, 1, 20000), (9, 4, 7)] {
                let distinct: Vec<i32> = (0..(t * k) as i32).map(|s| (s * 7 + 3) % (t * k) as i32).collect();
                let mut wild = distinct.clone();
                wild[0] = -1;
                wild[1 % (t * k)] = (t * k) as i32;
                wild[(t * k) - 1] = wild[(t * k) / 2];
                for (what, idx, rows) in
                    [("distinct", &distinct, t * k), ("wild", &wild, t * k), ("short", &distinct, t * k - 1)]
                {
                    let p = data(dtype, 11, &[rows, h]).unwrap();
                    let s = Tensor::from_slice(idx, &[t * k]).unwrap();
                    let w = probs.map(|d| data(d, 12, &[t, k]).unwrap());
                    let run = |d: &Device| -> Vec<u8> {
                        let (p, s) = (p.to_device(d).unwrap(), s.to_device(d).unwrap());
                        let w = w.as_ref().map(|w| w.to_device(d).unwrap());
                        let mut out = Tensor::zeros(&[t, h], dtype, d).unwrap();
                        d.backend().token_unpermute(&p, &s, w.as_ref(), k, &mut out).unwrap();
                        out.to_cpu().unwrap().cpu_bytes().unwrap().to_vec()
                    };
                    let label = format!("{} {dtype} probs {probs:?} t {t} k {k} h {h} {what}", imp.name());
                    let got = run(&dev);
                    if imp == FinalizeImpl::Native {
                        assert!(got == run(&cpu), "{label}: differs from the CPU backend");
                    } else {
                        let (x, w) = (to_f64(&p), w.as_ref().map(to_f64));
                        let (mut want, mut mag) = (vec![0f64; t * h], vec![0f64; t * h]);
                        for (slot, &r) in idx.iter().enumerate() {
                            if r < 0 || r as usize >= rows {
                                continue;
                            }
                            let pr = w.as_ref().map_or(1.0, |w| w[slot]);
                            for j in 0..h {
                                let term = pr * x[r as usize * h + j];
                                want[(slot / k) * h + j] += term;
                                mag[(slot / k) * h + j] += term.abs();
                            }
                        }
                        expect_close(&label, dtype, &got, &want, &mag);
                    }
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 5 * 3 * 3);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn native_token_unpermute_equals_the_cpu_backend_bit_for_bit() {
    token_unpermute_matrix(FinalizeImpl::Native);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn aclnn_token_unpermute_matches_an_f64_reference() {
    token_unpermute_matrix(FinalizeImpl::Aclnn);
}
