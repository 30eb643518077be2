//! The live forward context on the device, and the guards that captured ops
//! enqueue against it.
//!
//! An ACL graph replays the work it captured: the layout and the reductions
//! of the forward context it was captured under. The engine rewrites the live
//! context ([`LiveContext::set`], or its own copy into
//! [`LiveContext::device_ptr`]) before each replay; each guard
//! ([`LiveContext::guard`]) is one launch of the guard kernel
//! (`kernels/guard_kernel.cpp`) that compares the live words with the context
//! the guarded ops were built for and writes the first difference into its
//! own status record, where a captured guard's mismatch stays until it is
//! read, whatever later replays find. [`LiveContext::check`], after the
//! caller synchronised the stream, reads the records and returns the first
//! mismatch as [`Error::StaleContext`].
//!
//! Nothing a guard enqueues synchronises, allocates or reads device memory on
//! the host: its record and (for the AI Core build) its tiling are slots of
//! memory reserved ahead, in chunks that never move (captured kernels hold
//! their addresses). A context is made with [`GUARD_CHUNK`] records;
//! [`LiveContext::reserve`] adds more before capture. A guard enqueued while
//! its stream captures keeps its slot for the context's life, since every
//! replay rewrites it, so an engine that captures a graph per batch size
//! reserves a record for every guard of every graph; an eager guard's slot is
//! released by the next check. An eager guard that finds every record in use
//! adds a chunk itself (it may allocate), and so does one that finds fewer
//! records out of captured guards' hands than the largest run of captures
//! took (the guards captured between two eager guards): each graph of a
//! model captured after an eager warm-up then finds its records, and only
//! the first needs a reservation. A guard under capture cannot add records,
//! and is refused.

use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use acl_sys::aclrtMemcpyKind;

use super::device_check::GuardLauncher;
use super::kernel::guard::{
    check_guard_status, ContextWords, GuardTiling, CTX_WORDS, GUARD_GM_COUNT, GUARD_GM_LIVE, GUARD_GM_STATUS,
    STATUS_HEAD_WORDS,
};
use super::kernel::{STATUS_NOT_RUN, STATUS_WORDS};
use super::memory::{NpuBuffer, PinnedHostBuffer};
use super::pool::CaptureRuns;
use super::result::acl as rt;
use super::runtime::{NpuEvent, NpuStream};
use super::NpuDevice;
use crate::{Error, Result};

/// Bytes of the live context buffer.
pub const LIVE_BYTES: usize = CTX_WORDS * 4;
/// Guard records a new context holds, and the records an eager guard adds
/// when it finds none free.
pub const GUARD_CHUNK: usize = 128;
/// Updates [`LiveContext::set`] may have in flight before it waits for the oldest.
const STAGING_SLOTS: usize = 8;
const RECORD_BYTES: usize = STATUS_WORDS * 4;
const TILING_BYTES: usize = std::mem::size_of::<GuardTiling>();
/// The stride of the tiling slots of a chunk: every slot starts 64-byte
/// aligned, as CANN 8.0-9.0's `aclrtMemcpyAsync` reference asks of both
/// addresses of every copy (hicann/runtime v8.5.0
/// `docs/api_docs/aclrtMemcpyAsync.md:44`; the runtime itself checks none).
const TILING_SLOT: usize = TILING_BYTES.next_multiple_of(64);
const _: () = assert!(TILING_SLOT % 64 == 0 && TILING_SLOT >= TILING_BYTES);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    /// Enqueued eagerly on the stream (its raw handle's address): read and
    /// released by the next check of that stream. The number orders reports.
    Eager(&'static str, u64, usize),
    /// Enqueued while the stream captured: rewritten by every replay.
    Captured(&'static str, u64),
}

/// The device records, device tilings and pinned tiling slots of guards
/// `first..first + len`: allocated together and freed with the context,
/// never moved (captured kernels and copies hold their addresses).
struct Chunk {
    first: usize,
    len: usize,
    records: NpuBuffer,
    tilings: NpuBuffer,
    tiling_host: PinnedHostBuffer,
}

impl Chunk {
    fn new(device: &NpuDevice, op: &'static str, first: usize, len: usize) -> Result<Chunk> {
        let bytes = |each: usize| {
            len.checked_mul(each)
                .ok_or_else(|| Error::invalid(op, "guards", format!("{len} guard records do not fit in memory")))
        };
        // Records start as OK (zero): a captured guard's record holds that
        // until a replay rewrites it. Zeroed before this returns, so no
        // stream's guard can race the zeroing.
        let records = NpuBuffer::zeros_now(device, bytes(RECORD_BYTES)?)?;
        // Each guard copies its tiling into its own slot before it launches.
        let tilings = NpuBuffer::alloc(device, bytes(TILING_SLOT)?)?;
        let tiling_host = PinnedHostBuffer::zeros(device, bytes(TILING_SLOT)?)?;
        Ok(Chunk { first, len, records, tilings, tiling_host })
    }
}

/// Where a guard's record and tiling are: addresses in its chunk, which
/// outlives every use (chunks are freed with the context).
struct Placed {
    record: *mut c_void,
    tiling: *mut c_void,
    host_tiling: *const c_void,
}

/// The guard records: a slot per record, in chunk order.
struct Records {
    slots: Vec<Slot>,
    chunks: Vec<Chunk>,
    next_seq: u64,
    /// Slots held by captured guards (kept for the context's life).
    captured: usize,
    /// Guards captured, by run of captures: an eager guard keeps at least as
    /// many records out of the captured ones' hands as the largest run took.
    run: CaptureRuns,
}

impl Records {
    /// An eager guard ended the run of captures before it: the records not
    /// held by captured guards to keep, [`GUARD_CHUNK`] or the most one run
    /// of captures took (so the next graph of a model, captured after its
    /// warm-up, finds its records), and how many more that takes.
    fn end_run(&mut self) -> usize {
        let keep = self.run.end(GUARD_CHUNK);
        keep.saturating_sub(self.slots.len() - self.captured)
    }

    fn free(&self) -> usize {
        self.slots.iter().filter(|x| **x == Slot::Free).count()
    }

    /// Adds a chunk of `len` records after the others (those stay put).
    fn grow(&mut self, device: &NpuDevice, op: &'static str, len: usize) -> Result<()> {
        let first = self.slots.len();
        self.chunks.push(Chunk::new(device, op, first, len)?);
        self.slots.resize(first + len, Slot::Free);
        Ok(())
    }

    /// Writes `tiling` into the pinned slot of record `i` and returns where
    /// the guard of record `i` finds its memory.
    fn place(&mut self, i: usize, tiling: &GuardTiling) -> Placed {
        let c = self.chunks.partition_point(|c| c.first + c.len <= i);
        // `i` is a slot index, below the total length of the chunks.
        let c = &mut self.chunks[c];
        let k = i - c.first;
        let off = k * TILING_SLOT;
        c.tiling_host.as_bytes_mut()[off..off + TILING_BYTES].copy_from_slice(tiling.as_bytes());
        Placed {
            record: c.records.as_ptr().cast::<u8>().wrapping_add(k * RECORD_BYTES).cast(),
            tiling: c.tilings.as_ptr().cast::<u8>().wrapping_add(off).cast(),
            host_tiling: c.tiling_host.as_bytes()[off..].as_ptr().cast(),
        }
    }

    /// The refusal of a guard under capture that finds every record in use.
    fn full_under_capture(&self, op: &'static str) -> Error {
        let captured = self.slots.iter().filter(|x| matches!(x, Slot::Captured(..))).count();
        Error::invalid(
            op,
            "guards",
            format!(
                "all {} guard records of the live context are in use ({captured} by captured guards, which keep \
                 theirs for the context's life, the rest by eager guards not yet checked), and a guard under \
                 capture cannot add records (that allocates): before capturing, reserve N guards, N = the guards \
                 the graphs still to be captured take (one per guarded op of each graph: a prepare, a finalize and \
                 each reduction point that depends on the comm type per MoE layer, at most layers x 5 x batch sizes), with LiveContext::reserve(N) (C: amoe_live_context_reserve(ctx, N); Python: \
                 LiveContext.reserve(N))",
                self.slots.len()
            ),
        )
    }
}

struct Staging {
    host: PinnedHostBuffer,
    /// One event per staging slot, made with the context and recorded again
    /// after each copy out of the slot.
    done: Vec<NpuEvent>,
    /// Whether the slot's event was recorded (an `aclrtCreateEvent` event
    /// never recorded does not report complete: `Event::QueryEventStatus`,
    /// hicann/runtime `src/runtime/feature/src/event/event.cc:1072-1077` at
    /// v8.5.0).
    recorded: Vec<bool>,
    next: usize,
}

/// A live forward context in device memory, with the guard records of the
/// ops captured against it. Made outside capture (it allocates); used from
/// any stream of its device.
pub struct LiveContext {
    device: NpuDevice,
    live: NpuBuffer,
    staging: Mutex<Staging>,
    records: Mutex<Records>,
}

impl std::fmt::Debug for LiveContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LiveContext(npu:{}, {:p})", self.device.ordinal(), self.live.as_ptr())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its state consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An error naming `op` while `stream` captures a graph.
fn refuse_capture(op: &'static str, stream: &NpuStream, advice: &str) -> Result<()> {
    if stream.is_capturing()? {
        return Err(Error::invalid(op, "stream", format!("the stream is capturing a graph: {advice}")));
    }
    Ok(())
}

/// Reads the guard records of `records` into `words` (a blocking copy,
/// after synchronising the records' stream) in RELAXED capture mode
/// ([`rt::relaxed_capture_mode`]; the switch is taken into `relaxed` at a
/// check's first read and held for its others): CANN refuses a blocking
/// copy while any other thread's stream captures in GLOBAL mode,
/// torch_npu's default (`ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT`), which
/// would fail the check. The records are the guards' own,
/// which no capture records or reads; the check is refused while the
/// context's stream captures and leaves a captured guard's record whose
/// replay has not written it.
fn read_records(records: &NpuBuffer, words: &mut [u32], relaxed: &mut Option<rt::RelaxedCaptureMode>) -> Result<()> {
    records.stream().enter()?;
    if relaxed.is_none() {
        *relaxed = Some(rt::relaxed_capture_mode()?);
    }
    records.copy_to_host(bytemuck::cast_slice_mut(words))
}

/// `guards` rounded up to whole chunks.
fn whole_chunks(guards: usize) -> usize {
    guards.div_ceil(GUARD_CHUNK).saturating_mul(GUARD_CHUNK)
}

impl LiveContext {
    /// A zeroed live context (never written: every guard reports it until
    /// the engine sets it) with [`GUARD_CHUNK`] guard records, on `device`.
    /// Allocates and synchronises `device`'s stream once: call it outside capture.
    pub fn new(device: &NpuDevice) -> Result<LiveContext> {
        Self::with_capacity(device, GUARD_CHUNK)
    }

    /// [`new`](Self::new) with room for `guards` guards at once (rounded up
    /// to a multiple of [`GUARD_CHUNK`], at least one chunk), as
    /// [`reserve`](Self::reserve) would make.
    pub fn with_capacity(device: &NpuDevice, guards: usize) -> Result<LiveContext> {
        const OP: &str = "LiveContext::new";
        refuse_capture(OP, device.stream(), "make the live context before capture (it allocates device memory)")?;
        let live = NpuBuffer::zeros(device, LIVE_BYTES)?;
        let mut records =
            Records { slots: Vec::new(), chunks: Vec::new(), next_seq: 0, captured: 0, run: CaptureRuns::default() };
        records.grow(device, OP, whole_chunks(guards.max(1)))?;
        let staging = Mutex::new(Staging {
            host: PinnedHostBuffer::zeros(device, STAGING_SLOTS * LIVE_BYTES)?,
            done: (0..STAGING_SLOTS).map(|_| NpuEvent::create(device.stream())).collect::<Result<_>>()?,
            recorded: vec![false; STAGING_SLOTS],
            next: 0,
        });
        device.synchronize()?;
        Ok(LiveContext { device: device.clone(), live, staging, records: Mutex::new(records) })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.device.ordinal()
    }

    /// The live buffer: [`LIVE_BYTES`] bytes in the word layout of
    /// `kernels/guard_tiling.h`, for an engine that writes it itself.
    pub fn device_ptr(&self) -> *mut c_void {
        self.live.as_ptr()
    }

    fn same_device(&self, op: &'static str, stream: &NpuStream) -> Result<()> {
        if stream.ordinal() != self.ordinal() {
            return Err(Error::Device {
                op,
                arg: "stream",
                expected: format!("npu:{}", self.ordinal()),
                actual: format!("npu:{}", stream.ordinal()),
            });
        }
        Ok(())
    }

    /// Enqueues on `stream` a copy of `words` into the live buffer (through
    /// pinned staging; the copy reads it when the stream runs it). The engine
    /// calls it before each replay, outside capture. A replay on another
    /// stream reads the update only once that stream is ordered after it on
    /// the device (an event recorded on `stream` and waited for there, e.g.
    /// [`NpuStream::wait_for`]): streams run unordered, so it may otherwise
    /// read the context before the copy wrote it. It creates no event and
    /// waits on the host only when the copy `STAGING_SLOTS` updates ago
    /// (the last one out of the staging slot it reuses) has not run yet:
    /// the slot's event is asked first, without waiting
    /// (`aclrtQueryEventStatus`).
    pub fn set(&self, words: &ContextWords, stream: &NpuStream) -> Result<()> {
        const OP: &str = "LiveContext::set";
        self.same_device(OP, stream)?;
        if stream.is_capturing()? {
            return Err(Error::invalid(
                OP,
                "stream",
                "the stream is capturing a graph: set the live context outside capture, before each replay",
            ));
        }
        let mut st = lock(&self.staging);
        let i = st.next;
        st.next = (i + 1) % STAGING_SLOTS;
        // aclrtQueryEventStatus reports the latest record's state without
        // waiting (`aclrtQueryEventStatusImpl`, hicann/runtime
        // `src/acl/aclrt_impl/event.cpp:153-172`, `Event::QueryEventStatus`,
        // `src/runtime/feature/src/event/event.cc:1068-1092`, v8.5.0).
        if st.recorded[i] && !st.done[i].is_complete()? {
            st.done[i].synchronize()?;
        }
        let off = i * LIVE_BYTES;
        st.host.as_bytes_mut()[off..off + LIVE_BYTES].copy_from_slice(words.as_bytes());
        stream.enter()?;
        // SAFETY: the destination is the live buffer (LIVE_BYTES bytes of this
        // device); the source is a pinned slot of LIVE_BYTES bytes that is not
        // rewritten before the event recorded below completes.
        unsafe {
            rt::memcpy_async(
                self.live.as_ptr(),
                LIVE_BYTES,
                st.host.as_bytes().as_ptr().add(off) as *const c_void,
                LIVE_BYTES,
                aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                stream.raw(),
            )
        }?;
        // A re-record moves the event to this copy (`Event::Record`,
        // hicann/runtime `src/runtime/feature/src/event/event.cc:440-495`).
        st.recorded[i] = false;
        st.done[i].record(stream)?;
        st.recorded[i] = true;
        Ok(())
    }

    /// Enqueues on `stream` a guard of the ops of `op`, built for the context
    /// `expected` (`actual`: they also depend on the actual-token count).
    /// Only enqueues: the result is read by [`check_stream`](Self::check_stream)
    /// of `stream` (or [`check`](Self::check)); an eager guard holds its
    /// record until then, so every stream taking guards is checked. The guard
    /// takes a free record; when none is, a guard outside capture adds
    /// [`GUARD_CHUNK`] records (allocating: refused while the context's own
    /// stream captures), and a guard under capture is refused with an error
    /// naming [`reserve`](Self::reserve).
    pub fn guard(&self, op: &'static str, expected: &ContextWords, actual: bool, stream: &NpuStream) -> Result<()> {
        self.guard_with(op, &GuardTiling::new(expected, actual), stream)
    }

    /// [`guard`](Self::guard) with a given tiling (for example
    /// [`GuardTiling::comm_type_only`]).
    pub fn guard_with(&self, op: &'static str, tiling: &GuardTiling, stream: &NpuStream) -> Result<()> {
        const F: &str = "LiveContext::guard";
        self.same_device(F, stream)?;
        let captured = stream.is_capturing()?;
        let (slot, at) = {
            let mut r = lock(&self.records);
            let short = if captured { 0 } else { r.end_run() };
            if short > 0 && !self.device.stream().is_capturing()? {
                r.grow(&self.device, F, whole_chunks(short))?;
            }
            let i = match r.slots.iter().position(|x| *x == Slot::Free) {
                Some(i) => i,
                None if captured => return Err(r.full_under_capture(F)),
                None => {
                    refuse_capture(
                        F,
                        self.device.stream(),
                        "every guard record is in use and adding more allocates: reserve them before the \
                         capture (LiveContext::reserve)",
                    )?;
                    let i = r.slots.len();
                    r.grow(&self.device, F, GUARD_CHUNK)?;
                    i
                }
            };
            let seq = r.next_seq;
            r.slots[i] = if captured { Slot::Captured(op, seq) } else { Slot::Eager(op, seq, stream.raw() as usize) };
            if captured {
                r.captured += 1;
                r.run.took(1);
            }
            r.next_seq += 1;
            (i, r.place(i, tiling))
        };
        let launched = self.launch_guard(&at, captured, stream);
        if launched.is_err() {
            let mut r = lock(&self.records);
            r.slots[slot] = Slot::Free;
            if captured {
                r.captured -= 1;
                r.run.gave_back(1);
            }
        }
        launched
    }

    fn launch_guard(&self, at: &Placed, captured: bool, stream: &NpuStream) -> Result<()> {
        stream.enter()?;
        // Bytes 0xFF: STATUS_NOT_RUN, so a guard that never ran is reported.
        // A captured guard resets only the head: every replay runs this
        // memset, and the sticky copy of a mismatch (`guard_tiling.h`) must
        // outlast later replays until the check reads and zeroes it. An
        // eager guard's slot is new to it, so the whole record is reset.
        let bytes = if captured { STATUS_HEAD_WORDS * 4 } else { RECORD_BYTES };
        // SAFETY: the first `bytes` (at most RECORD_BYTES) bytes of the
        // record of a chunk of this context, owned by this guard's slot; the
        // stream is live and of this device.
        unsafe { rt::memset_async(at.record, bytes, 0xFF, bytes, stream.raw()) }?;
        let mut gm = [std::ptr::null_mut::<c_void>(); GUARD_GM_COUNT];
        gm[GUARD_GM_LIVE] = self.live.as_ptr();
        gm[GUARD_GM_STATUS] = at.record;
        let launcher = GuardLauncher::find(stream, "forward-context guard")?;
        // SAFETY: the pinned slot and the device slot are this guard's own,
        // TILING_BYTES each, in a chunk freed only with the context (no other
        // guard writes them while it holds the slot; an eager guard's slot
        // is released after the stream ran this copy, a captured one never).
        unsafe {
            rt::memcpy_async(
                at.tiling,
                TILING_BYTES,
                at.host_tiling,
                TILING_BYTES,
                aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                stream.raw(),
            )
        }?;
        // SAFETY: `gm` holds the live buffer (CTX_WORDS words) and one status
        // record of this device; the tiling is the slot's TILING_BYTES of
        // device memory, which the simulator and the device read when the
        // task runs.
        unsafe { launcher.launch(stream, &gm, at.tiling, TILING_BYTES) }
    }

    /// Makes sure at least `guards` guard records are free, adding a chunk
    /// of them (a multiple of [`GUARD_CHUNK`]) when fewer are; the records in
    /// use stay where they are. A guard captured into a graph keeps its
    /// record for the context's life and a guard under capture cannot add
    /// records, so before capturing, reserve one for every guard the graphs
    /// will take (per MoE layer a prepare, a finalize and each reduction point
    /// whose result depends on the comm type, at most 3: with a graph per batch
    /// size, at most layers x 5 x batch sizes).
    /// Allocates device and pinned memory and zeroes the records (a blocking
    /// memset): refused while the context's stream captures.
    pub fn reserve(&self, guards: usize) -> Result<()> {
        const OP: &str = "LiveContext::reserve";
        refuse_capture(
            OP,
            self.device.stream(),
            "reserve guard records before the capture begins (adding them allocates)",
        )?;
        let mut r = lock(&self.records);
        let free = r.free();
        if free >= guards {
            return Ok(());
        }
        r.grow(&self.device, OP, whole_chunks(guards - free))
    }

    /// Reads every guard record after the caller synchronised the streams the
    /// guards ran on, and returns the first stale context (in enqueue order).
    /// One device-to-host copy per chunk of records with a guard. Eager
    /// guards' slots are released, also when the records cannot be read (the
    /// read's error is returned: the stream failed, and what the guards
    /// found is lost with it); a reported record is reset, so each mismatch
    /// is reported once. A captured guard's record keeps a mismatch of any
    /// replay since the last check, also when later replays matched (the
    /// kernel's sticky copy, `kernels/guard_tiling.h`), so replays under
    /// another context are reported however many ran before the check; one
    /// whose replay has begun and not yet written it (a graph may be replayed
    /// on a stream the caller did not synchronise) is left for a later check.
    /// A host read: this is the caller's sync point, never called by an op.
    pub fn check(&self) -> Result<()> {
        self.check_guards(None)
    }

    /// [`check`](Self::check) of the guards enqueued on `stream`, which the
    /// caller synchronised, and of the captured ones: an eager guard
    /// enqueued on another stream may not have run yet, so its record is
    /// neither read nor released (that stream's check reports it).
    pub fn check_stream(&self, stream: &NpuStream) -> Result<()> {
        self.check_guards(Some(stream.raw() as usize))
    }

    fn check_guards(&self, only: Option<usize>) -> Result<()> {
        refuse_capture(
            "LiveContext::check",
            self.device.stream(),
            "check after the capture ends (e.g. after a replay): the check reads the guard records on the host",
        )?;
        let mut r = lock(&self.records);
        let Records { slots, chunks, .. } = &mut *r;
        // The slots this check reads: captured ones, and eager ones of the
        // streams it covers.
        let read_here = |x: &Slot| match *x {
            Slot::Free => false,
            Slot::Eager(_, _, on) => only.map_or(true, |s| s == on),
            Slot::Captured(..) => true,
        };
        if !slots.iter().any(read_here) {
            return Ok(());
        }
        let mut words: Vec<u32> = Vec::new();
        let mut relaxed = None;
        let mut read = Ok(());
        let mut reset = Ok(());
        let mut first: Option<(u64, Error)> = None;
        for c in chunks.iter() {
            let held = &mut slots[c.first..c.first + c.len];
            if !held.iter().any(read_here) {
                continue;
            }
            if read.is_ok() {
                words.resize(c.len * STATUS_WORDS, 0);
                read = read_records(&c.records, &mut words, &mut relaxed);
            }
            for (k, slot) in held.iter_mut().enumerate() {
                if !read_here(slot) {
                    continue;
                }
                let (op, seq, eager) = match *slot {
                    Slot::Free => continue,
                    Slot::Eager(op, seq, _) => (op, seq, true),
                    Slot::Captured(op, seq) => (op, seq, false),
                };
                if eager {
                    *slot = Slot::Free;
                }
                if read.is_err() {
                    continue;
                }
                let rec = &words[k * STATUS_WORDS..(k + 1) * STATUS_WORDS];
                // A captured guard's head still filled by its replay: the
                // replay may be running on a stream this check did not
                // synchronise (a graph is replayed on any stream); left, as
                // is its sticky copy, for a later check.
                if !eager && rec[0] == STATUS_NOT_RUN {
                    continue;
                }
                if let Err(e) = check_guard_status(op, rec) {
                    if reset.is_ok() {
                        reset = c.records.memset_async(0, k * RECORD_BYTES, RECORD_BYTES);
                    }
                    if first.as_ref().map_or(true, |(s, _)| seq < *s) {
                        first = Some((seq, e));
                    }
                }
            }
        }
        drop(relaxed);
        read?;
        reset?;
        self.device.synchronize()?;
        match first {
            None => Ok(()),
            Some((_, e)) => Err(e),
        }
    }

    /// [`check_stream`](Self::check_stream) after synchronising `stream`, the
    /// stream of this context's device the guards ran on. Refused before
    /// anything waits for a stream of another device (as [`set`](Self::set)
    /// and [`guard`](Self::guard) refuse one) and while `stream` captures a
    /// graph (a synchronisation would invalidate the capture).
    pub fn synchronize_and_check(&self, stream: &NpuStream) -> Result<()> {
        const OP: &str = "LiveContext::check";
        self.same_device(OP, stream)?;
        refuse_capture(
            OP,
            stream,
            "check after the capture ends (e.g. after a replay): the check waits for the stream",
        )?;
        stream.synchronize()?;
        self.check_stream(stream)
    }

    /// Guard records the context has (in use or free).
    pub fn capacity(&self) -> usize {
        self.guard_records().0
    }

    /// Guards holding a record (captured ones, and eager ones not yet checked).
    pub fn guards_in_use(&self) -> usize {
        self.guard_records().1
    }

    /// [`capacity`](Self::capacity) and [`guards_in_use`](Self::guards_in_use),
    /// read together.
    pub fn guard_records(&self) -> (usize, usize) {
        let r = lock(&self.records);
        (r.slots.len(), r.slots.len() - r.free())
    }
}
