//! Element types: [`DType`], [`Element`] and its implementations, and the
//! [`with_dtype!`](crate::with_dtype) dispatch macros.

use half::{bf16, f16};

use super::numbering::numbered;

numbered! {
    /// The element type of a tensor or a collective buffer.
    ///
    /// The discriminants are the crate's own stable numbering (also used by the C
    /// ABI); they are not ACL or HCCL values, which live in the sys crates.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum DType {
        /// IEEE 754 binary32.
        F32 = 0 => "F32",
        /// IEEE 754 binary16.
        F16 = 1 => "F16",
        /// bfloat16.
        BF16 = 2 => "BF16",
        /// Signed 32-bit integer (index tensors).
        I32 = 3 => "I32",
        /// Signed 64-bit integer.
        I64 = 4 => "I64",
        /// Signed 8-bit integer (int8-quantized hidden states; moved, never reduced).
        I8 = 5 => "I8",
        /// Unsigned 8-bit integer (also packed fp4: two e2m1 values per byte; moved,
        /// never reduced).
        U8 = 6 => "U8",
        /// Boolean, one byte (0 or 1; masks, moved, never reduced).
        Bool = 7 => "BOOL",
        /// 8-bit float, 4 exponent / 3 mantissa bits, finite only (`float8_e4m3fn`;
        /// moved, never reduced).
        F8E4M3 = 8 => "F8E4M3",
        /// 8-bit float, 5 exponent / 2 mantissa bits (`float8_e5m2`; moved, never reduced).
        F8E5M2 = 9 => "F8E5M2",
    }
}

impl DType {
    /// The dtypes reductions take (and every other collective), in numbering
    /// order: every dtype but the one-byte [`DType::BYTE_MOVES`].
    pub const REDUCIBLE: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64];
    /// The one-byte dtypes that data movement carries as exact bytes and
    /// reductions refuse.
    pub const BYTE_MOVES: [DType; 5] = [DType::I8, DType::U8, DType::Bool, DType::F8E4M3, DType::F8E5M2];
    /// Every dtype, in numbering order.
    pub const EVERY: [DType; 10] = Self::VARIANTS;
    /// The floating-point dtypes data tensors may have.
    pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::I8 | DType::U8 | DType::Bool | DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }

    /// Lower-case name (`"f32"`, `"bf16"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::Bool => "bool",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }

    /// True for f32 / f16 / bf16.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// True for the dtypes reductions (sum / max / min) accept: f32, f16, bf16,
    /// i32, i64. The one-byte dtypes are moved, never reduced.
    pub const fn is_reducible(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::I32 | DType::I64)
    }

    /// The dtype for a C ABI / CLI number, if it is one.
    pub fn from_u32(v: u32) -> Option<DType> {
        Self::try_from(v).ok()
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that is one of the crate's element types.
///
/// `to_f32` / `from_f32` are the accumulation conversions: integers go through
/// `f32` only where an op asks for it (collectives reduce integers exactly, in
/// their own type).
pub trait Element: bytemuck::Pod + Copy + Send + Sync + PartialEq + std::fmt::Debug + Default + 'static {
    /// The tag of this type.
    const DTYPE: DType;
    /// Widen to f32 (exact for f16 / bf16; may round for i32 / i64).
    fn to_f32(self) -> f32;
    /// Narrow from f32: the float types round to nearest even; the integer
    /// types truncate toward zero, saturating at their range (NaN is 0);
    /// [`Bool`] is 1 for any non-zero value.
    fn from_f32(v: f32) -> Self;
    /// Widen to f64 (used by reference implementations in tests).
    fn to_f64(self) -> f64;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

impl Element for i32 {
    const DTYPE: DType = DType::I32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v as i32
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Element for i64 {
    const DTYPE: DType = DType::I64;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v as i64
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
}

macro_rules! int_element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                self as f32
            }
            #[inline(always)]
            fn from_f32(v: f32) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
int_element!(i8, I8);
int_element!(u8, U8);

/// A one-byte boolean (0 = false, anything else = true; written as 0 or 1),
/// the layout of numpy's and torch's `bool`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct Bool(pub u8);

impl Element for Bool {
    const DTYPE: DType = DType::Bool;
    fn to_f32(self) -> f32 {
        f32::from(u8::from(self.0 != 0))
    }
    fn from_f32(v: f32) -> Self {
        Bool(u8::from(v != 0.0))
    }
    fn to_f64(self) -> f64 {
        f64::from(self.to_f32())
    }
}

/// The value of an 8-bit float code with `man` mantissa bits and exponent
/// bias `bias`; `ieee_special` when the all-ones exponent means inf / NaN
/// (e5m2), else only all-ones exponent and mantissa is NaN (e4m3fn).
fn f8_decode(bits: u8, man: u32, bias: i32, ieee_special: bool) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = i32::from((bits & 0x7f) >> man);
    let m = u32::from(bits) & ((1 << man) - 1);
    let emax = (1 << (7 - man)) - 1;
    if ieee_special && e == emax {
        return if m == 0 { sign * f32::INFINITY } else { f32::NAN };
    }
    if !ieee_special && e == emax && m == (1 << man) - 1 {
        return f32::NAN;
    }
    let frac = m as f32 / (1u32 << man) as f32;
    if e == 0 {
        sign * frac * 2f32.powi(1 - bias)
    } else {
        sign * (1.0 + frac) * 2f32.powi(e - bias)
    }
}

/// The nearest 8-bit float code to `v` (ties to the even code); beyond the
/// largest finite value by half an ulp or more: inf (`ieee_special`) or NaN.
fn f8_encode(v: f32, man: u32, bias: i32, ieee_special: bool) -> u8 {
    // 0x7f is a NaN in both formats.
    let nan = 0x7f;
    if v.is_nan() {
        return nan;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    // Finite non-negative codes in increasing order of value.
    let finite = |c: u8| f8_decode(c, man, bias, ieee_special).is_finite();
    let max_code = (0u8..0x80).rev().find(|&c| finite(c)).unwrap_or(0);
    let max = f8_decode(max_code, man, bias, ieee_special);
    let ulp = max - f8_decode(max_code - 1, man, bias, ieee_special);
    if a >= max + ulp / 2.0 {
        return sign | if ieee_special { ((1u8 << (7 - man)) - 1) << man } else { nan };
    }
    let mut best = 0u8;
    let mut best_err = f32::INFINITY;
    for c in 0..=max_code {
        let err = (f8_decode(c, man, bias, ieee_special) - a).abs();
        if err < best_err || (err == best_err && c % 2 == 0) {
            best = c;
            best_err = err;
        }
    }
    sign | best
}

macro_rules! f8_element {
    ($t:ident, $d:ident, $man:expr, $bias:expr, $ieee:expr, $doc:literal) => {
        #[doc = $doc]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
        #[repr(transparent)]
        pub struct $t(pub u8);

        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn to_f32(self) -> f32 {
                f8_decode(self.0, $man, $bias, $ieee)
            }
            fn from_f32(v: f32) -> Self {
                $t(f8_encode(v, $man, $bias, $ieee))
            }
            fn to_f64(self) -> f64 {
                f64::from(self.to_f32())
            }
        }
    };
}
f8_element!(
    F8E4M3,
    F8E4M3,
    3,
    7,
    false,
    "An `float8_e4m3fn` value (bias 7, no infinities, NaN = 0x7f / 0xff, max 448)."
);
f8_element!(F8E5M2, F8E5M2, 2, 15, true, "An `float8_e5m2` value (bias 15, IEEE-style inf / NaN, max 57344).");

/// Calls `$body` with the type alias `$T` bound to the Rust type of `$dtype`.
///
/// ```
/// use ascend_moe::{with_dtype, DType, Element};
/// let size = with_dtype!(DType::BF16, T => std::mem::size_of::<T>());
/// assert_eq!(size, 2);
/// ```
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::half::bf16;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::DType::Bool => {
                type $T = $crate::types::Bool;
                $body
            }
            $crate::DType::F8E4M3 => {
                type $T = $crate::types::F8E4M3;
                $body
            }
            $crate::DType::F8E5M2 => {
                type $T = $crate::types::F8E5M2;
                $body
            }
        }
    };
}

/// [`with_dtype!`] for the dtypes reductions accept ([`DType::is_reducible`]);
/// any other dtype evaluates `$other` instead.
#[macro_export]
macro_rules! with_reducible_dtype {
    ($dtype:expr, $T:ident => $body:expr, else $other:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::half::bf16;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            _ => $other,
        }
    };
}
