//! Streams and the state every handle of one raw stream shares.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use acl_sys::{aclrtEvent, aclrtStream, Acl};

use super::device::DeviceCtx;
use super::load::{record_drop_error, settled};
use crate::backend::npu::pool::{self, Allocator, CaptureRuns, Pool};
use crate::backend::npu::result::acl as rt;
use crate::{Error, Result};

/// Queued work whose outcome only the device knows: a collective (its
/// communicator's async error), a kernel launch (its status words). Recorded
/// when the work is queued, examined by [`NpuStream::check`] after the stream
/// drained.
pub(crate) trait Pending: Send + Sync {
    /// Identifies work that reports the same thing (one communicator and
    /// collective): a repeat replaces nothing and is not recorded again.
    fn key(&self) -> Option<(usize, &'static str)>;
    /// The longest this work may take (a collective's communicator timeout).
    fn timeout(&self) -> Option<Duration>;
    /// The error recorded on the device for this work, once the stream is
    /// drained (or failed to drain: then `wait` holds why). Work with a
    /// [`record`](Self::record) reads it and [`settle`](Self::settle)s (a
    /// check reads every record at once instead); when the stream failed its
    /// words may be stale, and the failed wait is what the check reports.
    fn outcome(&self, wait: Option<&Error>, stream: &NpuStream) -> Result<()> {
        match self.record() {
            Some(r) if wait.is_none() => self.settle(stream.read_records(&[r])?.of(&r), stream),
            _ => Ok(()),
        }
    }
    /// The status record this work reports through, if it has one: the
    /// check reads it with the other records of its block in as few copies
    /// as their places allow, and gives its words to [`settle`](Self::settle)
    /// instead of calling [`outcome`](Self::outcome).
    fn record(&self) -> Option<StatusRecord> {
        None
    }
    /// The outcome from the words of its status record (exactly the
    /// record's words), read once the work completed: by the check, or
    /// earlier for an eager launch when every slot of the ring is held.
    fn settle(&self, _words: &[u32], _stream: &NpuStream) -> Result<()> {
        Ok(())
    }
    /// True when the words of a captured launch's record may belong to a
    /// replay still running (a replay on a stream the check did not
    /// synchronise): such a record is left for a later check.
    fn in_flight(&self, _words: &[u32]) -> bool {
        false
    }
}

/// Where a launch's status record lies: `words` 32-bit words at device
/// address `addr`, inside the block `block` (device address, bytes) that
/// holds it and its neighbours, so the check reads neighbours in one copy
/// and never past the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StatusRecord {
    pub(crate) addr: usize,
    pub(crate) words: usize,
    pub(crate) block: (usize, usize),
    /// The sequence number of an eager launch's record ([`EagerRecords`]).
    pub(crate) seq: Option<u64>,
}

/// A block of zeroed record slots for launches captured into graphs: every
/// slot taken stays with its captured launch for the stream's life.
pub(crate) struct CaptureRecords {
    pub(super) base: usize,
    pub(super) slot_bytes: usize,
    pub(super) slots: usize,
    pub(super) used: usize,
}

/// The fence of a staging block or of a run of status records: an event
/// recorded after the work it covers.
pub(crate) type Fence = Arc<SyncEvent>;

/// The status records of a stream's eager kernel launches: a ring of
/// `slots` slots of `slot_bytes` bytes at device address `base` (a pool block
/// reserved at the first launch, kept for the stream's life), so a launch
/// neither allocates nor frees. A launch takes the next slot and holds it
/// until the stream check read it. Every [`RECORD_FENCE_EVERY`] launches a
/// fence (an event of the ring's, recorded again) follows them. When every
/// slot is held (the engine has not checked for `slots` launches), the
/// launch frees the slots before the oldest fence: it asks that fence
/// without waiting, waits for it on the host only when it has not
/// completed, then reads those records (one blocking device-to-host copy of
/// completed memory) and keeps the first error among them for the next
/// check, in its place in the queue order ([`NpuStream::check`]).
pub(crate) struct EagerRecords {
    pub(super) base: usize,
    pub(super) slot_bytes: usize,
    pub(super) slots: u64,
    /// The sequence number of the next launch.
    pub(super) head: u64,
    /// The oldest sequence number whose slot is held.
    pub(super) tail: u64,
    /// Launches that took a slot and are not finished (enqueued or not).
    pub(super) open: Vec<u64>,
    /// Launches finished since the last fence.
    pub(super) since_fence: usize,
    /// Fences recorded, oldest first: every launch numbered below `.0` had
    /// finished (was enqueued, or failed to) when the fence was recorded.
    pub(super) fences: VecDeque<(u64, Fence)>,
    /// Fences not recorded since the last release.
    pub(super) spare: Vec<Fence>,
    /// An error read before the check is held in the pending list.
    pub(super) holds_error: bool,
}

/// The state shared by every handle on one raw stream: its pending checks,
/// the handles its queued work still uses, and its workspace.
#[derive(Default)]
pub(crate) struct StreamState {
    pub(super) pending: Vec<Box<dyn Pending>>,
    /// Checks of work captured into a graph: every replay rewrites what they
    /// read, so every check reads them again (they are never drained).
    pub(super) captured: Vec<Box<dyn Pending>>,
    /// Zeroed record slots for kernel launches captured into graphs, in
    /// blocks reserved outside capture from the pool (a block is never moved
    /// or freed: captured launches hold its addresses).
    pub(super) capture_records: Vec<CaptureRecords>,
    /// Record slots taken by captures, by run of captures: an eager launch
    /// keeps at least as many free as the largest run took.
    pub(super) captured_run: CaptureRuns,
    /// The status records of eager kernel launches (see [`EagerRecords`]).
    pub(super) eager: Option<EagerRecords>,
    /// The event this stream records for the streams that wait on it.
    pub(super) sync_event: Option<Arc<SyncEvent>>,
    /// Other streams' events this stream waited for since its last
    /// synchronisation (each once).
    pub(super) waited: Vec<Arc<SyncEvent>>,
    pub(crate) pool: Pool,
    pub(crate) staging: pool::Staging<Fence>,
    pub(crate) allocator: Option<Allocator>,
    /// A bounded wait on the stream timed out and no wait has succeeded
    /// since: its work may still run, so a drop releases nothing it may use
    /// and waits no more ([`teardown_sync`]).
    pub(super) stalled: bool,
}

/// The synchronisation a drop makes before it releases what queued work may
/// use: bounded by the longest communicator timeout of the collectives still
/// pending on the stream, else [`crate::CommOptions::from_env`]'s, so a
/// collective that never completes (a rank that never joined; HCCL's own
/// execution timeout is 1836 s on A2 by default, and only CANN 8.5 and later
/// take a per-communicator one) cannot block a drop. Once a bounded wait on the
/// stream timed out, later drops fail at once with the same timeout until a
/// wait succeeds. A timeout is returned as `ACL_ERROR_RT_STREAM_SYNC_TIMEOUT`,
/// and a stream being captured as an error without waiting, both of which
/// [`settled`] turns into "release nothing".
pub(crate) fn teardown_sync(raw: aclrtStream, state: &StateRef) -> Result<()> {
    // A capturing stream cannot be synchronised (CANN refuses with
    // RT_ERROR_STREAM_CAPTURED, hicann/runtime v8.5.0
    // `src/runtime/feature/src/api_impl/api_error.cc:1010-1011`) and its
    // queued work still runs: the drop releases nothing, and is not the
    // synchronisation that breaks the capture. A status that cannot be read
    // leaves it to the wait, which such a stream refuses ([`settled`]).
    if capturing(raw).unwrap_or(false) {
        return Err(Error::invalid(
            "drop",
            "stream",
            "dropped while its stream is captured into a graph: what it holds is left allocated (leaked, not \
             freed under the stream's queued work); drop it after the capture ends",
        ));
    }
    let bound = {
        let st = lock(state);
        if st.stalled {
            return Err(Error::Acl {
                call: "aclrtSynchronizeStreamWithTimeout",
                code: acl_sys::ACL_ERROR_RT_STREAM_SYNC_TIMEOUT as acl_sys::aclError,
                msg: "an earlier bounded wait on this stream timed out and its work may still run: \
                      nothing it may use is released (leaked, not freed under running work)"
                    .into(),
            });
        }
        st.pending.iter().filter_map(|p| p.timeout()).max()
    };
    let bound = bound.unwrap_or_else(|| crate::CommOptions::from_env().timeout);
    bounded_sync(raw, state, bound)
}

/// `aclrtSynchronizeStreamWithTimeout(raw, bound)` (an unbounded
/// `aclrtSynchronizeStream` on a CANN without it), marking the stream stalled
/// on a timeout and not stalled on success. The device must be bound.
fn bounded_sync(raw: aclrtStream, state: &StateRef, bound: Duration) -> Result<()> {
    let ms = i32::try_from(bound.as_millis()).unwrap_or(i32::MAX).max(1);
    // SAFETY: live stream, device bound (the callers'), positive timeout in ms.
    let r = match unsafe { rt::synchronize_stream_with_timeout(raw, ms) } {
        Ok(Some(())) => Ok(()),
        // SAFETY: as above.
        Ok(None) => unsafe { rt::synchronize_stream(raw) },
        Err(e) => Err(e),
    };
    let timed_out = matches!(&r, Err(Error::Acl { code, .. })
        if *code == acl_sys::ACL_ERROR_RT_STREAM_SYNC_TIMEOUT as acl_sys::aclError);
    if timed_out || r.is_ok() {
        lock(state).stalled = timed_out;
    }
    r
}

pub(crate) type StateRef = Arc<Mutex<StreamState>>;

/// One [`StreamState`] per `(device, raw stream)` while a handle of it lives,
/// so two wraps of the host engine's stream share one check and one pool.
type StateMap = HashMap<(u32, usize), std::sync::Weak<Mutex<StreamState>>>;

fn states() -> &'static Mutex<StateMap> {
    static STATES: OnceLock<Mutex<StateMap>> = OnceLock::new();
    STATES.get_or_init(|| Mutex::new(HashMap::new()))
}

fn state_for(ordinal: u32, raw: aclrtStream) -> StateRef {
    let mut map = states().lock().unwrap_or_else(|p| p.into_inner());
    let slot = map.entry((ordinal, raw as usize)).or_default();
    if let Some(s) = slot.upgrade() {
        return s;
    }
    let s = StateRef::default();
    *slot = Arc::downgrade(&s);
    s
}

/// Runs `f` over the other live streams of device `ordinal` (not `own`),
/// with their raw handles: a graph may be replayed on any stream, so a
/// stream's check also reads what graphs captured on the others recorded.
/// Under the map's lock, so that none of them frees its pool meanwhile
/// (`release_pool` decides under it); the lock is the process's, so `f` is
/// kept short (a check's few reads of small records).
pub(crate) fn with_other_streams<R>(
    ordinal: u32,
    own: &StateRef,
    f: impl FnOnce(&[(aclrtStream, StateRef)]) -> R,
) -> R {
    let map = states().lock().unwrap_or_else(|p| p.into_inner());
    let others: Vec<(aclrtStream, StateRef)> = map
        .iter()
        .filter(|((o, _), _)| *o == ordinal)
        .filter_map(|(&(_, raw), w)| Some((raw as aclrtStream, w.upgrade()?)))
        .filter(|(_, s)| !Arc::ptr_eq(s, own))
        .collect();
    f(&others)
}

pub(crate) fn lock(state: &StateRef) -> std::sync::MutexGuard<'_, StreamState> {
    // A panic while holding the lock leaves plain lists behind: still usable.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

struct StreamInner {
    raw: aclrtStream,
    owned: bool,
    ctx: Arc<DeviceCtx>,
    state: StateRef,
}

// SAFETY: an aclrtStream is a runtime handle, not thread-affine: ACL allows
// any thread that has set the stream's device (we bind before every call) to
// launch work on it, and launches on one stream are serialised by the runtime.
unsafe impl Send for StreamInner {}
// SAFETY: as above; shared references only launch work or synchronise.
unsafe impl Sync for StreamInner {}

/// True unless the capture status of `raw` ([`rt::capture_get_info`]) is
/// `ACL_MODEL_RI_CAPTURE_STATUS_NONE`; false on a runtime without the
/// capture API. The stream's device must be bound.
///
/// The default stream (NULL) never captures: `aclmdlRICaptureBegin` refuses a
/// NULL stream and `aclmdlRICaptureGetInfo` refuses to be asked about one,
/// both with `ACL_ERROR_INVALID_PARAM` (`ACL_REQUIRES_NOT_NULL(stream)`,
/// hicann/runtime `src/acl/aclrt_impl/model_ri.cpp:54` and `:73` at v8.5.0),
/// so it is not asked.
pub(super) fn capturing(raw: aclrtStream) -> Result<bool> {
    Ok(capture_model(raw)?.is_some())
}

/// The model `raw` captures into (as an address), `None` when it captures
/// none: as [`capturing`], whose status rule it applies.
fn capture_model(raw: aclrtStream) -> Result<Option<usize>> {
    if raw.is_null() {
        return Ok(None);
    }
    // SAFETY: live stream, device bound.
    let info = unsafe { rt::capture_get_info(raw) }?;
    Ok(info
        .filter(|(s, _)| *s != acl_sys::aclmdlRICaptureStatus::ACL_MODEL_RI_CAPTURE_STATUS_NONE)
        .map(|(_, model)| model as usize))
}

impl StreamInner {
    /// Frees the workspace pool when this is the last handle of the stream:
    /// the stream is synchronised first (the pool's blocks may still be in
    /// use by queued work), the one synchronisation the pool ever makes.
    fn release_pool(&self) -> Result<()> {
        {
            // Decided under the map's lock, which the checks of the device's
            // other streams hold while they read this stream's captured
            // records ([`with_other_streams`]): from here on none
            // finds it, so none reads a record of a freed pool.
            let mut map = states().lock().unwrap_or_else(|p| p.into_inner());
            let st = lock(&self.state);
            if Arc::strong_count(&self.state) > 1 || (st.pool.is_empty() && st.staging.is_empty()) {
                return Ok(());
            }
            // Under capture the sync would invalidate the capture and the blocks
            // may belong to the graph being recorded: they are kept (and reported).
            if capturing(self.raw)? {
                return Err(Error::invalid(
                    "NpuStream::drop",
                    "stream",
                    "the last handle of a stream was dropped while it is captured: its workspace pool is kept \
                     (freeing it would synchronise the capture); drop the handle after the capture ends",
                ));
            }
            let key = (self.ctx.ordinal, self.raw as usize);
            if map.get(&key).is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.state))) {
                map.remove(&key);
            }
        }
        settled(teardown_sync(self.raw, &self.state))?;
        let (segments, (staged, fences)) = {
            let mut st = lock(&self.state);
            (st.pool.take_segments(), st.staging.take_all())
        };
        drop(fences);
        let mut first = Ok(());
        for (ptr, _) in segments {
            // SAFETY: a segment from aclrtMalloc (`reserve_workspace`), freed
            // once; the stream that used it was synchronised just above.
            first = first.and(unsafe { rt::free(ptr as *mut std::ffi::c_void) });
        }
        for (ptr, _) in staged {
            // SAFETY: a block from aclrtMallocHost (`staging_block`), freed
            // once; no copy from it is queued any more.
            first = first.and(unsafe { rt::free_host(ptr as *mut std::ffi::c_void) });
        }
        first
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if !self.owned {
            if let Err(e) = self.ctx.bind().and_then(|_| self.release_pool()) {
                record_drop_error(e);
            }
            return;
        }
        let result = self.ctx.bind().and_then(|_| {
            // Pending work must finish before the stream is destroyed (a
            // bounded wait: on a timeout the stream is left, not destroyed).
            settled(teardown_sync(self.raw, &self.state))?;
            let kept = {
                let mut st = lock(&self.state);
                std::mem::take(&mut st.waited)
            };
            drop(kept);
            self.release_pool()?;
            if let Ok(mut map) = states().lock() {
                map.remove(&(self.ctx.ordinal, self.raw as usize));
            }
            // SAFETY: owned, synchronised, destroyed exactly once.
            unsafe { rt::destroy_stream(self.raw) }
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}

/// A stream on one device: created by us (destroyed on drop) or borrowed.
/// Work on one raw stream (its ops, collectives and [`check`](Self::check)),
/// through any of its handles, is queued from one thread at a time, as a
/// stream runs its work in one order: the status records of its kernel
/// launches are freed by its check, and a launch on another thread that
/// finds the ring of records full could take a record a concurrent check
/// has not read yet.
#[derive(Clone)]
pub struct NpuStream {
    inner: Arc<StreamInner>,
}

impl std::fmt::Debug for NpuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NpuStream(npu:{}, {:p}, {})",
            self.ordinal(),
            self.inner.raw,
            if self.inner.owned { "owned" } else { "borrowed" }
        )
    }
}

impl NpuStream {
    /// Creates a new stream on `ctx`'s device.
    pub fn create(ctx: &Arc<DeviceCtx>) -> Result<Self> {
        ctx.bind()?;
        let raw = rt::create_stream()?;
        let state = state_for(ctx.ordinal, raw);
        Ok(NpuStream { inner: Arc::new(StreamInner { raw, owned: true, ctx: ctx.clone(), state }) })
    }

    /// Wraps a stream owned by someone else (e.g. `torch.npu.current_stream()`
    /// as a raw pointer). It is never destroyed by us.
    ///
    /// # Safety
    /// `raw` must be a live stream of `ctx`'s device (or NULL, the default
    /// stream) and outlive every use of the returned handle.
    pub unsafe fn borrow_raw(ctx: &Arc<DeviceCtx>, raw: aclrtStream) -> Self {
        let state = state_for(ctx.ordinal, raw);
        NpuStream { inner: Arc::new(StreamInner { raw, owned: false, ctx: ctx.clone(), state }) }
    }

    /// The raw handle.
    pub fn raw(&self) -> aclrtStream {
        self.inner.raw
    }

    /// True when this handle destroys the stream on drop.
    pub fn is_owned(&self) -> bool {
        self.inner.owned
    }

    /// The device context.
    pub fn ctx(&self) -> &Arc<DeviceCtx> {
        &self.inner.ctx
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.inner.ctx.ordinal
    }

    /// True if both handles name the same stream.
    pub fn same_as(&self, other: &NpuStream) -> bool {
        self.inner.raw == other.inner.raw && self.ordinal() == other.ordinal()
    }

    /// Binds the device and returns the ACL table.
    pub(crate) fn enter(&self) -> Result<&'static Acl> {
        self.inner.ctx.bind()?;
        Ok(self.inner.ctx.api)
    }

    /// Waits for all work on the stream (a host wait: never inside an op).
    pub fn synchronize(&self) -> Result<()> {
        self.enter()?;
        // SAFETY: live stream, device bound.
        unsafe { rt::synchronize_stream(self.raw()) }?;
        self.release_kept();
        Ok(())
    }

    /// Waits for all work on the stream, at most `timeout` (falls back to an
    /// unbounded wait on a CANN without `aclrtSynchronizeStreamWithTimeout`).
    pub fn synchronize_timeout(&self, timeout: Duration) -> Result<()> {
        self.enter()?;
        bounded_sync(self.raw(), self.state(), timeout)?;
        self.release_kept();
        Ok(())
    }

    /// [`teardown_sync`] of this stream: the bounded wait of a drop.
    pub(crate) fn teardown_sync(&self) -> Result<()> {
        self.enter()?;
        teardown_sync(self.raw(), self.state())?;
        self.release_kept();
        Ok(())
    }

    /// The state shared by the handles of this raw stream.
    pub(crate) fn state(&self) -> &StateRef {
        &self.inner.state
    }

    /// True while the stream is being captured into a graph (status
    /// `ACTIVE`, or `INVALIDATED` until the capture ends), see `capturing`;
    /// false on a runtime without the capture API, which cannot capture.
    pub fn is_capturing(&self) -> Result<bool> {
        self.enter()?;
        capturing(self.raw())
    }

    /// The graph this stream is being captured into (the model's address),
    /// `None` when it is not captured.
    pub(crate) fn capture(&self) -> Result<Option<usize>> {
        self.enter()?;
        capture_model(self.raw())
    }

    /// An error naming `op` while this stream is captured into a graph.
    pub(crate) fn refuse_under_capture(&self, op: &'static str, advice: &str) -> Result<()> {
        if self.is_capturing()? {
            return Err(Error::invalid(op, "stream", format!("{self:?} is being captured into a graph: {advice}")));
        }
        Ok(())
    }

    /// Drops the handles queued work used, once the stream drained.
    fn release_kept(&self) {
        let kept = {
            let mut st = lock(self.state());
            st.staging.drained();
            std::mem::take(&mut st.waited)
        };
        drop(kept);
    }
}

/// The event a stream records for other streams to wait on
/// ([`NpuStream::wait_for`]): one per stream, re-recorded at every wait, so
/// waits never create events (an A2/A3 device has at most 65536 events that
/// synchronise streams: API reference, `aclrtCreateEvent` /
/// `aclrtCreateEventExWithFlag`, hicann/runtime `docs/api_docs/` at v8.5.0).
/// Created by `aclrtCreateEventExWithFlag(ACL_EVENT_SYNC)` so that records
/// and waits also work while a capture spans the streams (the runtime
/// guide's cross-stream capture; [`rt::create_sync_event`]). Destroyed when
/// the stream's state and every waiter that may still use it let go.
pub(crate) struct SyncEvent {
    pub(super) raw: aclrtEvent,
    ctx: Arc<DeviceCtx>,
}

// SAFETY: as for NpuEvent: a runtime handle usable from any thread bound to its device.
unsafe impl Send for SyncEvent {}
// SAFETY: shared references only record it or wait for it.
unsafe impl Sync for SyncEvent {}

impl SyncEvent {
    pub(crate) fn create(stream: &NpuStream) -> Result<Self> {
        stream.enter()?;
        let raw = match rt::create_sync_event()? {
            Some(raw) => raw,
            // A runtime without the call has no graph capture to span either.
            None => rt::create_event()?,
        };
        Ok(SyncEvent { raw, ctx: stream.ctx().clone() })
    }
}

impl SyncEvent {
    /// Records the event at the current end of `stream` again (a re-record
    /// moves the event: `Event::Record` takes a new record task each time,
    /// hicann/runtime `src/runtime/feature/src/event/event.cc:440-495` at
    /// v8.5.0, reached through `aclrtRecordEventImpl`,
    /// `src/acl/aclrt_impl/event.cpp:99-113`, and `ApiImpl::EventRecord`,
    /// `src/runtime/feature/src/api_impl/api_impl.cc:2093-2136`).
    pub(crate) fn record(&self, stream: &NpuStream) -> Result<()> {
        stream.enter()?;
        // SAFETY: live event and stream, the stream's device bound.
        unsafe { rt::record_event(self.raw, stream.raw()) }
    }

    /// True when the work before the latest record completed, without
    /// waiting: `aclrtQueryEventStatus` (`aclrtQueryEventStatusImpl`,
    /// `src/acl/aclrt_impl/event.cpp:153-172`; `ApiErrorDecorator::EventQueryStatus`,
    /// `src/runtime/feature/src/api_impl/api_error.cc:1309-1317`, refuses
    /// only external events and events recorded in an ongoing capture;
    /// `Event::QueryEventStatus`, `src/runtime/feature/src/event/event.cc:1068-1092`,
    /// reports the latest record's state, and a new-mode event never
    /// recorded as complete). No host wait.
    pub(crate) fn is_complete(&self) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: live event, its device bound.
        let status = unsafe { rt::query_event_status(self.raw) }?;
        Ok(status == acl_sys::aclrtEventRecordedStatus::ACL_EVENT_RECORDED_STATUS_COMPLETE)
    }

    /// Waits on the host until the work before the latest record completed
    /// (`aclrtSynchronizeEvent`: `aclrtSynchronizeEventImpl`,
    /// `src/acl/aclrt_impl/event.cpp:199`; `ApiImpl::EventSynchronize`,
    /// `src/runtime/feature/src/api_impl/api_impl.cc:2229-2247`).
    pub(crate) fn wait(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: live event, its device bound.
        unsafe { rt::synchronize_event(self.raw) }
    }
}

impl Drop for SyncEvent {
    fn drop(&mut self) {
        let result = self.ctx.bind().and_then(|_| {
            // SAFETY: created by us, destroyed once, after every stream that
            // waited for it synchronised or let go of it.
            unsafe { rt::destroy_event(self.raw) }
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}
