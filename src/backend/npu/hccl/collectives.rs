//! The collectives of SPEC section 8 on an HCCL communicator.

use std::ffi::c_void;

use crate::backend::args::collective_len;
use crate::backend::npu::memory::NpuBuffer;
use crate::backend::npu::result::hccl as hc;
use crate::backend::npu::NpuDevice;
use crate::backend::{Communicator, View, ViewMut};
use crate::types::{DType, ReduceOp, TensorMeta};
use crate::{Error, Result};

use super::api::{check_dtype, hccl_dtype, hccl_op, Table};
use super::HcclComm;

/// The side of a call whose empty buffer [`HcclComm::dev_ptr`] stands in
/// for: the send buffer, and (below) the receive buffer.
const SEND: usize = 0;
const RECV: usize = 1;

impl HcclComm {
    /// The device address to pass for `b`, the `side` ([`SEND`] or [`RECV`])
    /// buffer of a call: its own, or for an empty buffer (which has no
    /// allocation) a small live one, a different one per side. In the V
    /// collectives a rank with count 0 still takes part, and those refuse one
    /// address for both buffers whatever the counts, so two NULLs would be
    /// refused (hicann/hccl v9.1.0
    /// `src/ops/all_to_all_v/all_to_all_v_op.cc:487-489`; API reference
    /// `HcclAlltoAllV.md:41`, `HcclReduceScatterV.md:40`, `HcclAllGatherV.md:44`).
    fn dev_ptr(&self, b: &NpuBuffer, side: usize) -> Result<*mut c_void> {
        if !b.as_ptr().is_null() {
            return Ok(b.as_ptr());
        }
        Ok(self.placeholders()?[side].as_ptr())
    }

    /// The two stand-ins for empty buffers ([`HcclComm::dev_ptr`]),
    /// allocated once. A new communicator allocates them at once: the first
    /// empty buffer may come under a graph capture, where nothing may be
    /// allocated.
    pub(super) fn placeholders(&self) -> Result<&[NpuBuffer; 2]> {
        if let Some(p) = self.inner.placeholders.get() {
            return Ok(p);
        }
        let p = [NpuBuffer::alloc(&self.inner.device, 32)?, NpuBuffer::alloc(&self.inner.device, 32)?];
        Ok(self.inner.placeholders.get_or_init(|| p))
    }

    /// The addresses of a V collective's send and receive buffers, which
    /// must not overlap: HCCL refuses the same address for both (see
    /// [`HcclComm::dev_ptr`]) and defines no result for overlapping ones,
    /// where the CPU communicator computes in place.
    fn dev_ptrs(
        &self,
        op: &'static str,
        (s, s_len): (&NpuBuffer, usize),
        (d, d_len): (&NpuBuffer, usize),
    ) -> Result<(*mut c_void, *mut c_void)> {
        let (sa, da) = (s.as_ptr() as usize, d.as_ptr() as usize);
        if s_len > 0 && d_len > 0 && sa < da + d_len && da < sa + s_len {
            return Err(Error::invalid(
                op,
                "dst",
                format!(
                    "its {d_len} bytes at {da:#x} overlap the {s_len} bytes of `src` at {sa:#x}; HCCL runs no \
                     V collective in place: pass a separate destination"
                ),
            ));
        }
        Ok((self.dev_ptr(s, SEND)?, self.dev_ptr(d, RECV)?))
    }

    /// A buffer `arg` of `HcclAllGatherV` / `HcclReduceScatterV` whose length
    /// is not what this rank's counts give (`Error::InvalidArgument`, as on
    /// the CPU communicator).
    fn v_len_err(op: &'static str, arg: &'static str, actual: usize, expected: usize, what: &str) -> Error {
        Error::invalid(op, arg, format!("holds {actual} elements, expected {expected} ({what})"))
    }

    /// `b`, which must be on this communicator's device.
    fn buffer<'a>(&self, op: &'static str, arg: &'static str, b: &'a NpuBuffer) -> Result<&'a NpuBuffer> {
        if b.device().ordinal() != self.inner.device.ordinal() {
            return Err(Error::Device {
                op,
                arg,
                expected: format!("npu:{}", self.inner.device.ordinal()),
                actual: format!("npu:{}", b.device().ordinal()),
            });
        }
        Ok(b)
    }

    /// `b` of a reduction (`HcclAllReduce`, `HcclReduceScatter[V]`), whose
    /// address HCCL needs aligned to the element size: 2 bytes for 16-bit
    /// types, 4 for 32-bit, 8 for 64-bit (HCCL API reference, hicann/hccl
    /// v9.1.0 `docs/zh/api_ref/comm_op_interface/HcclAllReduce.md:69-73`,
    /// `HcclReduceScatter.md:70-74`, `HcclReduceScatterV.md:71-75`). Only a
    /// borrowed buffer (a caller's pointer) can break it.
    fn reduce_buffer<'a>(
        &self,
        op: &'static str,
        arg: &'static str,
        b: &'a NpuBuffer,
        dtype: DType,
    ) -> Result<&'a NpuBuffer> {
        let b = self.buffer(op, arg, b)?;
        let at = b.as_ptr() as usize;
        if at % dtype.size() != 0 {
            return Err(Error::invalid(
                op,
                arg,
                format!(
                    "its address {at:#x} is not aligned to its {}-byte {} elements, which HCCL reductions need",
                    dtype.size(),
                    dtype.name()
                ),
            ));
        }
        Ok(b)
    }

    fn same_dtype(&self, op: &'static str, a: TensorMeta<'_>, b: TensorMeta<'_>) -> Result<()> {
        if a.dtype != b.dtype {
            return Err(Error::dtype(op, "dst", a.dtype.name(), b.dtype));
        }
        Ok(())
    }

    fn counts_check(
        &self,
        op: &'static str,
        arg: &'static str,
        counts: &[usize],
    ) -> Result<(Vec<u64>, Vec<u64>, usize)> {
        if counts.len() != self.inner.world {
            return Err(Error::invalid(
                op,
                arg,
                format!("{} counts for a group of {}", counts.len(), self.inner.world),
            ));
        }
        let c: Vec<u64> = counts.iter().map(|&n| n as u64).collect();
        let mut displs = Vec::with_capacity(counts.len());
        let mut total = 0u64;
        for &n in &c {
            displs.push(total);
            total += n;
        }
        Ok((c, displs, total as usize))
    }
}

impl Communicator for HcclComm {
    type Backend = NpuDevice;

    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world_size(&self) -> usize {
        self.inner.world
    }

    fn name(&self) -> &str {
        &self.inner.name
    }

    fn backend(&self) -> &NpuDevice {
        &self.inner.device
    }

    fn backend_of(&self, buf: &NpuBuffer) -> NpuDevice {
        buf.device().clone()
    }

    fn split(&self, ranks: &[usize]) -> Result<HcclComm> {
        self.split_hccl(ranks)
    }

    fn all_reduce(&self, src: View<'_, NpuBuffer>, dst: ViewMut<'_, NpuBuffer>, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        self.same_dtype(OP, src.meta(), dst.meta())?;
        check_dtype(OP, Table::Reduce, src.dtype())?;
        collective_len(OP, "dst", dst.shape(), src.numel(), "as src")?;
        let (s, d) = (
            self.reduce_buffer(OP, "src", src.buf(), src.dtype())?,
            self.reduce_buffer(OP, "dst", dst.buf(), src.dtype())?,
        );
        let (n, dt) = (src.numel() as u64, hccl_dtype(src.dtype()));
        if n == 0 {
            // Every rank has the same count: nothing moves anywhere.
            return Ok(());
        }
        self.run(OP, &[s, d], |stream| {
            // SAFETY: both buffers hold `n` elements of `dt` on this device.
            unsafe { hc::all_reduce(s.as_ptr(), d.as_ptr(), n, dt, hccl_op(op), self.inner.raw, stream) }
        })
    }

    fn all_reduce_in_place(&self, buf: ViewMut<'_, NpuBuffer>, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce_in_place";
        check_dtype(OP, Table::Reduce, buf.dtype())?;
        let b = self.reduce_buffer(OP, "buf", buf.buf(), buf.dtype())?;
        let (n, dt) = (buf.numel() as u64, hccl_dtype(buf.dtype()));
        if n == 0 {
            return Ok(());
        }
        self.run(OP, &[b], |stream| {
            // SAFETY: in-place all-reduce is supported; `n` elements of `dt`.
            unsafe { hc::all_reduce(b.as_ptr(), b.as_ptr(), n, dt, hccl_op(op), self.inner.raw, stream) }
        })
    }

    fn reduce_scatter(&self, src: View<'_, NpuBuffer>, dst: ViewMut<'_, NpuBuffer>, op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter";
        self.same_dtype(OP, src.meta(), dst.meta())?;
        check_dtype(OP, Table::Reduce, src.dtype())?;
        collective_len(OP, "src", src.shape(), dst.numel() * self.inner.world, "world size x dst elements")?;
        let (s, d) = (
            self.reduce_buffer(OP, "src", src.buf(), src.dtype())?,
            self.reduce_buffer(OP, "dst", dst.buf(), src.dtype())?,
        );
        let (n, dt) = (dst.numel() as u64, hccl_dtype(src.dtype()));
        if n == 0 {
            return Ok(());
        }
        self.run(OP, &[s, d], |stream| {
            // SAFETY: src holds world*n, dst n elements of `dt`.
            unsafe { hc::reduce_scatter(s.as_ptr(), d.as_ptr(), n, dt, hccl_op(op), self.inner.raw, stream) }
        })
    }

    fn all_gather(&self, src: View<'_, NpuBuffer>, dst: ViewMut<'_, NpuBuffer>) -> Result<()> {
        const OP: &str = "all_gather";
        self.same_dtype(OP, src.meta(), dst.meta())?;
        collective_len(OP, "dst", dst.shape(), src.numel() * self.inner.world, "world size x src elements")?;
        let (s, d) = (self.buffer(OP, "src", src.buf())?, self.buffer(OP, "dst", dst.buf())?);
        let (n, dt) = (src.numel() as u64, hccl_dtype(src.dtype()));
        if n == 0 {
            return Ok(());
        }
        self.run(OP, &[s, d], |stream| {
            // SAFETY: src holds n, dst world*n elements of `dt`.
            unsafe { hc::all_gather(s.as_ptr(), d.as_ptr(), n, dt, self.inner.raw, stream) }
        })
    }

    fn reduce_scatter_v(
        &self,
        src: View<'_, NpuBuffer>,
        dst: ViewMut<'_, NpuBuffer>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter_v";
        self.same_dtype(OP, src.meta(), dst.meta())?;
        check_dtype(OP, Table::ReduceScatterV, src.dtype())?;
        let (c, displs, total) = self.counts_check(OP, "counts", counts)?;
        let mine = counts[self.inner.rank];
        if src.numel() != total {
            return Err(Self::v_len_err(OP, "src", src.numel(), total, "the sum of counts"));
        }
        if dst.numel() != mine {
            return Err(Self::v_len_err(OP, "dst", dst.numel(), mine, "this rank's count"));
        }
        let (s, d) = (
            self.reduce_buffer(OP, "src", src.buf(), src.dtype())?,
            self.reduce_buffer(OP, "dst", dst.buf(), src.dtype())?,
        );
        let dt = hccl_dtype(src.dtype());
        if total == 0 {
            // The counts are the same on every rank: nothing moves anywhere.
            return Ok(());
        }
        let (sp, dp) = self.dev_ptrs(OP, (s, src.len_bytes()), (d, dst.len_bytes()))?;
        self.run(OP, &[s, d], |stream| {
            // SAFETY: counts/displacements are host u64 arrays of world length
            // that outlive the call; the buffers hold the sizes checked above.
            unsafe {
                hc::reduce_scatter_v(
                    sp,
                    c.as_ptr().cast::<c_void>(),
                    displs.as_ptr().cast::<c_void>(),
                    dp,
                    mine as u64,
                    dt,
                    hccl_op(op),
                    self.inner.raw,
                    stream,
                )
            }
        })
    }

    fn all_gather_v(&self, src: View<'_, NpuBuffer>, dst: ViewMut<'_, NpuBuffer>, counts: &[usize]) -> Result<()> {
        const OP: &str = "all_gather_v";
        self.same_dtype(OP, src.meta(), dst.meta())?;
        let (c, displs, total) = self.counts_check(OP, "counts", counts)?;
        let mine = counts[self.inner.rank];
        if src.numel() != mine {
            return Err(Self::v_len_err(OP, "src", src.numel(), mine, "this rank's count"));
        }
        if dst.numel() != total {
            return Err(Self::v_len_err(OP, "dst", dst.numel(), total, "the sum of counts"));
        }
        let (s, d) = (self.buffer(OP, "src", src.buf())?, self.buffer(OP, "dst", dst.buf())?);
        let dt = hccl_dtype(src.dtype());
        if total == 0 {
            return Ok(());
        }
        let (sp, dp) = self.dev_ptrs(OP, (s, src.len_bytes()), (d, dst.len_bytes()))?;
        self.run(OP, &[s, d], |stream| {
            // SAFETY: as for reduce_scatter_v.
            unsafe {
                hc::all_gather_v(
                    sp,
                    mine as u64,
                    dp,
                    c.as_ptr().cast::<c_void>(),
                    displs.as_ptr().cast::<c_void>(),
                    dt,
                    self.inner.raw,
                    stream,
                )
            }
        })
    }

    fn all_to_all_v(
        &self,
        src: View<'_, NpuBuffer>,
        send_counts: &[usize],
        dst: ViewMut<'_, NpuBuffer>,
        recv_counts: &[usize],
    ) -> Result<()> {
        const OP: &str = "all_to_all_v";
        self.same_dtype(OP, src.meta(), dst.meta())?;
        let (sc, sd, stotal) = self.counts_check(OP, "send_counts", send_counts)?;
        let (rc, rd, rtotal) = self.counts_check(OP, "recv_counts", recv_counts)?;
        collective_len(OP, "src", src.shape(), stotal, "sum of send_counts")?;
        collective_len(OP, "dst", dst.shape(), rtotal, "sum of recv_counts")?;
        let (s, d) = (self.buffer(OP, "src", src.buf())?, self.buffer(OP, "dst", dst.buf())?);
        let dt = hccl_dtype(src.dtype());
        let (sp, dp) = self.dev_ptrs(OP, (s, src.len_bytes()), (d, dst.len_bytes()))?;
        self.run(OP, &[s, d], |stream| {
            // SAFETY: host u64 count/displacement arrays of world length; the
            // buffers hold the totals checked above.
            unsafe {
                hc::all_to_all_v(
                    sp,
                    sc.as_ptr().cast::<c_void>(),
                    sd.as_ptr().cast::<c_void>(),
                    dt,
                    dp,
                    rc.as_ptr().cast::<c_void>(),
                    rd.as_ptr().cast::<c_void>(),
                    dt,
                    self.inner.raw,
                    stream,
                )
            }
        })
    }

    fn broadcast(&self, buf: ViewMut<'_, NpuBuffer>, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        if root >= self.inner.world {
            let why = format!("root {root} is out of range for world size {}", self.inner.world);
            return Err(Error::invalid(OP, "root", why));
        }
        let b = self.reduce_buffer(OP, "buf", buf.buf(), buf.dtype())?;
        let (n, dt) = (buf.numel() as u64, hccl_dtype(buf.dtype()));
        if n == 0 {
            // Every rank has the same count: nothing moves, and an empty
            // buffer has no address HCCL would accept.
            return Ok(());
        }
        self.run(OP, &[b], |stream| {
            // SAFETY: `n` elements of `dt` on this device.
            unsafe { hc::broadcast(b.as_ptr(), n, dt, root as u32, self.inner.raw, stream) }
        })
    }

    fn barrier(&self) -> Result<()> {
        self.barrier_on(&self.inner.device.stream().clone())
    }
    fn barrier_on(&self, on: &NpuDevice) -> Result<()> {
        HcclComm::barrier_on(self, on.stream())
    }
}
