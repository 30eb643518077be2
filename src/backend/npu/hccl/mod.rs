//! HCCL, safely: root info, communicators (from root info, sub-communicators,
//! borrowed from the host engine) and the collectives of SPEC section 8.
//!
//! Every collective is queued on the stream of its call (the stream of its
//! operands: for the C ABI the caller's `amoe_stream`) and returns: the host
//! never waits inside a collective. The HCCL API reference gives each
//! collective's `stream` argument as "the stream of the rank" (HcclAllReduce,
//! HcclAllGather, ..., hcclcpp_07_0021 and neighbours, CANN 8.0), any stream of
//! the communicator's device, on which the collective is one more task.
//! A collective whose operands live on other streams, or whose communicator
//! last ran on another stream, is ordered after them on the device (event
//! record and wait), so one communicator's collectives run in call order.
//! What only the device can tell (a mismatch between ranks, a hung peer:
//! `HcclGetCommAsyncError`) is reported by [`NpuStream::check`] of that
//! stream, naming the collective, the group and the rank.

mod api;
mod collectives;
mod init;
mod queue;
mod root_info;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::memory::NpuBuffer;
use super::runtime::{record_drop_error, NpuStream};
use super::NpuDevice;
use crate::types::CommOptions;

use super::result::hccl as hc;
pub use super::result::hccl::hccl;
pub use api::{hccl_dtype, hccl_op, ROOT_INFO_BYTES};
pub use root_info::HcclRootInfo;

struct CommInner {
    raw: hccl_sys::HcclComm,
    owned: bool,
    /// Whether HCCL can split it: one made from a root info, or one borrowed
    /// with the caller's word that it is the engine's world communicator.
    splittable: bool,
    device: NpuDevice,
    rank: usize,
    world: usize,
    name: String,
    /// An id identical on every member (from the root info, or the parent's
    /// id and the rank list), from which sub-communicator ids derive.
    key: u64,
    opts: CommOptions,
    /// Per rank list, how many sub-communicators were split off with it (so
    /// a repeated split gets a fresh id, the same on every member).
    splits: Mutex<HashMap<Vec<usize>, u64>>,
    /// The global communicator this one was split from (`None`: this is one).
    /// HcclCreateSubCommConfig (HCCL API reference) splits only a global
    /// communicator, so every split goes to it.
    global: Option<Arc<CommInner>>,
    /// The global rank of each rank of this communicator (ascending).
    global_ranks: Vec<usize>,
    /// Small device allocations passed in place of an empty (NULL) send and
    /// receive buffer: two, as the V collectives refuse one address for both.
    placeholders: std::sync::OnceLock<[NpuBuffer; 2]>,
    /// The stream the last collective was queued on: the next one, on
    /// whatever stream, is ordered after it, and destruction waits for it.
    last_stream: Mutex<Option<NpuStream>>,
}

// SAFETY: an HcclComm is a library handle; HCCL allows its use from any
// thread bound to the communicator's device, and this crate serialises use
// of one communicator through its (single) stream.
unsafe impl Send for CommInner {}
// SAFETY: as above.
unsafe impl Sync for CommInner {}

impl Drop for CommInner {
    fn drop(&mut self) {
        let last = self.last_stream.lock().map(|mut l| l.take()).unwrap_or_default();
        // Bounded waits (`teardown_sync`): after a collective that never
        // completes (a rank that never joined) the communicator is left, not
        // destroyed under its running work, and the timeout is recorded. The
        // stand-ins for empty buffers, which that work may name, stay too.
        let result = hccl().and_then(|_| {
            if let Some(s) = last {
                super::runtime::settled(s.teardown_sync())?;
            }
            if !self.owned {
                return Ok(());
            }
            super::runtime::settled(self.device.stream().teardown_sync())?;
            // SAFETY: created by us, destroyed once, no queued collective left.
            unsafe { hc::comm_destroy(self.raw) }
        });
        if let Err(e) = result {
            record_drop_error(e);
            if let Some(p) = self.placeholders.take() {
                std::mem::forget(p);
            }
        }
    }
}

/// An HCCL communicator bound to one device (and its stream).
#[derive(Clone)]
pub struct HcclComm {
    inner: Arc<CommInner>,
}

impl std::fmt::Debug for HcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HcclComm({:?}, rank {} of {}, npu:{}{})",
            self.inner.name,
            self.inner.rank,
            self.inner.world,
            self.inner.device.ordinal(),
            if self.inner.owned { "" } else { ", borrowed" }
        )
    }
}

impl HcclComm {
    /// The raw handle (for passing to other HCCL users).
    pub fn raw(&self) -> hccl_sys::HcclComm {
        self.inner.raw
    }

    /// The NPU device.
    pub fn npu_device(&self) -> &NpuDevice {
        &self.inner.device
    }
}
