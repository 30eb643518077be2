//! NPU benchmarks for `ci/npu-4card.sh`: HCCL all-reduce / reduce-scatter /
//! all-gather bandwidth on 4 ranks and the finalize, each reported twice:
//! the host time of one call (ops only enqueue, so this is what a forward pays
//! on the CPU) and the time per call including the wait at the stream check
//! (the device's throughput). Every result that is timed is also checked,
//! element by element, against a reference computed here, so a fast wrong
//! answer fails. Ignored without an NPU.
//!
//! `ASCEND_MOE_BENCH_ITERS` (default 10) sets the timed iterations.
//! `ASCEND_MOE_BENCH_SHORT=1` runs the short form: small sizes and two
//! iterations, every check the same (what `ci/sim.sh` runs under the
//! simulated runtime, where timings mean nothing).

mod common;
mod moe_common;

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
    let default = if short() { 2 } else { 10 };
    std::env::var("ASCEND_MOE_BENCH_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(default).max(1)
}

/// Whether `ASCEND_MOE_BENCH_SHORT=1` asks for the short form.
fn short() -> bool {
    std::env::var("ASCEND_MOE_BENCH_SHORT").is_ok_and(|v| v == "1")
}

/// `got` (bf16) equals `want` exactly (small integers: every order of an
/// exact sum gives the same bits).
fn expect_exact(what: &str, got: &Tensor, want: impl Fn(usize) -> f32) -> Result<()> {
    let got = got.to_vec::<bf16>()?;
    if let Some((i, g)) = got.iter().enumerate().find(|(i, g)| g.to_f32() != want(*i)) {
        panic!("{what}: element {i} is {g}, want {}", want(i));
    }
    Ok(())
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn bench_collectives_world4() {
    const WORLD: usize = 4;
    // bf16 elements: 128 KiB .. 16 MiB (short form: 2 KiB and 8 KiB).
    let sizes: &[usize] = if short() { &[1 << 10, 1 << 12] } else { &[1 << 16, 1 << 20, 1 << 23] };
    // Rank r sends `i % 7 + r` (all-reduce, reduce-scatter) and `3r + i % 5`
    // (all-gather): small integers, so every sum is exact in bf16 whatever
    // the order HCCL reduces in.
    let sent = |r: usize, i: usize| (i % 7 + r) as f32;
    let summed = |i: usize| (0..WORLD).map(|r| sent(r, i)).sum::<f32>();
    let gathered_from = |r: usize, j: usize| (3 * r + j % 5) as f32;
    let rows = npu_run_ranks(WORLD, &CommOptions::from_env(), |rank, comm| -> Result<Vec<String>> {
        let dev = comm.device();
        let mut report = Vec::new();
        for &n in sizes {
            let block = n / WORLD;
            let mine: Vec<bf16> = (0..n).map(|i| bf16::from_f32(sent(rank, i))).collect();
            let src = Tensor::from_slice(&mine, &[n])?.to_device(&dev)?;
            let mut dst = Tensor::zeros(&[n], DType::BF16, &dev)?;
            let mut part = Tensor::zeros(&[block], DType::BF16, &dev)?;
            let mut gathered = Tensor::zeros(&[n], DType::BF16, &dev)?;
            let mine: Vec<bf16> = (0..block).map(|j| bf16::from_f32(gathered_from(rank, j))).collect();
            let chunk = Tensor::from_slice(&mine, &[block])?.to_device(&dev)?;
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
            expect_exact(&format!("all_reduce of {n} on rank {rank}"), &dst, summed)?;
            expect_exact(&format!("reduce_scatter of {n} on rank {rank}"), &part, |j| summed(rank * block + j))?;
            expect_exact(&format!("all_gather of {n} on rank {rank}"), &gathered, |i| {
                gathered_from(i / block, i % block)
            })?;
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
    let (n, k, h) = if short() { (64usize, 4usize, 256usize) } else { (1024usize, 8usize, 2048usize) };
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
    // Every element against SPEC section 1 in f64 (mode 2, scales, no
    // skips): f32 accumulation in any order and one rounding to bf16.
    let mut want = vec![0f64; n * h];
    let mut mag = vec![0f64; n * h];
    for (slot, &r) in idx.iter().enumerate() {
        let (row, token) = (&x[r as usize * h..][..h], slot / k);
        for (j, v) in row.iter().enumerate() {
            let term = 0.125 * v.to_f64();
            want[token * h + j] += term;
            mag[token * h + j] += term.abs();
        }
    }
    moe_common::assert_within_rounding(
        &format!("finalize ({imp})"),
        DType::BF16,
        &moe_common::to_f64(&out),
        &want,
        &mag,
    );
}
