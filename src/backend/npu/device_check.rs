//! Checks only the device can make, reported at the caller's sync point (the
//! stream check, [`NpuStream::check`]): the status records of kernel
//! launches, and the guard kernel over any device words.
//!
//! A record is, for an eager launch, a slot of the stream's ring of status
//! records (reserved from its pool at the first launch; the check reads it
//! and frees it, see `EagerRecords` for what happens when every slot is
//! held), or, for a launch captured into a graph, a zeroed slot the graph
//! keeps (every replay rewrites it, every check reads it and zeroes what it
//! read), so a bad value of any one replay is reported once, by the check
//! after it. Nothing here allocates after the first launch of a stream, or
//! under capture; the stream check does the reading.
//!
//! This module knows streams and raw device addresses only, so the ops that
//! use it stay above it.

use std::ffi::c_void;
use std::sync::Arc;

use super::kernel::abi::{GUARD_GM_COUNT, GUARD_GM_LIVE, GUARD_GM_STATUS, STATUS_NOT_RUN, STATUS_WORDS};
use super::kernel::guard::{guard_host_entry, GuardTiling, STATUS_HEAD_WORDS};
use super::kernel::library::shared_kernel_lib;
use super::result::acl as rt;
use super::runtime::{lock, NpuStream, Pending, StatusRecord, SyncEvent, RECORD_FENCE_EVERY};
use crate::{Error, Result};

/// Turns a launch's status words into its result.
pub(crate) type Decode = Box<dyn Fn(&[u32]) -> Result<()> + Send + Sync>;

/// Cores a recorded launch may use: the bytes of one captured record slot
/// are this many status records.
pub(crate) const MAX_RECORD_CORES: usize = 8;
/// Bytes of one captured launch's record slot.
const SLOT_BYTES: usize = MAX_RECORD_CORES * STATUS_WORDS * 4;
/// Record slots for captured launches a stream keeps free outside capture
/// (at least; more when one run of captures took more), and the size of the
/// blocks they come in.
const SLOTS: usize = 256;
/// Eager launches a stream holds records for between two checks (beyond
/// them the oldest are read early, see `EagerRecords`).
const EAGER_SLOTS: usize = 256;

/// A block of `len` bytes from `stream`'s pool, detached (device address,
/// block id; give it back with `NpuStream::give_back_block`). The pool grows
/// outside capture only; under capture a request that does not fit is an
/// error saying how to reserve ahead.
pub(crate) fn take_pool_block(stream: &NpuStream, len: usize) -> Result<(usize, usize)> {
    let capturing = stream.is_capturing()?;
    let taken = if capturing {
        lock(stream.state()).pool.take_in_capture(len)?
    } else {
        lock(stream.state()).pool.take(len)?
    };
    if let Some(b) = taken {
        return Ok(b);
    }
    if capturing {
        let largest = lock(stream.state()).pool.largest_free();
        return Err(Error::invalid(
            "workspace",
            "bytes",
            format!(
                "{len} bytes of workspace are needed while {stream:?} is captured into a graph and the largest free \
                 block of its pool has {largest}; the pool cannot grow under capture: reserve ahead with \
                 amoe_workspace_reserve / NpuStream::reserve_workspace (or run the op once on this stream \
                 before capture: pools are per stream, and torch.npu.graph without stream= captures on \
                 torch_npu's own side stream, not the warm-up's: amoe_stream_reserve_like / \
                 ascend_moe.prepare_capture reserve on it like the warm-up stream), or set an allocator on the stream"
            ),
        ));
    }
    stream.reserve_workspace(len)?;
    lock(stream.state())
        .pool
        .take(len)?
        .ok_or_else(|| Error::invalid("workspace", "bytes", format!("a fresh pool segment does not hold {len} bytes")))
}

/// `aclrtMemsetAsync(ptr, len, value, len, stream)`.
pub(crate) fn memset_on(stream: &NpuStream, ptr: usize, len: usize, value: u8) -> Result<()> {
    stream.enter()?;
    // SAFETY: `ptr` is `len` bytes of this stream's device memory owned by
    // the caller's record; the stream is live.
    unsafe { rt::memset_async(ptr as *mut c_void, len, value as i32, len, stream.raw()) }
}

/// Reserves, outside capture, the status records of `stream`'s launches:
/// the ring of eager records with its fences (at the first launch), and
/// zeroed record slots for the launches captured later: at least
/// [`SLOTS`] free, or as many as the most that one run of captures took
/// (the launches captured between two eager launches, such as one graph
/// captured after its warm-up), so the next graph of the same model finds
/// its records without a reservation.
fn reserve_records(stream: &NpuStream) -> Result<()> {
    if !stream.has_eager_records() {
        let fences = (0..=EAGER_SLOTS / RECORD_FENCE_EVERY)
            .map(|_| SyncEvent::create(stream).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let (base, _block) = take_pool_block(stream, SLOT_BYTES * EAGER_SLOTS)?;
        stream.set_eager_records(base, SLOT_BYTES, EAGER_SLOTS, fences);
    }
    let keep = stream.end_captured_run(SLOTS);
    ensure_capture_records(stream, keep)
}

/// Makes sure `launches` record slots for captured launches are free,
/// adding one pool block (zeroed on the stream) of the missing ones, at
/// least [`SLOTS`]. Outside capture.
fn ensure_capture_records(stream: &NpuStream, launches: usize) -> Result<()> {
    let free = stream.capture_records_free();
    if free >= launches {
        return Ok(());
    }
    let slots = (launches - free).max(SLOTS);
    let bytes = slots.checked_mul(SLOT_BYTES).ok_or_else(|| {
        Error::invalid("reserve_capture_records", "launches", format!("{launches} records overflow the address space"))
    })?;
    let (base, block) = take_pool_block(stream, bytes)?;
    if let Err(e) = memset_on(stream, base, bytes, 0) {
        stream.give_back_block(base, block);
        return Err(e);
    }
    stream.add_capture_records(base, SLOT_BYTES, slots);
    Ok(())
}

impl NpuStream {
    /// Reserves, before capture, the status records of `launches` native
    /// kernel launches captured into graphs on this stream (each captured
    /// launch keeps one for the stream's life, since every replay rewrites
    /// it): afterwards at least `launches` are free. Outside capture a
    /// stream keeps at least 256 free, or as many as its largest run of
    /// captures took; reserve for a first capture of more. Refused while the
    /// stream captures (it allocates).
    pub fn reserve_capture_records(&self, launches: usize) -> Result<()> {
        self.refuse_under_capture(
            "reserve_capture_records",
            "reserve the records before the capture begins (the reservation allocates device memory)",
        )?;
        ensure_capture_records(self, launches)
    }

    /// Reserves on this stream what `warm` reserved by running ops eagerly,
    /// so that the ops, first run on this stream under a graph capture, find
    /// what they need: the status records (as many free slots for captured
    /// launches as `warm` keeps), the pinned staging (the arena, and as much
    /// room for captured copies) and workspace up to what `warm`'s pool holds
    /// (a segment of the difference; an allocator set on `warm` is not
    /// copied: set it on this stream too). For a capture stream other than
    /// the one the warm-up ran on, such as the side stream `torch.npu.graph`
    /// captures on when given no `stream=`. Refused under capture, and for
    /// streams of two devices.
    pub fn reserve_like(&self, warm: &NpuStream) -> Result<()> {
        self.refuse_under_capture("reserve_like", "reserve before the capture begins")?;
        if warm.ordinal() != self.ordinal() {
            return Err(Error::invalid(
                "reserve_like",
                "warm",
                format!(
                    "{warm:?} is on npu:{}, this stream on npu:{}: reservations are copied between streams of \
                     one device",
                    warm.ordinal(),
                    self.ordinal()
                ),
            ));
        }
        ensure_capture_records(self, warm.capture_records_free())?;
        self.reserve_staging_like(warm)?;
        // Topped up to `warm`'s pool, once: blocks captured graphs keep count
        // as reserved, so a later call after captures adds nothing more.
        let (want, have) = (warm.workspace_stats().reserved_bytes, self.workspace_stats().reserved_bytes);
        if want > have {
            self.reserve_workspace(want - have)?;
        }
        Ok(())
    }
}

/// The status record of one launch about to be enqueued on a stream.
pub(crate) struct Record {
    stream: NpuStream,
    ptr: usize,
    words: usize,
    /// The block holding the record (device address, bytes).
    block: (usize, usize),
    /// The sequence number of an eager launch's record, until it finished.
    eager: Option<u64>,
}

impl Record {
    /// Takes the record of a launch writing `words` status words (at most
    /// [`MAX_RECORD_CORES`] records) on `stream` and fills it with bytes
    /// `0xFF` (every word `STATUS_NOT_RUN`, so a core that never ran is
    /// reported). Outside capture this also reserves the records at the
    /// stream's first launch.
    ///
    /// Under capture only each core's status head is filled (one fill per
    /// core): every replay runs the fills, and the sticky copy of a problem
    /// a core recorded (`kernels/finalize_tiling.h`) must outlast later
    /// replays until the check reads and zeroes the record.
    pub(crate) fn begin(stream: &NpuStream, words: usize) -> Result<Record> {
        let record = Self::take(stream, words)?;
        if record.eager.is_some() {
            memset_on(stream, record.ptr, words * 4, 0xFF)?;
        } else {
            for core in 0..words.div_ceil(STATUS_WORDS) {
                let head = STATUS_HEAD_WORDS.min(words - core * STATUS_WORDS);
                memset_on(stream, record.ptr + core * STATUS_WORDS * 4, head * 4, 0xFF)?;
            }
        }
        Ok(record)
    }

    /// [`begin`](Self::begin) for a guard kernel (one core): under capture
    /// only the status head is filled, since every replay runs the fill and
    /// the guard's sticky copy of a mismatch (`kernels/guard_tiling.h`) must
    /// outlast later replays until the check reads and zeroes the record.
    pub(crate) fn begin_guard(stream: &NpuStream) -> Result<Record> {
        let record = Self::take(stream, STATUS_WORDS)?;
        let words = if record.eager.is_some() { STATUS_WORDS } else { STATUS_HEAD_WORDS };
        memset_on(stream, record.ptr, words * 4, 0xFF)?;
        Ok(record)
    }

    /// The record of [`begin`](Self::begin), not yet filled.
    fn take(stream: &NpuStream, words: usize) -> Result<Record> {
        if words > MAX_RECORD_CORES * STATUS_WORDS {
            return Err(Error::invalid("status", "words", format!("{words} status words exceed a record slot")));
        }
        let record = if stream.is_capturing()? {
            let (ptr, block) = stream.take_capture_record(words * 4)?;
            Record { stream: stream.clone(), ptr, words, block, eager: None }
        } else {
            reserve_records(stream)?;
            let (ptr, seq) = stream.take_eager_record(words * 4)?;
            let block = stream.eager_records_block().unwrap_or((ptr, words * 4));
            Record { stream: stream.clone(), ptr, words, block, eager: Some(seq) }
        };
        Ok(record)
    }

    /// The device address the launch writes its status to.
    pub(crate) fn ptr(&self) -> *mut c_void {
        self.ptr as *mut c_void
    }

    /// After the launch was enqueued: the stream's check reads the record and
    /// reports what `decode` makes of it.
    pub(crate) fn finish(mut self, decode: Decode) {
        let stream = self.stream.clone();
        let seq = self.eager.take();
        let record = StatusRecord { addr: self.ptr, words: self.words, block: self.block, seq };
        match seq {
            Some(seq) => stream.finish_eager_record(seq, Some(Box::new(Eager { record, decode }))),
            None => stream.record_captured(Box::new(Captured { record, decode })),
        }
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        // A launch that failed to enqueue: nothing reads its record, which
        // is freed with the others at the next check.
        if let Some(seq) = self.eager.take() {
            self.stream.finish_eager_record(seq, None);
        }
    }
}

/// The record of an eager launch: a slot of the stream's ring, read by the
/// check (or earlier, when the ring is full).
struct Eager {
    record: StatusRecord,
    decode: Decode,
}

impl Pending for Eager {
    fn key(&self) -> Option<(usize, &'static str)> {
        None
    }

    fn timeout(&self) -> Option<std::time::Duration> {
        None
    }

    fn record(&self) -> Option<StatusRecord> {
        Some(self.record)
    }

    fn settle(&self, words: &[u32], _stream: &NpuStream) -> Result<()> {
        (self.decode)(words)
    }
}

/// The record of a launch captured into a graph: a zeroed slot every replay
/// rewrites (0xFF, then the kernel's words) and every check reads; once read
/// it is zeroed (all OK), so a bad value of one replay is reported once and a
/// check with no replay since reports nothing. A guard's mismatch also stays
/// in its sticky copy, which replays do not rewrite, so the check reports it
/// even when later replays matched.
struct Captured {
    record: StatusRecord,
    decode: Decode,
}

impl Pending for Captured {
    fn key(&self) -> Option<(usize, &'static str)> {
        None
    }

    fn timeout(&self) -> Option<std::time::Duration> {
        None
    }

    fn record(&self) -> Option<StatusRecord> {
        Some(self.record)
    }

    fn settle(&self, words: &[u32], stream: &NpuStream) -> Result<()> {
        if words.iter().all(|&w| w == 0) {
            return Ok(());
        }
        let r = (self.decode)(words);
        stream.zero_drained(self.record.addr, self.record.words * 4)?;
        r
    }

    /// A core's head still `STATUS_NOT_RUN`: every replay fills the heads
    /// first (`Record::begin`), so the replay that did has not finished.
    fn in_flight(&self, words: &[u32]) -> bool {
        words.chunks(STATUS_WORDS).any(|core| core.first() == Some(&STATUS_NOT_RUN))
    }
}

/// Enqueues on `stream` the guard kernel (one core) over the `CTX_WORDS`
/// words at device address `words`, comparing them with `tiling`'s expected
/// words; the stream's check reports what `decode` makes of its status.
/// The guard launches through the simulated runtime's host build or the AI
/// Core library, whichever is loaded.
pub(crate) fn guard_words(stream: &NpuStream, words: *mut c_void, tiling: &GuardTiling, decode: Decode) -> Result<()> {
    let record = Record::begin_guard(stream)?;
    let mut gm = [std::ptr::null_mut::<c_void>(); GUARD_GM_COUNT];
    gm[GUARD_GM_LIVE] = words;
    gm[GUARD_GM_STATUS] = record.ptr();
    let launcher = GuardLauncher::find(stream, "device check")?;
    let bytes = tiling.as_bytes();
    let (t, block) = take_pool_block(stream, bytes.len())?;
    let launched = stream.stage_to_device(bytes, t as *mut c_void, bytes.len()).and_then(|_| {
        // SAFETY: `gm` holds CTX_WORDS words of this device and one status
        // record; the tiling is in a pool block of this stream, reused only
        // by work queued after the launch, and read when the task runs.
        unsafe { launcher.launch(stream, &gm, t as *mut c_void, bytes.len()) }
    });
    stream.give_back_block(t, block);
    launched?;
    record.finish(decode);
    Ok(())
}

/// How a guard kernel launches on this runtime: through the simulated
/// runtime's host build, or the AI Core kernel library.
pub(crate) enum GuardLauncher {
    Sim(acl_sys::CannsimLaunchKernelFn, super::kernel::abi::KernelEntry),
    Lib(&'static super::kernel::library::NpuKernelLib),
}

impl GuardLauncher {
    /// The launcher for `stream`'s device; an error naming `who` when neither
    /// is available.
    pub(crate) fn find(stream: &NpuStream, who: &str) -> Result<Self> {
        let api = stream.enter()?;
        if let (Some(launch), Some(entry)) = (api.cannsim_launch_kernel, guard_host_entry()) {
            return Ok(GuardLauncher::Sim(launch, entry));
        }
        shared_kernel_lib().map(GuardLauncher::Lib).ok_or_else(|| super::launch::native_unavailable(who))
    }

    /// Launches the guard kernel on `stream` with `gm` and the `len`-byte
    /// tiling at device address `tiling`.
    ///
    /// # Safety
    /// `gm` holds the live words and one status record of `stream`'s device;
    /// `tiling` is `len` bytes of device memory of that device that stay
    /// valid until the task has run (the simulator and the device read it
    /// then).
    pub(crate) unsafe fn launch(
        &self,
        stream: &NpuStream,
        gm: &[*mut c_void; GUARD_GM_COUNT],
        tiling: *mut c_void,
        len: usize,
    ) -> Result<()> {
        match self {
            // SAFETY: the caller's contract.
            GuardLauncher::Sim(launch, entry) => unsafe {
                rt::sim_launch_kernel_device_tiling(*launch, stream.raw(), 1, Some(*entry), gm, tiling, len)
            },
            // SAFETY: the caller's contract.
            GuardLauncher::Lib(lib) => unsafe { lib.launch_guard(stream.raw(), gm, tiling) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A captured launch's record over `cores` cores, as another stream's
    /// check finds it.
    fn captured(cores: usize) -> Captured {
        let record =
            StatusRecord { addr: 0, words: cores * STATUS_WORDS, block: (0, cores * STATUS_WORDS * 4), seq: None };
        Captured { record, decode: Box::new(|_| Ok(())) }
    }

    #[test]
    fn a_captured_record_is_in_flight_while_any_cores_head_is_still_the_replays_fill() {
        let c = captured(2);
        let mut words = vec![0u32; 2 * STATUS_WORDS];
        assert!(!c.in_flight(&words), "never replayed (zeroed) or finished clean");
        words[STATUS_WORDS] = STATUS_NOT_RUN;
        assert!(c.in_flight(&words), "core 1 has not written its head yet");
        words[STATUS_WORDS] = 3;
        words[STATUS_WORDS + 1] = STATUS_NOT_RUN;
        assert!(!c.in_flight(&words), "only a core's head word tells: core 1 finished with code 3");
    }
}
