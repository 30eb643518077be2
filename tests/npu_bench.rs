//! NPU benchmarks for `ci/npu-4card.sh`: HCCL all-reduce / reduce-scatter /
//! all-gather bandwidth on 4 ranks and the finalize, each reported twice:
//! the host time of one call (ops only enqueue, so this is what a forward pays
//! on the CPU) and the time per call including the wait at the stream check
//! (the device's throughput). Each result is also checked, so a fast wrong
//! answer fails. Ignored without an NPU.
//!
//! `ASCEND_MOE_BENCH_ITERS` (default 10) sets the timed iterations.

mod common;

use std::time::Instant;

use ascend_moe::backend::{DropPadMode, FinalizeArgs, FinalizeDims, OutputRows};
use ascend_moe::half::bf16;
use ascend_moe::ranks::npu_run_ranks;
use ascend_moe::{Collectives, CommOptions, DType, Device, Result, Tensor};

/// The stream check of `dev`: waits for what was queued and reports what the device found.
fn check(dev: &Device) -> Result<()> {
    match dev {
        Device::Npu(d) => d.check(),
        _ => Ok(()),
    }
}

/// Runs `call` `iters()` times after a checked warm-up: (host seconds per
/// call, seconds per call including the stream check).
fn timed(dev: &Device, mut call: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    call()?;
    check(dev)?;
    let t = Instant::now();
    for _ in 0..iters() {
        call()?;
    }
    let host = t.elapsed().as_secs_f64();
    check(dev)?;
    let total = t.elapsed().as_secs_f64();
    Ok((host / iters() as f64, total / iters() as f64))
}

fn iters() -> usize {
    std::env::var("ASCEND_MOE_BENCH_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(10).max(1)
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn bench_collectives_world4() {
    const WORLD: usize = 4;
    let sizes = [1usize << 16, 1 << 20, 1 << 23]; // bf16 elements: 128 KiB .. 16 MiB
    let rows = npu_run_ranks(WORLD, &CommOptions::from_env(), |rank, comm| -> Result<Vec<String>> {
        let dev = comm.device();
        let mut report = Vec::new();
        for &n in &sizes {
            let ones: Vec<bf16> = vec![bf16::from_f32(1.0); n];
            let src = Tensor::from_slice(&ones, &[n])?.to_device(&dev)?;
            let mut dst = Tensor::zeros(&[n], DType::BF16, &dev)?;
            let mut part = Tensor::zeros(&[n / WORLD], DType::BF16, &dev)?;
            let mut gathered = Tensor::zeros(&[n], DType::BF16, &dev)?;
            let chunk = Tensor::zeros(&[n / WORLD], DType::BF16, &dev)?;
            let bytes = (n * 2) as f64;
            for (name, bus_factor) in [("all_reduce", 2.0), ("reduce_scatter", 1.0), ("all_gather", 1.0)] {
                comm.barrier()?;
                check(&dev)?;
                let (host, s) = timed(&dev, || match name {
                    "all_reduce" => comm.all_reduce(&src, &mut dst, ascend_moe::ReduceOp::Sum),
                    "reduce_scatter" => comm.reduce_scatter(&src, &mut part, ascend_moe::ReduceOp::Sum),
                    _ => comm.all_gather(&chunk, &mut gathered),
                })?;
                let busbw = bytes * bus_factor * (WORLD - 1) as f64 / WORLD as f64 / s / 1e9;
                report.push(format!(
                    "{name:>15} {:>10} bytes  host {:>7.1} us/call  with check {:>9.1} us  busbw {busbw:>7.2} GB/s",
                    n * 2,
                    host * 1e6,
                    s * 1e6
                ));
            }
            let check = dst.to_vec::<bf16>()?;
            assert!(check.iter().all(|v| v.to_f32() == WORLD as f32), "all_reduce of ones on rank {rank}");
        }
        Ok(report)
    })
    .unwrap();
    println!("HCCL on {WORLD} ranks (rank 0's timings):");
    for line in &rows[0] {
        println!("  {line}");
    }
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn bench_finalize_routing() {
    let dev = common::npu_device();
    let (n, k, h) = (1024usize, 8usize, 2048usize);
    let x: Vec<bf16> = common::values(1, n * k * h).into_iter().map(bf16::from_f32).collect();
    let idx: Vec<i32> = (0..n * k).map(|s| ((s * 7919) % (n * k)) as i32).collect();
    let scales: Vec<bf16> = vec![bf16::from_f32(0.125); n * k];
    let x_d = Tensor::from_slice(&x, &[n * k, h]).unwrap().to_device(&dev).unwrap();
    let idx_d = Tensor::from_slice(&idx, &[n * k]).unwrap().to_device(&dev).unwrap();
    let sc_d = Tensor::from_slice(&scales, &[n, k]).unwrap().to_device(&dev).unwrap();
    let args = FinalizeArgs::new(&x_d, &idx_d, DropPadMode::DropLessRow).with_scales(&sc_d);
    let dims = FinalizeDims { n, k, h, expanded_rows: n * k, experts: 0 };
    let mut out = Tensor::zeros(&[n, h], DType::BF16, &dev).unwrap();
    let imp = match &dev {
        Device::Npu(d) => d.finalize_impl().unwrap(),
        _ => "cpu",
    };
    let (host, s) = timed(&dev, || dev.backend().finalize_routing(&args, &dims, &mut out, OutputRows::Dense)).unwrap();
    let bytes = ((n * k * h) + n * h) as f64 * 2.0;
    println!(
        "finalize ({imp}) N={n} K={k} H={h} bf16: host {:.1} us/call, with check {:.1} us, {:.2} GB/s",
        host * 1e6,
        s * 1e6,
        bytes / s / 1e9
    );
    // Spot-check token 0 against the formula.
    let got = out.to_vec::<bf16>().unwrap();
    for j in [0usize, h / 2, h - 1] {
        let want: f32 = (0..k).map(|kk| 0.125 * x[idx[kk] as usize * h + j].to_f32()).sum();
        assert!((got[j].to_f32() - want).abs() <= 0.02 * want.abs().max(1.0), "column {j}: {} vs {want}", got[j]);
    }
}
