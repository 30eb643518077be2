//! The sequence-parallel EP layout (SPEC section 2): how many rows every EP
//! rank holds. It is explicit input to every op that needs it; no op reads
//! hidden global state to find it.

use crate::{Error, Result};

/// Most EP ranks (`dp_size * pcp_size * tp_size`) a layout or a [`crate::moe::prepare_finalize::MoeContext`]
/// may describe. Ops build per-rank tables of this size, so it is bounded
/// before anything is allocated. The C ABI exports it as `AMOE_MAX_EP_RANKS`.
pub const MAX_EP_RANKS: usize = 1 << 20;

/// Checks that the product of the named `sizes` (`dp_size`, `pcp_size`,
/// `tp_size`, ... as the caller passed them) is at most `MAX_EP_RANKS`,
/// without overflow, and returns it (the EP size); the error, naming `arg`,
/// gives every factor.
pub(crate) fn bounded_ep(op: &'static str, arg: &'static str, sizes: &[(&str, usize)]) -> Result<usize> {
    match sizes.iter().try_fold(1usize, |p, &(_, n)| p.checked_mul(n)) {
        Some(ep) if ep <= MAX_EP_RANKS => Ok(ep),
        _ => {
            let factors: Vec<String> = sizes.iter().map(|(name, n)| format!("{name} {n}")).collect();
            let why = format!("{} exceeds the maximum of {MAX_EP_RANKS} EP ranks", factors.join(" x "));
            Err(Error::invalid(op, arg, why))
        }
    }
}

/// `local_sizes[r]` for every EP rank `r`, with their prefix offsets and the
/// slot size `M = max(local_sizes)` of the padded EP buffer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SpLayout {
    local_sizes: Vec<usize>,
    /// `offsets[r]` = rows before rank `r`; `offsets[ep_size]` = total.
    offsets: Vec<usize>,
    max_rows: usize,
}

impl SpLayout {
    /// A layout from the rows of every EP rank (length = EP world size, at
    /// least 1). Ranks with 0 rows are legal.
    pub fn new(local_sizes: &[usize]) -> Result<Self> {
        if local_sizes.is_empty() {
            return Err(Error::invalid("SpLayout::new", "local_sizes", "expected one entry per EP rank, got none"));
        }
        if local_sizes.len() > MAX_EP_RANKS {
            return Err(Error::invalid(
                "SpLayout::new",
                "local_sizes",
                format!("{} entries exceed the maximum of {MAX_EP_RANKS} EP ranks", local_sizes.len()),
            ));
        }
        let mut offsets = Vec::with_capacity(local_sizes.len() + 1);
        let mut acc = 0usize;
        offsets.push(0);
        for &s in local_sizes {
            acc = acc.checked_add(s).ok_or_else(|| {
                Error::invalid("SpLayout::new", "local_sizes", format!("total rows overflow: {local_sizes:?}"))
            })?;
            offsets.push(acc);
        }
        let max_rows = local_sizes.iter().copied().max().unwrap_or(0);
        if local_sizes.len().checked_mul(max_rows).is_none() {
            return Err(Error::invalid(
                "SpLayout::new",
                "local_sizes",
                format!("{} ranks x {max_rows} rows: the padded row count overflows", local_sizes.len()),
            ));
        }
        Ok(SpLayout { local_sizes: local_sizes.to_vec(), offsets, max_rows })
    }

    /// The SP layout of DP token counts `dp_tokens[d]` with `tp_size` TP ranks
    /// per DP rank: `local_sizes[d * tp_size + t] = ceil(T_d / tp_size)` for every
    /// `t` (each DP batch is zero-padded to a multiple of TP and split evenly).
    pub fn from_dp_tokens(dp_tokens: &[usize], tp_size: usize) -> Result<Self> {
        const OP: &str = "SpLayout::from_dp_tokens";
        if tp_size == 0 {
            return Err(Error::invalid(OP, "tp_size", "expected >= 1, got 0"));
        }
        if dp_tokens.is_empty() {
            return Err(Error::invalid(OP, "dp_tokens", "expected one entry per DP rank, got none"));
        }
        bounded_ep(OP, "tp_size", &[("dp_size", dp_tokens.len()), ("tp_size", tp_size)])?;
        let sizes: Vec<usize> =
            dp_tokens.iter().flat_map(|&t| std::iter::repeat(t.div_ceil(tp_size)).take(tp_size)).collect();
        Self::new(&sizes)
    }

    /// The SP layout with prefill context parallelism: EP rank order is
    /// DP x PCP x TP and every PCP rank of DP rank `d` holds `ceil(T_d / TP)`
    /// rows per TP rank, `local_sizes[(d * pcp_size + p) * tp_size + t] =
    /// ceil(T_d / tp_size)` (SPEC section 2; DP2 PCP2 TP2 with tokens [1, 9]
    /// gives [1, 1, 1, 1, 5, 5, 5, 5]).
    pub fn from_dp_tokens_pcp(dp_tokens: &[usize], pcp_size: usize, tp_size: usize) -> Result<Self> {
        const OP: &str = "SpLayout::from_dp_tokens_pcp";
        if pcp_size == 0 {
            return Err(Error::invalid(OP, "pcp_size", "expected >= 1, got 0"));
        }
        if tp_size == 0 {
            return Err(Error::invalid(OP, "tp_size", "expected >= 1, got 0"));
        }
        bounded_ep(OP, "pcp_size", &[("dp_size", dp_tokens.len()), ("pcp_size", pcp_size), ("tp_size", tp_size)])?;
        let cell = pcp_size.saturating_mul(tp_size);
        let sizes: Vec<usize> =
            dp_tokens.iter().flat_map(|&t| std::iter::repeat(t.div_ceil(tp_size)).take(cell)).collect();
        if sizes.is_empty() {
            return Err(Error::invalid(OP, "dp_tokens", "expected one entry per DP rank, got none"));
        }
        Self::new(&sizes)
    }

    /// Checks that this layout has one entry per rank of DP `dp_size` x PCP
    /// `pcp_size` x TP `tp_size`; the error names the three sizes.
    pub fn check_dp_pcp_tp(&self, op: &'static str, dp_size: usize, pcp_size: usize, tp_size: usize) -> Result<()> {
        let want = dp_size.checked_mul(pcp_size).and_then(|c| c.checked_mul(tp_size));
        if want != Some(self.ep_size()) {
            return Err(Error::invalid(
                op,
                "layout",
                format!(
                    "has {} entries, which does not fit DP {dp_size} x PCP {pcp_size} x TP {tp_size}{}",
                    self.ep_size(),
                    want.map_or(String::new(), |w| format!(" = {w} EP ranks"))
                ),
            ));
        }
        Ok(())
    }

    /// Every rank holding `rows` rows (the layout of a plain reduce-scatter).
    pub fn uniform(ep_size: usize, rows: usize) -> Result<Self> {
        bounded_ep("SpLayout::uniform", "ep_size", &[("ep_size", ep_size)])?;
        Self::new(&vec![rows; ep_size])
    }

    /// EP world size (number of entries).
    pub fn ep_size(&self) -> usize {
        self.local_sizes.len()
    }

    /// Rows of every EP rank.
    pub fn local_sizes(&self) -> &[usize] {
        &self.local_sizes
    }

    /// Rows of EP rank `rank` (0 for a rank outside the layout).
    pub fn local_size(&self, rank: usize) -> usize {
        self.local_sizes.get(rank).copied().unwrap_or(0)
    }

    /// `M = max(local_sizes)`, the rows of one slot of the padded buffer (may be 0).
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// `sum(local_sizes)`: rows of the gathered tensor.
    pub fn total_rows(&self) -> usize {
        self.offsets[self.local_sizes.len()]
    }

    /// `EP * M`: rows of the padded EP buffer.
    pub fn padded_rows(&self) -> usize {
        self.ep_size() * self.max_rows
    }

    /// Prefix offsets: `offsets()[r]` is the first gathered row of rank `r`;
    /// the last entry is [`SpLayout::total_rows`].
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// First gathered row of rank `rank`.
    pub fn offset(&self, rank: usize) -> usize {
        self.offsets[rank.min(self.local_sizes.len())]
    }

    /// True when no rank is padded (every rank holds `M` rows).
    pub fn is_uniform(&self) -> bool {
        self.local_sizes.iter().all(|&s| s == self.max_rows)
    }

    /// Checks that this layout has one entry per rank of an EP group of `ep_size`.
    pub fn check_ep_size(&self, op: &'static str, ep_size: usize) -> Result<()> {
        if self.ep_size() != ep_size {
            return Err(Error::invalid(
                op,
                "layout",
                format!("has {} entries {:?}, expected one per EP rank ({ep_size})", self.ep_size(), self.local_sizes),
            ));
        }
        Ok(())
    }
}
