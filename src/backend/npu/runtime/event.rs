//! Events, and ordering one stream after another on the device.

use std::sync::Arc;

use acl_sys::aclrtEvent;

use super::load::record_drop_error;
use super::stream::{lock, NpuStream, SyncEvent};
use crate::backend::npu::result::acl as rt;
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
        stream.enter()?;
        let raw = rt::create_event()?;
        Ok(NpuEvent { raw, stream: stream.clone() })
    }

    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &NpuStream) -> Result<()> {
        stream.enter()?;
        // SAFETY: live event and stream.
        unsafe { rt::record_event(self.raw, stream.raw()) }
    }

    /// Waits until the recorded work completed.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.enter()?;
        // SAFETY: live event.
        unsafe { rt::synchronize_event(self.raw) }
    }

    /// True when the recorded work completed.
    pub fn is_complete(&self) -> Result<bool> {
        self.stream.enter()?;
        // SAFETY: live event.
        let status = unsafe { rt::query_event_status(self.raw) }?;
        Ok(status == acl_sys::aclrtEventRecordedStatus::ACL_EVENT_RECORDED_STATUS_COMPLETE)
    }

    /// Milliseconds between `start` and this event (both recorded and complete).
    pub fn elapsed_ms_since(&self, start: &NpuEvent) -> Result<f32> {
        self.stream.enter()?;
        // SAFETY: live events.
        unsafe { rt::event_elapsed_time(start.raw, self.raw) }
    }
}

impl Drop for NpuEvent {
    fn drop(&mut self) {
        let result = self.stream.enter().and_then(|_| {
            // SAFETY: created by us, destroyed once.
            unsafe { rt::destroy_event(self.raw) }
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}

impl NpuStream {
    /// Orders `operand_streams`, the streams of the operands of work just
    /// queued on this stream, each listed once, after that work (an event
    /// recorded here and waited for on each other stream; the host does not
    /// wait). An
    /// operand's own stream is the one its readers, writers and its drop
    /// synchronise with, so a read of an output through its own stream sees
    /// what the op wrote, and an input is neither overwritten nor freed while
    /// the op still reads it.
    ///
    /// Not while this stream captures a graph: the captured work runs only
    /// when the graph is replayed, so there is nothing to order now, and the
    /// wait would leave the operand's stream in the capture with a wait as
    /// its last task, which ends the capture unjoined (hicann/runtime v8.5.0
    /// `src/runtime/feature/src/context/context.cc:4843-4893`,
    /// `CheckCaptureModelValidity`; `src/runtime/feature/src/model/v100/
    /// capture_adapt.cc:49-53`: "The last task type is not event record").
    pub(crate) fn order_operand_streams_after(&self, operand_streams: &[NpuStream]) -> Result<()> {
        let mut others = operand_streams.iter().filter(|s| !s.same_as(self)).peekable();
        if others.peek().is_none() || self.is_capturing()? {
            return Ok(());
        }
        others.try_for_each(|s| s.wait_for(self))
    }

    /// Makes this stream wait (on the device) for `event`.
    pub fn wait_event(&self, event: &NpuEvent) -> Result<()> {
        self.enter()?;
        // SAFETY: both handles are live (the event holds its stream).
        unsafe { rt::stream_wait_event(self.raw(), event.raw) }
    }

    /// The event this stream records for waiters, created on first use.
    fn sync_event(&self) -> Result<Arc<SyncEvent>> {
        if let Some(ev) = lock(self.state()).sync_event.clone() {
            return Ok(ev);
        }
        let ev = Arc::new(SyncEvent::create(self)?);
        let mut st = lock(self.state());
        // Another thread may have created one meanwhile: keep the first.
        Ok(st.sync_event.get_or_insert(ev).clone())
    }

    /// Orders this stream after all work currently queued on `other`, on the
    /// device: `other`'s `SyncEvent` recorded on `other` and waited for
    /// here (a wait honours the record made before it, so re-recording the
    /// event for a later wait does not move an earlier one). The host does
    /// not wait. This stream keeps the event until its next synchronisation,
    /// since CANN asks that an event not be destroyed while a call still uses
    /// it (aclrtDestroyEvent, AscendCL API reference).
    ///
    /// A stream being captured waits for nothing outside its capture: the
    /// captured work runs when the graph is replayed, not now, and the
    /// stream that replays it orders it. CANN refuses that wait (a capturing
    /// stream waiting for an event recorded outside its capture is
    /// `RT_ERROR_STREAM_CAPTURE_ISOLATION`, ACL error 107024: hicann/runtime
    /// v8.5.0 `src/runtime/feature/src/api_impl/api_impl.cc:1549-1563`,
    /// `src/runtime/feature/src/common/errcode_manage.cc:184`), so a
    /// collective warmed up on one stream and captured on another
    /// (`torch.npu.graph` captures on its own side stream) would fail there.
    /// A stream outside every capture that waits for a capturing one joins
    /// its capture (`api_impl.cc:1534-1547`): that is how work on an
    /// operand's stream is captured with the op, and is kept.
    pub fn wait_for(&self, other: &NpuStream) -> Result<()> {
        if self.same_as(other) {
            return Ok(());
        }
        let capture = self.capture()?;
        if capture.is_some() && capture != other.capture()? {
            // Asking `other` bound its device: this stream's is left bound,
            // as after a wait.
            return self.enter().map(drop);
        }
        let ev = other.sync_event()?;
        other.enter()?;
        // SAFETY: live event and stream, the stream's device bound.
        unsafe { rt::record_event(ev.raw, other.raw()) }?;
        self.enter()?;
        // SAFETY: live stream and event, the stream's device bound.
        unsafe { rt::stream_wait_event(self.raw(), ev.raw) }?;
        let mut st = lock(self.state());
        if !st.waited.iter().any(|e| Arc::ptr_eq(e, &ev)) {
            st.waited.push(ev);
        }
        Ok(())
    }
}
