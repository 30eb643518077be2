//! Helpers shared by the MoE integration tests: a seeded generator, tensor
//! builders and per-dtype tolerances.
#![allow(dead_code)]

pub mod finalize;

use ascend_moe::{with_dtype, DType, Element, Tensor};

/// SplitMix64: small, seeded, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Uniform in `[-1, 1)`.
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// A float tensor of `dtype` with uniform values in `[-1, 1)`.
pub fn random(rng: &mut Rng, shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
    from_f32(&v, shape, dtype)
}

/// A tensor of `dtype` holding `v` rounded to it.
pub fn from_f32(v: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    with_dtype!(dtype, T => {
        let d: Vec<T> = v.iter().map(|x| T::from_f32(*x)).collect();
        Tensor::from_slice(&d, shape).unwrap()
    })
}

/// The elements of a float tensor, widened to f64.
pub fn to_f64(t: &Tensor) -> Vec<f64> {
    with_dtype!(t.dtype(), T => t.to_vec::<T>().unwrap().iter().map(|x| x.to_f64()).collect())
}

/// The raw bits of a tensor (for bitwise comparisons).
pub fn bits(t: &Tensor) -> Vec<u8> {
    t.to_cpu().unwrap().cpu_bytes().unwrap().to_vec()
}

pub fn i32_tensor(v: &[i32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap()
}

/// The one op-level tolerance and its rounding unit.
#[allow(unused_imports)]
pub use ascend_moe::testing::{assert_within_rounding, eps};

/// Asserts `got` is within `rel * |want| + abs` of `want`, elementwise.
pub fn assert_close_abs(what: &str, got: &[f64], want: &[f64], rel: f64, abs: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = rel * w.abs() + abs[i];
        assert!((g - w).abs() <= tol, "{what}: element {i}: got {g}, want {w} (tol {tol})");
    }
}
