//! The experts' sum of the aclnn MoE ops, in the simulator's own order.

/// `terms(k, j)` for `k < K`, summed into `acc[j]` (`j < acc.len()`) in pairs
/// from the last: `acc += (t[K-1] + t[K-2]) + (t[K-3] + t[K-4]) + ...`, an
/// odd one added alone at the end, all in f32.
///
/// The aclnn MoE ops promise neither an accumulation order nor, unless the
/// context asks with `aclrtCtxSetSysParamOpt(ACL_OPT_DETERMINISTIC, 1)`
/// (hicann/runtime v8.5.0 `docs/api_docs/aclSysParamOpt.md`: by default
/// "the accumulation order of floats may change" between runs), repeatable
/// bits; SPEC.md
/// section 1 fixes an order for the crate's own kernels only. The simulator
/// therefore accumulates in an order of its own: from K = 3 on, and from
/// K = 2 when added to skips, its bits differ from SPEC order's wherever
/// rounding depends on the order, so a caller that expects SPEC's bits from
/// an aclnn op fails here rather than on a device. The order is the same on
/// every run (a deterministic context would get exactly this).
pub(super) fn blocked_sum(acc: &mut [f32], k: usize, terms: impl Fn(usize, usize) -> f32) {
    let mut sum = vec![0f32; acc.len()];
    let mut hi = k;
    let mut first = true;
    while hi > 0 {
        let lo = hi.saturating_sub(2);
        for (j, s) in sum.iter_mut().enumerate() {
            let pair = if hi - lo == 2 { terms(hi - 1, j) + terms(lo, j) } else { terms(lo, j) };
            *s = if first { pair } else { *s + pair };
        }
        first = false;
        hi = lo;
    }
    acc.iter_mut().zip(sum).for_each(|(a, s)| *a += s);
}
