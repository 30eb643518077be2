//! Element types and reductions of the simulated HCCL.
//!
//! A reduction combines the ranks' contributions in the order it is given
//! them (`collectives::reduction_order`).
//! Floats accumulate in `f32` (f16 and bf16 widen exactly) and are rounded once,
//! to nearest-even, at the end, so every rank computes the same bits from the
//! same inputs. Integers (int8, int32, int64) reduce exactly, and a sum wraps
//! on overflow like two's-complement hardware, in the element's own width
//! (int8: 127 + 1 is -128), as the project's CPU communicator does for its
//! integers (`shm-comm/src/reduce.rs`, `wrapping_add`); neither HCCL's code nor
//! its documentation says otherwise (the API reference's overflow notes are
//! about floats: "INF/NaN mode, no saturation mode"). Max and min on floats
//! follow `f32::max` and `f32::min`: a NaN loses against a number.

use half::{bf16, f16};

use crate::ffi::*;
use crate::status::{fail, SimResult};

/// An `HcclDataType` the simulator accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// `HCCL_DATA_TYPE_FP32`.
    F32,
    /// `HCCL_DATA_TYPE_FP16`.
    F16,
    /// `HCCL_DATA_TYPE_BFP16`.
    BF16,
    /// `HCCL_DATA_TYPE_INT32`.
    I32,
    /// `HCCL_DATA_TYPE_INT64`.
    I64,
    /// `HCCL_DATA_TYPE_INT8`: moved, and reduced with sum, max and min.
    I8,
    /// `HCCL_DATA_TYPE_UINT8`: moved, never reduced.
    U8,
}

impl DType {
    /// The type of an `HcclDataType` code (`hccl_types.h`: INT8 = 0, INT32 = 2,
    /// FP16 = 3, FP32 = 4, INT64 = 5, UINT8 = 7, BFP16 = 11 in every header
    /// generation).
    pub fn from_hccl(code: i32) -> SimResult<DType> {
        Ok(match code {
            HCCL_DATA_TYPE_FP32 => DType::F32,
            HCCL_DATA_TYPE_FP16 => DType::F16,
            HCCL_DATA_TYPE_BFP16 => DType::BF16,
            HCCL_DATA_TYPE_INT32 => DType::I32,
            HCCL_DATA_TYPE_INT64 => DType::I64,
            HCCL_DATA_TYPE_INT8 => DType::I8,
            HCCL_DATA_TYPE_UINT8 => DType::U8,
            other => return fail(HCCL_E_NOT_SUPPORT, format!("HcclDataType {other} is not simulated")),
        })
    }

    /// The `HcclDataType` code.
    pub fn hccl(self) -> i32 {
        match self {
            DType::F32 => HCCL_DATA_TYPE_FP32,
            DType::F16 => HCCL_DATA_TYPE_FP16,
            DType::BF16 => HCCL_DATA_TYPE_BFP16,
            DType::I32 => HCCL_DATA_TYPE_INT32,
            DType::I64 => HCCL_DATA_TYPE_INT64,
            DType::I8 => HCCL_DATA_TYPE_INT8,
            DType::U8 => HCCL_DATA_TYPE_UINT8,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    /// The name in `hccl_types.h` without its prefix.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "fp32",
            DType::F16 => "fp16",
            DType::BF16 => "bfp16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::I8 => "int8",
            DType::U8 => "uint8",
        }
    }
}

/// An `HcclReduceOp` the simulator accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// `HCCL_REDUCE_SUM`.
    Sum,
    /// `HCCL_REDUCE_MAX`.
    Max,
    /// `HCCL_REDUCE_MIN`.
    Min,
}

impl ReduceOp {
    /// The op of an `HcclReduceOp` code for elements of `dtype`. The simulator
    /// reduces float32, float16, bfloat16, int8, int32 and int64 with sum, max
    /// and min only (stricter than HCCL, which also has prod). uint8 is never
    /// reduced, as in HCCL: hicann/hcomm v8.5.0
    /// `src/framework/communicator/impl/hccl_communicator_host.cc:787-803`
    /// (`CheckDataType` with `needReduce` refuses uint8/16/32/64, fp64 and
    /// reserved with HCCL_E_NOT_SUPPORT, and nothing else on a 910B), where
    /// int8 passes; `src/framework/common/src/param_check.cc:318-338`
    /// (`HcomCheckReduceDataType`, 910B: only prod with int16 or bfp16 refused).
    pub fn from_hccl(code: i32, dtype: DType) -> SimResult<ReduceOp> {
        let op = match code {
            HCCL_REDUCE_SUM => ReduceOp::Sum,
            HCCL_REDUCE_MAX => ReduceOp::Max,
            HCCL_REDUCE_MIN => ReduceOp::Min,
            other => return fail(HCCL_E_NOT_SUPPORT, format!("HcclReduceOp {other} is not simulated")),
        };
        if dtype == DType::U8 {
            return fail(HCCL_E_NOT_SUPPORT, format!("reductions of {} are not simulated", dtype.name()));
        }
        Ok(op)
    }

    /// The `HcclReduceOp` code.
    pub fn hccl(self) -> i32 {
        match self {
            ReduceOp::Sum => HCCL_REDUCE_SUM,
            ReduceOp::Max => HCCL_REDUCE_MAX,
            ReduceOp::Min => HCCL_REDUCE_MIN,
        }
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

/// Values being reduced, widened, and the rank being added (scratch).
#[derive(Debug)]
enum Acc {
    Float { acc: Vec<f32>, next: Vec<f32> },
    Int { acc: Vec<i64>, next: Vec<i64> },
}

/// A reduction in progress: [`Reduction::new`] with rank 0's bytes, then
/// [`Reduction::add`] with each further rank's, in the reduction's order.
#[derive(Debug)]
pub struct Reduction {
    dtype: DType,
    op: ReduceOp,
    acc: Acc,
}

/// `out[i] = dec(i-th N-byte element of bytes)`, as a plain indexed loop
/// (which the simulator's opt-level 1 build compiles tightly).
fn widen<const N: usize, A: Copy + Default>(bytes: &[u8], out: &mut Vec<A>, dec: fn([u8; N]) -> A) {
    let n = bytes.len() / N;
    out.clear();
    out.resize(n, A::default());
    for (i, o) in out.iter_mut().enumerate() {
        let mut b = [0u8; N];
        b.copy_from_slice(&bytes[i * N..i * N + N]);
        *o = dec(b);
    }
}

/// `bytes` (elements of a float `dtype`) widened into `out`.
fn widen_floats(dtype: DType, bytes: &[u8], out: &mut Vec<f32>) {
    match dtype {
        DType::F16 => widen(bytes, out, |b| f16::from_le_bytes(b).to_f32()),
        DType::BF16 => widen(bytes, out, |b| bf16::from_le_bytes(b).to_f32()),
        _ => widen(bytes, out, f32::from_le_bytes),
    }
}

/// `bytes` (elements of an integer `dtype`) widened into `out`.
fn widen_ints(dtype: DType, bytes: &[u8], out: &mut Vec<i64>) {
    match dtype {
        DType::I8 => widen(bytes, out, |b: [u8; 1]| b[0] as i8 as i64),
        DType::I32 => widen(bytes, out, |b| i32::from_le_bytes(b) as i64),
        _ => widen(bytes, out, i64::from_le_bytes),
    }
}

impl Reduction {
    /// Starts with the first contribution. `op` was accepted for
    /// `dtype` by [`ReduceOp::from_hccl`].
    pub fn new(dtype: DType, op: ReduceOp, first: &[u8]) -> Reduction {
        let acc = match dtype {
            DType::F32 | DType::F16 | DType::BF16 => {
                let mut acc = Vec::new();
                widen_floats(dtype, first, &mut acc);
                Acc::Float { acc, next: Vec::new() }
            }
            _ => {
                let mut acc = Vec::new();
                widen_ints(dtype, first, &mut acc);
                Acc::Int { acc, next: Vec::new() }
            }
        };
        Reduction { dtype, op, acc }
    }

    /// Combines the next contribution (as many bytes as the first).
    pub fn add(&mut self, next: &[u8]) {
        match &mut self.acc {
            Acc::Float { acc, next: x } => {
                widen_floats(self.dtype, next, x);
                let pairs = acc.iter_mut().zip(x.iter());
                match self.op {
                    ReduceOp::Sum => pairs.for_each(|(a, x)| *a += *x),
                    ReduceOp::Max => pairs.for_each(|(a, x)| *a = a.max(*x)),
                    ReduceOp::Min => pairs.for_each(|(a, x)| *a = a.min(*x)),
                }
            }
            Acc::Int { acc, next: x } => {
                widen_ints(self.dtype, next, x);
                let pairs = acc.iter_mut().zip(x.iter());
                match self.op {
                    ReduceOp::Sum => pairs.for_each(|(a, x)| *a = a.wrapping_add(*x)),
                    ReduceOp::Max => pairs.for_each(|(a, x)| *a = (*a).max(*x)),
                    ReduceOp::Min => pairs.for_each(|(a, x)| *a = (*a).min(*x)),
                }
            }
        }
    }

    /// The result in the element type (little-endian bytes), into `out`
    /// (exactly as many bytes as each contribution).
    pub fn finish(self, out: &mut [u8]) {
        match (self.acc, self.dtype) {
            (Acc::Float { acc, .. }, DType::F16) => {
                out.chunks_exact_mut(2).zip(acc).for_each(|(o, x)| o.copy_from_slice(&f16::from_f32(x).to_le_bytes()))
            }
            (Acc::Float { acc, .. }, DType::BF16) => {
                out.chunks_exact_mut(2).zip(acc).for_each(|(o, x)| o.copy_from_slice(&bf16::from_f32(x).to_le_bytes()))
            }
            (Acc::Float { acc, .. }, _) => {
                out.chunks_exact_mut(4).zip(acc).for_each(|(o, x)| o.copy_from_slice(&x.to_le_bytes()))
            }
            // An int8 or int32 sum taken modulo 2^64 and truncated equals the
            // wrapping sum in the element's width (both are the sum modulo
            // 2^8, 2^32); a max or min of values of the type is one of them.
            (Acc::Int { acc, .. }, DType::I8) => out.iter_mut().zip(acc).for_each(|(o, x)| *o = x as i8 as u8),
            (Acc::Int { acc, .. }, DType::I32) => {
                out.chunks_exact_mut(4).zip(acc).for_each(|(o, x)| o.copy_from_slice(&(x as i32).to_le_bytes()))
            }
            (Acc::Int { acc, .. }, _) => {
                out.chunks_exact_mut(8).zip(acc).for_each(|(o, x)| o.copy_from_slice(&x.to_le_bytes()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce(dtype: DType, op: ReduceOp, ranks: &[Vec<u8>]) -> Vec<u8> {
        let mut r = Reduction::new(dtype, op, &ranks[0]);
        ranks[1..].iter().for_each(|b| r.add(b));
        let mut out = vec![0u8; ranks[0].len()];
        r.finish(&mut out);
        out
    }

    #[test]
    fn bf16_sums_round_once_at_the_end() {
        // 1 + 2^-8 + 2^-8: each addition rounded to bf16 (8 significant bits)
        // would lose both small terms; one rounding of the f32 sum keeps them.
        let one = bf16::from_f32(1.0).to_le_bytes().to_vec();
        let small = bf16::from_f32(1.0 / 256.0).to_le_bytes().to_vec();
        let got = reduce(DType::BF16, ReduceOp::Sum, &[one, small.clone(), small]);
        assert_eq!(bf16::from_le_bytes([got[0], got[1]]).to_f32(), 1.0 + 2.0 / 256.0);
    }

    #[test]
    fn int32_sums_wrap_and_int64_max_min_are_exact() {
        let a = i32::MAX.to_le_bytes().to_vec();
        let b = 2i32.to_le_bytes().to_vec();
        assert_eq!(reduce(DType::I32, ReduceOp::Sum, &[a, b]), (i32::MIN + 1).to_le_bytes());
        let big = [i64::MAX - 1, i64::MIN + 1];
        let bytes: Vec<Vec<u8>> = big.iter().map(|v| v.to_le_bytes().to_vec()).collect();
        assert_eq!(reduce(DType::I64, ReduceOp::Max, &bytes), (i64::MAX - 1).to_le_bytes());
        assert_eq!(reduce(DType::I64, ReduceOp::Min, &bytes), (i64::MIN + 1).to_le_bytes());
    }

    #[test]
    fn a_nan_loses_max_and_min_against_a_number() {
        let nan = f32::NAN.to_le_bytes().to_vec();
        let three = 3f32.to_le_bytes().to_vec();
        assert_eq!(reduce(DType::F32, ReduceOp::Max, &[nan.clone(), three.clone()]), 3f32.to_le_bytes());
        assert_eq!(reduce(DType::F32, ReduceOp::Min, &[three, nan]), 3f32.to_le_bytes());
    }

    #[test]
    fn int8_sums_wrap_in_eight_bits_and_max_min_are_signed() {
        let ranks: Vec<Vec<u8>> = [[100i8, -100, -128, 5], [27, -28, -1, -7], [1, -1, 0, 2]]
            .iter()
            .map(|r| r.map(|v| v as u8).to_vec())
            .collect();
        // 100 + 27 + 1 = 128 wraps to -128; -100 - 28 - 1 = -129 wraps to 127;
        // -128 - 1 + 0 = -129 wraps to 127; 5 - 7 + 2 = 0.
        let want = |v: [i8; 4]| v.map(|x| x as u8).to_vec();
        assert_eq!(reduce(DType::I8, ReduceOp::Sum, &ranks), want([-128, 127, 127, 0]));
        assert_eq!(reduce(DType::I8, ReduceOp::Max, &ranks), want([100, -1, 0, 5]));
        assert_eq!(reduce(DType::I8, ReduceOp::Min, &ranks), want([1, -100, -128, -7]));
    }

    #[test]
    fn uint8_is_never_reduced_and_prod_is_not_simulated() {
        assert!(ReduceOp::from_hccl(HCCL_REDUCE_SUM, DType::I8).is_ok());
        assert_eq!(ReduceOp::from_hccl(HCCL_REDUCE_SUM, DType::U8).unwrap_err().code, HCCL_E_NOT_SUPPORT);
        assert_eq!(ReduceOp::from_hccl(HCCL_REDUCE_PROD, DType::F32).unwrap_err().code, HCCL_E_NOT_SUPPORT);
    }
}
