//! The leaf of the crate: basic types that every layer shares and that import
//! nothing of the crate (only `std`, `half`, `bytemuck`).
//!
//! | item | what |
//! |---|---|
//! | [`DType`], [`Element`], [`with_dtype!`](crate::with_dtype) | element types |
//! | [`Numbered`], [`Variant`], `numbered!` | enums whose numbers the C ABI and Python share, each number written once |
//! | [`ReduceOp`] | reduction operators of the collectives |
//! | [`DropPadMode`] | drop-pad modes of the finalize op (SPEC section 1) |
//! | [`TensorMeta`] | shape + dtype without data (the input of shape functions) |
//! | [`FinalizeDims`], [`OutputRows`] | sizes and output placement of a validated finalize |
//! | [`CommOptions`] | communicator options (timeouts) |
//!
//! Data tensors are `f32`, `f16` or `bf16`; index tensors are `i32`; `i64` is
//! supported by the collectives. Arithmetic on data always accumulates in `f32`
//! and rounds once (round-to-nearest-even) to the output type.
//!
//! The one-byte dtypes `i8`, `u8`, `bool`, `f8e4m3` and `f8e5m2` (packed fp4
//! travels as `u8`) carry quantized hidden states and masks: data movement
//! (all-gather, all-to-all, broadcast and the SP/DP gathers) moves them as exact
//! bytes; reductions refuse them ([`DType::is_reducible`]).

use std::ffi::CStr;
use std::time::Duration;

use half::{bf16, f16};

/// One variant of a [`Numbered`] enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    /// Upper-case name, the C ABI's spelling without the enum's prefix
    /// (`"BF16"`, `"FUSED_MC2"`); the Python package's member name.
    pub name: &'static str,
    /// [`Variant::name`] NUL-terminated, for the C ABI's name tables.
    pub c_name: &'static CStr,
    /// The fixed number.
    pub value: u32,
    /// The variant's doc comment, one line per doc line.
    pub doc: &'static str,
}

impl Variant {
    /// `name` NUL-terminated, checked at compile time where `numbered!`
    /// builds its table (a name holding a NUL fails the build).
    pub const fn nul_terminated(name_with_nul: &'static str) -> &'static CStr {
        match CStr::from_bytes_with_nul(name_with_nul.as_bytes()) {
            Ok(c) => c,
            Err(_) => panic!("a numbered variant's name must end in its only NUL"),
        }
    }
}

/// A number that is no variant of a [`Numbered`] enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownValue {
    /// The enum's Rust name.
    pub type_name: &'static str,
    /// The number.
    pub value: u32,
}

impl std::fmt::Display for UnknownValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} is not a {} number", self.value, self.type_name)
    }
}

impl std::error::Error for UnknownValue {}

/// An enum whose variants have fixed numbers that the C ABI
/// (`include/ascend_moe.h`) and the Python package take from it. Defined
/// with the crate's `numbered!` macro, which writes each number once: the
/// discriminant, [`TryFrom<u32>`] and [`Numbered::TABLE`] all come from it.
pub trait Numbered: Copy + Eq + TryFrom<u32, Error = UnknownValue> + 'static {
    /// The enum's Rust name.
    const NAME: &'static str;
    /// Name, number and doc of every variant, in declaration order.
    const TABLE: &'static [Variant];

    /// The variant's number (its discriminant).
    fn value(self) -> u32;

    /// The variant's entry of [`Numbered::TABLE`].
    fn variant(self) -> &'static Variant;

    /// The valid numbers, for error messages: `0..=3`, or a list when they
    /// are not dense from 0.
    fn expected() -> String {
        let n = Self::TABLE.len() as u32;
        if Self::TABLE.iter().enumerate().all(|(i, e)| e.value == i as u32) {
            return format!("0..={}", n.saturating_sub(1));
        }
        Self::TABLE.iter().map(|e| e.value.to_string()).collect::<Vec<_>>().join(", ")
    }
}

/// Defines a `#[repr(u32)]` enum whose numbers are written once, as
/// `Variant = number => "UPPER_NAME"`, and derives from them the
/// discriminants, `VARIANTS` (every variant, in order), [`TryFrom<u32>`] and
/// [`Numbered`] (its table of names, numbers and docs).
///
/// A number used twice is a compile error (the discriminants collide).
macro_rules! numbered {
    (@entry $upper:literal, $value:literal, [$($doc:literal)*]) => {
        $crate::types::Variant {
            name: $upper,
            c_name: $crate::types::Variant::nul_terminated(concat!($upper, "\0")),
            value: $value,
            doc: concat!($($doc, "\n"),*),
        }
    };
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $(
                $(#[doc = $doc:literal])*
                $variant:ident = $value:literal => $upper:literal
            ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr(u32)]
        $vis enum $name {
            $( $(#[doc = $doc])* $variant = $value, )+
        }

        impl $name {
            /// Every variant, in numbering order.
            pub const VARIANTS: [$name; [$(stringify!($variant)),+].len()] = [$($name::$variant),+];
        }

        impl TryFrom<u32> for $name {
            type Error = $crate::types::UnknownValue;
            fn try_from(v: u32) -> Result<Self, Self::Error> {
                match v {
                    $($value => Ok($name::$variant),)+
                    _ => Err($crate::types::UnknownValue { type_name: stringify!($name), value: v }),
                }
            }
        }

        impl $crate::types::Numbered for $name {
            const NAME: &'static str = stringify!($name);
            const TABLE: &'static [$crate::types::Variant] =
                &[$($crate::types::numbered!(@entry $upper, $value, [$($doc)*])),+];
            fn value(self) -> u32 {
                self as u32
            }
            fn variant(self) -> &'static $crate::types::Variant {
                match self {
                    $($name::$variant => {
                        const V: $crate::types::Variant = $crate::types::numbered!(@entry $upper, $value, [$($doc)*]);
                        &V
                    })+
                }
            }
        }
    };
}
pub(crate) use numbered;

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

numbered! {
    /// Reduction operator.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum ReduceOp {
        /// Sum (f32 accumulation for f16 / bf16).
        Sum = 0 => "SUM",
        /// Elementwise maximum.
        Max = 1 => "MAX",
        /// Elementwise minimum.
        Min = 2 => "MIN",
    }
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 3] = Self::VARIANTS;
    /// The operator for its number.
    pub fn from_u32(v: u32) -> Option<Self> {
        Self::try_from(v).ok()
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

numbered! {
    /// Drop-pad mode of the finalize op (SPEC section 1).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum DropPadMode {
        /// Drop-less, `expanded_x [N*K, H]`, column index layout `R(i,k) = idx[k*N + i]`.
        DropLessColumn = 0 => "DROP_LESS_COLUMN",
        /// Drop-pad, `expanded_x [E, C, H]`, column layout, `-1` = dropped slot.
        DropPadColumn = 1 => "DROP_PAD_COLUMN",
        /// Drop-less, row index layout `R(i,k) = idx[i*K + k]`.
        DropLessRow = 2 => "DROP_LESS_ROW",
        /// Drop-pad, row layout, `-1` = dropped slot.
        DropPadRow = 3 => "DROP_PAD_ROW",
    }
}

impl DropPadMode {
    /// Every mode, in numbering order.
    pub const ALL: [DropPadMode; 4] = Self::VARIANTS;
    /// The mode for its number.
    pub fn from_u32(v: u32) -> Option<Self> {
        Self::try_from(v).ok()
    }
    /// Modes 1 and 3: `expanded_x` is `[E, C, H]` and `-1` marks a dropped slot.
    pub fn is_drop_pad(self) -> bool {
        matches!(self, Self::DropPadColumn | Self::DropPadRow)
    }
    /// Modes 2 and 3: `R(i,k) = idx[i*K + k]`.
    pub fn is_row_layout(self) -> bool {
        matches!(self, Self::DropLessRow | Self::DropPadRow)
    }
}

/// Shape and dtype of a tensor, without data: the input of the shape functions
/// and of the argument checks every backend shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorMeta<'a> {
    /// Shape.
    pub shape: &'a [usize],
    /// Element type.
    pub dtype: DType,
}

impl TensorMeta<'_> {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Rows (dim 0); a 0-d tensor has one row.
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }
    /// Elements per row (product of the trailing dims).
    pub fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
}

/// Sizes of a validated finalize call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinalizeDims {
    /// Output tokens.
    pub n: usize,
    /// Top-k.
    pub k: usize,
    /// Elements per row (product of the trailing dims of `expanded_x`).
    pub h: usize,
    /// Rows of `expanded_x` viewed as 2-D (`N*K`, or `E*C`).
    pub expanded_rows: usize,
    /// Rows of `bias` (experts), 0 without bias.
    pub experts: usize,
}

/// Where the finalize writes its output rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputRows<'a> {
    /// `out` is `[N, H]`, token `i` goes to row `i`.
    Dense,
    /// `out` is the padded EP buffer `[local_sizes.len() * slot_rows, H]` of
    /// SPEC section 3: the tokens come in EP-rank block order, block `r`
    /// (`local_sizes[r]` tokens) goes to rows `[r * slot_rows, r * slot_rows +
    /// local_sizes[r])`, and every other row is written with zeros.
    Padded {
        /// Tokens per EP rank; sums to N.
        local_sizes: &'a [usize],
        /// Rows per slot (`M = max(local_sizes)`).
        slot_rows: usize,
    },
}

/// Communicator options.
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// Upper bound on every wait (rendezvous, each collective step).
    pub timeout: Duration,
}

impl Default for CommOptions {
    fn default() -> Self {
        Self::from_env()
    }
}

impl CommOptions {
    /// Default timeout when `ASCEND_MOE_COMM_TIMEOUT` is unset.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// Reads `ASCEND_MOE_COMM_TIMEOUT` (seconds, may be fractional); falls back
    /// to [`CommOptions::DEFAULT_TIMEOUT`] when unset or unparsable.
    pub fn from_env() -> Self {
        let timeout = std::env::var("ASCEND_MOE_COMM_TIMEOUT")
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(Self::DEFAULT_TIMEOUT);
        CommOptions { timeout }
    }

    /// Options with the given timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        CommOptions { timeout }
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
