//! Element types and reduction operators the transport knows.
//!
//! Reductions run on f32 / f16 / bf16 / i32 / i64. Data movement (all-gather,
//! all-to-all, broadcast) copies bytes, so it takes every type here, including
//! the 1-byte quantized types (int8, uint8, bool, fp8; packed fp4 travels as
//! uint8).

/// The element type of a collective buffer.
///
/// The discriminants are this crate's own numbering, posted in collective
/// descriptors so that ranks passing different types are told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum DataType {
    /// IEEE 754 binary32.
    F32 = 0,
    /// IEEE 754 binary16.
    F16 = 1,
    /// bfloat16.
    BF16 = 2,
    /// Signed 32-bit integer.
    I32 = 3,
    /// Signed 64-bit integer.
    I64 = 4,
    /// Signed 8-bit integer.
    I8 = 5,
    /// Unsigned 8-bit integer (also packed fp4 pairs).
    U8 = 6,
    /// One byte per boolean.
    Bool = 7,
    /// fp8 e4m3fn.
    F8E4M3 = 8,
    /// fp8 e5m2.
    F8E5M2 = 9,
}

impl DataType {
    /// Every type, in numbering order.
    pub const ALL: [DataType; 10] = [
        DataType::F32,
        DataType::F16,
        DataType::BF16,
        DataType::I32,
        DataType::I64,
        DataType::I8,
        DataType::U8,
        DataType::Bool,
        DataType::F8E4M3,
        DataType::F8E5M2,
    ];
    /// The types reductions accept.
    pub const REDUCIBLE: [DataType; 5] = [DataType::F32, DataType::F16, DataType::BF16, DataType::I32, DataType::I64];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DataType::F32 | DataType::I32 => 4,
            DataType::F16 | DataType::BF16 => 2,
            DataType::I64 => 8,
            DataType::I8 | DataType::U8 | DataType::Bool | DataType::F8E4M3 | DataType::F8E5M2 => 1,
        }
    }

    /// Lower-case name (`"f32"`, `"bf16"`, `"f8e4m3fn"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DataType::F32 => "f32",
            DataType::F16 => "f16",
            DataType::BF16 => "bf16",
            DataType::I32 => "i32",
            DataType::I64 => "i64",
            DataType::I8 => "i8",
            DataType::U8 => "u8",
            DataType::Bool => "bool",
            DataType::F8E4M3 => "f8e4m3fn",
            DataType::F8E5M2 => "f8e5m2",
        }
    }

    /// Whether reductions (sum / max / min) accept this type.
    pub const fn is_reducible(self) -> bool {
        matches!(self, DataType::F32 | DataType::F16 | DataType::BF16 | DataType::I32 | DataType::I64)
    }

    /// The type for its number.
    pub fn from_u32(v: u32) -> Option<DataType> {
        Self::ALL.into_iter().find(|d| *d as u32 == v)
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ReduceOp {
    /// Sum (f32 accumulation for f16 / bf16; integers wrap).
    Sum = 0,
    /// Elementwise maximum.
    Max = 1,
    /// Elementwise minimum.
    Min = 2,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];

    /// The operator for its number.
    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|o| *o as u32 == v)
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
