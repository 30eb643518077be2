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
//! own status record. [`LiveContext::check`], after the caller synchronised
//! the stream, reads the records and returns the first mismatch as
//! [`Error::StaleContext`].
//!
//! Nothing a guard enqueues synchronises, allocates or reads device memory on
//! the host: its record and (for the AI Core build) its tiling are slots of
//! buffers reserved when the context is made. A guard enqueued while its
//! stream captures keeps its slot for the context's life, since every replay
//! rewrites it; an eager guard's slot is released by the next check.

use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

use acl_sys::aclrtMemcpyKind;

use super::device_check::GuardLauncher;
use super::kernel::guard::{
    check_guard_status, ContextWords, GuardTiling, CTX_WORDS, GUARD_GM_COUNT, GUARD_GM_LIVE, GUARD_GM_STATUS,
};
use super::kernel::STATUS_WORDS;
use super::memory::{NpuBuffer, PinnedHostBuffer};
use super::result::acl as rt;
use super::runtime::{NpuEvent, NpuStream};
use super::NpuDevice;
use crate::{Error, Result};

/// Bytes of the live context buffer.
pub const LIVE_BYTES: usize = CTX_WORDS * 4;
/// Guards a context holds at once (captured ones plus eager ones not yet checked).
pub const GUARD_SLOTS: usize = 128;
/// Updates [`LiveContext::set`] may have in flight before it waits for the oldest.
const STAGING_SLOTS: usize = 8;
const RECORD_BYTES: usize = STATUS_WORDS * 4;
const TILING_BYTES: usize = std::mem::size_of::<GuardTiling>();

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    /// Enqueued eagerly: released by the next check. The number orders reports.
    Eager(&'static str, u64),
    /// Enqueued while the stream captured: rewritten by every replay.
    Captured(&'static str, u64),
}

struct Slots {
    slots: Vec<Slot>,
    next_seq: u64,
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
    records: NpuBuffer,
    tilings: NpuBuffer,
    tiling_host: Mutex<PinnedHostBuffer>,
    staging: Mutex<Staging>,
    slots: Mutex<Slots>,
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

impl LiveContext {
    /// A zeroed live context (never written: every guard reports it until
    /// the engine sets it) with [`GUARD_SLOTS`] guard records, on `device`.
    /// Allocates and synchronises `device`'s stream once: call it outside capture.
    pub fn new(device: &NpuDevice) -> Result<LiveContext> {
        if device.stream().is_capturing()? {
            return Err(Error::invalid(
                "LiveContext::new",
                "stream",
                "the stream is capturing a graph: make the live context before capture (it allocates device memory)",
            ));
        }
        let live = NpuBuffer::zeros(device, LIVE_BYTES)?;
        // Records start as OK (zero): a captured guard's record holds that until a replay rewrites it.
        let records = NpuBuffer::zeros(device, GUARD_SLOTS * RECORD_BYTES)?;
        let tilings = NpuBuffer::zeros(device, GUARD_SLOTS * TILING_BYTES)?;
        let tiling_host = Mutex::new(PinnedHostBuffer::zeros(device, GUARD_SLOTS * TILING_BYTES)?);
        let staging = Mutex::new(Staging {
            host: PinnedHostBuffer::zeros(device, STAGING_SLOTS * LIVE_BYTES)?,
            done: (0..STAGING_SLOTS).map(|_| NpuEvent::create(device.stream())).collect::<Result<_>>()?,
            recorded: vec![false; STAGING_SLOTS],
            next: 0,
        });
        device.synchronize()?;
        Ok(LiveContext {
            device: device.clone(),
            live,
            records,
            tilings,
            tiling_host,
            staging,
            slots: Mutex::new(Slots { slots: vec![Slot::Free; GUARD_SLOTS], next_seq: 0 }),
        })
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
    /// calls it before each replay, outside capture. It creates no event and
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
    /// Only enqueues: the result is read by [`check`](Self::check).
    pub fn guard(&self, op: &'static str, expected: &ContextWords, actual: bool, stream: &NpuStream) -> Result<()> {
        self.guard_with(op, &GuardTiling::new(expected, actual), stream)
    }

    /// [`guard`](Self::guard) with a given tiling (for example
    /// [`GuardTiling::comm_type_only`]).
    pub fn guard_with(&self, op: &'static str, tiling: &GuardTiling, stream: &NpuStream) -> Result<()> {
        const F: &str = "LiveContext::guard";
        self.same_device(F, stream)?;
        let captured = stream.is_capturing()?;
        let slot = {
            let mut s = lock(&self.slots);
            let seq = s.next_seq;
            let i = s.slots.iter().position(|x| *x == Slot::Free).ok_or_else(|| {
                Error::invalid(
                    F,
                    "guards",
                    format!(
                        "all {GUARD_SLOTS} guard records are in use (captured guards keep theirs; eager ones are \
                         released by the stream check): check the stream, or make another live context"
                    ),
                )
            })?;
            s.slots[i] = if captured { Slot::Captured(op, seq) } else { Slot::Eager(op, seq) };
            s.next_seq += 1;
            i
        };
        let launched = self.launch_guard(slot, tiling, stream);
        if launched.is_err() {
            lock(&self.slots).slots[slot] = Slot::Free;
        }
        launched
    }

    fn launch_guard(&self, slot: usize, tiling: &GuardTiling, stream: &NpuStream) -> Result<()> {
        let record = self.records.as_ptr().cast::<u8>().wrapping_add(slot * RECORD_BYTES).cast::<c_void>();
        stream.enter()?;
        // Bytes 0xFF: STATUS_NOT_RUN, so a guard that never ran is reported.
        // SAFETY: the record is RECORD_BYTES bytes inside `records`, owned by
        // this guard's slot; the stream is live and of this device.
        unsafe { rt::memset_async(record, RECORD_BYTES, 0xFF, RECORD_BYTES, stream.raw()) }?;
        let mut gm = [std::ptr::null_mut::<c_void>(); GUARD_GM_COUNT];
        gm[GUARD_GM_LIVE] = self.live.as_ptr();
        gm[GUARD_GM_STATUS] = record;
        let launcher = GuardLauncher::find(stream, "forward-context guard")?;
        let dev_tiling = self.tilings.as_ptr().cast::<u8>().wrapping_add(slot * TILING_BYTES).cast::<c_void>();
        let mut host = lock(&self.tiling_host);
        let off = slot * TILING_BYTES;
        host.as_bytes_mut()[off..off + TILING_BYTES].copy_from_slice(tiling.as_bytes());
        // SAFETY: the pinned slot and the device slot are this guard's own
        // (no other guard writes them while it holds the slot), TILING_BYTES each.
        unsafe {
            rt::memcpy_async(
                dev_tiling,
                TILING_BYTES,
                host.as_bytes().as_ptr().add(off) as *const c_void,
                TILING_BYTES,
                aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                stream.raw(),
            )
        }?;
        // SAFETY: `gm` holds the live buffer (CTX_WORDS words) and one status
        // record of this device; the tiling is the slot's TILING_BYTES of
        // device memory, which the simulator and the device read when the
        // task runs.
        unsafe { launcher.launch(stream, &gm, dev_tiling, TILING_BYTES) }
    }

    /// Reads every guard record after the caller synchronised the streams the
    /// guards ran on, and returns the first stale context (in enqueue order).
    /// Eager guards' slots are released, also when the records cannot be read
    /// (the read's error is returned: the stream failed, and what the guards
    /// found is lost with it); a reported record is reset, so each mismatch
    /// is reported once per run. A host read: this is the caller's sync
    /// point, never called by an op.
    pub fn check(&self) -> Result<()> {
        let mut s = lock(&self.slots);
        if s.slots.iter().all(|x| *x == Slot::Free) {
            return Ok(());
        }
        let mut words = vec![0u32; GUARD_SLOTS * STATUS_WORDS];
        let read = self.records.copy_to_host(bytemuck::cast_slice_mut(&mut words));
        let mut first: Option<(u64, usize, Error)> = None;
        let mut reset = Ok(());
        for (i, slot) in s.slots.iter_mut().enumerate() {
            let (op, seq, eager) = match *slot {
                Slot::Free => continue,
                Slot::Eager(op, seq) => (op, seq, true),
                Slot::Captured(op, seq) => (op, seq, false),
            };
            if eager {
                *slot = Slot::Free;
            }
            if read.is_err() {
                continue;
            }
            let rec = &words[i * STATUS_WORDS..(i + 1) * STATUS_WORDS];
            if let Err(e) = check_guard_status(op, rec) {
                if reset.is_ok() {
                    reset = self.records.memset_async(0, i * RECORD_BYTES, RECORD_BYTES);
                }
                if first.as_ref().map_or(true, |(s, _, _)| seq < *s) {
                    first = Some((seq, i, e));
                }
            }
        }
        read?;
        reset?;
        self.device.synchronize()?;
        match first {
            None => Ok(()),
            Some((_, _, e)) => Err(e),
        }
    }

    /// Guards holding a record (captured ones, and eager ones not yet checked).
    pub fn guards_in_use(&self) -> usize {
        lock(&self.slots).slots.iter().filter(|x| **x != Slot::Free).count()
    }
}
