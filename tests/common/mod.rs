//! Helpers shared by the integration tests: deterministic data and a naive
//! reference for every collective, and `backend_test!`, which turns one test
//! body (on a device, on `N` ranks, or on a backend) into a module with a
//! `cpu` case and an `npu` case (ignored here: it needs an Ascend NPU or the
//! simulated runtime, but it always compiles).
#![allow(dead_code)]

use ascend_moe::half::{bf16, f16};
use ascend_moe::{DType, Device, Element, ReduceOp, Result};

/// The crate's one generator: SplitMix64 as a stateless hash.
pub use ascend_moe::testing::mix;

/// Element types with a test data generator and a naive reducer.
pub trait TestElem: Element {
    /// A deterministic value for (seed, rank, index).
    fn gen(seed: u64, rank: usize, i: usize) -> Self;
    /// Naive reduction over ranks in order 0..n-1 (f32 accumulation for floats).
    fn reduce(op: ReduceOp, xs: &[Self]) -> Self;
}

fn rand_f32(seed: u64, rank: usize, i: usize) -> f32 {
    let h = mix(seed ^ mix(rank as u64 ^ mix(i as u64)));
    // Full-mantissa values in [-4, 4) scaled by 2^-12 ..= 2^11: wide enough in
    // range that the f32 sum depends on the order it is taken in.
    let m = ((h >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0;
    m * f32::powi(2.0, (h % 24) as i32 - 12)
}

fn fold_f32(op: ReduceOp, xs: impl Iterator<Item = f32>) -> f32 {
    let mut acc: Option<f32> = None;
    for x in xs {
        acc = Some(match (acc, op) {
            (None, _) => x,
            (Some(a), ReduceOp::Sum) => a + x,
            (Some(a), ReduceOp::Max) => a.max(x),
            (Some(a), ReduceOp::Min) => a.min(x),
        });
    }
    acc.expect("at least one rank")
}

impl TestElem for f32 {
    fn gen(seed: u64, rank: usize, i: usize) -> Self {
        rand_f32(seed, rank, i)
    }
    fn reduce(op: ReduceOp, xs: &[Self]) -> Self {
        fold_f32(op, xs.iter().copied())
    }
}

impl TestElem for f16 {
    fn gen(seed: u64, rank: usize, i: usize) -> Self {
        f16::from_f32(rand_f32(seed, rank, i))
    }
    fn reduce(op: ReduceOp, xs: &[Self]) -> Self {
        f16::from_f32(fold_f32(op, xs.iter().map(|x| x.to_f32())))
    }
}

impl TestElem for bf16 {
    fn gen(seed: u64, rank: usize, i: usize) -> Self {
        bf16::from_f32(rand_f32(seed, rank, i))
    }
    fn reduce(op: ReduceOp, xs: &[Self]) -> Self {
        bf16::from_f32(fold_f32(op, xs.iter().map(|x| x.to_f32())))
    }
}

impl TestElem for i32 {
    fn gen(seed: u64, rank: usize, i: usize) -> Self {
        mix(seed ^ mix(rank as u64 ^ mix(i as u64))) as i32
    }
    fn reduce(op: ReduceOp, xs: &[Self]) -> Self {
        let mut acc = xs[0];
        for &x in &xs[1..] {
            acc = match op {
                ReduceOp::Sum => acc.wrapping_add(x),
                ReduceOp::Max => acc.max(x),
                ReduceOp::Min => acc.min(x),
            };
        }
        acc
    }
}

impl TestElem for i64 {
    fn gen(seed: u64, rank: usize, i: usize) -> Self {
        mix(seed ^ mix(rank as u64 ^ mix(i as u64))) as i64
    }
    fn reduce(op: ReduceOp, xs: &[Self]) -> Self {
        let mut acc = xs[0];
        for &x in &xs[1..] {
            acc = match op {
                ReduceOp::Sum => acc.wrapping_add(x),
                ReduceOp::Max => acc.max(x),
                ReduceOp::Min => acc.min(x),
            };
        }
        acc
    }
}

/// Data of `rank`: `n` values.
pub fn data<T: TestElem>(seed: u64, rank: usize, n: usize) -> Vec<T> {
    (0..n).map(|i| T::gen(seed, rank, i)).collect()
}

/// Naive elementwise reduction of every rank's data.
pub fn reduced<T: TestElem>(seed: u64, world: usize, n: usize, op: ReduceOp) -> Vec<T> {
    let all: Vec<Vec<T>> = (0..world).map(|r| data(seed, r, n)).collect();
    (0..n)
        .map(|i| {
            let col: Vec<T> = all.iter().map(|v| v[i]).collect();
            T::reduce(op, &col)
        })
        .collect()
}

/// Per-rank counts for a `_v` collective of size class `base`: uneven, with zeros.
pub fn v_counts(world: usize, base: usize) -> Vec<usize> {
    (0..world).map(|j| if base == 0 || j % 3 == 2 { 0 } else { base + j % 2 }).collect()
}

/// All-to-all matrix: `m[i][j]` elements go from rank i to rank j.
pub fn a2a_matrix(world: usize, base: usize) -> Vec<Vec<usize>> {
    (0..world)
        .map(|i| (0..world).map(|j| if base == 0 { 0 } else { (base + i * 3 + j * 5) % (2 * base + 1) }).collect())
        .collect()
}

/// Bitwise comparison with the first differing index.
pub fn same_bits<T: Element>(got: &[T], want: &[T]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("length {} != {}", got.len(), want.len()));
    }
    let (g, w): (&[u8], &[u8]) = (bytemuck::cast_slice(got), bytemuck::cast_slice(want));
    let sz = std::mem::size_of::<T>();
    match (0..got.len()).find(|&i| g[i * sz..(i + 1) * sz] != w[i * sz..(i + 1) * sz]) {
        None => Ok(()),
        Some(i) => Err(format!("element {i}: got {:?}, want {:?}", got[i], want[i])),
    }
}

/// The dtypes reductions take (not the one-byte `DType::BYTE_MOVES`).
pub const REDUCIBLE_DTYPES: [DType; 5] = DType::REDUCIBLE;

/// Expands one test body into a module with a `cpu` case and an `npu` case
/// (ignored here: it needs an Ascend NPU or the simulated runtime, but it
/// always compiles). Three forms, by what the body takes:
///
/// ```ignore
/// // One device: the CPU, or NPU 0 (`npu_device`).
/// backend_test!(adds_two_tensors, |dev| { ...; Ok(()) });
/// // `N` thread ranks: the shared-memory CPU communicator, or HCCL on NPUs `0..N`.
/// backend_test!(sums_over_four_ranks, ranks = 4, |rank, comm| { ...; Ok(()) });
/// // The backend itself, for bodies that launch several worlds (`On::run`).
/// backend_test!(pads_every_layout, |on: On| { ... });
/// ```
#[macro_export]
macro_rules! backend_test {
    ($name:ident, ranks = $world:expr, $body:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn body(rank: usize, comm: ascend_moe::Comm) -> ascend_moe::Result<()> {
                let f: fn(usize, ascend_moe::Comm) -> ascend_moe::Result<()> = $body;
                f(rank, comm)
            }

            #[test]
            fn cpu() {
                $crate::common::On::Cpu.expect_ranks($world, body);
            }

            #[test]
            #[ignore = "needs an Ascend NPU"]
            fn npu() {
                $crate::common::On::Npu.expect_ranks($world, body);
            }
        }
    };
    ($name:ident, |$on:ident: On| $body:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn body($on: $crate::common::On) {
                $body
            }

            #[test]
            fn cpu() {
                body($crate::common::On::Cpu);
            }

            #[test]
            #[ignore = "needs an Ascend NPU"]
            fn npu() {
                body($crate::common::On::Npu);
            }
        }
    };
    ($name:ident, $body:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn body(dev: &ascend_moe::Device) -> ascend_moe::Result<()> {
                let f: fn(&ascend_moe::Device) -> ascend_moe::Result<()> = $body;
                f(dev)
            }

            #[test]
            fn cpu() {
                if let Err(e) = body(&ascend_moe::Device::cpu()) {
                    panic!("cpu: {e}");
                }
            }

            #[test]
            #[ignore = "needs an Ascend NPU"]
            fn npu() {
                let dev = $crate::common::npu_device();
                if let Err(e) = body(&dev) {
                    panic!("npu: {e}");
                }
            }
        }
    };
}

/// NPU 0 (ordinal from `ASCEND_MOE_TEST_NPU`, default 0); panics with the
/// probe report when it cannot be opened.
pub fn npu_device() -> Device {
    let ordinal = std::env::var("ASCEND_MOE_TEST_NPU").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    match Device::npu(ordinal) {
        Ok(d) => d,
        Err(e) => panic!("cannot open npu:{ordinal}: {e}\n{}", ascend_moe::backend::npu::probe_report()),
    }
}

/// Deterministic pseudo-random values in [-1, 1), from the crate's one generator.
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    ascend_moe::testing::SplitMix::new(seed).vec(n, 1.0)
}

/// Where a multi-rank test body runs: thread ranks on the CPU communicator,
/// or on NPUs `0..world` through HCCL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    Cpu,
    Npu,
}

impl On {
    /// Runs `f(rank, comm)` on `world` ranks of this backend.
    pub fn run<R: Send>(
        self,
        world: usize,
        opts: &ascend_moe::CommOptions,
        f: impl Fn(usize, ascend_moe::Comm) -> ascend_moe::Result<R> + Sync,
    ) -> ascend_moe::Result<Vec<R>> {
        match self {
            On::Cpu => ascend_moe::ranks::run_ranks(world, opts, f),
            On::Npu => ascend_moe::ranks::npu_run_ranks(world, opts, f),
        }
    }

    /// Runs `body` on `world` ranks (options from the environment) and
    /// panics with the error of a rank that failed.
    pub fn expect_ranks(self, world: usize, body: fn(usize, ascend_moe::Comm) -> ascend_moe::Result<()>) {
        if let Err(e) = self.run(world, &ascend_moe::CommOptions::from_env(), body) {
            match self {
                On::Cpu => panic!("cpu: {e}"),
                On::Npu => panic!("npu: {e}\n{}", ascend_moe::backend::npu::probe_report()),
            }
        }
    }

    /// Whether a world of `world` ranks fits this backend (the NPU suite
    /// runs on 4 devices).
    pub fn fits(self, world: usize) -> bool {
        self == On::Cpu || world <= 4
    }
}
