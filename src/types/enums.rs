//! The operators' numbered modes: [`ReduceOp`] (collectives) and
//! [`DropPadMode`] (the finalize op, SPEC section 1).

use super::numbering::numbered;

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
