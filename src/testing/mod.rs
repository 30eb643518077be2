//! Test and benchmark support, public for the integration tests and the CLI
//! (`ascend-moe check` / `bench`) but not part of the API.
//!
//! | module | holds |
//! |---|---|
//! | [`layer`] | the end-to-end MoE layer harness: cases, launchers, per-rank runs |
//! | `model` | its single-rank reference (weights, routing, the layer in f64) |
//! | [`graph`] | an ACL graph captured and replayed through the runtime's own calls (NPU tests) |
//! | [`bench`] | the finalize and finalize-and-reduce benchmarks (`ascend-moe bench`) |
//! | [`runtime`] | which CANN runtime an NPU test run expects (a missing simulator hook fails under the simulator) |
//! | here | the one RNG ([`SplitMix`]) and the one tolerance ([`assert_within_rounding`], [`Rounding`]), which the layer harness shares |

/// Runs `f` while this thread holds the process-wide locks a child made by
/// `fork` must find unlocked (the C ABI's handle table and the host pool's
/// free list, which the crate takes around `fork`): a test of those handlers.
pub fn with_fork_locks_held<R>(f: impl FnOnce() -> R) -> R {
    let _held = (crate::capi::handle::lock_for_fork(), crate::backend::cpu::host_pool::lock_for_fork());
    f()
}

pub mod bench;
pub mod graph;
pub mod layer;
mod model;
pub mod runtime;

use crate::DType;

/// SplitMix64's step as a stateless hash: `z` plus the golden gamma, then
/// the finaliser. [`SplitMix`]'s `n`th output is `mix(seed + n * gamma)`;
/// tests use it to derive one value per (seed, rank, index) directly.
pub fn mix(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The one deterministic generator of the harnesses, benches and tests (SplitMix64).
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let z = mix(self.0);
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z
    }
    /// A value in `[0, n)` (`n` > 0; modulo bias is negligible for small `n`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    /// A uniform value in `[-1, 1)` (24 random bits).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// `n` values of [`SplitMix::unit`] times `scale`.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

/// Relative rounding error of one rounding to `dtype` (0 for the exact
/// integer dtypes).
pub fn eps(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f32::EPSILON as f64,
        DType::F16 => half::f16::EPSILON.to_f64(),
        DType::BF16 => half::bf16::EPSILON.to_f64(),
        _ => 0.0,
    }
}

/// How a result was rounded, for the one op-level tolerance
/// ([`within_rounding`]): its terms summed in `acc`, the sum stored as `out`.
///
/// A [`DType`] converts to "summed and stored in that dtype" (HCCL's
/// reductions, the NPU's kernels, any order); [`Rounding::once`] is "summed
/// in f32, rounded once" (the CPU backend's finalize and unpermute).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rounding {
    /// Where the terms are summed.
    pub acc: DType,
    /// What the result is stored as.
    pub out: DType,
}

impl Rounding {
    /// Summed in f32, rounded once to `out`.
    pub fn once(out: DType) -> Self {
        Rounding { acc: DType::F32, out }
    }

    /// The bound for one element whose exact value is `want` and whose terms'
    /// magnitudes sum to `mag`: `4 * eps(acc) * mag`, plus `eps(out) * |want|`
    /// when the result is stored coarser than it was summed. Each of a few
    /// additions rounds by at most `eps(acc) / 2` of a partial sum, whose
    /// size `mag` bounds, in any order; the final store rounds by at most
    /// half an `out` unit of the result.
    pub fn tol(&self, want: f64, mag: f64) -> f64 {
        let store = if eps(self.out) > eps(self.acc) { eps(self.out) * want.abs() } else { 0.0 };
        4.0 * eps(self.acc) * mag + store + 1e-30
    }
}

impl From<DType> for Rounding {
    fn from(dtype: DType) -> Self {
        Rounding { acc: dtype, out: dtype }
    }
}

/// The tolerance of every op-level comparison with an f64 reference:
/// `got[i]` within [`Rounding::tol`]`(want[i], mag[i])` of `want[i]`, where
/// `mag[i]` is the sum of the magnitudes of the terms summed into element
/// `i`. That covers accumulation of a few terms in any order and the
/// rounding of the result, whichever backend computed it. Panics with
/// [`within_rounding`]'s message.
pub fn assert_within_rounding(what: &str, rounding: impl Into<Rounding>, got: &[f64], want: &[f64], mag: &[f64]) {
    if let Err(e) = within_rounding(what, rounding, got, want, mag) {
        panic!("{e}");
    }
}

/// [`assert_within_rounding`] as a result: `Err` names `what` and the first
/// element outside the tolerance (or the lengths that differ).
pub fn within_rounding(
    what: &str,
    rounding: impl Into<Rounding>,
    got: &[f64],
    want: &[f64],
    mag: &[f64],
) -> Result<(), String> {
    let rounding = rounding.into();
    if got.len() != want.len() || mag.len() != want.len() {
        return Err(format!("{what}: lengths: got {}, want {}, magnitudes {}", got.len(), want.len(), mag.len()));
    }
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = rounding.tol(*w, *m);
        // Written so that a NaN on either side is outside.
        let inside = (g - w).abs() <= tol;
        if !inside {
            return Err(format!("{what}: element {i}: got {g}, want {w} (tol {tol})"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rounding_bound_counts_the_sum_and_a_coarser_store() {
        let e32 = f32::EPSILON as f64;
        let ebf = half::bf16::EPSILON.to_f64();
        // Summed and stored in bf16: 4 bf16 units of the terms' size.
        assert_eq!(Rounding::from(DType::BF16).tol(1.0, 3.0), 4.0 * ebf * 3.0 + 1e-30);
        // Summed in f32, stored once as bf16: 4 f32 units of the terms plus a bf16 unit of the result.
        assert_eq!(Rounding::once(DType::BF16).tol(-2.0, 3.0), 4.0 * e32 * 3.0 + 2.0 * ebf + 1e-30);
        // f32 stored as f32: no extra store term.
        assert_eq!(Rounding::once(DType::F32).tol(2.0, 3.0), 4.0 * e32 * 3.0 + 1e-30);
        // Integers are exact.
        assert_eq!(Rounding::from(DType::I32).tol(5.0, 9.0), 1e-30);
    }

    #[test]
    fn within_rounding_refuses_what_is_outside_and_nan() {
        let tol = Rounding::from(DType::F16).tol(1.0, 1.0);
        assert!(within_rounding("x", DType::F16, &[1.0 + tol], &[1.0], &[1.0]).is_ok());
        let e = within_rounding("x", DType::F16, &[1.0, 1.0 + 2.0 * tol], &[1.0, 1.0], &[1.0, 1.0]).unwrap_err();
        assert!(e.contains("x: element 1"), "{e}");
        assert!(within_rounding("x", DType::F32, &[f64::NAN], &[1.0], &[1.0]).is_err());
        assert!(within_rounding("x", DType::F32, &[1.0], &[f64::NAN], &[1.0]).is_err());
        assert!(within_rounding("x", DType::F32, &[1.0], &[1.0, 2.0], &[1.0, 1.0]).unwrap_err().contains("lengths"));
    }
}
