//! The device-side ops every backend implements: zeros, copies, row copies,
//! add. One body per test, run on the CPU and (ignored here) on NPU 0.

mod common;

use ascend_moe::half::{bf16, f16};
use ascend_moe::{with_dtype, DType, Device, Element, Error, Result, Tensor};
use common::values;

fn host<T: Element>(seed: u64, shape: &[usize]) -> Result<Tensor> {
    let n = shape.iter().product();
    let v: Vec<T> = values(seed, n).into_iter().map(|x| T::from_f32(x * 4.0)).collect();
    Tensor::from_slice(&v, shape)
}

backend_test!(zeros_are_zero_in_every_dtype, |dev| {
    for dtype in DType::REDUCIBLE {
        let t = Tensor::zeros(&[3, 5], dtype, dev)?;
        assert_eq!((t.shape(), t.dtype()), (&[3usize, 5][..], dtype));
        assert_eq!(t.device(), *dev);
        let back = t.to_cpu()?;
        assert!(back.cpu_bytes()?.iter().all(|&b| b == 0), "{dtype}");
    }
    let empty = Tensor::zeros(&[0, 7], DType::BF16, dev)?;
    assert_eq!(empty.to_cpu()?.len_bytes(), 0);
    Ok(())
});

backend_test!(copies_round_trip_bit_exactly, |dev| {
    for (i, dtype) in DType::REDUCIBLE.into_iter().enumerate() {
        let src = with_dtype!(dtype, T => host::<T>(i as u64 + 1, &[4, 3, 2])?);
        let on_dev = src.to_device(dev)?;
        let twice = on_dev.try_clone()?;
        drop(on_dev);
        let back = twice.to_cpu()?;
        assert_eq!(back.shape(), src.shape());
        assert_eq!(back.cpu_bytes()?, src.cpu_bytes()?, "{dtype}");
    }
    Ok(())
});

backend_test!(copy_rows_moves_exactly_the_named_rows, |dev| {
    for dtype in [DType::F32, DType::F16, DType::I64] {
        let (src_rows, dst_rows, h) = (6, 9, 5);
        let src_h = with_dtype!(dtype, T => host::<T>(7, &[src_rows, h])?);
        let src = src_h.to_device(dev)?;
        let mut dst = Tensor::zeros(&[dst_rows, h], dtype, dev)?;
        dev.backend().copy_rows(&src, 1, &mut dst, 4, 3)?;
        dev.backend().copy_rows(&src, 5, &mut dst, 0, 1)?;
        // Naive reference on bytes.
        let rb = h * dtype.size();
        let s = src_h.cpu_bytes()?;
        let mut want = vec![0u8; dst_rows * rb];
        want[4 * rb..7 * rb].copy_from_slice(&s[rb..4 * rb]);
        want[..rb].copy_from_slice(&s[5 * rb..6 * rb]);
        assert_eq!(dst.to_cpu()?.cpu_bytes()?, &want[..], "{dtype}");

        let err = dev.backend().copy_rows(&src, 4, &mut dst, 0, 3).expect_err("rows 4..7 of 6");
        assert!(matches!(err, Error::InvalidArgument { arg: "src_row", .. }), "{err:?}");
        let err = dev.backend().copy_rows(&src, 0, &mut dst, 8, 2).expect_err("rows 8..10 of 9");
        assert!(matches!(err, Error::InvalidArgument { arg: "dst_row", .. }), "{err:?}");
        // Row ranges whose end does not fit a usize are refused too, not wrapped.
        let huge = 1usize << 63;
        let err = dev.backend().copy_rows(&src, huge, &mut dst, huge, huge).expect_err("wrapping rows");
        assert!(matches!(err, Error::InvalidArgument { arg: "src_row", .. }), "{err:?}");
        let err = dev.backend().copy_rows(&src, usize::MAX, &mut dst, 0, 1).expect_err("row usize::MAX");
        assert!(matches!(err, Error::InvalidArgument { arg: "src_row", .. }), "{err:?}");
        let err = dev.backend().copy_rows(&src, 0, &mut dst, usize::MAX, 1).expect_err("row usize::MAX");
        assert!(matches!(err, Error::InvalidArgument { arg: "dst_row", .. }), "{err:?}");
    }
    Ok(())
});

fn add_case<T: Element>(dev: &Device, n: usize) -> Result<()> {
    let (a, b) = (host::<T>(11, &[n, 3])?, host::<T>(12, &[n, 3])?);
    let want: Vec<f64> = a
        .as_slice::<T>()?
        .iter()
        .zip(b.as_slice::<T>()?)
        .map(|(x, y)| T::from_f32(x.to_f32() + y.to_f32()).to_f64())
        .collect();
    let mut out = Tensor::zeros(&[n, 3], T::DTYPE, dev)?;
    dev.backend().add(&a.to_device(dev)?, &b.to_device(dev)?, &mut out)?;
    let got = out.to_vec::<T>()?;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.to_f64(), *w, "{} element {i}", T::DTYPE);
    }
    Ok(())
}

backend_test!(add_rounds_once_per_dtype, |dev| {
    add_case::<f32>(dev, 17)?;
    add_case::<f16>(dev, 33)?;
    add_case::<bf16>(dev, 5)?;
    let a = Tensor::zeros(&[2, 3], DType::F32, dev)?;
    let b = Tensor::zeros(&[3, 2], DType::F32, dev)?;
    let mut out = Tensor::zeros(&[2, 3], DType::F32, dev)?;
    let err = dev.backend().add(&a, &b, &mut out).expect_err("shape mismatch");
    assert!(matches!(err, Error::Shape { arg: "b", .. }), "{err:?}");
    Ok(())
});

backend_test!(add_is_exact_on_integers, |dev| {
    // Past f32's 24 bits of integer, and at the wrap of each type.
    let a = Tensor::from_slice(&[16_777_217i32, 2_000_000_001, i32::MAX], &[3])?;
    let b = Tensor::from_slice(&[1i32, 0, 1], &[3])?;
    let mut out = Tensor::zeros(&[3], DType::I32, dev)?;
    dev.backend().add(&a.to_device(dev)?, &b.to_device(dev)?, &mut out)?;
    assert_eq!(out.to_vec::<i32>()?, [16_777_218, 2_000_000_001, i32::MIN]);
    if !matches!(dev, Device::Cpu) {
        // The simulator's aclnnAdd takes float and int32 only.
        return Ok(());
    }
    let a = Tensor::from_slice(&[(1i64 << 53) + 1, -3], &[2])?;
    let b = Tensor::from_slice(&[2i64, 1 << 40], &[2])?;
    let mut out = Tensor::zeros(&[2], DType::I64, dev)?;
    dev.backend().add(&a.to_device(dev)?, &b.to_device(dev)?, &mut out)?;
    assert_eq!(out.to_vec::<i64>()?, [(1i64 << 53) + 3, (1 << 40) - 3]);
    let a = Tensor::from_slice(&[250u8, 7], &[2])?;
    let b = Tensor::from_slice(&[10u8, 8], &[2])?;
    let mut out = Tensor::zeros(&[2], DType::U8, dev)?;
    dev.backend().add(&a.to_device(dev)?, &b.to_device(dev)?, &mut out)?;
    assert_eq!(out.to_vec::<u8>()?, [4, 15]);
    Ok(())
});
