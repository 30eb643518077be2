//! Fused finalize routing and token unpermute through the backend trait,
//! against a naive f64 reference of SPEC section 1. One body, CPU and NPU.

mod common;

use ascend_moe::backend::{DropPadMode, FinalizeArgs, FinalizeDims, OutputRows};
use ascend_moe::half::bf16;
use ascend_moe::{DType, Device, Element, Error, Result, Tensor};
use common::{assert_close, values};

struct Case {
    n: usize,
    k: usize,
    h: usize,
    e: usize,
    mode: DropPadMode,
}

struct Inputs {
    x: Vec<f32>,
    x_shape: Vec<usize>,
    idx: Vec<i32>,
    x1: Vec<f32>,
    x2: Vec<f32>,
    bias: Vec<f32>,
    scales: Vec<f32>,
    expert: Vec<i32>,
}

fn inputs(c: &Case) -> Inputs {
    let (n, k, h, e) = (c.n, c.k, c.h, c.e);
    let (rows, x_shape) = if c.mode.is_drop_pad() {
        let cap = n * k / e + 2;
        (e * cap, vec![e, cap, h])
    } else {
        (n * k, vec![n * k, h])
    };
    // A permutation for drop-less; for drop-pad some slots dropped (-1).
    let mut idx: Vec<i32> = (0..n * k).map(|s| ((s * 7 + 3) % (n * k)) as i32).collect();
    if c.mode.is_drop_pad() {
        for (s, v) in idx.iter_mut().enumerate() {
            *v = if s % 3 == 1 { -1 } else { ((*v as usize * 5) % rows) as i32 };
        }
    }
    Inputs {
        x: values(1, rows * h),
        x_shape,
        idx,
        x1: values(2, n * h),
        x2: values(3, n * h),
        bias: values(4, e * h),
        scales: values(5, n * k),
        expert: (0..n * k).map(|s| ((s * 11) % e) as i32).collect(),
    }
}

/// SPEC section 1, straight from the formula.
fn reference(c: &Case, i: &Inputs) -> Vec<f64> {
    let (n, k, h) = (c.n, c.k, c.h);
    let mut out = vec![0f64; n * h];
    for t in 0..n {
        for j in 0..h {
            let mut acc = i.x1[t * h + j] as f64 + i.x2[t * h + j] as f64;
            for kk in 0..k {
                let slot = if c.mode.is_row_layout() { t * k + kk } else { kk * n + t };
                let r = i.idx[slot];
                let row = if r < 0 { 0.0 } else { i.x[r as usize * h + j] as f64 };
                let b = i.bias[i.expert[t * k + kk] as usize * h + j] as f64;
                acc += i.scales[t * k + kk] as f64 * (row + b);
            }
            out[t * h + j] = acc;
        }
    }
    out
}

fn up<T: Element>(dev: &Device, v: &[f32], shape: &[usize]) -> Result<Tensor> {
    let t: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
    Tensor::from_slice(&t, shape)?.to_device(dev)
}

fn run_case<T: Element>(dev: &Device, c: &Case, rows: OutputRows<'_>) -> Result<Vec<T>> {
    let i = inputs(c);
    let (n, k, h, e) = (c.n, c.k, c.h, c.e);
    let x = up::<T>(dev, &i.x, &i.x_shape)?;
    let idx = Tensor::from_slice(&i.idx, &[n * k])?.to_device(dev)?;
    let (x1, x2) = (up::<T>(dev, &i.x1, &[n, h])?, up::<T>(dev, &i.x2, &[n, h])?);
    let bias = up::<T>(dev, &i.bias, &[e, h])?;
    let scales = up::<T>(dev, &i.scales, &[n, k])?;
    let expert = Tensor::from_slice(&i.expert, &[n, k])?.to_device(dev)?;
    let args = FinalizeArgs {
        expanded_x: &x,
        expanded_row_idx: &idx,
        x1: Some(&x1),
        x2: Some(&x2),
        bias: Some(&bias),
        scales: Some(&scales),
        expert_idx: Some(&expert),
        drop_pad_mode: c.mode,
    };
    let dims = FinalizeDims { n, k, h, expanded_rows: x.numel() / h, experts: e };
    let out_rows = match rows {
        OutputRows::Dense => n,
        OutputRows::Padded { local_sizes, slot_rows } => local_sizes.len() * slot_rows,
    };
    let mut out = Tensor::zeros(&[out_rows, h], T::DTYPE, dev)?;
    dev.backend().finalize_routing(&args, &dims, &mut out, rows)?;
    out.to_vec::<T>()
}

backend_test!(finalize_matches_the_formula_in_every_mode, |dev| {
    for mode in
        [DropPadMode::DropLessColumn, DropPadMode::DropPadColumn, DropPadMode::DropLessRow, DropPadMode::DropPadRow]
    {
        let c = Case { n: 7, k: 3, h: 16, e: 4, mode };
        let want = reference(&c, &inputs(&c));
        assert_close::<f32>(&format!("f32 mode {mode:?}"), &run_case::<f32>(dev, &c, OutputRows::Dense)?, &want)?;
        let got = run_case::<bf16>(dev, &c, OutputRows::Dense)?;
        // bf16 inputs are rounded, so compare with the reference of the rounded inputs.
        let mut i = inputs(&c);
        for v in [&mut i.x, &mut i.x1, &mut i.x2, &mut i.bias, &mut i.scales] {
            v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32());
        }
        assert_close::<bf16>(&format!("bf16 mode {mode:?}"), &got, &reference(&c, &i))?;
    }
    Ok(())
});

backend_test!(finalize_into_padded_slots_zeroes_the_padding, |dev| {
    let c = Case { n: 6, k: 2, h: 8, e: 3, mode: DropPadMode::DropLessRow };
    let dense = reference(&c, &inputs(&c));
    let local_sizes = [2usize, 0, 3, 1];
    let slot_rows = 3;
    let got = run_case::<f32>(dev, &c, OutputRows::Padded { local_sizes: &local_sizes, slot_rows })?;
    let mut want = vec![0f64; local_sizes.len() * slot_rows * c.h];
    let mut t = 0;
    for (r, &s) in local_sizes.iter().enumerate() {
        for j in 0..s {
            let dst = (r * slot_rows + j) * c.h;
            want[dst..dst + c.h].copy_from_slice(&dense[(t + j) * c.h..(t + j + 1) * c.h]);
        }
        t += s;
    }
    assert_close::<f32>("padded", &got, &want)
});

backend_test!(finalize_rejects_an_out_of_range_row_index, |dev| {
    let (n, k, h) = (3usize, 2usize, 4usize);
    let x = Tensor::zeros(&[n * k, h], DType::F32, dev)?;
    let idx = Tensor::from_slice(&[0i32, 1, 2, 3, 6, 5], &[n * k])?.to_device(dev)?;
    let args = FinalizeArgs {
        expanded_x: &x,
        expanded_row_idx: &idx,
        x1: None,
        x2: None,
        bias: None,
        scales: None,
        expert_idx: None,
        drop_pad_mode: DropPadMode::DropLessColumn,
    };
    let dims = FinalizeDims { n: n * k, k: 1, h, expanded_rows: n * k, experts: 0 };
    let mut out = Tensor::zeros(&[n * k, h], DType::F32, dev)?;
    let result = dev.backend().finalize_routing(&args, &dims, &mut out, OutputRows::Dense);
    let err = match dev {
        // The native kernel finds the index on the device: the op queues the
        // launch and the stream's check reports it (once).
        Device::Npu(n) if n.finalize_impl()? == "native" => {
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
    let mut want = vec![0f64; t * h];
    for tok in 0..t {
        for kk in 0..k {
            let r = idx[tok * k + kk];
            if r < 0 || r as usize >= rows {
                continue;
            }
            for j in 0..h {
                want[tok * h + j] += probs[tok * k + kk] as f64 * permuted[r as usize * h + j] as f64;
            }
        }
    }
    let p = Tensor::from_slice(&permuted, &[rows, h])?.to_device(dev)?;
    let s = Tensor::from_slice(&idx, &[t * k])?.to_device(dev)?;
    let w = Tensor::from_slice(&probs, &[t, k])?.to_device(dev)?;
    let mut out = Tensor::zeros(&[t, h], DType::F32, dev)?;
    dev.backend().token_unpermute(&p, &s, Some(&w), k, &mut out)?;
    assert_close::<f32>("unpermute", &out.to_vec::<f32>()?, &want)
});
