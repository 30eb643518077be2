//! Streams and events.
//!
//! Every stream has a worker thread that runs its tasks in order. In the
//! default `lazy` mode a queued task runs only once something waits for it: a
//! stream or event synchronisation, an event query, or another stream's
//! `aclrtStreamWaitEvent` reaching it. Until then its effects are invisible, so
//! a read that forgot its synchronisation sees stale data every time, not just
//! under an unlucky schedule. `CANNSIM_STREAM_MODE=eager` releases each task as
//! soon as it is queued.
//!
//! A failing task leaves a sticky error on its stream: later tasks on it are
//! skipped and every synchronisation returns the error.
//!
//! A leaf under graph capture: a stream knows nothing of captures. Capture
//! installs its [`Interceptor`] before a stream first takes part in one, and
//! every queued job passes through it from then on.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config;
use crate::ffi::*;
use crate::status::{fail, SimError, SimResult};

/// Work run on a stream's worker. It is `Fn`, not `FnOnce`: work queued on a
/// capturing stream is recorded into a model and runs again at every replay
/// (`aclmdlRIExecuteAsync`), on the same buffers.
pub type Job = Box<dyn Fn() -> SimResult<()> + Send + Sync>;

/// Takes a job queued on a stream (named after the call that queued it):
/// returns None when it recorded the job into a graph capture, or hands the
/// job back to be queued.
pub type Interceptor = fn(&Stream, &'static str, Job) -> Option<Job>;

/// The interceptor of every stream's queue, once installed.
static INTERCEPTOR: OnceLock<Interceptor> = OnceLock::new();

/// Installs `f` as the interceptor of every stream's queue; the first
/// installation stays. Graph capture installs its recorder
/// ([`crate::capture::intercept`]) before any stream joins a capture, so no
/// job queued on a capturing stream escapes it.
pub fn install_interceptor(f: Interceptor) {
    let _ = INTERCEPTOR.set(f);
}

struct Task {
    seq: u64,
    name: &'static str,
    job: Job,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Task>,
    /// Sequence number of the last queued task (tasks count from 1).
    last: u64,
    /// Tasks up to this number may run.
    released: u64,
    /// Tasks up to this number have run (or were skipped).
    done: u64,
    error: Option<SimError>,
    shutdown: bool,
}

/// A simulated stream.
pub struct Stream {
    /// Device the stream belongs to.
    pub device: u32,
    /// True for a device's default stream (the NULL handle).
    pub is_default: bool,
    state: Mutex<State>,
    cv: Condvar,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream(device {}, default {})", self.device, self.is_default)
    }
}

impl Stream {
    /// A new stream with its worker thread.
    pub fn new(device: u32, is_default: bool) -> SimResult<Arc<Stream>> {
        let s = Arc::new(Stream {
            device,
            is_default,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            worker: Mutex::new(None),
        });
        let w = s.clone();
        let handle = std::thread::Builder::new()
            .name(format!("cannsim-stream-d{device}"))
            .spawn(move || w.run())
            .map_err(|e| SimError::new(ACL_ERROR_RT_INTERNAL_ERROR, format!("cannot start a stream worker: {e}")))?;
        *s.worker.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(s)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Tasks run outside the lock, so poisoning cannot leave State half-updated.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn run(&self) {
        loop {
            let (task, skip) = {
                let mut g = self.lock();
                loop {
                    if g.queue.front().is_some_and(|t| t.seq <= g.released) {
                        break;
                    }
                    if g.shutdown && g.queue.is_empty() {
                        return;
                    }
                    g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                // Invariant: the loop above only breaks when the queue has a front.
                let t = g.queue.pop_front().expect("queue has a released front task");
                (t, g.error.is_some())
            };
            let seq = task.seq;
            let name = task.name;
            let result = if skip {
                Ok(())
            } else {
                match catch_unwind(AssertUnwindSafe(|| (task.job)())) {
                    Ok(r) => r,
                    Err(_) => fail(ACL_ERROR_RT_INTERNAL_ERROR, "the task panicked inside the simulator"),
                }
            };
            let mut g = self.lock();
            if let Err(e) = result {
                config::trace(&format!("stream task {name} failed: {}", e.msg));
                if g.error.is_none() {
                    g.error = Some(SimError::new(e.code, format!("asynchronous {name} failed: {}", e.msg)));
                }
            }
            g.done = seq;
            drop(g);
            self.cv.notify_all();
        }
    }

    /// Queues `job` (named after the call that queued it); returns its number.
    /// On a capturing stream the job is recorded into the capture's model
    /// instead (by the installed [`Interceptor`]), and the number of the last
    /// task queued before it is returned.
    pub fn enqueue(&self, name: &'static str, job: Job) -> u64 {
        let job = match INTERCEPTOR.get() {
            Some(intercept) => match intercept(self, name, job) {
                Some(job) => job,
                None => return self.last(),
            },
            None => job,
        };
        let mut g = self.lock();
        g.last += 1;
        let seq = g.last;
        g.queue.push_back(Task { seq, name, job });
        if !config::get().lazy {
            g.released = seq;
        }
        drop(g);
        self.cv.notify_all();
        seq
    }

    /// Number of the last queued task.
    pub fn last(&self) -> u64 {
        self.lock().last
    }

    /// Number of the last finished task.
    pub fn done(&self) -> u64 {
        self.lock().done
    }

    /// Lets tasks up to `seq` run.
    pub fn release(&self, seq: u64) {
        let mut g = self.lock();
        if seq > g.released {
            g.released = seq;
            drop(g);
            self.cv.notify_all();
        }
    }

    /// Releases and waits for tasks up to `seq`; `timeout` None waits as long
    /// as the tasks take (each task is itself bounded).
    pub fn wait_for(&self, seq: u64, timeout: Option<Duration>) -> SimResult<()> {
        self.release(seq);
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = self.lock();
        while g.done < seq {
            g = match deadline {
                None => self.cv.wait(g).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return fail(
                            ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
                            format!("stream on device {} did not finish task {seq} in time", self.device),
                        );
                    }
                    self.cv.wait_timeout(g, d - now).unwrap_or_else(|e| e.into_inner()).0
                }
            };
        }
        Ok(())
    }

    /// The sticky error, if a task failed.
    pub fn error(&self) -> Option<SimError> {
        self.lock().error.clone()
    }

    /// Runs every queued task and returns the sticky error, if any.
    pub fn synchronize(&self, timeout: Option<Duration>) -> SimResult<()> {
        let last = self.last();
        self.wait_for(last, timeout)?;
        match self.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Number of queued tasks that have not run.
    pub fn pending(&self) -> u64 {
        let g = self.lock();
        g.last - g.done
    }

    /// Runs what is queued, then stops the worker.
    pub fn shutdown(&self) {
        let last = self.last();
        let _ = self.wait_for(last, None);
        self.lock().shutdown = true;
        self.cv.notify_all();
        let h = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = h {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

#[derive(Debug, Default)]
struct EventState {
    /// Latest record: (stream, task number, generation).
    rec: Option<(Arc<Stream>, u64, u64)>,
    generation: u64,
    /// Completion time of a record: (generation, when).
    time: Option<(u64, Instant)>,
}

/// `RT_EVENT_DDSYNC_NS` (`ACL_EVENT_SYNC`), runtime `pkg_inc/runtime/runtime/event.h:55` (v8.5.0).
pub const RT_EVENT_DDSYNC_NS: u32 = 0x01;
/// `RT_EVENT_STREAM_MARK` (`ACL_EVENT_CAPTURE_STREAM_PROGRESS`), event.h:56.
pub const RT_EVENT_STREAM_MARK: u32 = 0x02;
/// `RT_EVENT_DDSYNC`, event.h:57.
pub const RT_EVENT_DDSYNC: u32 = 0x04;
/// `RT_EVENT_TIME_LINE` (`ACL_EVENT_TIME_LINE`), event.h:58.
pub const RT_EVENT_TIME_LINE: u32 = 0x08;
/// `RT_EVENT_MC2` (`ACL_EVENT_DEVICE_USE_ONLY` in the API reference), not
/// OR-able with another flag; event.h:60 at HEAD.
pub const RT_EVENT_MC2: u32 = 0x10;
/// `RT_EVENT_EXTERNAL`, event.h:60 (v8.5.0).
pub const RT_EVENT_EXTERNAL: u32 = 0x20;
/// `RT_EVENT_IPC`, event.h:61 (not OR-able with another flag).
pub const RT_EVENT_IPC: u32 = 0x40;
/// `RT_EVENT_DEFAULT`, the flag of an `aclrtCreateEvent` event, event.h:62.
pub const RT_EVENT_DEFAULT: u32 = RT_EVENT_DDSYNC | RT_EVENT_TIME_LINE | RT_EVENT_STREAM_MARK;

/// A simulated event.
#[derive(Debug)]
pub struct Event {
    /// Device the event was created on.
    pub device: u32,
    /// The runtime flag it was created with (`RT_EVENT_*`).
    pub flag: u32,
    /// Created by `aclrtCreateEventExWithFlag` (the runtime's "new mode",
    /// `Event::IsNewMode`, `ApiImpl::EventCreateEx` at api_impl.cc:1977-1994).
    pub new_mode: bool,
    /// True once a record took one of the device's synchronisation event
    /// resources (see [`crate::acl`]'s event limit).
    pub holds_resource: std::sync::atomic::AtomicBool,
    state: Mutex<EventState>,
}

impl Event {
    /// A new, never recorded event of `aclrtCreateEvent` (old mode, `RT_EVENT_DEFAULT`).
    pub fn new(device: u32) -> Event {
        Event::with_flag(device, RT_EVENT_DEFAULT, false)
    }

    /// A new, never recorded event with `flag`, old or new mode.
    pub fn with_flag(device: u32, flag: u32, new_mode: bool) -> Event {
        Event {
            device,
            flag,
            new_mode,
            holds_resource: std::sync::atomic::AtomicBool::new(false),
            state: Mutex::new(EventState::default()),
        }
    }

    /// The runtime's `Event::IsEventWithoutWaitTask` (runtime
    /// `src/runtime/feature/inc/event/event.hpp:135-137`, v8.5.0): no
    /// `DDSYNC`, `DDSYNC_NS`, `EXTERNAL` or `IPC` bit, so a stream cannot
    /// wait for it and its record in a capture is skipped.
    pub fn without_wait_task(&self) -> bool {
        self.flag & (RT_EVENT_DDSYNC | RT_EVENT_DDSYNC_NS | RT_EVENT_EXTERNAL | RT_EVENT_IPC) == 0
    }

    /// True once the event was recorded (the runtime's `Event::HasRecord`).
    pub fn has_record(&self) -> bool {
        self.lock().rec.is_some()
    }

    /// True when a stream may not wait for the event yet: an old-mode event
    /// without `DDSYNC_NS` or `EXTERNAL` that was never recorded. The
    /// runtime's `Event::Wait` refuses such a wait with `RT_ERROR_INVALID_VALUE`
    /// (runtime `src/runtime/feature/src/event/event.cc:597-605`, v8.5.0,
    /// reached because `Event::WaitSendCheck` asks for a wait task for every
    /// old-mode event whose latest record has not run, `:540-546`); a new-mode
    /// event never recorded is a wait that does nothing (`:519-523`).
    pub fn wait_needs_a_record(&self) -> bool {
        !self.new_mode && self.flag & (RT_EVENT_DDSYNC_NS | RT_EVENT_EXTERNAL) == 0 && !self.has_record()
    }

    /// The status `aclrtQueryEventStatus` reports: complete once the latest
    /// record has run. Never recorded, a new-mode event is complete and an
    /// old-mode one is not (`Event::QueryEventStatus`, runtime
    /// `src/runtime/feature/src/event/event.cc:1072-1077`, v8.5.0: `RT_EVENT_INIT`,
    /// which `aclrtQueryEventStatusImpl` reports as not ready, acl
    /// `src/acl/aclrt_impl/event.cpp:167-171`).
    pub fn query_complete(&self) -> bool {
        if !self.has_record() {
            return self.new_mode;
        }
        self.is_complete()
    }

    fn lock(&self) -> MutexGuard<'_, EventState> {
        // Every critical section below leaves EventState consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a record of `self` on `stream`.
    pub fn record(self: &Arc<Self>, stream: &Arc<Stream>) {
        let mut g = self.lock();
        g.generation += 1;
        let generation = g.generation;
        let me = self.clone();
        let seq = stream.enqueue(
            "aclrtRecordEvent",
            Box::new(move || {
                let mut g = me.lock();
                g.time = Some((generation, Instant::now()));
                Ok(())
            }),
        );
        g.rec = Some((stream.clone(), seq, generation));
    }

    /// The stream and task number of the latest record.
    pub fn target(&self) -> Option<(Arc<Stream>, u64)> {
        self.lock().rec.as_ref().map(|(s, q, _)| (s.clone(), *q))
    }

    /// True when the latest record has run (or the event was never recorded).
    pub fn is_complete(&self) -> bool {
        match self.target() {
            None => true,
            Some((s, q)) => s.done() >= q,
        }
    }

    /// Completion time of the latest record, if it has run.
    pub fn time(&self) -> Option<Instant> {
        let g = self.lock();
        let (_, _, generation) = g.rec.as_ref()?;
        match g.time {
            Some((t_gen, t)) if t_gen == *generation => Some(t),
            _ => None,
        }
    }
}
