//! Helpers shared by the integration tests.
//!
//! `backend_test!` turns one test body `fn(&Device) -> Result<()>` into a
//! module with a `cpu` case and an `npu` case; the NPU case is ignored (it
//! needs an Ascend NPU or the simulated runtime) but always compiles.

#![allow(dead_code)]

use ascend_moe::{Device, Element, Result};

/// Expands one test body into `cpu` and (ignored) `npu` cases:
///
/// ```ignore
/// backend_test!(adds_two_tensors, |dev| { ...; Ok(()) });
/// ```
#[macro_export]
macro_rules! backend_test {
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

/// Absolute tolerance per dtype for values of magnitude up to ~`scale`.
pub fn tolerance<T: Element>(scale: f64) -> f64 {
    let eps = match T::DTYPE {
        ascend_moe::DType::F32 => 1e-6,
        ascend_moe::DType::F16 => 1e-3,
        ascend_moe::DType::BF16 => 8e-3,
        _ => 0.0,
    };
    eps * scale.max(1.0)
}

/// Asserts `got` is within the dtype tolerance of the f64 reference `want`.
pub fn assert_close<T: Element>(what: &str, got: &[T], want: &[f64]) -> Result<()> {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let tol = tolerance::<T>(scale);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f64();
        assert!((g - w).abs() <= tol, "{what}[{i}]: got {g}, want {w} (tolerance {tol})");
    }
    Ok(())
}

/// Deterministic pseudo-random values in [-1, 1) (xorshift), no dependency.
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}
