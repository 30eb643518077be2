//! The collective engine: one driver that posts and checks descriptors and
//! runs the staging rounds, and the data phase of each collective on raw
//! pointers (the public calls in `api` check the slices first).

use crate::copy::Copier;
use crate::descriptor::{disagreement, Desc, Kind};
use crate::reduce;
use crate::segment::{ERR_BYTES, SLOTS};
use crate::{DataType, ReduceOp, Result, ShmComm, State};

/// Most bytes a rank stages per round of a data-moving collective: a round's
/// chunk stays in the cache between its staging and the peers' reads (measured
/// in `copy`). The fused finalize-and-reduce-scatter (`reduce_scatter_rows_with`)
/// is capped the same way, to whole rows ([`ShmComm::round_rows`]).
const ROUND_MAX: usize = 1 << 20;

impl ShmComm {
    /// Runs one collective. Posts `desc` (flagged invalid, with the error text,
    /// when `invalid` is given) and, when it is not, stages round 0; one
    /// barrier covers both. Every rank then checks all descriptors the same way
    /// (failing together on a disagreement), learns the number of rounds from
    /// them, consumes round 0, and runs rounds 1.. as stage / barrier / consume.
    /// With `tail`, a last barrier is followed by `consume(rounds, _)`.
    ///
    /// `stage(k, slot)` writes round `k` into this rank's staging slot `slot`;
    /// `consume(k, slot)` reads round `k` from every rank's slot `slot`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn drive(
        &self,
        kind: Kind,
        mut desc: Desc,
        invalid: Option<&str>,
        rounds: &dyn Fn(&[Desc]) -> usize,
        stage: &mut dyn FnMut(usize, usize),
        consume: &mut dyn FnMut(usize, usize),
        tail: bool,
    ) -> Result<()> {
        let coll = kind.name();
        self.check_owner(coll)?;
        // A panic in `stage` or `consume` (the caller's code runs there) would
        // leave the peers waiting for this rank until their timeout, and this
        // handle out of step with them: the guard aborts the handle instead.
        let _guard = AbortOnUnwind { comm: self, coll, panicking: std::thread::panicking() };
        let mut st = self.lock();
        if let Some(e) = &st.broken {
            return Err(e.clone());
        }
        st.seq += 1;
        desc.seq = st.seq;
        desc.tag = st.tag;
        desc.invalid = invalid.is_some();
        let dslot = (st.seq % 2) as usize;
        let seg = &self.inner.seg;
        let me = self.inner.rank;
        let words = desc.to_words(self.inner.world);
        let ctrl = seg.ctrl_ptr(me);
        // SAFETY: only this rank writes its control block, and nobody reads slot
        // `seq % 2` until this rank arrives at the next phase (release store in
        // `sync`); readers of the previous use of this slot (call seq - 2) all
        // passed a barrier of call seq - 1 before this point.
        unsafe {
            std::ptr::addr_of_mut!((*ctrl).desc[dslot]).write(words);
            let mut err = [0u8; ERR_BYTES];
            if let Some(text) = invalid {
                let n = text.len().min(ERR_BYTES - 1);
                err[..n].copy_from_slice(&text.as_bytes()[..n]);
            }
            std::ptr::addr_of_mut!((*ctrl).err[dslot]).write(err);
        }
        // Every rank takes a slot for round 0, staged or not, so the rotation
        // stays in step.
        let slot0 = Self::slot(&mut st);
        if invalid.is_none() {
            stage(0, slot0);
        }
        self.sync(&mut st, coll)?;
        let world = self.inner.world;
        let descs: Vec<Desc> = (0..world)
            .map(|j| {
                let p = seg.ctrl_ptr(j);
                // SAFETY: rank j wrote slot `dslot` before arriving at the phase we
                // just observed (acquire), and will not rewrite it before this rank
                // arrives at the next phase.
                Desc::from_words(unsafe { &*std::ptr::addr_of!((*p).desc[dslot]) })
            })
            .collect();
        if invalid.is_some() {
            return Ok(());
        }
        if let Some(detail) = disagreement(seg, kind, &descs, dslot) {
            return Err(self.err(coll, crate::ErrorKind::Mismatch, detail));
        }
        let n = rounds(&descs);
        if n == 0 {
            return Ok(());
        }
        consume(0, slot0);
        let mut last = slot0;
        for k in 1..n {
            last = Self::slot(&mut st);
            stage(k, last);
            self.sync(&mut st, coll)?;
            consume(k, last);
        }
        if tail {
            self.sync(&mut st, coll)?;
            consume(n, last);
        }
        Ok(())
    }

    /// The staging slot of the next round.
    fn slot(st: &mut State) -> usize {
        let h = (st.round % SLOTS as u64) as usize;
        st.round += 1;
        h
    }

    /// Bytes per destination region when staging is split across the group.
    pub(crate) fn region_bytes(&self) -> usize {
        (self.inner.seg.staging / self.inner.world) / 64 * 64
    }

    /// Bytes a rank stages per round of a data-moving collective: one slot,
    /// at most [`ROUND_MAX`].
    fn round_bytes(&self) -> usize {
        self.inner.seg.staging.min(ROUND_MAX)
    }

    /// Bytes per destination region a rank stages per round of a
    /// personalised collective: a multiple of 64, at least 64 (a slot holds
    /// 64 bytes per rank of the largest world) and at most `region_bytes`.
    fn round_region_bytes(&self) -> usize {
        self.round_bytes() / self.inner.world / 64 * 64
    }

    /// Rows of `row_bytes` bytes (> 0) per destination region a rank stages
    /// per round of [`ShmComm::reduce_scatter_rows_with`]: as many as fit
    /// [`round_region_bytes`](Self::round_region_bytes), at least one, at most
    /// the rows a whole region holds (0 when not even one does).
    pub(crate) fn round_rows(&self, row_bytes: usize) -> usize {
        let whole = self.region_bytes() / row_bytes;
        (self.round_region_bytes() / row_bytes).clamp(whole.min(1), whole)
    }

    // ---- data phases ----
    //
    // Each takes this rank's descriptor and the text of its local validation
    // error, if any; with one, the pointers are never touched and the call
    // returns Ok after the descriptor exchange (the caller returns its error).

    /// # Safety
    /// If `invalid` is None: `src` readable and `dst` writable for `n` elements of
    /// `dtype`, aligned; they may be equal (in place) but not partially overlap.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn all_reduce_raw(
        &self,
        desc: Desc,
        invalid: Option<&str>,
        dtype: DataType,
        op: ReduceOp,
        src: *const u8,
        dst: *mut u8,
        n: usize,
    ) -> Result<()> {
        let seg = &self.inner.seg;
        let (world, me, esz) = (self.inner.world, self.inner.rank, dtype.size());
        let chunk = self.round_bytes() / esz;
        let rounds = n.div_ceil(chunk);
        let span = |k: usize| (k * chunk, chunk.min(n - k * chunk));
        let cp = Copier::for_bytes(n.saturating_mul(esz));
        // Round k: stage chunk k but for piece `me`; barrier; copy out chunk k - 1
        // (reduced in the previous round); reduce piece `me` of chunk k, this
        // rank's part read from `src` (no peer reads it, so it is not staged),
        // into piece `me` of this rank's slot. A last barrier precedes the
        // copy-out of the last chunk. Slot k % 3 is next written in round k + 3,
        // after the barrier of round k + 2, which every rank reaches only after
        // copying out chunk k.
        let mut stage = |k: usize, slot: usize| {
            if k < rounds {
                let (base, len) = span(k);
                let (lo, hi) = piece(me, len, world);
                for (from, to) in [(0, lo), (hi, len)] {
                    // SAFETY: base + to <= base + len <= n; the slot holds chunk >=
                    // len elements; only this rank writes its staging, and nobody
                    // reads this slot now.
                    unsafe {
                        Copier::STAGE.copy(
                            src.add((base + from) * esz),
                            seg.staging_ptr(me, slot).add(from * esz),
                            (to - from) * esz,
                        )
                    };
                }
            }
        };
        let mut prev: Option<(usize, usize)> = None;
        let mut consume = |k: usize, slot: usize| {
            if let Some((pk, pslot)) = prev.take() {
                let (base, len) = span(pk);
                for j in 0..world {
                    let (lo, hi) = piece(j, len, world);
                    // SAFETY: piece j of rank j's slot holds reduced values (a
                    // barrier passed since); dst holds n >= base + hi elements.
                    unsafe {
                        cp.copy(seg.staging_ptr(j, pslot).add(lo * esz), dst.add((base + lo) * esz), (hi - lo) * esz)
                    };
                }
            }
            if k < rounds {
                let (base, len) = span(k);
                let (lo, hi) = piece(me, len, world);
                let inputs: Vec<*const u8> = (0..world)
                    .map(|j| {
                        if j == me {
                            // SAFETY: base + lo <= n.
                            unsafe { src.add((base + lo) * esz) }
                        } else {
                            // SAFETY: lo <= len <= chunk: inside each staging slot.
                            unsafe { seg.staging_ptr(j, slot).add(lo * esz) as *const u8 }
                        }
                    })
                    .collect();
                // SAFETY: every other rank staged this chunk (synced); piece `me` of
                // every slot is read only by this rank in this round. The output,
                // this rank's own piece of its slot, was not staged and overlaps no
                // input. With src == dst (in place), dst's chunk k is written only
                // by the copy-out in the next round, after this read.
                unsafe { reduce::reduce(dtype, op, &inputs, seg.staging_ptr(me, slot).add(lo * esz), hi - lo) };
                prev = Some((k, slot));
            }
        };
        self.drive(Kind::AllReduce, desc, invalid, &|_| rounds, &mut stage, &mut consume, true)
    }

    /// # Safety
    /// If `invalid` is None: `src` readable for `sum(counts)` elements, `dst`
    /// writable for `counts[rank]`, aligned, not overlapping.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn reduce_scatter_raw(
        &self,
        kind: Kind,
        desc: Desc,
        invalid: Option<&str>,
        dtype: DataType,
        op: ReduceOp,
        src: *const u8,
        dst: *mut u8,
        counts: &[usize],
    ) -> Result<()> {
        let (region, esz, me) = (self.region_bytes(), dtype.size(), self.inner.rank);
        let relems = self.round_region_bytes() / esz;
        let displs = prefix(counts);
        let mut stage = |k: usize, slot: *mut u8| {
            // SAFETY: src holds sum(counts) elements (the caller's contract when
            // staging runs); the slot holds one region per rank.
            unsafe { stage_regions(src, counts, &displs, slot, me, k, relems, region, esz) }
        };
        // This rank's own block is reduced straight from `src`: no rank but this
        // one reads it, so staging it would only copy it. wrapping_add: with
        // `invalid`, counts need not describe src, and the pointer is never read.
        let own = src.wrapping_add(displs.get(me).copied().unwrap_or(0).wrapping_mul(esz));
        // SAFETY: the caller's contract on src (displs[me] + counts[me] elements)
        // and dst; `stage` fills relems <= region / esz elements of every other
        // region.
        unsafe { self.reduce_scatter_core(kind, desc, invalid, dtype, op, dst, counts, relems, Some(own), &mut stage) }
    }

    /// The reduce phase shared by every reduce-scatter: round `k` takes elements
    /// `[k * relems, (k + 1) * relems)` of every block, which `stage(k, slot)`
    /// has put in region `j` of this rank's staging slot for block `j`. With
    /// `own`, this rank's contribution to its own block is read from there
    /// (`counts[rank]` elements) instead of from region `rank`, which `stage`
    /// then need not fill; the reduction order is the same.
    ///
    /// # Safety
    /// If `invalid` is None: `dst` writable for `counts[rank]` elements of `dtype`,
    /// aligned, not overlapping the staging; `own`, if given, readable for
    /// `counts[rank]` aligned elements and not partially overlapping `dst`;
    /// `relems * dtype.size() <= region_bytes()`; `stage` writes only inside
    /// the slot it is given.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn reduce_scatter_core(
        &self,
        kind: Kind,
        desc: Desc,
        invalid: Option<&str>,
        dtype: DataType,
        op: ReduceOp,
        dst: *mut u8,
        counts: &[usize],
        relems: usize,
        own: Option<*const u8>,
        stage: &mut dyn FnMut(usize, *mut u8),
    ) -> Result<()> {
        let seg = &self.inner.seg;
        let (world, me, esz) = (self.inner.world, self.inner.rank, dtype.size());
        let region = self.region_bytes();
        // relems >= 1 is the callers' guarantee when `invalid` is None; max(1) keeps
        // a failed call (which never stages) from dividing by zero.
        let rounds = counts.iter().max().copied().unwrap_or(0).div_ceil(relems.max(1));
        let mut stage_slot = |k: usize, slot: usize| stage(k, seg.staging_ptr(me, slot));
        let mut consume = |k: usize, slot: usize| {
            let (lo, hi) = (k * relems, ((k + 1) * relems).min(counts[me]));
            if lo < hi {
                let inputs: Vec<*const u8> = (0..world)
                    .map(|j| match own {
                        // SAFETY: lo < counts[me], which `own` holds.
                        Some(p) if j == me => unsafe { p.add(lo * esz) },
                        // SAFETY: region `me` lies inside each staging slot.
                        _ => unsafe { seg.staging_ptr(j, slot).add(me * region) as *const u8 },
                    })
                    .collect();
                // SAFETY: region `me` of every other slot holds this round's piece
                // (synced) and is read only by this rank; dst holds counts[me].
                unsafe { reduce::reduce(dtype, op, &inputs, dst.add(lo * esz), hi - lo) };
            }
        };
        self.drive(kind, desc, invalid, &|_| rounds, &mut stage_slot, &mut consume, false)
    }

    /// # Safety
    /// If `invalid` is None: `src` readable for `counts[rank]` elements, `dst`
    /// writable for `sum(counts)`, aligned, not overlapping.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn all_gather_raw(
        &self,
        kind: Kind,
        desc: Desc,
        invalid: Option<&str>,
        dtype: DataType,
        src: *const u8,
        dst: *mut u8,
        counts: &[usize],
    ) -> Result<()> {
        let seg = &self.inner.seg;
        let (me, esz) = (self.inner.rank, dtype.size());
        let chunk = self.round_bytes() / esz;
        let displs = prefix(counts);
        let rounds = counts.iter().max().copied().unwrap_or(0).div_ceil(chunk);
        let cp = Copier::for_counts(counts, esz);
        let mut stage = |k: usize, slot: usize| {
            let (lo, hi) = (k * chunk, ((k + 1) * chunk).min(counts[me]));
            if lo < hi {
                // SAFETY: hi <= counts[me]; the slot holds chunk elements.
                unsafe { Copier::STAGE.copy(src.add(lo * esz), seg.staging_ptr(me, slot), (hi - lo) * esz) };
            }
        };
        let mut consume = |k: usize, slot: usize| {
            for (j, &c) in counts.iter().enumerate() {
                let (lo, hi) = (k * chunk, ((k + 1) * chunk).min(c));
                if lo < hi {
                    // SAFETY: rank j staged elements lo..hi of its block (synced);
                    // displs[j] + hi <= sum(counts).
                    unsafe { cp.copy(seg.staging_ptr(j, slot), dst.add((displs[j] + lo) * esz), (hi - lo) * esz) };
                }
            }
        };
        self.drive(kind, desc, invalid, &|_| rounds, &mut stage, &mut consume, false)
    }

    /// # Safety
    /// If `invalid` is None: `src` readable for `sum(send)` elements, `dst`
    /// writable for `sum(recv)`, aligned, not overlapping.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn all_to_all_raw(
        &self,
        desc: Desc,
        invalid: Option<&str>,
        dtype: DataType,
        src: *const u8,
        send: &[usize],
        dst: *mut u8,
        recv: &[usize],
    ) -> Result<()> {
        let seg = &self.inner.seg;
        let (me, esz) = (self.inner.rank, dtype.size());
        let region = self.region_bytes();
        let relems = self.round_region_bytes() / esz;
        let (sd, rd) = (prefix(send), prefix(recv));
        let cp = Copier::for_counts(send, esz).or(Copier::for_counts(recv, esz));
        // The number of rounds depends on every rank's sends (agreed descriptors).
        let rounds = |descs: &[Desc]| {
            (descs.iter().flat_map(|d| d.counts_a.iter()).copied().max().unwrap_or(0) as usize).div_ceil(relems)
        };
        let mut stage = |k: usize, slot: usize| {
            // SAFETY: src holds sum(send) elements (the caller's contract when
            // staging runs); this rank's slot holds one region per rank.
            unsafe { stage_regions(src, send, &sd, seg.staging_ptr(me, slot), me, k, relems, region, esz) }
        };
        let mut consume = |k: usize, slot: usize| {
            for (i, &c) in recv.iter().enumerate() {
                let (lo, hi) = (k * relems, ((k + 1) * relems).min(c));
                if lo < hi {
                    // This rank's own block is not staged: it is copied from src.
                    let from = if i == me {
                        // SAFETY: sd[me] + hi <= sum(send), since send[me] == recv[me]
                        // (checked with the descriptors).
                        unsafe { src.add((sd[me] + lo) * esz) }
                    } else {
                        // SAFETY: region `me` lies inside rank i's staging slot.
                        unsafe { seg.staging_ptr(i, slot).add(me * region) as *const u8 }
                    };
                    // SAFETY: rank i staged its block for this rank in region `me`
                    // (synced; its send count equals our recv count, checked), or
                    // `from` is in src, which does not overlap dst; rd[i] + hi <=
                    // sum(recv).
                    unsafe { cp.copy(from, dst.add((rd[i] + lo) * esz), (hi - lo) * esz) };
                }
            }
        };
        self.drive(Kind::AllToAllV, desc, invalid, &rounds, &mut stage, &mut consume, false)
    }

    /// # Safety
    /// If `invalid` is None: `buf` valid for reading (root) or writing (others) `n`
    /// elements.
    pub(crate) unsafe fn broadcast_raw(
        &self,
        desc: Desc,
        invalid: Option<&str>,
        dtype: DataType,
        buf: *mut u8,
        n: usize,
        root: usize,
    ) -> Result<()> {
        let seg = &self.inner.seg;
        let (me, esz) = (self.inner.rank, dtype.size());
        let chunk = self.round_bytes() / esz;
        let rounds = n.div_ceil(chunk);
        let span = |k: usize| (k * chunk, chunk.min(n.saturating_sub(k * chunk)));
        let cp = Copier::for_bytes(n.saturating_mul(esz));
        let mut stage = |k: usize, slot: usize| {
            let (base, len) = span(k);
            if me == root && len > 0 {
                // SAFETY: base + len <= n; the slot holds chunk elements.
                unsafe { Copier::STAGE.copy(buf.add(base * esz), seg.staging_ptr(root, slot), len * esz) };
            }
        };
        let mut consume = |k: usize, slot: usize| {
            let (base, len) = span(k);
            if me != root && len > 0 {
                // SAFETY: the root staged this chunk (synced); base + len <= n.
                unsafe { cp.copy(seg.staging_ptr(root, slot), buf.add(base * esz), len * esz) };
            }
        };
        self.drive(Kind::Broadcast, desc, invalid, &|_| rounds, &mut stage, &mut consume, false)
    }
}

/// Aborts the handle of a collective that unwinds (a panic that began after
/// the guard was made, `panicking` being whether one was under way then):
/// its peers fail at once with [`crate::ErrorKind::PeerFailed`] naming the
/// panic, and every later call on the handle fails.
struct AbortOnUnwind<'a> {
    comm: &'a ShmComm,
    coll: &'static str,
    panicking: bool,
}

impl Drop for AbortOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.panicking {
            self.comm.abort(self.coll);
        }
    }
}

/// Balanced split of `len` into `n` pieces aligned to 16 elements; piece `i`.
fn piece(i: usize, len: usize, n: usize) -> (usize, usize) {
    let per = len.div_ceil(n).div_ceil(16) * 16;
    ((i * per).min(len), ((i + 1) * per).min(len))
}

/// Stages round `k` of a personalised send: elements `[k * relems, (k + 1) *
/// relems)` of block `j` of `src` (`counts[j]` elements of `esz` bytes from
/// element `displs[j]`) go to region `j` (`region` bytes from `j * region`) of
/// the staging slot `slot`, with plain stores. Block `own` is not staged: it is
/// this rank's own, which the rank reads from `src` itself.
///
/// # Safety
/// `src` readable for `displs[j] + counts[j]` elements for every `j`; `slot`
/// writable for `counts.len()` regions of `region >= relems * esz` bytes, not
/// overlapping `src`.
#[allow(clippy::too_many_arguments)]
unsafe fn stage_regions(
    src: *const u8,
    counts: &[usize],
    displs: &[usize],
    slot: *mut u8,
    own: usize,
    k: usize,
    relems: usize,
    region: usize,
    esz: usize,
) {
    for (j, &c) in counts.iter().enumerate() {
        let (lo, hi) = (k * relems, ((k + 1) * relems).min(c));
        if lo < hi && j != own {
            // SAFETY: displs[j] + hi <= displs[j] + counts[j]; region j of the
            // slot holds relems >= hi - lo elements (the function's contract).
            unsafe { Copier::STAGE.copy(src.add((displs[j] + lo) * esz), slot.add(j * region), (hi - lo) * esz) };
        }
    }
}

/// Displacements of `counts`. The data phases use them only after
/// [`counts_sum`](crate::counts_sum) accepted the counts, so saturation never shows there; it
/// keeps a rejected count list from overflowing before the descriptors are
/// exchanged.
pub(crate) fn prefix(counts: &[usize]) -> Vec<usize> {
    let mut acc = 0usize;
    counts
        .iter()
        .map(|&c| {
            let d = acc;
            acc = acc.saturating_add(c);
            d
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::ROUND_MAX;
    use crate::{Config, ShmComm, MAX_WORLD};

    /// A capped round of a personalised collective fits the staging layout
    /// for every world and slot size: its region is a multiple of 64 bytes
    /// (aligned for every type), holds at least 64, lies inside the slot's
    /// region for its destination (what staging and the peers' reads rely
    /// on), and a whole round stays within the cap.
    #[test]
    fn capped_rounds_fit_the_staging_layout() {
        let slots = [Config::MIN_STAGING, 4096 + 64, ROUND_MAX - 64, ROUND_MAX + 4096, Config::DEFAULT_STAGING];
        for world in [1, 3, MAX_WORLD] {
            for staging_bytes in slots {
                let name = format!("rounds-{world}-{staging_bytes}-{}", std::process::id());
                let cfg = Config { staging_bytes };
                std::thread::scope(|s| {
                    for rank in 0..world {
                        let (name, cfg) = (&name, &cfg);
                        s.spawn(move || {
                            let c = ShmComm::rendezvous(name, world, rank, Duration::from_secs(30), cfg)
                                .expect("rendezvous");
                            let (round, region, per) = (c.round_bytes(), c.region_bytes(), c.round_region_bytes());
                            let what = format!("world {world}, staging {staging_bytes}");
                            assert_eq!(round, cfg.effective_staging().min(ROUND_MAX), "{what}");
                            assert!(per >= 64 && per % 64 == 0 && per <= region, "{what}: {per} of {region}");
                            assert!(per * world <= round, "{what}: {per} x {world} > {round}");
                            // Rows of the fused finalize-and-reduce-scatter: whole
                            // rows inside a region, within the round cap unless a
                            // single row is larger, none only when none fits.
                            for row in [2, 6, 64, 4096, 14_336, per, per + 2, region, region + 2] {
                                let rows = c.round_rows(row);
                                let fit = region / row;
                                assert!(rows <= fit && (rows > 0) == (fit > 0), "{what}, row {row}: {rows} of {fit}");
                                assert!(rows <= 1 || rows * row <= per, "{what}, row {row}: {rows} rows over {per}");
                                assert!(rows == fit || (rows + 1) * row > per, "{what}, row {row}: {rows} rows");
                            }
                        });
                    }
                });
            }
        }
    }
}
