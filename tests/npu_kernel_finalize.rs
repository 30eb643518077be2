//! The NPU backend's finalize routing on both implementations over a golden
//! matrix: every drop-pad mode, optional inputs present and absent, f32 / f16
//! / bf16 data, f32 scales with 16-bit data, H not a multiple of the tile and
//! H over one tile, fewer tokens than cores, K = 1, -1 slots, and the padded
//! EP output. The native kernel accumulates in SPEC section 1's order, so it
//! must equal the CPU backend bit for bit; aclnnMoeFinalizeRoutingV2 and
//! aclnnMoeTokenUnpermute promise no accumulation order, so they are checked
//! against an f64 reference of SPEC section 1 within the dtype's rounding.
//!
//! The cases, their inputs and the reference are the shared finalize case
//! generator (`moe_common::finalize`), whose golden matrix every backend
//! also runs through the default implementation (`moe_finalize`). These
//! choose the implementation, so they are NPU-only (the simulated runtime
//! launches the host build of the kernel through `cannsim_launch_kernel`;
//! `ci/sim.sh` runs these).

use ascend_moe::backend::npu::{FinalizeImpl, NpuDevice};
use ascend_moe::backend::{DropPadMode, FinalizeArgs, FinalizeDims, OutputRows};
use ascend_moe::{DType, Device, Error, Tensor};

mod moe_common;
use moe_common::finalize::{data, expect_close, golden_matrix, host_inputs, reference, run, Case};
use moe_common::to_f64;

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

/// The golden matrix (`moe_common::finalize::golden_matrix`) on
/// implementation `imp`: the native kernel bit for bit against the CPU
/// backend, aclnn within rounding of the f64 reference.
fn golden_matrix_on(imp: FinalizeImpl) {
    let dev = npu(imp);
    let cpu = Device::Cpu;
    let (mut checked, mut skipped) = (0, 0);
    for (c, rows) in golden_matrix() {
        let Case { n, k, h, mode, dtype, scales, x1, x2, bias, .. } = c;
        // aclnnMoeFinalizeRoutingV2 takes K from the scales' shape: without
        // scales it can only express K = 1.
        if imp == FinalizeImpl::Aclnn && scales.is_none() && k > 1 {
            skipped += 1;
            continue;
        }
        let hi = host_inputs(&c).unwrap();
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
    // modes x dtypes x optionals x (dense for 3 shapes + padded for the 2 with n = 5)
    assert_eq!(checked + skipped, 4 * 5 * 4 * 5);
    if imp == FinalizeImpl::Native {
        assert_eq!(skipped, 0);
    }
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn native_finalize_equals_the_cpu_backend_bit_for_bit() {
    golden_matrix_on(FinalizeImpl::Native);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn aclnn_finalize_matches_an_f64_reference() {
    golden_matrix_on(FinalizeImpl::Aclnn);
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

/// Expert ids without a bias, as vLLM-Ascend passes them on every call
/// (`export_for_source_row`): they index nothing, so the result is the call's
/// without them, on the CPU and on either implementation (both refused them:
/// "given, but the tiling says it is absent"). An id past any expert is not
/// read either.
fn expert_ids_without_bias_are_not_read(imp: FinalizeImpl) {
    let dev = npu(imp);
    let (n, k, h) = (3usize, 2usize, 5usize);
    let x: Vec<f32> = (0..n * k * h).map(|i| i as f32 * 0.25 - 3.0).collect();
    let x = Tensor::from_slice(&x, &[n * k, h]).unwrap();
    let idx = Tensor::from_slice(&[4i32, 0, 2, 5, 1, 3], &[n * k]).unwrap();
    let scales = Tensor::from_slice(&[0.5f32, 0.25, 1.0, -1.0, 2.0, 0.75], &[n, k]).unwrap();
    let ids = Tensor::from_slice(&[0i32, 1, 1, 0, 99, 0], &[n, k]).unwrap();
    let run = |d: &Device, with_ids: bool| {
        let (x, idx, scales, ids) = (
            x.to_device(d).unwrap(),
            idx.to_device(d).unwrap(),
            scales.to_device(d).unwrap(),
            ids.to_device(d).unwrap(),
        );
        let mut args = FinalizeArgs::new(&x, &idx, DropPadMode::DropLessRow).with_scales(&scales);
        if with_ids {
            args = args.with_expert_idx(&ids);
        }
        let out =
            ascend_moe::moe::moe_finalize_routing(&args).unwrap_or_else(|e| panic!("{} {with_ids}: {e}", imp.name()));
        out.to_vec::<f32>().unwrap()
    };
    // SPEC section 1, mode 2 (row layout): out[i] = sum_k s[i,k] * x[idx[i*K + k]];
    // every value here is exact in f32.
    let (xv, iv, sv) = (x.to_vec::<f32>().unwrap(), idx.to_vec::<i32>().unwrap(), scales.to_vec::<f32>().unwrap());
    let formula: Vec<f32> = (0..n * h)
        .map(|o| (0..k).map(|j| sv[o / h * k + j] * xv[iv[o / h * k + j] as usize * h + o % h]).sum())
        .collect();
    let want = run(&Device::Cpu, false);
    assert_eq!(want, formula);
    assert_eq!(run(&Device::Cpu, true), want);
    assert_eq!(run(&dev, false), want, "{}", imp.name());
    assert_eq!(run(&dev, true), want, "{}", imp.name());
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn native_finalize_takes_expert_ids_without_bias() {
    expert_ids_without_bias_are_not_read(FinalizeImpl::Native);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn aclnn_finalize_takes_expert_ids_without_bias() {
    expert_ids_without_bias_are_not_read(FinalizeImpl::Aclnn);
}

/// Under the simulated runtime (`ci/npu-4card.sh` skips the `sim_only_`
/// tests on real hardware) finalize defaults to the native kernel.
#[test]
#[ignore = "needs the simulated CANN runtime"]
fn sim_only_the_simulated_runtime_defaults_to_the_native_kernel() {
    let d = NpuDevice::open(0).unwrap();
    let sim = ascend_moe::backend::npu::probe().runtime.is_some_and(|r| r.simulator);
    assert!(sim, "a sim_only_ test needs the simulated runtime (it exports cannsim_* entry points)");
    if std::env::var_os(ascend_moe::backend::npu::FINALIZE_ENV).is_none() {
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
