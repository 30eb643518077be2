//! Shapes without data: [`TensorMeta`], and the sizes and output placement
//! of a validated finalize ([`FinalizeDims`], [`OutputRows`]).

use super::dtype::DType;

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
    /// Number of elements; `usize::MAX` for a shape whose product does not
    /// fit (no tensor has one: every constructor checks the product).
    pub fn numel(&self) -> usize {
        self.shape.iter().fold(1usize, |n, &d| n.saturating_mul(d))
    }
    /// Rows (dim 0); a 0-d tensor has one row.
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }
    /// Elements per row (product of the trailing dims; `usize::MAX` when it
    /// does not fit, as [`TensorMeta::numel`]).
    pub fn row_len(&self) -> usize {
        self.shape.iter().skip(1).fold(1usize, |n, &d| n.saturating_mul(d))
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
