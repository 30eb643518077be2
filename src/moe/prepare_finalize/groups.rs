//! The communicator groups of a MoE layer and the checks that they, and the
//! comm type every EP rank chose, match the context.

use super::plan::{MoeContext, PREPARE};
use crate::comm::{agree_on_sizes, expect_group_agrees, Collectives, Comm, CommType};
use crate::{Error, Result, Tensor};

/// The groups a MoE layer communicates over: EP (= the world, DP-major), the
/// TP group of this rank, its DP group and, with PCP, its PCP group.
#[derive(Debug, Clone)]
pub struct MoeGroups {
    /// EP group: every rank, EP rank `(dp * PCP + pcp) * TP + tp`.
    pub ep: Comm,
    /// This rank's TP group (`tp_size` ranks, same DP and PCP rank).
    pub tp: Comm,
    /// This rank's DP group (`dp_size` ranks, same PCP and TP rank).
    pub dp: Comm,
    /// This rank's PCP group (`pcp_size` ranks, same DP and TP rank); `None`
    /// when the PCP size is 1.
    pub pcp: Option<Comm>,
}

impl MoeGroups {
    /// Splits `world` (EP = DP x TP ranks) into TP and DP groups. Every rank calls it.
    pub fn from_world(world: &Comm, tp_size: usize) -> Result<Self> {
        const OP: &str = "MoeGroups::from_world";
        let ep = world.world_size();
        let coords = if tp_size == 0 || ep % tp_size != 0 {
            Err(Error::invalid(OP, "tp_size", format!("{tp_size} does not divide the world size {ep}")))
        } else {
            crate::comm::dp_pcp_tp_coords(OP, world, 1, tp_size)
        };
        let coords = agree_on_sizes(OP, world, &[("pcp_size", 1), ("tp_size", tp_size)], coords)?;
        Self::split(world, coords, 1, tp_size)
    }

    /// Splits `world` (EP = DP x PCP x TP ranks, EP rank `(dp * PCP + pcp) * TP
    /// + tp`, as vLLM-Ascend orders them) into TP, DP and PCP groups. Every
    /// rank calls it. An error names the three sizes when the world is not
    /// DP x `pcp_size` x `tp_size`. `pcp_size` is the world size of the PCP
    /// group (vLLM-Ascend's `pcp_size`): 0 or 1 is no PCP, the groups of
    /// [`MoeGroups::from_world`], as in [`MoeContext::with_pcp`].
    pub fn from_world_pcp(world: &Comm, pcp_size: usize, tp_size: usize) -> Result<Self> {
        const OP: &str = "MoeGroups::from_world_pcp";
        if pcp_size <= 1 {
            return Self::from_world(world, tp_size);
        }
        let coords = crate::comm::dp_pcp_tp_coords(OP, world, pcp_size, tp_size);
        let coords = agree_on_sizes(OP, world, &[("pcp_size", pcp_size), ("tp_size", tp_size)], coords)?;
        Self::split(world, coords, pcp_size, tp_size)
    }

    /// The groups of this rank at `coords` (its DP, PCP and TP ranks),
    /// after every rank agreed on the sizes.
    fn split(world: &Comm, [d, p, t]: [usize; 3], pcp_size: usize, tp_size: usize) -> Result<Self> {
        let ep = world.world_size();
        let dp_size = ep / (pcp_size * tp_size);
        let at = |d: usize, p: usize, t: usize| (d * pcp_size + p) * tp_size + t;
        let tp_ranks: Vec<usize> = (0..tp_size).map(|i| at(d, p, i)).collect();
        let dp_ranks: Vec<usize> = (0..dp_size).map(|i| at(i, p, t)).collect();
        let tp = world.split(&tp_ranks)?;
        let dp = world.split(&dp_ranks)?;
        let pcp = if pcp_size > 1 {
            let pcp_ranks: Vec<usize> = (0..pcp_size).map(|i| at(d, i, t)).collect();
            Some(world.split(&pcp_ranks)?)
        } else {
            None
        };
        Ok(MoeGroups { ep: world.clone(), tp, dp, pcp })
    }

    /// The groups of communicators the engine already has (vLLM-Ascend's EP,
    /// TP, DP and PCP groups), creating none. They must form the DP x PCP x TP
    /// layout: `ep` has `dp * pcp * tp` ranks and this rank is EP rank
    /// `(dp_rank * pcp + pcp_rank) * tp + tp_rank`; an error names the sizes
    /// and ranks that do not fit. Local: no communication.
    pub fn from_comms(ep: &Comm, tp: &Comm, dp: &Comm, pcp: Option<&Comm>) -> Result<Self> {
        const OP: &str = "MoeGroups::from_comms";
        let (p_size, p_rank) = pcp.map_or((1, 0), |c| (c.world_size(), c.rank()));
        let want = dp.world_size() * p_size * tp.world_size();
        if ep.world_size() != want {
            return Err(Error::invalid(
                OP,
                "ep",
                format!(
                    "{} ranks, but DP {} x PCP {p_size} x TP {} is {want}",
                    ep.world_size(),
                    dp.world_size(),
                    tp.world_size()
                ),
            ));
        }
        let at = (dp.rank() * p_size + p_rank) * tp.world_size() + tp.rank();
        if ep.rank() != at {
            return Err(Error::invalid(
                OP,
                "ep",
                format!(
                    "this rank is EP rank {}, but its DP rank {}, PCP rank {p_rank} and TP rank {} make EP rank {at} \
                     (EP rank = (dp * PCP + pcp) * TP + tp)",
                    ep.rank(),
                    dp.rank(),
                    tp.rank()
                ),
            ));
        }
        if let Some(c) = pcp.filter(|c| c.world_size() == 1) {
            return Err(Error::invalid(OP, "pcp", format!("{:?} has one rank: pass no PCP group", c.name())));
        }
        Ok(MoeGroups { ep: ep.clone(), tp: tp.clone(), dp: dp.clone(), pcp: pcp.cloned() })
    }
}

pub(super) fn check_groups(op: &'static str, ctx: &MoeContext, g: &MoeGroups) -> Result<()> {
    if g.ep.world_size() != ctx.ep_size() {
        return Err(Error::invalid(
            op,
            "ep",
            format!(
                "group has {} ranks, the context has DP {} x PCP {} x TP {} = {}",
                g.ep.world_size(),
                ctx.dp_size(),
                ctx.pcp_size(),
                ctx.tp_size(),
                ctx.ep_size()
            ),
        ));
    }
    let (pcp_size, pcp_rank) = g.pcp.as_ref().map_or((1, 0), |c| (c.world_size(), c.rank()));
    let checks = [
        ("pcp", pcp_size, ctx.pcp_size(), pcp_rank, ctx.pcp_rank()),
        ("ep", g.ep.world_size(), ctx.ep_size(), g.ep.rank(), ctx.ep_rank()),
        ("tp", g.tp.world_size(), ctx.tp_size(), g.tp.rank(), ctx.tp_rank()),
        ("dp", g.dp.world_size(), ctx.dp_size(), g.dp.rank(), ctx.dp_rank()),
    ];
    for (arg, size, want, rank, want_rank) in checks {
        if size != want || rank != want_rank {
            return Err(Error::invalid(
                op,
                arg,
                format!("group is rank {rank} of {size}, the context says rank {want_rank} of {want}"),
            ));
        }
    }
    Ok(())
}

/// Whether [`prepare`](super::prepare()), [`finalize`](super::finalize()) and
/// the reduction points check that every rank of their group chose the same
/// comm type: always on the CPU communicator; on the NPU only with
/// `ASCEND_MOE_CHECK_COMM_TYPE=1` (there the check is an extra collective, a
/// small copy and a guard launch per call, compared on the device and
/// reported by the stream check: it never synchronises and can be captured).
/// `ASCEND_MOE_CHECK_COMM_TYPE=0` turns it off everywhere.
pub(crate) fn comm_type_check_enabled<C: Collectives + ?Sized>(group: &C) -> bool {
    crate::types::env_switch("ASCEND_MOE_CHECK_COMM_TYPE")
        .unwrap_or_else(|| matches!(group.device(), crate::Device::Cpu))
}

/// Checks that every rank of `ep` chose `comm` for this forward (SPEC section
/// 5: all EP ranks of a forward agree on the comm type). One all-gather of one
/// i32 per rank, then [`crate::backend::Backend::expect_all_equal`]: on the
/// CPU every rank fails at once with the same error naming which ranks chose
/// which type (e.g. DP 0 ALLGATHER, DP 1 MC2); on an NPU the choices are
/// compared on the device and every rank's next stream check fails naming a
/// rank that chose otherwise. Either way the collectives of two different
/// paths never fail with an unrelated mismatch on some ranks and succeed on
/// others unnoticed.
pub fn check_comm_type_agreement<C: Collectives + ?Sized>(comm: CommType, ep: &C) -> Result<()> {
    comm_type_agreement(PREPARE, "EP", comm, None, ep, &ep.device())
}

/// What else the ranks of a comm-type agreement must see alike: `print`, a
/// fingerprint of it, sent with the comm type; `what` names it and `shown`
/// gives this rank's, for the error of ranks whose prints differ (written
/// only then, off the path of every call).
pub(crate) struct Facts {
    /// The arguments the facts come from, which the error names.
    pub(crate) arg: &'static str,
    pub(crate) what: std::borrow::Cow<'static, str>,
    pub(crate) shown: Box<dyn Fn() -> String + Send + Sync>,
    pub(crate) print: i32,
    /// This rank's DP rank and its actual-token count, which the ranks of
    /// one DP rank (its TP and PCP ranks) must hold alike while other DP
    /// ranks hold theirs: compared on a CPU group only ([`actual_tokens`]).
    pub(crate) actual: Option<(usize, usize)>,
}

/// The facts of a forward that every EP rank must see alike for prepare and
/// finalize (SPEC sections 2 and 6): every DP rank's token count, the TP and
/// PCP sizes, SP and the MC2 pad target, and the dtype and row shape of the
/// tokens `arg` (`x` of prepare, `y` of finalize; one hidden shape and dtype
/// per layer: rows of one length in another shape are other tensors, which
/// an HCCL group, comparing no shapes, would otherwise move as they are). Ranks that see the context otherwise plan other rows, and
/// where no collective compares counts (an MC2 or ALLTOALL prepare is a local
/// pad) they would go on with different layouts; ranks whose tokens differ
/// would fail only in the groups of their first collective (a DP or PCP
/// group), while the ranks of the other groups return or wait for them in
/// the second. The agreement already runs, so they cost nothing more.
pub(crate) fn context_facts(ctx: &MoeContext, arg: &'static str, tokens: &Tensor) -> Facts {
    let (dtype, row_len) = (tokens.dtype(), tokens.row_len());
    let rows: Vec<usize> = tokens.shape().get(1..).unwrap_or(&[]).to_vec();
    let mut v = ctx.dp_tokens().to_vec();
    v.extend([ctx.tp_size(), usize::from(ctx.sp()), ctx.pcp_size(), ctx.padded_num_tokens()]);
    v.extend([dtype as usize, row_len]);
    let mut printed = v.clone();
    printed.push(rows.len());
    printed.extend(&rows);
    let print = crate::moe::pad_reduce::fingerprint(&printed);
    // The error's argument names both; a `&'static str`, so one of two.
    let args = if arg == "x" { "ctx` or `x" } else { "ctx` or `y" };
    Facts {
        arg: args,
        what: format!(
            "forward context (every DP rank's token count, the TP and PCP sizes, SP, the MC2 pad target) or the \
             dtype and row shape of `{arg}`"
        )
        .into(),
        // `v` is the DP token counts, then the four sizes above, then the
        // dtype and row length.
        shown: Box::new(move || {
            let n = v.len() - 6;
            format!(
                "dp_tokens {:?}, tp_size {}, sp {}, pcp_size {}, MC2 pad target {}, `{arg}` of dtype {dtype} with \
                 rows of {row_len} elements (shape {rows:?})",
                &v[..n],
                v[n],
                v[n + 1] == 1,
                v[n + 2],
                v[n + 3]
            )
        }),
        print,
        actual: Some((ctx.dp_rank(), ctx.num_actual_tokens())),
    }
}

/// The value a rank sends in the agreement: the comm type in the low byte,
/// 24 bits of the facts' print above it.
fn agreement_value(comm: CommType, facts: Option<&Facts>) -> i32 {
    let print = facts.map_or(0, |f| f.print as u32);
    ((print << 8) | (comm as u32 & 0xff)) as i32
}

/// [`check_comm_type_agreement`] for the op `op` over its `kind` group (EP,
/// TP), which the error names, the ranks also agreeing on `facts`; on `on`,
/// the device (stream) of the op's operands.
pub(crate) fn comm_type_agreement<C: Collectives + ?Sized>(
    op: &'static str,
    kind: &'static str,
    comm: CommType,
    facts: Option<Facts>,
    ep: &C,
    on: &crate::Device,
) -> Result<()> {
    let world = ep.world_size();
    if world <= 1 {
        return Ok(());
    }
    let (group, rank) = (ep.name().to_string(), ep.rank());
    let value = agreement_value(comm, facts.as_ref());
    let actual = facts.as_ref().and_then(|f| f.actual).filter(|_| matches!(ep.device(), crate::Device::Cpu));
    let mismatch: crate::backend::Mismatch = Box::new(move |chosen, first, theirs| {
        let types_differ = match chosen {
            Some(chosen) => chosen.iter().any(|&c| c & 0xff != value & 0xff),
            None => theirs & 0xff != value & 0xff,
        };
        match facts.as_ref().filter(|_| !types_differ) {
            Some(f) => facts_disagreement(op, kind, f, &group, rank, chosen, first),
            None => comm_type_disagreement(op, kind, comm, &group, rank, chosen, first, theirs),
        }
    });
    match actual {
        Some(actual) => actual_tokens(op, ep, value, actual, mismatch),
        None => expect_group_agrees(ep, on, value, mismatch),
    }
}

/// The agreement of a CPU group whose ranks also compare their actual-token
/// counts (`actual`: this rank's DP rank and count), in the same all-gather:
/// the ranks of one DP rank run one batch, and one that counts other real
/// tokens than its TP peers would mark other rows of it real in the MC2
/// mask, silently (the mask is built on each rank alone, no collective
/// compares it). Every rank fails with `mismatch` when the agreed values
/// differ, else with an error naming `num_actual_tokens` and each
/// disagreeing DP rank's ranks and counts. An HCCL group compares the
/// fingerprint alone (its device check compares one value per rank).
fn actual_tokens<C: Collectives + ?Sized>(
    op: &'static str,
    ep: &C,
    value: i32,
    actual: (usize, usize),
    mismatch: crate::backend::Mismatch,
) -> Result<()> {
    let mine = Tensor::from_slice(&[i64::from(value), actual.0 as i64, actual.1 as i64], &[3])?;
    let mut all = Tensor::try_zeros_cpu(&[3 * ep.world_size()], crate::DType::I64)?;
    ep.all_gather(&mine, &mut all)?;
    let all = all.to_vec::<i64>()?;
    let values: Vec<i32> = all.chunks(3).map(|c| c[0] as i32).collect();
    if let Some(first) = values.iter().position(|&v| v != value) {
        return Err(mismatch(Some(&values), first, values[first]));
    }
    let each: Vec<(i64, i64)> = all.chunks(3).map(|c| (c[1], c[2])).collect();
    let mut odd = Vec::new();
    for (dp, ranks) in ranks_by(&each, |(dp, _)| dp) {
        let counts: Vec<(i64, Vec<usize>)> = ranks_by(&ranks, |r| each[r].1)
            .into_iter()
            .map(|(n, at)| (n, at.into_iter().map(|i| ranks[i]).collect()))
            .collect();
        if counts.len() > 1 {
            let parts: Vec<String> = counts.iter().map(|(n, r)| format!("ranks {r:?} count {n}")).collect();
            odd.push(format!("DP rank {dp}: {}", parts.join(", ")));
        }
    }
    if odd.is_empty() {
        return Ok(());
    }
    Err(Error::invalid(
        op,
        "num_actual_tokens",
        format!(
            "the ranks of one DP rank (its TP and PCP ranks, group {:?}) disagree on its actual-token count: {}; this \
             is rank {}, which counts {} for DP rank {}",
            ep.name(),
            odd.join("; "),
            ep.rank(),
            actual.1,
            actual.0
        ),
    ))
}

/// The error of ranks that chose one comm type but see other `facts`: the
/// ranks grouped by what they see (when all were read), else the first rank
/// that differs.
fn facts_disagreement(
    op: &'static str,
    kind: &'static str,
    facts: &Facts,
    group: &str,
    rank: usize,
    chosen: Option<&[i32]>,
    first: usize,
) -> Error {
    let who = match chosen {
        Some(chosen) => {
            let parts: Vec<String> = ranks_by(chosen, |c| c).iter().map(|(_, ranks)| format!("{ranks:?}")).collect();
            format!("ranks {} each see one", parts.join(" and "))
        }
        None => format!("rank {first} sees another (found on the device)"),
    };
    Error::invalid(
        op,
        facts.arg,
        format!(
            "the {kind} ranks of group {group:?} agree on the comm type but not on the {}: {who}; this is rank \
             {rank}, which sees {}",
            facts.what,
            (facts.shown)()
        ),
    )
}

/// The ranks of `values` (one per rank) grouped by `key` of their value,
/// in order of each key's first rank.
pub(super) fn ranks_by<T: Copy, K: PartialEq>(values: &[T], key: impl Fn(T) -> K) -> Vec<(K, Vec<usize>)> {
    let mut groups: Vec<(K, Vec<usize>)> = Vec::new();
    for (r, &v) in values.iter().enumerate() {
        let k = key(v);
        match groups.iter_mut().find(|(g, _)| *g == k) {
            Some((_, ranks)) => ranks.push(r),
            None => groups.push((k, vec![r])),
        }
    }
    groups
}

fn comm_type_name(c: i32) -> String {
    let c = c & 0xff;
    CommType::from_u32(c as u32).map_or_else(|_| format!("unknown type {c}"), |t| t.name().to_string())
}

/// The error of ranks that disagree on the comm type: every rank's choice
/// when they were all read (`chosen`), else the first rank that differs.
#[allow(clippy::too_many_arguments)]
fn comm_type_disagreement(
    op: &'static str,
    kind: &'static str,
    comm: CommType,
    group: &str,
    rank: usize,
    chosen: Option<&[i32]>,
    first: usize,
    value: i32,
) -> Error {
    let what = match chosen {
        Some(chosen) => {
            // By the comm type alone (the low byte of what each rank sent).
            let parts: Vec<String> = ranks_by(chosen, |c| c & 0xff)
                .iter()
                .map(|(c, ranks)| {
                    let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
                    let who = if ranks.len() == 1 { "rank" } else { "ranks" };
                    format!("{who} {} chose {}", list.join(", "), comm_type_name(*c))
                })
                .collect();
            parts.join("; ")
        }
        None => format!(
            "rank {first} chose {} and rank {rank} chose {} (found on the device)",
            comm_type_name(value),
            comm.name()
        ),
    };
    Error::invalid(
        op,
        "comm_type",
        format!(
            "the {kind} ranks of group {group:?} disagree on the MoE comm type of this forward: {what} (this is rank {rank})"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prepare's facts name its `x`, finalize's its `y`, in both the
    /// argument and the text of a disagreement.
    #[test]
    fn context_facts_name_the_tokens_of_their_op() {
        let ctx = MoeContext::new(&[2], 1, 0, 0, false).unwrap();
        let tokens = Tensor::from_slice(&[0f32; 6], &[2, 3]).unwrap();
        for (arg, other) in [("x", "y"), ("y", "x")] {
            let f = context_facts(&ctx, arg, &tokens);
            assert_eq!(f.arg, format!("ctx` or `{arg}"));
            assert!(f.what.starts_with("forward context (every DP rank's token count"), "{}", f.what);
            assert!(f.what.ends_with(&format!("dtype and row shape of `{arg}`")), "{}", f.what);
            assert!((f.shown)().ends_with(&format!("`{arg}` of dtype f32 with rows of 3 elements (shape [3])")));
            assert!(!f.what.contains(&format!("`{other}`")), "{}", f.what);
        }
    }
}
