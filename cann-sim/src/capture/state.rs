//! The models being captured or replayed, and the streams and events taking
//! part in a capture.

use std::cell::Cell;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use crate::handles::Table;
use crate::status::SimResult;
use crate::stream::{Event, Stream};

use super::codes::ACL_MODEL_RI_CAPTURE_MODE_GLOBAL;

/// A recorded task: the call that queued it and its re-runnable job.
pub(super) type Recorded = (&'static str, Arc<dyn Fn() -> SimResult<()> + Send + Sync>);

/// The capture a model is being recorded by.
pub(super) struct Session {
    pub(super) mode: i32,
    pub(super) thread: ThreadId,
    pub(super) origin: Arc<Stream>,
}

#[derive(Default)]
pub(super) struct ModelState {
    pub(super) tasks: Vec<Recorded>,
    /// Set between `aclmdlRICaptureBegin` and `aclmdlRICaptureEnd`.
    pub(super) capture: Option<Session>,
    /// Why the capture was invalidated.
    pub(super) invalid: Option<String>,
    /// Queued replays: (stream, task number).
    pub(super) replays: Vec<(Arc<Stream>, u64)>,
}

/// A model runtime instance (`aclmdlRI`).
pub struct Model {
    /// Device of the stream that captured it.
    pub device: u32,
    pub(super) state: Mutex<ModelState>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "aclmdlRI(device {}, {} tasks)", self.device, self.tasks())
    }
}

impl Model {
    pub(super) fn lock(&self) -> MutexGuard<'_, ModelState> {
        // Every critical section leaves ModelState consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of recorded tasks.
    pub fn tasks(&self) -> usize {
        self.lock().tasks.len()
    }

    /// True while the model is still being captured.
    pub fn capturing(&self) -> bool {
        self.lock().capture.is_some()
    }
}

/// Live models: created by `aclmdlRICaptureBegin` (so `aclmdlRICaptureGetInfo`
/// can name one during the capture), removed by `aclmdlRIDestroy` or a failed
/// `aclmdlRICaptureEnd`.
pub static MODELS: Table<Model> = Table::new("aclmdlRI", 0x5a8);

/// A stream taking part in a capture.
pub(super) struct Member {
    pub(super) stream: Arc<Stream>,
    pub(super) model: usize,
    /// Number of model tasks up to this stream's last recorded one.
    pub(super) recorded: usize,
    /// Number of model tasks up to the last of this stream's tasks that
    /// another member waited for.
    pub(super) joined: usize,
    /// The stream's last captured operation is a wait for an event (the
    /// wait that made it join, or a later one), not a task of its own.
    pub(super) waits_last: bool,
}

/// An event whose latest record was captured.
pub(super) struct CapturedEvent {
    pub(super) event: Arc<Event>,
    pub(super) model: usize,
    pub(super) stream: Arc<Stream>,
    /// Number of model tasks up to the record.
    pub(super) at: usize,
}

pub(super) static MEMBERS: Mutex<Vec<Member>> = Mutex::new(Vec::new());
pub(super) static EVENTS: Mutex<Vec<CapturedEvent>> = Mutex::new(Vec::new());

pub(super) fn members() -> MutexGuard<'static, Vec<Member>> {
    // Each critical section leaves the list consistent.
    MEMBERS.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn captured_events() -> MutexGuard<'static, Vec<CapturedEvent>> {
    // Each critical section leaves the list consistent.
    EVENTS.lock().unwrap_or_else(|e| e.into_inner())
}

pub(super) fn member_of<'a>(m: &'a [Member], s: &Stream) -> Option<&'a Member> {
    m.iter().find(|x| std::ptr::eq(&*x.stream, s))
}

/// Marks the capture of model `h` invalidated (the first reason is kept).
pub(super) fn invalidate(h: usize, why: &str) {
    if let Some(model) = MODELS.get(h) {
        let mut st = model.lock();
        if st.capture.is_some() && st.invalid.is_none() {
            st.invalid = Some(why.to_string());
        }
    }
}

thread_local! {
    /// The calling thread's capture mode, which
    /// `aclmdlRICaptureThreadExchangeMode` swaps: GLOBAL until a thread
    /// changes it (`InnerThreadLocalContainer::exchangeCaptureMode_`, a
    /// thread-local initialised to RT_STREAM_CAPTURE_MODE_GLOBAL: hicann/runtime
    /// v8.5.0 `src/runtime/feature/src/common/inner_thread_local.cpp:22`).
    /// It decides, with the captures' modes, whether an unsafe call is
    /// refused ([`super::hooks::unsafe_call`]).
    pub(super) static THREAD_MODE: Cell<i32> = const { Cell::new(ACL_MODEL_RI_CAPTURE_MODE_GLOBAL) };
}
