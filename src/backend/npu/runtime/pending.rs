//! The sync point a caller owns: the work a stream's check reports, the
//! status records of eager launches, and the record slots of captured
//! launches.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::stream::{lock, CaptureRecords, EagerRecords, Fence, NpuStream, Pending, StatusRecord, SyncEvent};
use crate::backend::npu::result::acl as rt;
use crate::{Error, Result};

/// Eager launches between two fences of a stream's status records.
pub(crate) const RECORD_FENCE_EVERY: usize = 32;
/// Records of one block further apart than this are read in separate copies.
const SPAN_GAP: usize = 32 << 10;

impl EagerRecords {
    /// The first sequence number not yet finished (every lower one is).
    fn finished_below(&self) -> u64 {
        self.open.iter().copied().min().unwrap_or(self.head)
    }
}

/// The words of status records read by [`NpuStream::read_records`], by
/// device address.
pub(crate) struct RecordWords(HashMap<usize, Vec<u32>>);

impl RecordWords {
    /// The words read for `r` (empty if it was not among those read).
    pub(crate) fn of(&self, r: &StatusRecord) -> &[u32] {
        self.0.get(&r.addr).map_or(&[], Vec::as_slice)
    }
}

/// An error read from a status record before the check, reported by the
/// check in the record's place.
struct Settled(Mutex<Option<Error>>);

impl Pending for Settled {
    fn key(&self) -> Option<(usize, &'static str)> {
        None
    }

    fn timeout(&self) -> Option<Duration> {
        None
    }

    fn outcome(&self, _wait: Option<&Error>, _stream: &NpuStream) -> Result<()> {
        match self.0.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl NpuStream {
    /// Records queued work whose outcome [`check`](Self::check) reports.
    /// Work with the key of an entry already pending reports through that one.
    pub(crate) fn record_pending(&self, p: Box<dyn Pending>) {
        let mut st = lock(self.state());
        if let Some(k) = p.key() {
            if st.pending.iter().any(|q| q.key() == Some(k)) {
                return;
            }
        }
        st.pending.push(p);
    }

    /// The sync point the caller owns: waits for every queued work of this
    /// stream (bounded by the longest communicator timeout of the
    /// collectives queued since the last check, else `default_timeout`), then
    /// returns the first error recorded for it since the last check, in
    /// queue order: a collective's HCCL async error (naming the collective,
    /// group and rank), a kernel's status (a bad index with its position and
    /// value), or the failed wait itself. Each error is reported once. Then
    /// what graphs captured on the device's other streams recorded in
    /// replays (a graph may be replayed on any stream: `check_captures_of_other_streams`).
    /// Refused while the stream is captured into a graph.
    pub fn check_with_timeout(&self, default_timeout: Duration) -> Result<()> {
        // A synchronisation would invalidate the capture (CANN's runtime
        // guide, capture restriction 2): refused before anything is taken.
        self.refuse_under_capture("check", "check after the capture ends (e.g. after a replay)")?;
        let (pending, records_read) = {
            let mut st = lock(self.state());
            let upto = st.eager.as_ref().map(|er| er.finished_below());
            (std::mem::take(&mut st.pending), upto)
        };
        let timeout = pending.iter().filter_map(|p| p.timeout()).max().unwrap_or(default_timeout);
        let wait = self.synchronize_timeout(timeout).err();
        // Then what graphs captured on this stream left since the last check.
        let captured = std::mem::take(&mut lock(self.state()).captured);
        // Every status record is read after the wait, neighbours in one copy;
        // when the stream failed, its words may be stale and the failed wait
        // is what the check reports.
        let records: Vec<StatusRecord> = pending.iter().chain(&captured).filter_map(|p| p.record()).collect();
        // One RELAXED switch ([`rt::relaxed_capture_mode`]) for every
        // blocking read and reset below, of this stream's records and of the
        // other streams' captured ones, taken at the first read (the reads'
        // own switches do nothing under it). Nothing it covers allocates.
        let mut relaxed = None;
        let mut read = match wait {
            None if !records.is_empty() => rt::relaxed_capture_mode()
                .and_then(|r| {
                    relaxed = Some(r);
                    self.read_records(&records)
                })
                .map(Some),
            _ => Ok(None),
        };
        let mut first = Ok(());
        for p in pending.iter().chain(&captured) {
            // Every entry is looked at (and releases what it holds); the
            // first error in queue order is the one returned.
            let r = match p.record() {
                None => p.outcome(wait.as_ref(), self),
                Some(rec) => match &read {
                    Ok(Some(words)) => p.settle(words.of(&rec), self),
                    Ok(None) => Ok(()),
                    // A failed read is reported once, in the place of the
                    // first record it lost.
                    Err(_) => std::mem::replace(&mut read, Ok(None)).map(drop),
                },
            };
            if first.is_ok() {
                first = r;
            }
        }
        lock(self.state()).captured.splice(0..0, captured);
        if let Some(upto) = records_read {
            self.release_eager_records(upto);
        }
        first?;
        if wait.is_none() {
            self.check_captures_of_other_streams()?;
        }
        drop(relaxed);
        match wait {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// What graphs captured on the device's other streams recorded in
    /// replays since the last check: `torch.npu.graph` captures on its own
    /// side stream and replays on the current one (torch_npu
    /// `torch_npu/csrc/core/npu/NPUGraph.cpp`, `NPUGraph::replay`: "model_ri_
    /// may be replayed in any stream"), whose check is the one the engine
    /// makes. A record reporting a problem is reset, so it is reported once,
    /// by whichever check reads it first.
    ///
    /// Left for a later check: a record with a core's head still filled by
    /// its replay (`Pending::in_flight`: a replay on a stream this check did
    /// not synchronise may still be running; a core that never ran looks the
    /// same, and only the capture stream's own check reports that), and
    /// everything while any of those streams captures: its records of the
    /// graph being captured were written by no replay, and the zeroing of
    /// their slots, queued on it before the capture, may not have run (no
    /// check synchronised it), so their words are no result; and on a
    /// runtime without `aclmdlRICaptureThreadExchangeMode` the reads, blocking
    /// copies, would be refused during a GLOBAL capture
    /// (hicann/runtime v8.5.0 `src/runtime/feature/src/api_impl/api_impl.cc:2691`,
    /// `:3059`, `src/runtime/feature/src/context/context.cc:5134-5162`).
    /// A capture on a stream this crate does not know (torch_npu's own) is
    /// not asked about: the reads switch the thread to RELAXED
    /// ([`rt::relaxed_capture_mode`]), which CANN lets make them whatever
    /// captures, and none of these records is that capture's. A replay
    /// running on a stream this check did not synchronise may rewrite a
    /// record between its read and its reset; its report is then lost.
    fn check_captures_of_other_streams(&self) -> Result<()> {
        super::stream::with_other_streams(self.ordinal(), self.state(), |others| {
            // The common case, no graph captured elsewhere: nothing to ask the runtime.
            if others.iter().all(|(_, state)| lock(state).captured.is_empty()) {
                return Ok(());
            }
            for (raw, _) in others {
                if super::stream::capturing(*raw)? {
                    return Ok(());
                }
            }
            // One switch for every stream's reads (none when the check holds one).
            let _relaxed = rt::relaxed_capture_mode()?;
            let mut first = Ok(());
            for (_, state) in others {
                let captured = std::mem::take(&mut lock(state).captured);
                if captured.is_empty() {
                    continue;
                }
                let records: Vec<StatusRecord> = captured.iter().filter_map(|p| p.record()).collect();
                let read = self.read_records(&records);
                if let Ok(words) = &read {
                    for p in &captured {
                        let Some(rec) = p.record() else { continue };
                        let w = words.of(&rec);
                        if p.in_flight(w) {
                            continue;
                        }
                        let r = p.settle(w, self);
                        if first.is_ok() {
                            first = r;
                        }
                    }
                }
                lock(state).captured.splice(0..0, captured);
                read?;
            }
            first
        })
    }

    /// Reads `records` after the stream drained: the records of one block
    /// in address order, one copy for each run of them no more than
    /// [`SPAN_GAP`] bytes apart, never outside the block.
    pub(crate) fn read_records(&self, records: &[StatusRecord]) -> Result<RecordWords> {
        let mut sorted: Vec<&StatusRecord> = records.iter().collect();
        sorted.sort_by_key(|r| (r.block, r.addr));
        let mut out = RecordWords(HashMap::with_capacity(records.len()));
        let mut i = 0;
        while i < sorted.len() {
            let start = sorted[i].addr;
            let mut end = start + sorted[i].words * 4;
            let mut j = i + 1;
            while j < sorted.len() && sorted[j].block == sorted[i].block && sorted[j].addr <= end + SPAN_GAP {
                end = end.max(sorted[j].addr + sorted[j].words * 4);
                j += 1;
            }
            let (base, len) = sorted[i].block;
            if start < base || end > base + len {
                return Err(Error::invalid(
                    "status records",
                    "record",
                    format!("records {start:#x}..{end:#x} lie outside their block {base:#x}+{len}"),
                ));
            }
            let mut words = vec![0u32; (end - start) / 4];
            self.read_drained(start, bytemuck::cast_slice_mut(&mut words))?;
            for r in &sorted[i..j] {
                let at = (r.addr - start) / 4;
                out.0.insert(r.addr, words[at..at + r.words].to_vec());
            }
            i = j;
        }
        Ok(out)
    }

    /// True once the status records of eager launches are reserved.
    pub(crate) fn has_eager_records(&self) -> bool {
        lock(self.state()).eager.is_some()
    }

    /// The block of the eager records' ring (device address, bytes).
    pub(crate) fn eager_records_block(&self) -> Option<(usize, usize)> {
        lock(self.state()).eager.as_ref().map(|er| (er.base, er.slots as usize * er.slot_bytes))
    }

    /// Takes `slots` status records of `slot_bytes` at device address `base`
    /// (a detached pool block) for the eager launches, with `fences` to
    /// record between them.
    pub(crate) fn set_eager_records(&self, base: usize, slot_bytes: usize, slots: usize, fences: Vec<Fence>) {
        lock(self.state()).eager = Some(EagerRecords {
            base,
            slot_bytes,
            slots: slots as u64,
            head: 0,
            tail: 0,
            open: Vec::new(),
            since_fence: 0,
            fences: VecDeque::new(),
            spare: fences,
            holds_error: false,
        });
    }

    /// The status record of an eager launch of at least `bytes`: (device
    /// address, sequence number). When every record is held, the oldest
    /// fenced ones are read first ([`EagerRecords`]).
    pub(crate) fn take_eager_record(&self, bytes: usize) -> Result<(usize, u64)> {
        loop {
            {
                let mut st = lock(self.state());
                let Some(er) = st.eager.as_mut() else {
                    return Err(Error::invalid("status records", "stream", "no status records were reserved"));
                };
                if bytes > er.slot_bytes {
                    return Err(Error::invalid(
                        "status records",
                        "bytes",
                        format!("a launch needs {bytes} bytes of status, a record holds {}", er.slot_bytes),
                    ));
                }
                if er.head - er.tail < er.slots {
                    let seq = er.head;
                    er.head += 1;
                    er.open.push(seq);
                    return Ok((er.base + (seq % er.slots) as usize * er.slot_bytes, seq));
                }
            }
            self.read_oldest_records()?;
        }
    }

    /// The launch of record `seq` was enqueued (`pending` reports it) or
    /// failed to be (`None`); every [`RECORD_FENCE_EVERY`] of them a fence
    /// is recorded.
    pub(crate) fn finish_eager_record(&self, seq: u64, pending: Option<Box<dyn Pending>>) {
        let fence = {
            let mut st = lock(self.state());
            if let Some(p) = pending {
                st.pending.push(p);
            }
            let Some(er) = st.eager.as_mut() else { return };
            er.open.retain(|&s| s != seq);
            er.since_fence += 1;
            if er.since_fence < RECORD_FENCE_EVERY {
                return;
            }
            match er.spare.pop() {
                Some(f) => (er.finished_below(), f),
                None => return,
            }
        };
        let (bound, f) = fence;
        // A fence that cannot be recorded is not kept: the records it would
        // have covered are covered by a later one, or by the check.
        let recorded = f.record(self);
        let mut st = lock(self.state());
        let Some(er) = st.eager.as_mut() else { return };
        if recorded.is_ok() {
            er.fences.push_back((bound, f));
            er.since_fence = 0;
        } else {
            er.spare.push(f);
        }
    }

    /// Frees the eager records before the oldest fence (every record is
    /// held): asks the fence without waiting, waits for it on the host only
    /// when it has not completed, reads the records, and keeps the first
    /// error among them in the pending list in their place. With no fence
    /// recorded, one is recorded now after every finished launch.
    fn read_oldest_records(&self) -> Result<()> {
        let (bound, fence) = {
            let mut st = lock(self.state());
            let Some(er) = st.eager.as_mut() else { return Ok(()) };
            match er.fences.pop_front() {
                Some(f) => f,
                None => {
                    let bound = er.finished_below();
                    if bound == er.tail {
                        return Err(Error::invalid(
                            "status records",
                            "stream",
                            format!("all {} status records are held by launches being enqueued", er.slots),
                        ));
                    }
                    let f = match er.spare.pop() {
                        Some(f) => f,
                        None => {
                            drop(st);
                            Arc::new(SyncEvent::create(self)?)
                        }
                    };
                    if let Err(e) = f.record(self) {
                        if let Some(er) = lock(self.state()).eager.as_mut() {
                            er.spare.push(f);
                        }
                        return Err(e);
                    }
                    (bound, f)
                }
            }
        };
        let done = fence.is_complete().and_then(|c| if c { Ok(()) } else { fence.wait() });
        let (tail, base, slot_bytes, slots) = {
            let mut st = lock(self.state());
            let Some(er) = st.eager.as_mut() else { return Ok(()) };
            er.spare.push(fence);
            done?;
            (er.tail, er.base, er.slot_bytes, er.slots)
        };
        if bound <= tail {
            return Ok(());
        }
        // The records in [tail, bound), in ring order (one or two ranges).
        let n = (bound - tail) as usize;
        let first = (tail % slots) as usize;
        let upto_end = n.min(slots as usize - first);
        let per = slot_bytes / 4;
        let mut words = vec![0u32; n * per];
        let (a, b) = words.split_at_mut(upto_end * per);
        self.read_drained(base + first * slot_bytes, bytemuck::cast_slice_mut(a))?;
        if !b.is_empty() {
            self.read_drained(base, bytemuck::cast_slice_mut(b))?;
        }
        let mut st = lock(self.state());
        let mut holds_error = st.eager.as_ref().is_some_and(|er| er.holds_error);
        let pending = std::mem::take(&mut st.pending);
        let mut kept: Vec<Box<dyn Pending>> = Vec::with_capacity(pending.len());
        for p in pending {
            match p.record() {
                Some(StatusRecord { seq: Some(s), words: n, .. }) if (tail..bound).contains(&s) && n <= per => {
                    let at = (s - tail) as usize * per;
                    if let Err(e) = p.settle(&words[at..at + n], self) {
                        if !holds_error {
                            holds_error = true;
                            kept.push(Box::new(Settled(Mutex::new(Some(e)))));
                        }
                    }
                }
                _ => kept.push(p),
            }
        }
        // Entries queued meanwhile come after.
        kept.append(&mut st.pending);
        st.pending = kept;
        if let Some(er) = st.eager.as_mut() {
            er.tail = er.tail.max(bound);
            er.holds_error = holds_error;
        }
        Ok(())
    }

    /// The eager records below `upto` were read by a check: their slots and
    /// the fences before them are free.
    fn release_eager_records(&self, upto: u64) {
        let mut st = lock(self.state());
        let Some(er) = st.eager.as_mut() else { return };
        er.tail = er.tail.max(upto);
        while er.fences.front().is_some_and(|(b, _)| *b <= upto) {
            if let Some((_, f)) = er.fences.pop_front() {
                er.spare.push(f);
            }
        }
        if er.fences.is_empty() {
            er.since_fence = 0;
        }
        er.holds_error = false;
    }

    /// Keeps `p` for every check from now on: the check of work captured
    /// into a graph, whose replays rewrite what it reads.
    pub(crate) fn record_captured(&self, p: Box<dyn Pending>) {
        lock(self.state()).captured.push(p);
    }

    /// Record slots for captured launches not yet taken.
    pub(crate) fn capture_records_free(&self) -> usize {
        lock(self.state()).capture_records.iter().map(|b| b.slots - b.used).sum()
    }

    /// An eager launch: the captures before it ended their run. Returns the
    /// record slots to keep free: `at_least`, or the most one run took.
    pub(crate) fn end_captured_run(&self, at_least: usize) -> usize {
        lock(self.state()).captured_run.end(at_least)
    }

    /// Adds `slots` record slots of `slot_bytes` at device address `base` (a
    /// detached pool block whose zeroing is queued on this stream) for the
    /// kernel launches captured later.
    pub(crate) fn add_capture_records(&self, base: usize, slot_bytes: usize, slots: usize) {
        lock(self.state()).capture_records.push(CaptureRecords { base, slot_bytes, slots, used: 0 });
    }

    /// A zeroed record slot of at least `bytes` for a launch being captured,
    /// kept for the stream's life: (device address, its block). An error
    /// says how to reserve more when none are left (or none were reserved:
    /// no launch ran before capture).
    pub(crate) fn take_capture_record(&self, bytes: usize) -> Result<(usize, (usize, usize))> {
        let mut st = lock(self.state());
        let free = st.capture_records.iter_mut().find(|b| b.used < b.slots && bytes <= b.slot_bytes);
        if let Some(b) = free {
            let p = b.base + b.used * b.slot_bytes;
            b.used += 1;
            let block = (b.base, b.slots * b.slot_bytes);
            st.captured_run.took(1);
            return Ok((p, block));
        }
        let reserved: usize = st.capture_records.iter().map(|b| b.slots).sum();
        let slot_bytes = st.capture_records.first().map(|b| b.slot_bytes);
        Err(Error::invalid(
            "capture records",
            "stream",
            match slot_bytes {
                None => "no status records were reserved on this stream (reservations are per stream; an op that \
                         ran on another stream reserved there): run the op once on this stream before capturing \
                         it, or reserve them with NpuStream::reserve_capture_records / \
                         amoe_capture_records_reserve / ascend_moe.reserve_capture_records (torch.npu.graph \
                         without stream= captures on torch_npu's own side stream, not the warm-up's: reserve on it \
                         like the warm-up stream with amoe_stream_reserve_like / ascend_moe.prepare_capture)"
                    .into(),
                Some(slot) if bytes > slot => {
                    format!("a launch needs {bytes} bytes of status, a captured record holds {slot}")
                }
                Some(_) => format!(
                    "all {reserved} status records for captured launches are taken (each captured native kernel \
                     launch keeps one for the stream's life): reserve more before capture with \
                     NpuStream::reserve_capture_records / amoe_capture_records_reserve / \
                     ascend_moe.reserve_capture_records"
                ),
            },
        ))
    }

    /// Writes `len` zero bytes at device address `ptr` (a captured launch's
    /// record, once read) after this stream drained: the check's own write.
    /// A replay of the record's graph on another stream, not drained, may
    /// write it too (`check_captures_of_other_streams` says what is lost then).
    /// A blocking memset, made in RELAXED capture mode for the reason
    /// [`read_drained`](Self::read_drained) gives.
    pub(crate) fn zero_drained(&self, ptr: usize, len: usize) -> Result<()> {
        self.enter()?;
        let _relaxed = rt::relaxed_capture_mode()?;
        // SAFETY: `ptr` is `len` bytes of this device's memory (a record slot
        // of a live stream's pool); device writes racing the memset change
        // the record's words, never host memory.
        unsafe { rt::memset(ptr as *mut std::ffi::c_void, len, 0, len) }
    }

    /// [`check_with_timeout`](Self::check_with_timeout) with the timeout of
    /// `ASCEND_MOE_COMM_TIMEOUT` (or 60 s) when no collective is pending.
    pub fn check(&self) -> Result<()> {
        self.check_with_timeout(crate::CommOptions::from_env().timeout)
    }
}
