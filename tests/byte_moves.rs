//! SPEC section 8: the one-byte dtypes (int8, uint8 / packed fp4, bool, fp8
//! e4m3fn and e5m2) and 1-D per-token f32 scales travel through the data
//! movement collectives and the SP / DP gathers of sections 4 and 6 as exact
//! bytes; every reduction refuses them with an error naming the dtype.

use ascend_moe::moe::layout::SpLayout;
use ascend_moe::moe::pad_reduce::{maybe_all_gather_and_maybe_unpad, maybe_pad_and_reduce};
use ascend_moe::moe::prepare_finalize::{prepare, MoeContext, MoeGroups};
use ascend_moe::ranks::run_ranks;
use ascend_moe::types::{Bool, F8E4M3, F8E5M2};
use ascend_moe::{with_dtype, Collectives, CommOptions, CommType, DType, Element, ReduceOp, Tensor};

fn opts() -> CommOptions {
    CommOptions::with_timeout(std::time::Duration::from_secs(30))
}

/// Byte `i` of rank `r`: every one of the 256 patterns appears (fp8 NaN codes included).
fn byte(r: usize, i: usize) -> u8 {
    (r * 77 + i * 13 + 5) as u8
}

fn bytes_tensor(dtype: DType, r: usize, n: usize, shape: &[usize]) -> Tensor {
    let raw: Vec<u8> = (0..n).map(|i| byte(r, i)).collect();
    with_dtype!(dtype, T => {
        let v: Vec<T> = raw.iter().map(|b| bytemuck::cast::<u8, T>(*b)).collect();
        Tensor::from_slice(&v, shape).unwrap()
    })
}

fn raw(t: &Tensor) -> Vec<u8> {
    t.cpu_bytes().unwrap().to_vec()
}

#[test]
fn codes_names_and_sizes_are_appended() {
    let want = [
        (DType::I8, 5, "i8"),
        (DType::U8, 6, "u8"),
        (DType::Bool, 7, "bool"),
        (DType::F8E4M3, 8, "f8e4m3"),
        (DType::F8E5M2, 9, "f8e5m2"),
    ];
    for (d, code, name) in want {
        assert_eq!(d as u32, code);
        assert_eq!(d.name(), name);
        assert_eq!(d.size(), 1);
        assert!(!d.is_reducible() && !d.is_float());
        assert_eq!(DType::from_u32(code), Some(d));
        assert_eq!(name.parse::<DType>().unwrap(), d);
    }
    // The existing codes did not move.
    assert_eq!([DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64].map(|d| d as u32), [0, 1, 2, 3, 4]);
    assert!(DType::REDUCIBLE.iter().all(|d| d.is_reducible()));
    assert_eq!(DType::from_u32(10), None);
}

#[test]
fn fp8_conversions_follow_the_formats() {
    // e4m3fn: bias 7, 3 mantissa bits, no inf, max 448 = 0x7e, NaN 0x7f.
    for (v, code) in [
        (1.0f32, 0x38u8),
        (-2.0, 0xc0),
        (448.0, 0x7e),
        (0.001953125, 0x01),
        (0.0, 0x00),
        (1.0625, 0x38),
        (1.1875, 0x3a),
    ] {
        assert_eq!(F8E4M3::from_f32(v).0, code, "e4m3 {v}");
    }
    assert_eq!(F8E4M3(0x7e).to_f32(), 448.0);
    assert_eq!(F8E4M3(0x08).to_f32(), 0.015625); // smallest normal 2^-6
    assert!(F8E4M3(0x7f).to_f32().is_nan() && F8E4M3::from_f32(500.0).to_f32().is_nan());
    // e5m2: bias 15, 2 mantissa bits, max 57344 = 0x7b, inf 0x7c.
    for (v, code) in [(1.0f32, 0x3cu8), (57344.0, 0x7b), (-0.5, 0xb8), (1.0f32 / 65536.0, 0x01), (70000.0, 0x7c)] {
        assert_eq!(F8E5M2::from_f32(v).0, code, "e5m2 {v}");
    }
    assert_eq!(F8E5M2(0x7c).to_f32(), f32::INFINITY);
    assert!(F8E5M2(0x7d).to_f32().is_nan());
    assert_eq!(Bool::from_f32(3.0), Bool(1));
    assert_eq!(Bool(0).to_f32(), 0.0);
}

#[test]
fn data_movement_is_an_exact_byte_move_and_reductions_refuse() {
    let w = 4;
    run_ranks(w, &opts(), |r, comm| {
        for dt in DType::BYTE_MOVES {
            let n = 300;
            // all_gather
            let src = bytes_tensor(dt, r, n, &[n]);
            let mut dst = Tensor::zeros_cpu(&[n * w], dt);
            comm.all_gather(&src, &mut dst)?;
            let want: Vec<u8> = (0..w).flat_map(|q| (0..n).map(move |i| byte(q, i))).collect();
            assert_eq!(raw(&dst), want, "{dt} all_gather");
            // all_gather_v with an empty rank
            let counts = [5usize, 0, 17, 3];
            let src = bytes_tensor(dt, r, counts[r], &[counts[r]]);
            let mut dst = Tensor::zeros_cpu(&[25], dt);
            comm.all_gather_v(&src, &mut dst, &counts)?;
            let want: Vec<u8> = (0..w).flat_map(|q| (0..counts[q]).map(move |i| byte(q, i))).collect();
            assert_eq!(raw(&dst), want, "{dt} all_gather_v");
            // all_to_all_v: m[i][j] bytes from i to j
            let m = |i: usize, j: usize| (i * 3 + j * 5) % 7;
            let send: Vec<usize> = (0..w).map(|j| m(r, j)).collect();
            let recv: Vec<usize> = (0..w).map(|i| m(i, r)).collect();
            let src = bytes_tensor(dt, r, send.iter().sum(), &[send.iter().sum()]);
            let mut dst = Tensor::zeros_cpu(&[recv.iter().sum()], dt);
            comm.all_to_all_v(&src, &send, &mut dst, &recv)?;
            let want: Vec<u8> = (0..w)
                .flat_map(|i| {
                    let off: usize = (0..r).map(|j| m(i, j)).sum();
                    (off..off + m(i, r)).map(move |k| byte(i, k))
                })
                .collect();
            assert_eq!(raw(&dst), want, "{dt} all_to_all_v");
            // broadcast from rank 2
            let mut buf = bytes_tensor(dt, r, 64, &[8, 8]);
            comm.broadcast(&mut buf, 2)?;
            assert_eq!(raw(&buf), (0..64).map(|i| byte(2, i)).collect::<Vec<_>>(), "{dt} broadcast");
            // Every reduction refuses, on every rank, naming the dtype.
            let x = bytes_tensor(dt, r, 8, &[8]);
            let mut y = Tensor::zeros_cpu(&[8], dt);
            let mut y2 = Tensor::zeros_cpu(&[2], dt);
            let mut b = bytes_tensor(dt, r, 8, &[8]);
            let errs = [
                comm.all_reduce(&x, &mut y, ReduceOp::Sum).unwrap_err().to_string(),
                comm.all_reduce_in_place(&mut b, ReduceOp::Max).unwrap_err().to_string(),
                comm.reduce_scatter(&x, &mut y2, ReduceOp::Sum).unwrap_err().to_string(),
                comm.reduce_scatter_v(&x, &mut y2, &[2, 2, 2, 2], ReduceOp::Min).unwrap_err().to_string(),
            ];
            for e in errs {
                assert!(e.contains(dt.name()) && e.contains("never reduced"), "{dt}: {e}");
            }
            comm.barrier()?;
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn quantized_hidden_states_and_per_token_scales_gather_before_the_experts() {
    // SP gather (section 4) on an uneven layout with an empty rank: int8 hidden
    // [rows, 6], their 1-D f32 per-token scales [rows], fp8 and bool masks.
    let l = SpLayout::new(&[3, 0, 2, 4]).unwrap();
    let h = 6;
    let scale = |r: usize, i: usize| 0.5 + r as f32 * 10.0 + i as f32 / 8.0;
    let outs = run_ranks(4, &opts(), |r, comm| {
        let rows = l.local_size(r);
        let mut got = Vec::new();
        for dt in DType::BYTE_MOVES {
            let x = bytes_tensor(dt, r, rows * h, &[rows, h]);
            got.push(raw(&maybe_all_gather_and_maybe_unpad(&x, Some(&l), &comm)?));
        }
        let s = Tensor::from_slice(&(0..rows).map(|i| scale(r, i)).collect::<Vec<_>>(), &[rows])?;
        let sg = maybe_all_gather_and_maybe_unpad(&s, Some(&l), &comm)?.to_vec::<f32>()?;
        // The SP finalize (a reduction) refuses a quantized tensor.
        let q = bytes_tensor(DType::I8, r, l.total_rows() * h, &[l.total_rows(), h]);
        let e = maybe_pad_and_reduce(&q, Some(&l), &comm).unwrap_err().to_string();
        assert!(e.contains("i8") && e.contains("never reduced"), "{e}");
        Ok((got, sg))
    })
    .unwrap();
    for (r, (got, sg)) in outs.iter().enumerate() {
        let want: Vec<u8> = (0..4).flat_map(|q| (0..l.local_size(q) * h).map(move |i| byte(q, i))).collect();
        for (dt, g) in DType::BYTE_MOVES.iter().zip(got) {
            assert_eq!(g, &want, "rank {r} {dt}");
        }
        let want_s: Vec<f32> = (0..4).flat_map(|q| (0..l.local_size(q)).map(move |i| scale(q, i))).collect();
        assert_eq!(sg, &want_s, "rank {r} scales");
    }
}

#[test]
fn dp_gather_prepare_moves_int8_and_fp8_tokens() {
    // ALLGATHER without SP (section 6): pad to max_d T_d = 3 with zero bytes,
    // DP all-gather. DP 2 x TP 2, tokens [3, 1].
    let h = 4;
    let outs = run_ranks(4, &opts(), |rank, comm| {
        let (d, t) = (rank / 2, rank % 2);
        let ctx = MoeContext::new(&[3, 1], 2, d, t, false)?;
        let g = MoeGroups::from_world(&comm, 2)?;
        let mut got = Vec::new();
        for dt in [DType::I8, DType::F8E4M3, DType::F8E5M2, DType::U8] {
            let n = [3, 1][d];
            let x = bytes_tensor(dt, d, n * h, &[n, h]);
            got.push(raw(&prepare(&x, CommType::AllGather, &ctx, &g)?.hidden));
        }
        Ok(got)
    })
    .unwrap();
    let mut want = Vec::new();
    for (d, n) in [(0usize, 3usize), (1, 1)] {
        want.extend((0..3 * h).map(|i| if i < n * h { byte(d, i) } else { 0 }));
    }
    for (rank, got) in outs.iter().enumerate() {
        for g in got {
            assert_eq!(g, &want, "rank {rank}");
        }
    }
}
