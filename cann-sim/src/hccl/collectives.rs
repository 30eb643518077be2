//! The HCCL collectives: validated when queued, run on the stream's worker as
//! one round of the communicator's [`Group`].
//!
//! The first call of each collective on a communicator is checked on the
//! host, inside the call, against every rank's (HCCL's parameter consistency
//! check at link setup, EI0005): a call that differs between ranks (another
//! collective, count, dtype, op, root or count array) returns `HCCL_E_PARA` on
//! every rank alike and queues nothing.
//!
//! On the stream, each rank publishes a descriptor of its call and the bytes
//! the others need from it, and checks all descriptors against each other
//! before it reads any payload. Real HCCL does not check a later call: the
//! ranks wait for data that never comes until the execution timeout, or move
//! the wrong bytes. The simulator fails such a collective on every rank with
//! `HCCL_E_TIMEOUT` at once (the stream's error), never a silent result; with
//! HCCL's inconsistent-op check on (`HCCL_DFS_CONFIG`), a call whose type,
//! dtype, operation, root or count differs is also `HcclGetCommAsyncError`'s
//! `HCCL_E_PARA` on every rank. Then each rank reads what it needs and computes its own
//! result: reductions combine the ranks in the order `reduction_order`
//! gives (rank order only when the communicator is deterministic).

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use super::comms::{comm, SimComm};
use super::elem::{DType, ReduceOp, Reduction};
use super::plane::{Group, Round};
use super::queue::{counts, enqueue, with_bytes, with_bytes_mut, Buf};
use crate::config;
use crate::ffi::*;
use crate::hccl_rules;
use crate::status::{self, fail, SimError, SimResult};

/// Descriptor word 0: the collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    AllReduce = 1,
    ReduceScatter,
    ReduceScatterV,
    AllGather,
    AllGatherV,
    AlltoAllV,
    Broadcast,
    Barrier,
}

const KINDS: [(Kind, &str); 8] = [
    (Kind::AllReduce, "HcclAllReduce"),
    (Kind::ReduceScatter, "HcclReduceScatter"),
    (Kind::ReduceScatterV, "HcclReduceScatterV"),
    (Kind::AllGather, "HcclAllGather"),
    (Kind::AllGatherV, "HcclAllGatherV"),
    (Kind::AlltoAllV, "HcclAlltoAllV"),
    (Kind::Broadcast, "HcclBroadcast"),
    (Kind::Barrier, "HcclBarrier"),
];

/// A descriptor word that does not apply to the collective.
const NONE: u64 = u64::MAX;
/// Words before the per-rank counts: kind, dtype, op, root, count.
const FIXED: usize = 5;

/// What a rank calls; every rank of the group must call the same (for
/// `HcclAlltoAllV`: matching send and receive counts).
#[derive(Debug, Default)]
struct Desc {
    dtype: Option<DType>,
    op: Option<ReduceOp>,
    root: Option<u32>,
    count: Option<usize>,
    counts: Vec<usize>,
    /// The displacements every rank must pass alike: `recvDispls` of
    /// `HcclAllGatherV` and `sendDispls` of `HcclReduceScatterV` (v9.1.0
    /// `HcclAllGatherV.md:64`, `HcclReduceScatterV.md:67`). HCCL's consistency
    /// check leaves them out (`inconsistent_check.cc:72-142`), so a
    /// disagreement moves undefined bytes there; here it is refused with the
    /// counts.
    displs: Vec<usize>,
}

impl Desc {
    fn words(&self, kind: Kind) -> Vec<u64> {
        let opt = |v: Option<u64>| v.unwrap_or(NONE);
        let mut w = vec![
            kind as u64,
            opt(self.dtype.map(|d| d.hccl() as u64)),
            opt(self.op.map(|o| o.hccl() as u64)),
            opt(self.root.map(u64::from)),
            opt(self.count.map(|c| c as u64)),
        ];
        w.extend(self.counts.iter().chain(&self.displs).map(|&c| c as u64));
        w
    }
}

/// A published descriptor in words.
fn describe(w: &[u64]) -> String {
    if w.len() < FIXED {
        return format!("a {}-word descriptor", w.len());
    }
    let name = KINDS.iter().find(|(k, _)| *k as u64 == w[0]).map_or("an unknown collective", |(_, n)| n);
    let mut parts = Vec::new();
    if w[1] != NONE {
        parts.push(DType::from_hccl(w[1] as i32).map_or(format!("dtype {}", w[1]), |d| d.name().to_string()));
    }
    if w[2] != NONE {
        let op = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min].into_iter().find(|o| o.hccl() as u64 == w[2]);
        parts.push(op.map_or(format!("op {}", w[2]), |o| o.name().to_string()));
    }
    if w[3] != NONE {
        parts.push(format!("root {}", w[3]));
    }
    if w[4] != NONE {
        parts.push(format!("count {}", w[4]));
    }
    let tail = &w[FIXED..];
    let with_displs = [Kind::AllGatherV, Kind::ReduceScatterV].iter().any(|&k| k as u64 == w[0]);
    if with_displs && tail.len() % 2 == 0 {
        let (counts, displs) = tail.split_at(tail.len() / 2);
        parts.push(format!("counts {counts:?}, displs {displs:?}"));
    } else if !tail.is_empty() {
        parts.push(format!("counts {tail:?}"));
    }
    format!("{name}({})", parts.join(", "))
}

/// Fails unless every rank published the same call. Every rank runs this on
/// the same descriptors, so all reach the same verdict. The fields are those
/// of HCCL's `InconsistentCheckParams` (hicann/hccl
/// `src/common/inconsistent_check.cc:72-142`, v9.1.0: root, op type, reduce
/// op, data type, count, group and tag; each mismatch is EI0005 and
/// HCCL_E_PARA, `ReportOpExchangeInfoCheckFailed`, lines 170-196) plus the
/// count arrays of the V collectives and the displacements [`Desc::displs`]
/// names.
fn agree(descs: &[Vec<u64>]) -> SimResult<()> {
    let first = &descs[0];
    let a2a = |d: &[u64]| d.first() == Some(&(Kind::AlltoAllV as u64));
    for (r, d) in descs.iter().enumerate().skip(1) {
        // All-to-all ranks send and receive different counts: the fixed part
        // must agree here, the counts pairwise below.
        let same =
            if a2a(first) && a2a(d) { d.len() == first.len() && d[..FIXED] == first[..FIXED] } else { d == first };
        if !same {
            return fail(
                HCCL_E_PARA,
                format!(
                    "EI0005: the arguments for collective communication are inconsistent between ranks: \
                     rank 0 calls {}, rank {r} {}",
                    describe(first),
                    describe(d)
                ),
            );
        }
    }
    if a2a(first) {
        let w = descs.len();
        if first.len() != FIXED + 2 * w {
            return fail(HCCL_E_PARA, format!("{} for {w} ranks", describe(first)));
        }
        for (i, j) in (0..w).flat_map(|i| (0..w).map(move |j| (i, j))) {
            let (sent, expected) = (descs[i][FIXED + j], descs[j][FIXED + w + i]);
            if sent != expected {
                return fail(
                    HCCL_E_PARA,
                    format!("HcclAlltoAllV: rank {i} sends {sent} elements to rank {j}, which expects {expected}"),
                );
            }
        }
    }
    Ok(())
}

/// Queues collective `kind`: the rank publishes `desc` and the bytes of `send`
/// (in order), and `finish` writes its result from what every rank published.
#[allow(clippy::too_many_arguments)]
fn run(
    kind: Kind,
    comm_h: HcclComm,
    stream: AclrtStream,
    bufs: &[(Buf, DType, &str)],
    dt: DType,
    desc: Desc,
    send: Vec<Buf>,
    finish: impl Fn(&Round<'_>) -> SimResult<()> + Send + Sync + 'static,
) -> SimResult<()> {
    let call = KINDS[kind as usize - 1].1;
    let words = desc.words(kind);
    let setup_words = words.clone();
    let setup = move |c: &SimComm, before: &dyn Fn()| c.link_setup(&setup_words, &agree, before);
    let round = move |c: &SimComm, g: &mut Group| {
        g.publish(&words, |w| send.iter().try_for_each(|b| with_bytes(*b, dt, |bytes| w.append(bytes))))?;
        g.complete(|round| {
            agree(&round.descs).map_err(|e| {
                // HCCL's inconsistent-op check, when it is on, compares the
                // type, dtype, operation, root and count of each call
                // (hcomm v8.5.0 `heartbeat.cc:982-1023` `CheckIsSameOp`,
                // recorded at `:1049-1067`), not the count arrays.
                let first = round.descs[0].get(..FIXED);
                if config::get().inconsistent_check && round.descs.iter().any(|d| d.get(..FIXED) != first) {
                    c.inconsistent.store(true, Ordering::SeqCst);
                }
                SimError::new(
                    HCCL_E_TIMEOUT,
                    format!(
                        "{}; HCCL checks only the first call of a collective on a communicator (at link setup): \
                         this one would wait for data that never comes until the execution timeout",
                        e.msg
                    ),
                )
            })?;
            finish(round)
        })
    };
    // HcclBarrier is an all-reduce in SyncMode::UNLIMITED_TIMEWAITSYNCMODE
    // (hcomm v8.5.0 `src/framework/op_base/src/op_base_host.cc:217-218`),
    // whose notify waits take `notifyMaxWaitTime_` (`src/platform/task/
    // dispatcher.cc:293-305`), 2^31-1 s on 910B (`src/pub_inc/hccl_common.h:104`):
    // neither HCCL_EXEC_TIMEOUT nor hcclExecTimeOut bounds it, so a peer that
    // never comes keeps the stream waiting.
    let bound = move |g: &mut Group| if kind == Kind::Barrier { None } else { g.timeout() };
    let job = move |c: &SimComm, g: &mut Group| {
        let t = bound(g);
        g.with_timeout(t, |g| round(c, g))
    };
    enqueue(call, comm_h, stream, bufs, &setup, Box::new(job))
}

/// The order in which round `number` of a communicator of `size` ranks
/// combines the ranks.
///
/// HCCL promises a reduction order only when asked: `HCCL_DETERMINISTIC`
/// "true" makes repeated runs give the same output, "strict" also keeps the
/// reduction order (hicann/hccl `docs/zh/user_guide/hccl_env/HCCL_DETERMINISTIC.md`;
/// off by default on Atlas A2, v8.5.0 `src/common/alg_env_config.cc:686-714`).
/// Deterministic, the simulator combines the ranks in rank order, 0 first.
/// Otherwise the order rotates from call to call and never starts at rank 0
/// when more than two ranks take part: rank `s = 1 + (number mod (size - 1))`
/// first, then `s + 1, ..., size - 1, 0, ..., s - 1`. Every rank of one call
/// computes the same order from the same round number, so all receive the
/// same bytes (as one HCCL all-reduce gives every rank one result); a caller
/// that expects the bits of a rank-order sum sees them differ.
pub(crate) fn reduction_order(size: usize, number: u64, deterministic: bool) -> Vec<usize> {
    if deterministic || size <= 2 {
        return (0..size).collect();
    }
    let start = 1 + (number % (size as u64 - 1)) as usize;
    (0..size).map(|i| (start + i) % size).collect()
}

/// Every rank's payload bytes from byte `offset`, reduced into `out` (as
/// many bytes) in [`reduction_order`].
fn reduce_ranks(round: &Round<'_>, dt: DType, op: ReduceOp, offset: usize, out: Buf) -> SimResult<()> {
    let order = reduction_order(round.descs.len(), round.number(), round.deterministic());
    let mut scratch = vec![0u8; out.elems * dt.size()];
    round.read_into(order[0], offset, &mut scratch)?;
    let mut red = Reduction::new(dt, op, &scratch);
    for &r in &order[1..] {
        round.read_into(r, offset, &mut scratch)?;
        red.add(&scratch);
    }
    with_bytes_mut(out, dt, |dst| {
        red.finish(dst);
        Ok(())
    })
}

/// Fills `out` with rank `rank`'s payload from element `at`.
fn copy_from(round: &Round<'_>, rank: usize, dt: DType, at: usize, out: Buf) -> SimResult<()> {
    with_bytes_mut(out, dt, |dst| round.read_into(rank, at * dt.size(), dst))
}

/// Elements before rank `r`'s block in a packed layout.
fn before(counts: &[usize], r: usize) -> usize {
    counts[..r].iter().sum()
}

/// The blocks of `buf` at `displs` with `counts` elements each.
fn blocks(buf: Buf, dt: DType, counts: &[usize], displs: &[usize]) -> Vec<Buf> {
    counts.iter().zip(displs).map(|(&n, &d)| buf.part(dt, d, n)).collect()
}

fn extent(counts: &[usize], displs: &[usize]) -> usize {
    counts.iter().zip(displs).map(|(c, d)| c + d).max().unwrap_or(0)
}

/// `HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType, HcclReduceOp op, HcclComm comm, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn HcclAllReduce(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    count: u64,
    data_type: i32,
    op: i32,
    comm_h: HcclComm,
    stream: AclrtStream,
) -> HcclResult {
    status::hccl("HcclAllReduce", || {
        hccl_rules::operands(&[("sendBuf", send_buf), ("recvBuf", recv_buf)], stream)?;
        hccl_rules::count_in_range("HcclAllReduce", "count", count)?;
        hccl_rules::a2_dtype("HcclAllReduce", data_type, Some(op))?;
        let dt = DType::from_hccl(data_type)?;
        let op = ReduceOp::from_hccl(op, dt)?;
        hccl_rules::reduce_aligned(&[("sendBuf", send_buf), ("recvBuf", recv_buf)], dt.size())?;
        let n = count as usize;
        let (sb, rb) = (Buf { addr: send_buf as usize, elems: n }, Buf { addr: recv_buf as usize, elems: n });
        let desc = Desc { dtype: Some(dt), op: Some(op), count: Some(n), ..Desc::default() };
        let bufs = [(sb, dt, "sendBuf"), (rb, dt, "recvBuf")];
        run(Kind::AllReduce, comm_h, stream, &bufs, dt, desc, vec![sb], move |round| reduce_ranks(round, dt, op, 0, rb))
    })
}

/// `HcclResult HcclReduceScatter(void *sendBuf, void *recvBuf, uint64_t recvCount, HcclDataType dataType, HcclReduceOp op, HcclComm comm, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn HcclReduceScatter(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    recv_count: u64,
    data_type: i32,
    op: i32,
    comm_h: HcclComm,
    stream: AclrtStream,
) -> HcclResult {
    status::hccl("HcclReduceScatter", || {
        hccl_rules::operands(&[("sendBuf", send_buf), ("recvBuf", recv_buf)], stream)?;
        hccl_rules::count_in_range("HcclReduceScatter", "recvCount", recv_count)?;
        hccl_rules::a2_dtype("HcclReduceScatter", data_type, Some(op))?;
        let dt = DType::from_hccl(data_type)?;
        let op = ReduceOp::from_hccl(op, dt)?;
        hccl_rules::reduce_aligned(&[("sendBuf", send_buf), ("recvBuf", recv_buf)], dt.size())?;
        let world = comm(comm_h)?.size as usize;
        let n = recv_count as usize;
        let sb = Buf { addr: send_buf as usize, elems: n * world };
        let rb = Buf { addr: recv_buf as usize, elems: n };
        let desc = Desc { dtype: Some(dt), op: Some(op), count: Some(n), ..Desc::default() };
        let bufs = [(sb, dt, "sendBuf"), (rb, dt, "recvBuf")];
        run(Kind::ReduceScatter, comm_h, stream, &bufs, dt, desc, vec![sb], move |round| {
            reduce_ranks(round, dt, op, round.rank() * n * dt.size(), rb)
        })
    })
}

/// `HcclResult HcclReduceScatterV(void *sendBuf, const void *sendCounts, const void *sendDispls, void *recvBuf, uint64_t recvCount, HcclDataType dataType, HcclReduceOp op, HcclComm comm, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn HcclReduceScatterV(
    send_buf: *mut c_void,
    send_counts: *const c_void,
    send_displs: *const c_void,
    recv_buf: *mut c_void,
    recv_count: u64,
    data_type: i32,
    op: i32,
    comm_h: HcclComm,
    stream: AclrtStream,
) -> HcclResult {
    status::hccl("HcclReduceScatterV", || {
        hccl_rules::operands(&[("sendBuf", send_buf), ("recvBuf", recv_buf)], stream)?;
        hccl_rules::count_in_range("HcclReduceScatterV", "recvCount", recv_count)?;
        hccl_rules::a2_dtype("HcclReduceScatterV", data_type, Some(op))?;
        hccl_rules::distinct_buffers(send_buf, recv_buf)?;
        let dt = DType::from_hccl(data_type)?;
        let op = ReduceOp::from_hccl(op, dt)?;
        hccl_rules::reduce_aligned(&[("sendBuf", send_buf), ("recvBuf", recv_buf)], dt.size())?;
        let c = comm(comm_h)?;
        let sc = counts(send_counts, c.size, "sendCounts")?;
        let sd = counts(send_displs, c.size, "sendDispls")?;
        hccl_rules::counts_in_range("HcclReduceScatterV", "sendCounts", &sc)?;
        hccl_rules::own_count(("recvCount", recv_count), ("sendCounts", &sc), c.rank)?;
        let sb = Buf { addr: send_buf as usize, elems: extent(&sc, &sd) };
        let rb = Buf { addr: recv_buf as usize, elems: recv_count as usize };
        // Every rank publishes its blocks packed in rank order.
        let send = blocks(sb, dt, &sc, &sd);
        let desc = Desc { dtype: Some(dt), op: Some(op), counts: sc.clone(), displs: sd, ..Desc::default() };
        let bufs = [(sb, dt, "sendBuf"), (rb, dt, "recvBuf")];
        run(Kind::ReduceScatterV, comm_h, stream, &bufs, dt, desc, send, move |round| {
            reduce_ranks(round, dt, op, before(&sc, round.rank()) * dt.size(), rb)
        })
    })
}

/// `HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount, HcclDataType dataType, HcclComm comm, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn HcclAllGather(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    send_count: u64,
    data_type: i32,
    comm_h: HcclComm,
    stream: AclrtStream,
) -> HcclResult {
    status::hccl("HcclAllGather", || {
        hccl_rules::operands(&[("sendBuf", send_buf), ("recvBuf", recv_buf)], stream)?;
        hccl_rules::count_in_range("HcclAllGather", "sendCount", send_count)?;
        hccl_rules::a2_dtype("HcclAllGather", data_type, None)?;
        let dt = DType::from_hccl(data_type)?;
        let world = comm(comm_h)?.size as usize;
        let n = send_count as usize;
        let sb = Buf { addr: send_buf as usize, elems: n };
        let rb = Buf { addr: recv_buf as usize, elems: n * world };
        let desc = Desc { dtype: Some(dt), count: Some(n), ..Desc::default() };
        let bufs = [(sb, dt, "sendBuf"), (rb, dt, "recvBuf")];
        run(Kind::AllGather, comm_h, stream, &bufs, dt, desc, vec![sb], move |round| {
            (0..round.descs.len()).try_for_each(|r| copy_from(round, r, dt, 0, rb.part(dt, r * n, n)))
        })
    })
}

/// `HcclResult HcclAllGatherV(void *sendBuf, uint64_t sendCount, void *recvBuf, const void *recvCounts, const void *recvDispls, HcclDataType dataType, HcclComm comm, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn HcclAllGatherV(
    send_buf: *mut c_void,
    send_count: u64,
    recv_buf: *mut c_void,
    recv_counts: *const c_void,
    recv_displs: *const c_void,
    data_type: i32,
    comm_h: HcclComm,
    stream: AclrtStream,
) -> HcclResult {
    status::hccl("HcclAllGatherV", || {
        hccl_rules::operands(&[("sendBuf", send_buf), ("recvBuf", recv_buf)], stream)?;
        hccl_rules::count_in_range("HcclAllGatherV", "sendCount", send_count)?;
        hccl_rules::a2_dtype("HcclAllGatherV", data_type, None)?;
        hccl_rules::distinct_buffers(send_buf, recv_buf)?;
        let dt = DType::from_hccl(data_type)?;
        let c = comm(comm_h)?;
        let rc = counts(recv_counts, c.size, "recvCounts")?;
        let rd = counts(recv_displs, c.size, "recvDispls")?;
        hccl_rules::counts_in_range("HcclAllGatherV", "recvCounts", &rc)?;
        hccl_rules::own_count(("sendCount", send_count), ("recvCounts", &rc), c.rank)?;
        let sb = Buf { addr: send_buf as usize, elems: send_count as usize };
        let rb = Buf { addr: recv_buf as usize, elems: extent(&rc, &rd) };
        let desc = Desc { dtype: Some(dt), counts: rc.clone(), displs: rd.clone(), ..Desc::default() };
        let bufs = [(sb, dt, "sendBuf"), (rb, dt, "recvBuf")];
        run(Kind::AllGatherV, comm_h, stream, &bufs, dt, desc, vec![sb], move |round| {
            blocks(rb, dt, &rc, &rd)
                .into_iter()
                .enumerate()
                .try_for_each(|(q, block)| copy_from(round, q, dt, 0, block))
        })
    })
}

/// `HcclResult HcclAlltoAllV(const void *sendBuf, const void *sendCounts, const void *sdispls, HcclDataType sendType, const void *recvBuf, const void *recvCounts, const void *rdispls, HcclDataType recvType, HcclComm comm, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn HcclAlltoAllV(
    send_buf: *const c_void,
    send_counts: *const c_void,
    sdispls: *const c_void,
    send_type: i32,
    recv_buf: *const c_void,
    recv_counts: *const c_void,
    rdispls: *const c_void,
    recv_type: i32,
    comm_h: HcclComm,
    stream: AclrtStream,
) -> HcclResult {
    status::hccl("HcclAlltoAllV", || {
        hccl_rules::operands(&[("sendBuf", send_buf), ("recvBuf", recv_buf)], stream)?;
        hccl_rules::a2_dtype("HcclAlltoAllV", send_type, None)?;
        hccl_rules::distinct_buffers(send_buf, recv_buf)?;
        let dt = DType::from_hccl(send_type)?;
        if recv_type != send_type {
            return fail(HCCL_E_PARA, format!("sendType {send_type} != recvType {recv_type}"));
        }
        let c = comm(comm_h)?;
        let sc = counts(send_counts, c.size, "sendCounts")?;
        let sd = counts(sdispls, c.size, "sdispls")?;
        let rc = counts(recv_counts, c.size, "recvCounts")?;
        let rd = counts(rdispls, c.size, "rdispls")?;
        let largest = sc.iter().chain(&rc).copied().max().unwrap_or(0);
        hccl_rules::count_in_range("HcclAlltoAllV", "the largest of sendCounts and recvCounts", largest as u64)?;
        hccl_rules::one_rank_all_to_all_displacements(c.size, &sd, &rd)?;
        let sb = Buf { addr: send_buf as usize, elems: extent(&sc, &sd) };
        let rb = Buf { addr: recv_buf as usize, elems: extent(&rc, &rd) };
        let send = blocks(sb, dt, &sc, &sd);
        let desc = Desc { dtype: Some(dt), counts: sc.iter().chain(&rc).copied().collect(), ..Desc::default() };
        let bufs = [(sb, dt, "sendBuf"), (rb, dt, "recvBuf")];
        run(Kind::AlltoAllV, comm_h, stream, &bufs, dt, desc, send, move |round| {
            let (me, w) = (round.rank(), rc.len());
            blocks(rb, dt, &rc, &rd).into_iter().enumerate().try_for_each(|(q, block)| {
                // Rank q packed its blocks for ranks 0, 1, ... in order.
                let sent: Vec<usize> = round.descs[q][FIXED..FIXED + w].iter().map(|&v| v as usize).collect();
                copy_from(round, q, dt, before(&sent, me), block)
            })
        })
    })
}

/// `HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType dataType, uint32_t root, HcclComm comm, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn HcclBroadcast(
    buf: *mut c_void,
    count: u64,
    data_type: i32,
    root: u32,
    comm_h: HcclComm,
    stream: AclrtStream,
) -> HcclResult {
    status::hccl("HcclBroadcast", || {
        hccl_rules::operands(&[("buf", buf)], stream)?;
        hccl_rules::count_in_range("HcclBroadcast", "count", count)?;
        hccl_rules::a2_dtype("HcclBroadcast", data_type, None)?;
        let dt = DType::from_hccl(data_type)?;
        let c = comm(comm_h)?;
        // `HcomCheckUserRank(rankSize, root)`: HCCL_E_PARA (hicann/hccl v9.1.0
        // `src/ops/broadcast/broadcast_op.cc:117`; v8.5.0
        // `src/common/param_check.cc:134-142`).
        if root >= c.size {
            return fail(HCCL_E_PARA, format!("root {root} of {} ranks", c.size));
        }
        let b = Buf { addr: buf as usize, elems: count as usize };
        let send = if c.rank == root { vec![b] } else { Vec::new() };
        let desc = Desc { dtype: Some(dt), root: Some(root), count: Some(b.elems), ..Desc::default() };
        run(Kind::Broadcast, comm_h, stream, &[(b, dt, "buf")], dt, desc, send, move |round| {
            if round.rank() == root as usize {
                return Ok(());
            }
            copy_from(round, root as usize, dt, 0, b)
        })
    })
}

/// `HcclResult HcclBarrier(HcclComm comm, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn HcclBarrier(comm_h: HcclComm, stream: AclrtStream) -> HcclResult {
    status::hccl("HcclBarrier", || {
        hccl_rules::operands(&[], stream)?;
        hccl_rules::not_under_capture("HcclBarrier", stream)?;
        // Any dtype: a barrier publishes and reads no payload.
        run(Kind::Barrier, comm_h, stream, &[], DType::U8, Desc::default(), Vec::new(), |_| Ok(()))
    })
}
