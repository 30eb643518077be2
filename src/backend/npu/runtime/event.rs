//! Events, and ordering one stream after another on the device.

use acl_sys::aclrtEvent;

use super::load::{acl_fn, check, record_drop_error};
use super::stream::NpuStream;
use crate::Result;

/// An event, created on (and keeping alive) a stream's device.
pub struct NpuEvent {
    raw: aclrtEvent,
    stream: NpuStream,
}

// SAFETY: events are runtime handles usable from any thread bound to their
// device (ACL has no thread affinity for events).
unsafe impl Send for NpuEvent {}
// SAFETY: shared references only record, query or synchronise.
unsafe impl Sync for NpuEvent {}

impl std::fmt::Debug for NpuEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NpuEvent({:p} on {:?})", self.raw, self.stream)
    }
}

impl NpuEvent {
    /// Creates an event on `stream`'s device.
    pub fn create(stream: &NpuStream) -> Result<Self> {
        let api = stream.enter()?;
        let f = acl_fn!(api, aclrtCreateEvent)?;
        let mut raw: aclrtEvent = std::ptr::null_mut();
        // SAFETY: valid out-pointer, device bound.
        check("aclrtCreateEvent", unsafe { f(&mut raw) })?;
        Ok(NpuEvent { raw, stream: stream.clone() })
    }

    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &NpuStream) -> Result<()> {
        let api = stream.enter()?;
        let f = acl_fn!(api, aclrtRecordEvent)?;
        // SAFETY: live event and stream.
        check("aclrtRecordEvent", unsafe { f(self.raw, stream.raw()) })
    }

    /// Waits until the recorded work completed.
    pub fn synchronize(&self) -> Result<()> {
        let api = self.stream.enter()?;
        let f = acl_fn!(api, aclrtSynchronizeEvent)?;
        // SAFETY: live event.
        check("aclrtSynchronizeEvent", unsafe { f(self.raw) })
    }

    /// True when the recorded work completed.
    pub fn is_complete(&self) -> Result<bool> {
        let api = self.stream.enter()?;
        let f = acl_fn!(api, aclrtQueryEventStatus)?;
        let mut status = acl_sys::aclrtEventRecordedStatus(0);
        // SAFETY: live event, valid out-pointer.
        check("aclrtQueryEventStatus", unsafe { f(self.raw, &mut status) })?;
        Ok(status == acl_sys::aclrtEventRecordedStatus::ACL_EVENT_RECORDED_STATUS_COMPLETE)
    }

    /// Milliseconds between `start` and this event (both recorded and complete).
    pub fn elapsed_ms_since(&self, start: &NpuEvent) -> Result<f32> {
        let api = self.stream.enter()?;
        let f = acl_fn!(api, aclrtEventElapsedTime)?;
        let mut ms = 0f32;
        // SAFETY: live events, valid out-pointer.
        check("aclrtEventElapsedTime", unsafe { f(&mut ms, start.raw, self.raw) })?;
        Ok(ms)
    }
}

impl Drop for NpuEvent {
    fn drop(&mut self) {
        let result = self.stream.enter().and_then(|api| {
            let f = acl_fn!(api, aclrtDestroyEvent)?;
            // SAFETY: created by us, destroyed once.
            check("aclrtDestroyEvent", unsafe { f(self.raw) })
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}

impl NpuStream {
    /// Makes this stream wait (on the device) for `event`.
    pub fn wait_event(&self, event: &NpuEvent) -> Result<()> {
        let api = self.enter()?;
        let f = acl_fn!(api, aclrtStreamWaitEvent)?;
        // SAFETY: both handles are live (the event holds its stream).
        check("aclrtStreamWaitEvent", unsafe { f(self.raw(), event.raw) })
    }

    /// Orders this stream after all work currently queued on `other`, on the
    /// device: an event recorded on `other` and waited for here. The host
    /// does not wait; the event is kept until this stream's next
    /// synchronisation, since CANN asks that an event not be destroyed while
    /// a call still uses it (aclrtDestroyEvent, AscendCL API reference).
    pub fn wait_for(&self, other: &NpuStream) -> Result<()> {
        if self.same_as(other) {
            return Ok(());
        }
        let ev = NpuEvent::create(other)?;
        ev.record(other)?;
        self.wait_event(&ev)?;
        self.keep_until_sync(Box::new(ev));
        Ok(())
    }
}
