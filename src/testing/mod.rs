//! Test and benchmark support, public for the integration tests and the CLI
//! (`ascend-moe check` / `bench`) but not part of the API.
//!
//! | module | holds |
//! |---|---|
//! | [`layer`] | the end-to-end MoE layer harness: cases, launchers, per-rank runs |
//! | `model` | its single-rank reference (weights, routing, the layer in f64) |
//! | [`bench`] | the finalize and finalize-and-reduce benchmarks (`ascend-moe bench`) |
//! | here | the one RNG ([`SplitMix`]), the op-level tolerance ([`assert_within_rounding`]) and the layer's ([`tolerance`]) |

pub mod bench;
pub mod layer;
mod model;

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

/// The tolerance of every op-level comparison with an f64 reference:
/// `got[i]` within `4 * eps(dtype) * mag[i]` of `want[i]`, where `mag[i]` is
/// the sum of the magnitudes of the terms summed into element `i`. That
/// covers f32 accumulation of a few terms in any order (each addition rounds
/// by at most `eps(F32) / 2` of the partial sum) and one rounding to `dtype`,
/// whichever backend computed it and in whatever order. Panics with
/// [`within_rounding`]'s message.
pub fn assert_within_rounding(what: &str, dtype: DType, got: &[f64], want: &[f64], mag: &[f64]) {
    if let Err(e) = within_rounding(what, dtype, got, want, mag) {
        panic!("{e}");
    }
}

/// [`assert_within_rounding`] as a result: `Err` names `what` and the first
/// element outside the tolerance (or the lengths that differ).
pub fn within_rounding(what: &str, dtype: DType, got: &[f64], want: &[f64], mag: &[f64]) -> Result<(), String> {
    if got.len() != want.len() || mag.len() != want.len() {
        return Err(format!("{what}: lengths: got {}, want {}, magnitudes {}", got.len(), want.len(), mag.len()));
    }
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = 4.0 * eps(dtype) * m + 1e-30;
        // Written so that a NaN on either side is outside.
        let inside = (g - w).abs() <= tol;
        if !inside {
            return Err(format!("{what}: element {i}: got {g}, want {w} (tol {tol})"));
        }
    }
    Ok(())
}

/// The per-token tolerance of a dtype in the layer harness: `rtol * |want| + atol`.
pub fn tolerance(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (1e-4, 1e-4),
        DType::F16 => (1e-2, 1e-2),
        _ => (3e-2, 3e-2),
    }
}
