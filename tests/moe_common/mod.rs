//! Helpers shared by the MoE integration tests: the crate's generator with
//! their seeding, tensor builders, the tolerance and the finalize cases.
#![allow(dead_code)]

pub mod finalize;

use ascend_moe::testing::SplitMix;
use ascend_moe::{with_dtype, DType, Element, Tensor};

/// The crate's one generator ([`SplitMix`]) with the MoE tests' seeding:
/// `Rng::new(seed)` draws what `SplitMix::new(seed ^ 0x9E37_79B9_7F4A_7C15)` does.
pub struct Rng(SplitMix);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(SplitMix::new(seed ^ 0x9E37_79B9_7F4A_7C15))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: usize) -> usize {
        self.0.below(n as u64) as usize
    }
    /// Uniform in `[-1, 1)`.
    pub fn unit(&mut self) -> f32 {
        self.0.unit()
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

/// The one op-level tolerance, and how a result was rounded.
#[allow(unused_imports)]
pub use ascend_moe::testing::{assert_within_rounding, Rounding};
