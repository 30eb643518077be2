//! Element types: the [`DType`] tag and the [`Element`] trait that ties a Rust
//! type to it.
//!
//! Data tensors are `f32`, `f16` or `bf16`; index tensors are `i32`; `i64` is
//! supported by the collectives. Arithmetic on data always accumulates in `f32`
//! and rounds once (round-to-nearest-even) to the output type.

use half::{bf16, f16};

/// The element type of a tensor or a collective buffer.
///
/// The discriminants are the crate's own stable numbering (also used by the C
/// ABI); they are not ACL or HCCL values, which live in the sys crates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DType {
    /// IEEE 754 binary32.
    F32 = 0,
    /// IEEE 754 binary16.
    F16 = 1,
    /// bfloat16.
    BF16 = 2,
    /// Signed 32-bit integer (index tensors).
    I32 = 3,
    /// Signed 64-bit integer.
    I64 = 4,
}

impl DType {
    /// Every dtype, in numbering order.
    pub const ALL: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64];
    /// The floating-point dtypes data tensors may have.
    pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
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
        }
    }

    /// True for f32 / f16 / bf16.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// The dtype for a C ABI / CLI number, if it is one.
    pub fn from_u32(v: u32) -> Option<DType> {
        Self::ALL.into_iter().find(|d| *d as u32 == v)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL.into_iter().find(|d| d.name().eq_ignore_ascii_case(s)).ok_or_else(|| {
            crate::Error::invalid(
                "DType::from_str",
                "dtype",
                format!("unknown dtype {s:?} (expected one of f32, f16, bf16, i32, i64)"),
            )
        })
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
    /// Narrow from f32, rounding to nearest even.
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
        }
    };
}
