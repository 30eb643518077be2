//! The ACL runtime, safely: loading, error mapping, per-thread device
//! binding, streams and events.
//!
//! Ownership: a [`NpuStream`] holds an `Arc` of its device context, an
//! [`NpuEvent`] and every buffer hold their stream, so a parent never dies
//! before its children. Handles borrowed from a host engine (a torch_npu
//! stream) are never destroyed by us. `Drop` never panics: failures are
//! recorded in [`drop_errors`].
//!
//! Ordering without host waits: an op queues its work on the stream of its
//! call and returns. What only the device can tell (an HCCL async error, a
//! kernel's status words) is recorded as pending work of that stream and
//! reported by [`NpuStream::check`], the one sync point the caller owns.
//! Handles the device may still use (events of a cross-stream wait) are kept
//! with the stream until its next synchronisation. Status records of eager
//! launches and pinned staging blocks are reused in place, freed by the
//! check or by an event recorded after their work (`EagerRecords`,
//! `NpuStream::stage_to_device`), so ops allocate nothing once a stream
//! is warm.

mod device;
mod event;
pub(crate) mod load;
mod pending;
mod stream;
mod workspace;

pub use device::device_count;
pub use device::DeviceCtx;
pub(crate) use device::ThreadDevice;
pub use event::NpuEvent;
pub use load::{acl, recent_error_message, take_drop_errors};
pub(crate) use load::{record_drop_error, settled};
pub(crate) use pending::RECORD_FENCE_EVERY;
pub use stream::NpuStream;
pub(crate) use stream::{lock, Pending, StatusRecord, SyncEvent};
