//! The CPU communicator (SPEC section 8): [`Communicator`] on host buffers,
//! over the shared-memory transport of the `shm-comm` crate.
//!
//! [`CpuComm`] serves ranks that are threads of one process or separate
//! processes on one host, with the semantics the NPU backend gets from HCCL:
//! every collective, every dtype, sum / max / min, in place and out of place,
//! sub-groups, a timeout on every wait, and a loud error on every rank when
//! ranks disagree. It is the oracle the MoE test matrix runs against.
//!
//! This module only translates: views to byte slices and element types,
//! the crate's validation of its operands into the transport's `check` (so a
//! rank with bad arguments fails every rank), and the transport's errors into
//! [`Error`]. The protocol, the shared-memory layout and the failure handling
//! are documented in `shm-comm`.

use shm_comm::{DataType, Shape, ShmComm};

pub use shm_comm::Config as CpuCommConfig;
pub use shm_comm::{check_world_size, segment_path, shm_dir, MAX_WORLD};

use crate::backend::args::collective_len;
use crate::backend::cpu::finalize::fused_rows;
use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::CpuBuffer;
use crate::backend::{args, Backend, Call, Communicator, FinalizeArgs, FinalizeDims, OutputRows, View, ViewMut};
use crate::error::CommErrorKind;
use crate::types::TensorMeta;
use crate::types::{CommOptions, ReduceOp};
use crate::{DType, Element, Error, Result};

/// A rank's handle on a shared-memory group. Clones share the handle (calls
/// through clones are serialised); the rank leaves the group when the last clone
/// is dropped.
#[derive(Clone)]
pub struct CpuComm {
    shm: ShmComm,
    opts: CommOptions,
}

impl std::fmt::Debug for CpuComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuComm")
            .field("name", &self.shm.name())
            .field("rank", &self.shm.rank())
            .field("world", &self.shm.world_size())
            .field("segment", &self.shm.segment_path())
            .finish()
    }
}

impl From<shm_comm::Error> for Error {
    fn from(e: shm_comm::Error) -> Error {
        match e {
            shm_comm::Error::InvalidArgument { op, arg, reason } => Error::InvalidArgument { op, arg, reason },
            shm_comm::Error::Io { what, msg } => Error::Io { what, msg },
            shm_comm::Error::Comm { collective, group, rank, world, detail, kind } => {
                let kind = match kind {
                    shm_comm::ErrorKind::Mismatch => CommErrorKind::Mismatch,
                    shm_comm::ErrorKind::Timeout => CommErrorKind::Timeout,
                    shm_comm::ErrorKind::PeerFailed => CommErrorKind::PeerFailed,
                    shm_comm::ErrorKind::Setup => CommErrorKind::Setup,
                };
                Error::Comm { collective, group, rank, world, detail, kind }
            }
        }
    }
}

/// The transport's element type of `d`.
fn data_type(d: DType) -> DataType {
    match d {
        DType::F32 => DataType::F32,
        DType::F16 => DataType::F16,
        DType::BF16 => DataType::BF16,
        DType::I32 => DataType::I32,
        DType::I64 => DataType::I64,
        DType::I8 => DataType::I8,
        DType::U8 => DataType::U8,
        DType::Bool => DataType::Bool,
        DType::F8E4M3 => DataType::F8E4M3,
        DType::F8E5M2 => DataType::F8E5M2,
    }
}

fn reduce_op(op: ReduceOp) -> shm_comm::ReduceOp {
    match op {
        ReduceOp::Sum => shm_comm::ReduceOp::Sum,
        ReduceOp::Max => shm_comm::ReduceOp::Max,
        ReduceOp::Min => shm_comm::ReduceOp::Min,
    }
}

/// Host bytes of `t`; none for a device tensor (the call's check then fails,
/// and the transport never touches the bytes).
/// Checks `src` / `dst` are of one dtype.
fn check_pair(op: &'static str, src: &View<'_, CpuBuffer>, dst: &ViewMut<'_, CpuBuffer>) -> Result<()> {
    if src.dtype() != dst.dtype() {
        return Err(Error::dtype(op, "dst", format!("{} (the dtype of src)", src.dtype()), dst.dtype()));
    }
    Ok(())
}

/// `shape`, named `label`: what every rank of a collective must pass
/// alike, besides the element counts the transport compares anyway: equal
/// counts in other shapes (`[4, 4]` against `[8, 2]`) are other tensors.
/// The elementwise collectives (all_reduce, broadcast) and the fixed-count
/// row moves (reduce_scatter, all_gather, reduce_scatter_v, whose input has
/// the same rows on every rank) compare the whole shape: element `i` of one
/// rank's tensor is then the same element of every rank's (SPEC section 8
/// reduces and copies tensors, not flat buffers). The V moves whose blocks
/// differ in rows per rank (all_gather_v, all_to_all_v) compare the
/// trailing dimensions (`row`), which their rows must share (SPEC sections
/// 3 and 4: the tokens are dim 0, `H...` is the same everywhere).
fn whole<'a>(label: &'static str, shape: &'a [usize]) -> Shape<'a> {
    Shape { label, dims: shape }
}

/// The trailing dimensions of `shape` (its rows), labelled `label`
/// ([`whole`]).
fn row<'a>(label: &'static str, shape: &'a [usize]) -> Shape<'a> {
    Shape { label, dims: shape.get(1..).unwrap_or(&[]) }
}

/// `sum(counts)`, or the transport's error naming `arg` when it overflows.
fn counts_sum(op: &'static str, arg: &'static str, counts: &[usize]) -> Result<usize> {
    Ok(shm_comm::counts_sum(op, arg, counts)?)
}

impl CpuComm {
    /// Joins (or creates) the world `name` of `world_size` ranks as `rank`, with
    /// the default [`CpuCommConfig`]. Ranks may be threads of this process or
    /// separate processes; every rank waits until all have joined (at most
    /// `opts.timeout`).
    pub fn rendezvous(name: &str, world_size: usize, rank: usize, opts: &CommOptions) -> Result<CpuComm> {
        Self::rendezvous_with(name, world_size, rank, opts, &CpuCommConfig::default())
    }

    /// [`CpuComm::rendezvous`] with explicit shared-memory tuning (every rank of
    /// the world must pass the same `cfg`).
    pub fn rendezvous_with(
        name: &str,
        world_size: usize,
        rank: usize,
        opts: &CommOptions,
        cfg: &CpuCommConfig,
    ) -> Result<CpuComm> {
        let shm = ShmComm::rendezvous(name, world_size, rank, opts.timeout, cfg)?;
        Ok(CpuComm { shm, opts: opts.clone() })
    }

    /// The options this communicator was built with.
    pub fn options(&self) -> &CommOptions {
        &self.opts
    }

    /// Path the shared-memory file of this group had (unlinked once every rank attached).
    pub fn segment_path(&self) -> &str {
        self.shm.segment_path()
    }

    /// The shared-memory tuning in use.
    pub fn config(&self) -> CpuCommConfig {
        self.shm.config()
    }

    /// Sets the context tag posted with every later collective of this
    /// communicator and its clones (the MoE layer puts the forward's comm
    /// type there). Ranks whose tags differ fail their next collective
    /// together, with a [`CommErrorKind::Mismatch`] naming which ranks chose
    /// which tag (`ranks [0, 1] chose 0, ranks [2, 3] chose 1`). `None`, the
    /// default, posts no tag.
    pub fn set_context_tag(&self, tag: Option<u64>) {
        self.shm.set_context_tag(tag)
    }

    /// The context tag set by [`CpuComm::set_context_tag`].
    pub fn context_tag(&self) -> Option<u64> {
        self.shm.context_tag()
    }

    /// Rows per staging region for rows of `row_len` elements of `dtype`: the
    /// most rows of one block [`CpuComm::reduce_scatter_rows_with`] could move
    /// per round. 0 when one row does not fit (the caller then stages a buffer).
    pub fn rows_per_region(&self, row_len: usize, dtype: DType) -> usize {
        self.shm.rows_per_region(row_len, data_type(dtype))
    }

    /// Whether [`Communicator::finalize_reduce_scatter`] stages rows of
    /// `row_len` elements of `dtype` (a group of more than one rank, and a
    /// row that fits a staging region); otherwise it finalizes into a buffer
    /// and reduce-scatters that, the two-step path.
    pub fn stages_rows(&self, row_len: usize, dtype: DType) -> bool {
        self.shm.world_size() > 1 && self.rows_per_region(row_len, dtype) > 0
    }

    /// Reduce-scatter of row blocks that are computed straight into the
    /// staging buffers instead of being copied from a source tensor.
    ///
    /// Block `j` has `rows[j]` rows of `row_len` elements of `dtype`; the
    /// result of this rank is `op` over ranks of block `rank`, written to `dst`
    /// (`rows[rank] * row_len` elements). `produce(j, first, out)` must fill
    /// `out` (`out.len() / (row_len * dtype.size())` whole rows, 64-byte
    /// aligned) with rows `first..` of this rank's block `j`. It is called
    /// only when every argument and `local` (the caller's own validation of
    /// whatever `produce` reads) are good; otherwise the call fails on every
    /// rank with the reason, like any collective.
    ///
    /// The result is bitwise the same as [`Collectives::reduce_scatter_v`](crate::Collectives::reduce_scatter_v) over
    /// the concatenated blocks (same reduction order), with one copy of the
    /// input less. Needs [`CpuComm::rows_per_region`] `>= 1`.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_scatter_rows_with(
        &self,
        dtype: DType,
        op: ReduceOp,
        rows: &[usize],
        row_len: usize,
        mut dst: ViewMut<'_, CpuBuffer>,
        local: Result<()>,
        produce: &mut dyn FnMut(usize, usize, &mut [u8]),
    ) -> Result<()> {
        const C: &str = "reduce_scatter_rows";
        let me = self.shm.rank();
        let local = local.and_then(|_| {
            if dst.dtype() != dtype {
                return Err(Error::dtype(C, "dst", dtype.name(), dst.dtype()));
            }
            match rows.get(me).and_then(|r| r.checked_mul(row_len)) {
                Some(n) if rows.len() == self.shm.world_size() => {
                    collective_len(C, "dst", dst.shape(), n, "rows[rank] * row_len")
                }
                _ => Ok(()),
            }
        });
        let (dt, op) = (data_type(dtype), reduce_op(op));
        let shape = row("dst row", dst.shape());
        let dst = dst.buf_mut().as_bytes_mut();
        self.shm.agreeing(shape).reduce_scatter_rows_with(dt, op, rows, row_len, dst, local, produce)
    }

    /// The finalize-and-reduce of rows too wide to stage: the finalize into
    /// an unpadded `[N, H...]` buffer, then the V reduce-scatter of its
    /// blocks (`local_sizes[r] * H` elements each), the same sum in the same
    /// rank order as the staged path. The transport compares every rank's
    /// counts before any data moves, so ranks whose layouts disagree (even
    /// with the same largest block, which is all a padded reduce-scatter
    /// compares) fail together naming each rank's counts, as on the staged
    /// path; a failure before the collective is reported through it.
    fn finalize_then_reduce_scatter_v(
        &self,
        args: &FinalizeArgs<View<'_, CpuBuffer>>,
        dims: &FinalizeDims,
        local_sizes: &[usize],
        out: ViewMut<'_, CpuBuffer>,
    ) -> Result<()> {
        const OP: &str = "finalize_and_reduce";
        let dtype = out.dtype();
        let counts: Vec<usize> = local_sizes.iter().map(|&rows| rows.saturating_mul(dims.h)).collect();
        let shape = shm_comm::counts_len(OP, "local_sizes", local_sizes, self.shm.world_size())
            .map_err(Error::from)
            .and_then(|_| args::with_rows(OP, "expanded_x", out.shape(), dims.n));
        let backend = self.backend_of(out.buf());
        let refuse = |e| self.refuse(Call::ReduceScatterV(&counts, ReduceOp::Sum), dtype, e);
        let (shape, mut buf) = shape
            .and_then(|shape| {
                let buf = backend.scratch(args::checked_bytes(OP, "expanded_x", &shape, dtype)?)?;
                Ok((shape, buf))
            })
            .map_err(refuse)?;
        let full = ViewMut::new(OP, "expanded_x", TensorMeta { shape: &shape, dtype }, &mut buf)
            .and_then(|mut full| {
                backend.finalize_routing(args, dims, full.reborrow(), OutputRows::Dense)?;
                Ok(full)
            })
            .map_err(refuse)?;
        self.reduce_scatter_v(full.as_view(), out, &counts, ReduceOp::Sum)
    }

    /// `dst = op(src over ranks)` on host slices.
    pub fn all_reduce_slice<T: Element>(&self, src: &[T], dst: &mut [T], op: ReduceOp) -> Result<()> {
        let (s, d) = (bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst));
        self.shm.all_reduce(data_type(T::DTYPE), reduce_op(op), s, d, Ok::<(), Error>(()))
    }

    /// In-place all-reduce on a host slice.
    pub fn all_reduce_slice_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.shm.all_reduce_in_place(
            data_type(T::DTYPE),
            reduce_op(op),
            bytemuck::cast_slice_mut(buf),
            Ok::<(), Error>(()),
        )
    }

    /// Reduce-scatter on host slices: `src` holds `world * dst.len()` elements.
    pub fn reduce_scatter_slice<T: Element>(&self, src: &[T], dst: &mut [T], op: ReduceOp) -> Result<()> {
        let (s, d) = (bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst));
        self.shm.reduce_scatter(data_type(T::DTYPE), reduce_op(op), s, d, Ok::<(), Error>(()))
    }

    /// All-gather on host slices: `dst` holds `world * src.len()` elements.
    pub fn all_gather_slice<T: Element>(&self, src: &[T], dst: &mut [T]) -> Result<()> {
        let (s, d) = (bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst));
        self.shm.all_gather(data_type(T::DTYPE), s, d, Ok::<(), Error>(()))
    }

    /// Reduce-scatter with per-rank block sizes on host slices.
    pub fn reduce_scatter_v_slice<T: Element>(
        &self,
        src: &[T],
        dst: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let (s, d) = (bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst));
        self.shm.reduce_scatter_v(data_type(T::DTYPE), reduce_op(op), s, d, counts, Ok::<(), Error>(()))
    }

    /// All-gather with per-rank block sizes on host slices.
    pub fn all_gather_v_slice<T: Element>(&self, src: &[T], dst: &mut [T], counts: &[usize]) -> Result<()> {
        let (s, d) = (bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst));
        self.shm.all_gather_v(data_type(T::DTYPE), s, d, counts, Ok::<(), Error>(()))
    }

    /// Personalised exchange on host slices.
    pub fn all_to_all_v_slice<T: Element>(
        &self,
        src: &[T],
        send_counts: &[usize],
        dst: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let (s, d) = (bytemuck::cast_slice(src), bytemuck::cast_slice_mut(dst));
        self.shm.all_to_all_v(data_type(T::DTYPE), s, send_counts, d, recv_counts, Ok::<(), Error>(()))
    }

    /// Broadcast of a host slice from `root`.
    pub fn broadcast_slice<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.shm.broadcast(data_type(T::DTYPE), bytemuck::cast_slice_mut(buf), root, Ok::<(), Error>(()))
    }
}

impl Communicator for CpuComm {
    type Backend = CpuBackend;
    fn rank(&self) -> usize {
        self.shm.rank()
    }
    fn world_size(&self) -> usize {
        self.shm.world_size()
    }
    fn name(&self) -> &str {
        self.shm.name()
    }
    fn backend(&self) -> &CpuBackend {
        &CpuBackend
    }
    fn backend_of(&self, _: &CpuBuffer) -> CpuBackend {
        CpuBackend
    }
    fn split(&self, ranks: &[usize]) -> Result<CpuComm> {
        let shm = self.shm.split(ranks)?;
        Ok(CpuComm { shm, opts: self.opts.clone() })
    }

    fn all_reduce(&self, src: View<'_, CpuBuffer>, mut dst: ViewMut<'_, CpuBuffer>, op: ReduceOp) -> Result<()> {
        const C: &str = "all_reduce";
        let local =
            check_pair(C, &src, &dst).and_then(|_| collective_len(C, "dst", dst.shape(), src.numel(), "as src"));
        let (dt, op) = (data_type(src.dtype()), reduce_op(op));
        let shm = self.shm.agreeing(whole("src", src.shape()));
        shm.all_reduce(dt, op, src.buf().as_bytes(), dst.buf_mut().as_bytes_mut(), local)
    }

    fn all_reduce_in_place(&self, mut buf: ViewMut<'_, CpuBuffer>, op: ReduceOp) -> Result<()> {
        let (dt, op) = (data_type(buf.dtype()), reduce_op(op));
        let shm = self.shm.agreeing(whole("buf", buf.shape()));
        shm.all_reduce_in_place(dt, op, buf.buf_mut().as_bytes_mut(), Ok::<(), Error>(()))
    }

    fn reduce_scatter(&self, src: View<'_, CpuBuffer>, mut dst: ViewMut<'_, CpuBuffer>, op: ReduceOp) -> Result<()> {
        const C: &str = "reduce_scatter";
        let w = self.shm.world_size();
        let local = check_pair(C, &src, &dst)
            .and_then(|_| collective_len(C, "src", src.shape(), dst.numel() * w, "world size x dst elements"));
        let (dt, op) = (data_type(src.dtype()), reduce_op(op));
        let shm = self.shm.agreeing(whole("src", src.shape()));
        shm.reduce_scatter(dt, op, src.buf().as_bytes(), dst.buf_mut().as_bytes_mut(), local)
    }

    fn all_gather(&self, src: View<'_, CpuBuffer>, mut dst: ViewMut<'_, CpuBuffer>) -> Result<()> {
        const C: &str = "all_gather";
        let w = self.shm.world_size();
        let local = check_pair(C, &src, &dst)
            .and_then(|_| collective_len(C, "dst", dst.shape(), src.numel() * w, "world size x src elements"));
        let shm = self.shm.agreeing(whole("src", src.shape()));
        shm.all_gather(data_type(src.dtype()), src.buf().as_bytes(), dst.buf_mut().as_bytes_mut(), local)
    }

    fn reduce_scatter_v(
        &self,
        src: View<'_, CpuBuffer>,
        mut dst: ViewMut<'_, CpuBuffer>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let local = check_pair("reduce_scatter_v", &src, &dst);
        let (dt, op) = (data_type(src.dtype()), reduce_op(op));
        let shm = self.shm.agreeing(whole("src", src.shape()));
        shm.reduce_scatter_v(dt, op, src.buf().as_bytes(), dst.buf_mut().as_bytes_mut(), counts, local)
    }

    fn all_gather_v(&self, src: View<'_, CpuBuffer>, mut dst: ViewMut<'_, CpuBuffer>, counts: &[usize]) -> Result<()> {
        let local = check_pair("all_gather_v", &src, &dst);
        let dt = data_type(src.dtype());
        let shm = self.shm.agreeing(row("src row", src.shape()));
        shm.all_gather_v(dt, src.buf().as_bytes(), dst.buf_mut().as_bytes_mut(), counts, local)
    }

    fn all_to_all_v(
        &self,
        src: View<'_, CpuBuffer>,
        send_counts: &[usize],
        mut dst: ViewMut<'_, CpuBuffer>,
        recv_counts: &[usize],
    ) -> Result<()> {
        const C: &str = "all_to_all_v";
        let w = self.shm.world_size();
        let local = check_pair(C, &src, &dst).and_then(|_| {
            shm_comm::counts_len(C, "send_counts", send_counts, w)?;
            shm_comm::counts_len(C, "recv_counts", recv_counts, w)?;
            collective_len(C, "src", src.shape(), counts_sum(C, "send_counts", send_counts)?, "sum of send_counts")?;
            collective_len(C, "dst", dst.shape(), counts_sum(C, "recv_counts", recv_counts)?, "sum of recv_counts")
        });
        let dt = data_type(src.dtype());
        let (shm, d) = (self.shm.agreeing(row("src row", src.shape())), dst.buf_mut().as_bytes_mut());
        shm.all_to_all_v(dt, src.buf().as_bytes(), send_counts, d, recv_counts, local)
    }

    fn broadcast(&self, mut buf: ViewMut<'_, CpuBuffer>, root: usize) -> Result<()> {
        let dt = data_type(buf.dtype());
        let shm = self.shm.agreeing(whole("buf", buf.shape()));
        shm.broadcast(dt, buf.buf_mut().as_bytes_mut(), root, Ok::<(), Error>(()))
    }

    fn barrier(&self) -> Result<()> {
        Ok(self.shm.barrier()?)
    }

    /// Computes the finalize rows straight into the staging buffers
    /// (`fused_rows`) when a row fits a staging region, so the
    /// finalize output never exists as a buffer of its own and an invalid input
    /// on one rank fails every rank at once; else in two steps: the finalize
    /// into an unpadded buffer, then a V reduce-scatter of its blocks, whose
    /// counts every rank compares.
    /// With no rows to reduce (H = 0, or no tokens on any rank) the inputs
    /// are still checked, and every rank joins an empty reduce-scatter with
    /// its verdict, so bad arguments on one rank fail every rank.
    fn finalize_reduce_scatter(
        &self,
        args: &FinalizeArgs<View<'_, CpuBuffer>>,
        dims: &FinalizeDims,
        local_sizes: &[usize],
        out: ViewMut<'_, CpuBuffer>,
    ) -> Result<()> {
        if dims.h == 0 || local_sizes.iter().all(|&s| s == 0) {
            const C: &str = "finalize_and_reduce";
            let dtype = args.expanded_x.dtype();
            let local = shm_comm::counts_len(C, "local_sizes", local_sizes, self.shm.world_size())
                .map_err(Error::from)
                .and_then(|_| fused_rows(args, dims, local_sizes).local)
                .and_then(|_| {
                    if out.dtype() != dtype {
                        return Err(Error::dtype(C, "out", dtype.name(), out.dtype()));
                    }
                    collective_len(C, "out", out.shape(), 0, "no rows to reduce")
                });
            return self.shm.reduce_scatter(data_type(dtype), shm_comm::ReduceOp::Sum, &[], &mut [], local);
        }
        // Every rank of a group sees the same staging size, world and (when
        // the calls match at all) H and dtype, so every rank takes the same
        // branch; a rank that does not is reported as a mismatched collective.
        if self.stages_rows(dims.h, args.expanded_x.dtype()) {
            let mut rows = fused_rows(args, dims, local_sizes);
            let (dtype, local) = (rows.dtype, std::mem::replace(&mut rows.local, Ok(())));
            let mut produce = |block: usize, first: usize, bytes: &mut [u8]| rows.produce(block, first, bytes);
            return self.reduce_scatter_rows_with(dtype, ReduceOp::Sum, local_sizes, dims.h, out, local, &mut produce);
        }
        self.finalize_then_reduce_scatter_v(args, dims, local_sizes, out)
    }

    /// Joins the collective with no data and this rank's error, so every rank
    /// of the group fails with it at once.
    fn refuse(&self, call: Call<'_>, dtype: DType, error: Error) -> Error {
        let (dt, local) = (data_type(dtype), Err(error));
        let joined = match call {
            Call::AllReduce(op) => self.shm.all_reduce(dt, reduce_op(op), &[], &mut [], local),
            Call::AllReduceInPlace(op) => self.shm.all_reduce_in_place(dt, reduce_op(op), &mut [], local),
            Call::ReduceScatter(op) => self.shm.reduce_scatter(dt, reduce_op(op), &[], &mut [], local),
            Call::AllGather => self.shm.all_gather(dt, &[], &mut [], local),
            Call::ReduceScatterV(counts, op) => {
                self.shm.reduce_scatter_v(dt, reduce_op(op), &[], &mut [], counts, local)
            }
            Call::AllGatherV(counts) => self.shm.all_gather_v(dt, &[], &mut [], counts, local),
            Call::AllToAllV(send, recv) => self.shm.all_to_all_v(dt, &[], send, &mut [], recv, local),
            Call::Broadcast(root) => self.shm.broadcast(dt, &mut [], root, local),
        };
        match joined {
            Err(e) => e,
            // The transport returns the local error whenever the call itself
            // succeeds, so a refused call never comes back Ok.
            Ok(()) => Error::invalid("refuse", "call", "a refused collective reported success"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_maps_to_a_transport_type_of_the_same_size_and_name() {
        for d in DType::REDUCIBLE {
            let t = data_type(d);
            assert_eq!((t.size(), t.name()), (d.size(), d.name()), "{d}");
            assert!(t.is_reducible(), "{d}");
        }
    }
}
