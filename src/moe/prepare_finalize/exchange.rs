//! The token exchange of the MC2 and ALLTOALL paths over the EP group:
//! [`dispatch`] to the experts' ranks and [`combine`] back.

use crate::backend::args::with_rows;
use crate::backend::{Call, FinalizeArgs};
use crate::comm::{Collectives, Comm};
use crate::moe::finalize::moe_finalize_routing;
use crate::{DType, DropPadMode, Error, Result, Tensor};

/// Tokens after [`dispatch`]: the rows this rank's experts process.
#[derive(Debug)]
pub struct Dispatched {
    /// Received rows `[R, H...]`, grouped by source rank.
    pub rows: Tensor,
    /// The (global) expert of every received row.
    pub experts: Vec<i32>,
    send_counts: Vec<usize>,
    recv_counts: Vec<usize>,
    /// Per (token, k) slot (row-major): its position in the send order, or -1.
    send_pos: Vec<i32>,
    tokens: usize,
    top_k: usize,
}

const DISPATCH: &str = "moe_dispatch";

/// Elements every rank sends every other in the exchange of the counts:
/// the rows it sends there and its `num_experts`.
const COUNT_WORDS: usize = 2;

/// The host values `v` as a 1-D tensor on `device` for an op's own use:
/// on an NPU copied through the stream's pinned staging, queued on the
/// stream (no allocation, no synchronisation, no blocking copy, as
/// [`Tensor::to_device`] makes).
fn staged<T: crate::Element>(v: &[T], device: &crate::Device) -> Result<Tensor> {
    device.backend().scratch_from_host(&Tensor::from_slice(v, &[v.len()])?)
}

/// Exchanges the row counts of a dispatch over `ep`: this rank sends
/// `send[r]` to rank `r` and receives the rows every rank sends it. Each
/// count travels with the sender's `num_experts`, which decides which rank
/// owns which expert: ranks whose `num_experts` differ would send a token
/// to a rank that does not hold its expert, so every rank, having read
/// every rank's, fails naming them (no extra collective).
fn exchange_counts(ep: &Comm, send: &[usize], num_experts: usize) -> Result<Vec<usize>> {
    let world = ep.world_size();
    let s: Vec<i64> = send.iter().flat_map(|&c| [c as i64, num_experts as i64]).collect();
    let src = staged(&s, &ep.device())?;
    let mut dst = ep.device().backend().scratch(&[COUNT_WORDS * world], DType::I64)?;
    let words = vec![COUNT_WORDS; world];
    ep.all_to_all_v(&src, &words, &mut dst, &words)?;
    let got = dst.to_vec::<i64>()?;
    let experts: Vec<i64> = got.iter().skip(1).step_by(COUNT_WORDS).copied().collect();
    if experts.iter().any(|&e| e != num_experts as i64) {
        let groups = super::groups::ranks_by(&experts, |e| e);
        let each: Vec<String> = groups.iter().map(|(e, ranks)| format!("ranks {ranks:?} pass {e}")).collect();
        return Err(Error::invalid(
            DISPATCH,
            "num_experts",
            format!(
                "the EP ranks of group {:?} disagree on the number of experts, which decides the rank of each \
                 expert: {}; this is rank {}, which passes {num_experts}",
                ep.name(),
                each.join(", "),
                ep.rank()
            ),
        ));
    }
    Ok(got.iter().step_by(COUNT_WORDS).map(|&c| c.max(0) as usize).collect())
}

/// The arguments of [`dispatch`] for an EP group of `world` ranks.
fn check_dispatch(
    x: &Tensor,
    topk_ids: &[i32],
    top_k: usize,
    mask: Option<&[bool]>,
    num_experts: usize,
    world: usize,
) -> Result<()> {
    const OP: &str = DISPATCH;
    let n = x.rows();
    if x.shape().is_empty() {
        return Err(Error::shape(OP, "x", "[N, H...]", x.shape()));
    }
    if top_k == 0 || n.checked_mul(top_k) != Some(topk_ids.len()) {
        return Err(Error::invalid(OP, "topk_ids", format!("{} ids for {n} tokens x top-k {top_k}", topk_ids.len())));
    }
    if num_experts == 0 || num_experts % world != 0 {
        return Err(Error::invalid(
            OP,
            "num_experts",
            format!("{num_experts} experts do not split over {world} EP ranks"),
        ));
    }
    if let Some(m) = mask {
        if m.len() != n {
            return Err(Error::invalid(OP, "mask", format!("{} entries for {n} tokens", m.len())));
        }
    }
    if let Some(p) = topk_ids.iter().position(|&e| e < 0 || e as usize >= num_experts) {
        return Err(Error::IndexOutOfRange {
            op: OP,
            arg: "topk_ids",
            position: p,
            value: topk_ids[p] as i64,
            valid: format!("[0, {num_experts})"),
        });
    }
    Ok(())
}

/// MoE dispatch over the EP group: every (token, k) slot of `x` (`[N, H...]`)
/// whose token is real (`mask`, all real when `None`) is sent to the EP rank
/// owning expert `topk_ids[token * K + k]` (experts are split evenly, EP rank
/// `r` owning `[r * E/EP, (r+1) * E/EP)`). Every EP rank must pass the same
/// `num_experts`: ranks that do not all fail in the exchange of the counts,
/// naming each rank's.
pub fn dispatch(
    x: &Tensor,
    topk_ids: &[i32],
    top_k: usize,
    mask: Option<&[bool]>,
    num_experts: usize,
    ep: &Comm,
) -> Result<Dispatched> {
    let world = ep.world_size();
    let n = x.rows();
    let checked = check_dispatch(x, topk_ids, top_k, mask, num_experts, world);
    // The peers are in the exchange of the send counts already: a refusal
    // goes through it, so on a CPU group they fail at once with this rank's
    // reason instead of waiting for it until the group's timeout.
    let words = vec![COUNT_WORDS; world];
    checked.map_err(|e| ep.refuse_call(Call::AllToAllV(&words, &words), DType::I64, e))?;
    let per_rank = num_experts / world;
    // Send order: by destination rank, then slot order.
    let mut order: Vec<(usize, usize)> = Vec::new();
    for (slot, &e) in topk_ids.iter().enumerate() {
        if mask.map_or(true, |m| m[slot / top_k]) {
            order.push((e as usize / per_rank, slot));
        }
    }
    order.sort_by_key(|&(dst, slot)| (dst, slot));
    let mut send_counts = vec![0usize; world];
    let mut send_pos = vec![-1i32; n * top_k];
    let mut gather = Vec::with_capacity(order.len());
    let mut send_experts = Vec::with_capacity(order.len());
    for (p, &(dst, slot)) in order.iter().enumerate() {
        send_counts[dst] += 1;
        send_pos[slot] = p as i32;
        gather.push((slot / top_k) as i32);
        send_experts.push(topk_ids[slot]);
    }
    let recv_counts = exchange_counts(ep, &send_counts, num_experts)?;
    let device = x.device();
    let h = x.row_len();
    // The counts are the peers' and `h` is this rank's (a peer whose rows
    // are longer sends counts that, times `h`, may not be a number): the
    // products saturate, and the room for the received rows below, whose
    // size is then no number either, is refused through the exchange.
    let recv_total = recv_counts.iter().fold(0usize, |a, &c| a.saturating_add(c));
    let sc: Vec<usize> = send_counts.iter().map(|c| c.saturating_mul(h)).collect();
    let rc: Vec<usize> = recv_counts.iter().map(|c| c.saturating_mul(h)).collect();
    // The rows to send, gathered with the unpermute op (K = 1: a row
    // gather), and room for those received. Memory this rank cannot have
    // (a rank that sends or receives many more rows than its peers) fails
    // them in the exchange of the rows at once.
    let buffers = (|| {
        let idx = staged(&gather, &device)?;
        let send = crate::moe::finalize::moe_token_unpermute(x, &idx, None)?;
        let rows = device.backend().scratch(&with_rows("dispatch", "x", x.shape(), recv_total)?, x.dtype())?;
        Ok((send, rows))
    })();
    let (send, mut rows) = buffers.map_err(|e| ep.refuse_call(Call::AllToAllV(&sc, &rc), x.dtype(), e))?;
    ep.all_to_all_v(&send, &sc, &mut rows, &rc)?;
    let experts = (|| {
        let se = staged(&send_experts, &device)?;
        Ok((se, device.backend().scratch(&[recv_total], DType::I32)?))
    })();
    let (se, mut re) =
        experts.map_err(|e| ep.refuse_call(Call::AllToAllV(&send_counts, &recv_counts), DType::I32, e))?;
    ep.all_to_all_v(&se, &send_counts, &mut re, &recv_counts)?;
    Ok(Dispatched { rows, experts: re.to_vec::<i32>()?, send_counts, recv_counts, send_pos, tokens: n, top_k })
}

/// MoE combine: sends every expert output row back to its token's rank and
/// sums `topk_weights[i, k] * row` per token (the finalize op in drop-pad row
/// mode). A masked token's slots are dropped slots of SPEC section 1, each
/// adding `topk_weights[i, k] * 0`: the token is zero for finite weights and
/// NaN where one of its weights is NaN or infinite. Output `[N, H...]`, the
/// full routed sum.
pub fn combine(expert_out: &Tensor, d: &Dispatched, topk_weights: &Tensor, ep: &Comm) -> Result<Tensor> {
    const OP: &str = "moe_combine";
    let recv_total: usize = d.recv_counts.iter().sum();
    let h = d.rows.row_len();
    // `d.rows` holds every received row, so `sc` fits; the rows sent back
    // are those dispatched, which `x` held at its own length.
    let sc: Vec<usize> = d.recv_counts.iter().map(|c| c * h).collect();
    let rc: Vec<usize> = d.send_counts.iter().map(|c| c.saturating_mul(h)).collect();
    let checked = if expert_out.shape().first() != Some(&recv_total) || expert_out.row_len() != h {
        Err(Error::shape(OP, "expert_out", format!("{:?} (the dispatched rows)", d.rows.shape()), expert_out.shape()))
    } else if topk_weights.shape() != [d.tokens, d.top_k] {
        Err(Error::shape(OP, "topk_weights", format!("[{}, {}]", d.tokens, d.top_k), topk_weights.shape()))
    } else {
        Ok(())
    };
    // The peers are in the exchange of the rows already: a refusal goes
    // through it, as in `dispatch`.
    checked.map_err(|e| ep.refuse_call(Call::AllToAllV(&sc, &rc), expert_out.dtype(), e))?;
    let device = expert_out.device();
    let sent: usize = d.send_counts.iter().sum();
    let mut back_shape = vec![1, sent];
    back_shape.extend_from_slice(&expert_out.shape()[1..]);
    let mut back = device
        .backend()
        .scratch(&back_shape, expert_out.dtype())
        .map_err(|e| ep.refuse_call(Call::AllToAllV(&sc, &rc), expert_out.dtype(), e))?;
    ep.all_to_all_v(expert_out, &sc, &mut back, &rc)?;
    let idx = staged(&d.send_pos, &device)?;
    moe_finalize_routing(&FinalizeArgs {
        expanded_x: &back,
        expanded_row_idx: &idx,
        x1: None,
        x2: None,
        bias: None,
        scales: Some(topk_weights),
        expert_idx: None,
        drop_pad_mode: DropPadMode::DropPadRow,
    })
}
