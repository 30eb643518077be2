//! The public collectives: byte slices, an element type and element counts.
//!
//! Each call checks its slices against the counts (after the caller's own
//! `check`), posts its descriptor and runs the data phase of `collectives`.
//! A failed check still takes part in the descriptor exchange, so every rank
//! of the group fails together.

use std::fmt::Display;

use crate::counts::{counts_len, counts_sum, same_len};
use crate::descriptor::{Desc, Kind, PostedShape};
use crate::{Agreeing, Shape};
use crate::{DataType, Error, ReduceOp, Result, ShmComm};

/// Runs `call` with the text of `local`'s error (if any); a failure of the
/// call itself (the descriptor exchange or a data round) wins over `local`.
fn finish<E: From<Error> + Display>(
    local: Result<(), E>,
    call: impl FnOnce(Option<&str>) -> Result<()>,
) -> Result<(), E> {
    let text = local.as_ref().err().map(|e| e.to_string());
    call(text.as_deref())?;
    local
}

/// Whole elements of `dtype` in `bytes` bytes of argument `arg`.
fn elems(op: &'static str, arg: &'static str, dtype: DataType, bytes: usize) -> Result<usize> {
    if bytes % dtype.size() != 0 {
        return Err(Error::invalid(op, arg, format!("holds {bytes} bytes, not a whole number of {dtype} elements")));
    }
    Ok(bytes / dtype.size())
}

fn reducible(op: &'static str, dtype: DataType) -> Result<()> {
    if !dtype.is_reducible() {
        return Err(Error::invalid(
            op,
            "dtype",
            format!("{dtype} cannot be reduced (reductions take f32, f16, bf16, i32 or i64)"),
        ));
    }
    Ok(())
}

/// A reduction reads this rank's input and writes `arg` through typed
/// pointers: each must be aligned, unless it is empty (nothing is read or
/// written then, and an empty `Vec`'s pointer is only aligned to its own
/// element type).
fn aligned(op: &'static str, arg: &'static str, dtype: DataType, s: &[u8]) -> Result<()> {
    if !s.is_empty() && (s.as_ptr() as usize) % dtype.size() != 0 {
        return Err(Error::invalid(op, arg, format!("is not aligned to the {}-byte {dtype} elements", dtype.size())));
    }
    Ok(())
}

/// The collectives of [`ShmComm`] without a shape to compare: each one is
/// `pub fn name<E: From<Error> + Display>(&self, args) -> Result<(), E>`,
/// the same call through [`ShmComm::plain`] (the [`Agreeing`] collective of
/// that name, which holds the checks and the data phase). The signatures
/// and docs are written at the invocation.
macro_rules! plain_forwards {
    ($($(#[$attr:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {$(
        $(#[$attr])*
        pub fn $name<E: From<Error> + Display>(&self, $($arg: $ty),*) -> Result<(), E> {
            self.plain().$name($($arg),*)
        }
    )*};
}

impl ShmComm {
    /// The next collective through the handle returned also compares `shape`
    /// across the ranks: ranks that pass other shapes (or none) fail
    /// together with [`crate::ErrorKind::Mismatch`], naming each rank's.
    pub fn agreeing(&self, shape: Shape<'_>) -> Agreeing<'_> {
        Agreeing { comm: self, shape: Some(PostedShape::new(shape.label, shape.dims)) }
    }

    fn plain(&self) -> Agreeing<'_> {
        Agreeing { comm: self, shape: None }
    }

    plain_forwards! {
        /// `dst = op(src over ranks)`; `src` and `dst` hold the same number of
        /// elements, and a non-empty `src` is aligned to them.
        fn all_reduce(dtype: DataType, op: ReduceOp, src: &[u8], dst: &mut [u8], check: Result<(), E>);

        /// In-place all-reduce; a non-empty `buf` is aligned to its elements.
        fn all_reduce_in_place(dtype: DataType, op: ReduceOp, buf: &mut [u8], check: Result<(), E>);

        /// Reduce-scatter: `src` holds `world` blocks of `dst`'s element count;
        /// `dst` receives block `rank` of the reduction. Both are aligned to
        /// their elements (unless empty).
        fn reduce_scatter(dtype: DataType, op: ReduceOp, src: &[u8], dst: &mut [u8], check: Result<(), E>);

        /// Reduce-scatter with per-rank block sizes `counts` (elements); `src`
        /// and `dst` are aligned to their elements (unless empty).
        fn reduce_scatter_v(
            dtype: DataType, op: ReduceOp, src: &[u8], dst: &mut [u8], counts: &[usize], check: Result<(), E>,
        );

        /// `dst = concat(src of every rank)`: `dst` holds `world` times `src`.
        fn all_gather(dtype: DataType, src: &[u8], dst: &mut [u8], check: Result<(), E>);

        /// All-gather with per-rank block sizes `counts` (elements).
        fn all_gather_v(dtype: DataType, src: &[u8], dst: &mut [u8], counts: &[usize], check: Result<(), E>);

        /// Personalised exchange: block `j` of `src` (`send_counts[j]` elements)
        /// goes to rank `j`; block `i` of `dst` (`recv_counts[i]`) comes from rank
        /// `i`. The counts must agree pairwise across ranks.
        fn all_to_all_v(
            dtype: DataType, src: &[u8], send_counts: &[usize], dst: &mut [u8], recv_counts: &[usize],
            check: Result<(), E>,
        );

        /// Copies `buf` of rank `root` into `buf` of every rank.
        fn broadcast(dtype: DataType, buf: &mut [u8], root: usize, check: Result<(), E>);

        /// Reduce-scatter of row blocks that are computed straight into the
        /// staging buffers instead of being copied from a source buffer.
        ///
        /// Block `j` has `rows[j]` rows of `row_len` elements of `dtype`; the
        /// result of this rank is `op` over ranks of block `rank`, written to `dst`
        /// (`rows[rank] * row_len` elements). `produce(j, first, out)` must fill
        /// `out` (`out.len() / (row_len * dtype.size())` whole rows, 64-byte
        /// aligned) with rows `first..` of this rank's block `j`. It is called
        /// only when every argument and `check` (the caller's own validation of
        /// whatever `produce` reads) are good; otherwise the call fails on every
        /// rank with the reason, like any collective.
        ///
        /// The result is bitwise the same as [`ShmComm::reduce_scatter_v`] over
        /// the concatenated blocks (same reduction order), with one copy of the
        /// input less. Needs [`ShmComm::rows_per_region`] `>= 1`.
        #[allow(clippy::too_many_arguments)]
        fn reduce_scatter_rows_with(
            dtype: DataType, op: ReduceOp, rows: &[usize], row_len: usize, dst: &mut [u8], check: Result<(), E>,
            produce: &mut dyn FnMut(usize, usize, &mut [u8]),
        );
    }

    /// Waits for every rank.
    pub fn barrier(&self) -> Result<()> {
        let desc = Desc::new(Kind::Barrier, DataType::F32, None);
        self.drive(Kind::Barrier, desc, None, &|_| 0, &mut |_, _| {}, &mut |_, _| {}, false)
    }

    /// Rows per staging region for rows of `row_len` elements of `dtype`: the
    /// most rows of one block [`ShmComm::reduce_scatter_rows_with`] could move
    /// per round (it moves fewer, as many as keep a round in the cache). 0
    /// when one row does not fit (the caller then stages a buffer).
    pub fn rows_per_region(&self, row_len: usize, dtype: DataType) -> usize {
        match row_len.checked_mul(dtype.size()) {
            Some(b) if b > 0 => self.region_bytes() / b,
            _ => 0,
        }
    }

    fn check_root(&self, root: usize) -> Result<()> {
        let w = self.inner.world;
        if root >= w {
            return Err(Error::invalid("broadcast", "root", format!("root {root} is out of range for world size {w}")));
        }
        Ok(())
    }

    fn check_v(
        &self,
        op: &'static str,
        counts: &[usize],
        total: usize,
        total_arg: &'static str,
        mine: usize,
        mine_arg: &'static str,
    ) -> Result<()> {
        let w = self.inner.world;
        counts_len(op, "counts", counts, w)?;
        same_len(op, total_arg, counts_sum(op, "counts", counts)?, total)?;
        same_len(op, mine_arg, counts[self.inner.rank], mine)
    }
}

impl Agreeing<'_> {
    /// [`ShmComm::all_reduce`], also comparing the shape.
    pub fn all_reduce<E: From<Error> + Display>(
        &self,
        dtype: DataType,
        op: ReduceOp,
        src: &[u8],
        dst: &mut [u8],
        check: Result<(), E>,
    ) -> Result<(), E> {
        const C: &str = "all_reduce";
        let n = src.len() / dtype.size();
        let local = check.and_then(|_| {
            reducible(C, dtype)?;
            let n = elems(C, "src", dtype, src.len())?;
            same_len(C, "dst", n, elems(C, "dst", dtype, dst.len())?)?;
            Ok(aligned(C, "src", dtype, src)?)
        });
        let desc = Desc::new(Kind::AllReduce, dtype, Some(op)).count(n).shape(self.shape.clone());
        // SAFETY: the data phase runs only when the lengths agree and src is
        // aligned (no invalid text); & and &mut cannot overlap.
        finish(local, |inv| unsafe {
            self.comm.all_reduce_raw(desc, inv, dtype, op, src.as_ptr(), dst.as_mut_ptr(), n)
        })
    }

    /// [`ShmComm::all_reduce_in_place`], also comparing the shape.
    pub fn all_reduce_in_place<E: From<Error> + Display>(
        &self,
        dtype: DataType,
        op: ReduceOp,
        buf: &mut [u8],
        check: Result<(), E>,
    ) -> Result<(), E> {
        const C: &str = "all_reduce";
        let n = buf.len() / dtype.size();
        let local = check.and_then(|_| {
            reducible(C, dtype)?;
            elems(C, "buf", dtype, buf.len())?;
            Ok(aligned(C, "buf", dtype, buf)?)
        });
        let desc = Desc::new(Kind::AllReduce, dtype, Some(op)).count(n).shape(self.shape.clone());
        let p = buf.as_mut_ptr();
        // SAFETY: src == dst (in place is allowed); buf holds n aligned
        // elements when the data phase runs.
        finish(local, |inv| unsafe { self.comm.all_reduce_raw(desc, inv, dtype, op, p, p, n) })
    }

    /// [`ShmComm::reduce_scatter`], also comparing the shape.
    pub fn reduce_scatter<E: From<Error> + Display>(
        &self,
        dtype: DataType,
        op: ReduceOp,
        src: &[u8],
        dst: &mut [u8],
        check: Result<(), E>,
    ) -> Result<(), E> {
        const C: &str = "reduce_scatter";
        let w = self.comm.inner.world;
        let n = dst.len() / dtype.size();
        let local = check.and_then(|_| {
            reducible(C, dtype)?;
            let n = elems(C, "dst", dtype, dst.len())?;
            same_len(C, "src", n.saturating_mul(w), elems(C, "src", dtype, src.len())?)?;
            aligned(C, "src", dtype, src)?;
            Ok(aligned(C, "dst", dtype, dst)?)
        });
        let desc = Desc::new(Kind::ReduceScatter, dtype, Some(op)).count(n).shape(self.shape.clone());
        let counts = vec![n; w];
        // SAFETY: the data phase runs only when src holds w * n and dst n
        // elements, both aligned.
        finish(local, |inv| unsafe {
            self.comm.reduce_scatter_raw(
                Kind::ReduceScatter,
                desc,
                inv,
                dtype,
                op,
                src.as_ptr(),
                dst.as_mut_ptr(),
                &counts,
            )
        })
    }

    /// [`ShmComm::reduce_scatter_v`], also comparing the shape.
    pub fn reduce_scatter_v<E: From<Error> + Display>(
        &self,
        dtype: DataType,
        op: ReduceOp,
        src: &[u8],
        dst: &mut [u8],
        counts: &[usize],
        check: Result<(), E>,
    ) -> Result<(), E> {
        const C: &str = "reduce_scatter_v";
        let local = check.and_then(|_| {
            reducible(C, dtype)?;
            let (s, d) = (elems(C, "src", dtype, src.len())?, elems(C, "dst", dtype, dst.len())?);
            self.comm.check_v(C, counts, s, "src", d, "dst")?;
            aligned(C, "src", dtype, src)?;
            Ok(aligned(C, "dst", dtype, dst)?)
        });
        let desc = Desc::new(Kind::ReduceScatterV, dtype, Some(op)).counts(counts, counts).shape(self.shape.clone());
        // SAFETY: the data phase runs only when src holds sum(counts) and dst
        // counts[rank] elements, both aligned.
        finish(local, |inv| unsafe {
            self.comm.reduce_scatter_raw(
                Kind::ReduceScatterV,
                desc,
                inv,
                dtype,
                op,
                src.as_ptr(),
                dst.as_mut_ptr(),
                counts,
            )
        })
    }

    /// [`ShmComm::all_gather`], also comparing the shape.
    pub fn all_gather<E: From<Error> + Display>(
        &self,
        dtype: DataType,
        src: &[u8],
        dst: &mut [u8],
        check: Result<(), E>,
    ) -> Result<(), E> {
        const C: &str = "all_gather";
        let w = self.comm.inner.world;
        let n = src.len() / dtype.size();
        let local = check.and_then(|_| {
            let n = elems(C, "src", dtype, src.len())?;
            Ok(same_len(C, "dst", n.saturating_mul(w), elems(C, "dst", dtype, dst.len())?)?)
        });
        let desc = Desc::new(Kind::AllGather, dtype, None).count(n).shape(self.shape.clone());
        let counts = vec![n; w];
        // SAFETY: the data phase runs only when dst holds w * n elements.
        finish(local, |inv| unsafe {
            self.comm.all_gather_raw(Kind::AllGather, desc, inv, dtype, src.as_ptr(), dst.as_mut_ptr(), &counts)
        })
    }

    /// [`ShmComm::all_gather_v`], also comparing the shape.
    pub fn all_gather_v<E: From<Error> + Display>(
        &self,
        dtype: DataType,
        src: &[u8],
        dst: &mut [u8],
        counts: &[usize],
        check: Result<(), E>,
    ) -> Result<(), E> {
        const C: &str = "all_gather_v";
        let local = check.and_then(|_| {
            let (s, d) = (elems(C, "src", dtype, src.len())?, elems(C, "dst", dtype, dst.len())?);
            Ok(self.comm.check_v(C, counts, d, "dst", s, "src")?)
        });
        let desc = Desc::new(Kind::AllGatherV, dtype, None).counts(counts, counts).shape(self.shape.clone());
        // SAFETY: the data phase runs only when src holds counts[rank] and dst
        // sum(counts) elements.
        finish(local, |inv| unsafe {
            self.comm.all_gather_raw(Kind::AllGatherV, desc, inv, dtype, src.as_ptr(), dst.as_mut_ptr(), counts)
        })
    }

    /// [`ShmComm::all_to_all_v`], also comparing the shape.
    pub fn all_to_all_v<E: From<Error> + Display>(
        &self,
        dtype: DataType,
        src: &[u8],
        send_counts: &[usize],
        dst: &mut [u8],
        recv_counts: &[usize],
        check: Result<(), E>,
    ) -> Result<(), E> {
        const C: &str = "all_to_all_v";
        let w = self.comm.inner.world;
        let local = check.and_then(|_| {
            counts_len(C, "send_counts", send_counts, w)?;
            counts_len(C, "recv_counts", recv_counts, w)?;
            same_len(C, "src", counts_sum(C, "send_counts", send_counts)?, elems(C, "src", dtype, src.len())?)?;
            Ok(same_len(C, "dst", counts_sum(C, "recv_counts", recv_counts)?, elems(C, "dst", dtype, dst.len())?)?)
        });
        let desc = Desc::new(Kind::AllToAllV, dtype, None).counts(send_counts, recv_counts).shape(self.shape.clone());
        // SAFETY: the data phase runs only when src holds sum(send) and dst
        // sum(recv) elements, and the counts agree pairwise across ranks
        // (checked before any data moves).
        finish(local, |inv| unsafe {
            self.comm.all_to_all_raw(desc, inv, dtype, src.as_ptr(), send_counts, dst.as_mut_ptr(), recv_counts)
        })
    }

    /// [`ShmComm::broadcast`], also comparing the shape.
    pub fn broadcast<E: From<Error> + Display>(
        &self,
        dtype: DataType,
        buf: &mut [u8],
        root: usize,
        check: Result<(), E>,
    ) -> Result<(), E> {
        let n = buf.len() / dtype.size();
        let local = check.and_then(|_| {
            elems("broadcast", "buf", dtype, buf.len())?;
            Ok(self.comm.check_root(root)?)
        });
        let desc = Desc::new(Kind::Broadcast, dtype, None).count(n).root(root).shape(self.shape.clone());
        // SAFETY: buf holds n elements.
        finish(local, |inv| unsafe { self.comm.broadcast_raw(desc, inv, dtype, buf.as_mut_ptr(), n, root) })
    }

    /// [`ShmComm::reduce_scatter_rows_with`], also comparing the shape.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_scatter_rows_with<E: From<Error> + Display>(
        &self,
        dtype: DataType,
        op: ReduceOp,
        rows: &[usize],
        row_len: usize,
        dst: &mut [u8],
        check: Result<(), E>,
        produce: &mut dyn FnMut(usize, usize, &mut [u8]),
    ) -> Result<(), E> {
        const C: &str = "reduce_scatter_rows";
        let (world, me, esz) = (self.comm.inner.world, self.comm.inner.rank, dtype.size());
        let rpr = self.comm.rows_per_region(row_len, dtype);
        let region = self.comm.region_bytes();
        let checked = check.and_then(|_| {
            reducible(C, dtype)?;
            counts_len(C, "rows", rows, world)?;
            if rpr == 0 {
                let why = format!("a row of {row_len} {dtype} elements does not fit the {region}-byte staging region");
                return Err(Error::invalid(C, "row_len", why).into());
            }
            let elems = rows.iter().map(|r| r.checked_mul(row_len)).collect::<Option<Vec<usize>>>();
            let elems =
                elems.ok_or_else(|| Error::invalid(C, "rows", format!("{rows:?} rows of {row_len} overflow")))?;
            counts_sum(C, "rows", &elems)?;
            same_len(C, "dst", elems[me], self::elems(C, "dst", dtype, dst.len())?)?;
            aligned(C, "dst", dtype, dst)?;
            Ok(elems)
        });
        let (local, counts) = match checked {
            Ok(elems) => (Ok(()), elems),
            Err(e) => (Err(e), vec![0; world]),
        };
        let desc = Desc::new(Kind::ReduceScatterRows, dtype, Some(op))
            .count(row_len)
            .counts(&counts, &counts)
            .shape(self.shape.clone());
        // Rows per block per round: rounds of at most the cap of every data
        // collective, so that a round's rows are still cached when the peers
        // read them (rpr >= 1 when staging runs, and then so is this).
        let rpr = if rpr == 0 { 0 } else { self.comm.round_rows(row_len * esz) };
        let relems = rpr * row_len;
        let d = dst.as_mut_ptr();
        let mut stage = |k: usize, slot: *mut u8| {
            for (j, &r) in rows.iter().enumerate() {
                let (lo, hi) = (k * rpr, ((k + 1) * rpr).min(r));
                if lo < hi {
                    // SAFETY: region j of the slot holds rpr >= hi - lo rows
                    // (round_rows: at most rows_per_region); only this rank
                    // writes its slot, and nobody reads it during staging.
                    // Regions start at multiples of 64 bytes inside a 64-byte
                    // aligned slot.
                    let out =
                        unsafe { std::slice::from_raw_parts_mut(slot.add(j * region), (hi - lo) * row_len * esz) };
                    produce(j, lo, out);
                }
            }
        };
        // SAFETY: staging runs only when the checks passed: then dst holds
        // counts[me] aligned elements, and relems * esz <= region (rows_per_region).
        finish(local, |inv| unsafe {
            self.comm.reduce_scatter_core(
                Kind::ReduceScatterRows,
                desc,
                inv,
                dtype,
                op,
                d,
                &counts,
                relems,
                None,
                &mut stage,
            )
        })
    }
}
