//! The simulated communicators and the table of live ones.
//!
//! A leaf of HCCL: the exports create, use and destroy communicators here,
//! the HCCL rules look parents up here, and the leak report reads the table,
//! none of them through the others.

use std::sync::atomic::{AtomicBool, AtomicI32};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::ffi::*;
use crate::handles::Table;
use crate::status::{SimError, SimResult};

use super::plane::Group;

/// A simulated communicator.
pub struct SimComm {
    /// Rendezvous name of the group.
    pub key: String,
    /// Name reported by `HcclGetCommName`.
    pub name: String,
    /// Rank in this communicator.
    pub rank: u32,
    /// Ranks in this communicator.
    pub size: u32,
    /// Rank in the root-info world (fault injection selects by it).
    pub world_rank: u32,
    /// Device the communicator moves data on.
    pub device: u32,
    /// HCCL's execution timeout (`None`: never).
    pub(super) timeout: Option<Duration>,
    pub(super) group: Mutex<Group>,
    /// The host-side group of link setup (its rounds are the consistency
    /// checks of first calls), bounded by the connect timeout.
    pub(super) link: Mutex<Group>,
    /// Descriptor word 0 of each collective whose links are set up.
    pub(super) linked: Mutex<Vec<u64>>,
    /// The error CQE `HcclGetCommAsyncError` reports first: `HCCL_E_REMOTE`
    /// or success.
    pub(super) async_error: AtomicI32,
    /// HCCL's inconsistent-op check found a collective whose ranks disagree
    /// (reported as `HCCL_E_PARA` when there is no error CQE).
    pub(super) inconsistent: AtomicBool,
    /// The first failure of a collective on the device (sticky).
    pub(super) failed: AtomicI32,
    /// `HcclCommDestroy` was called: the communicator's resources are gone,
    /// and a task recorded before (in a captured model) faults when it runs.
    pub(super) destroyed: AtomicBool,
}

impl std::fmt::Debug for SimComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HcclComm({} rank {}/{} on device {})", self.name, self.rank, self.size, self.device)
    }
}

impl SimComm {
    /// The link setup of the first call of collective `words[0]` on this
    /// communicator: every rank publishes its descriptor on the host-side
    /// link group, within the connect timeout, and `agree` checks them (so
    /// every rank refuses a mismatch alike). Later calls of the collective
    /// skip it, as in HCCL: hicann/hccl `src/common/inconsistent_check.cc:17-51`
    /// (v9.1.0, `NeedInconsistentCheck`: in op-base mode only a call without an
    /// existing context, i.e. the first of its kind, is checked) and
    /// `docs/zh/user_guide/fault_diagnosis/param_link_stage.md:34-38` ("only
    /// when an operator of a new type or algorithm is first called on a
    /// communicator ... cannot catch every inconsistent call"). A failed check
    /// leaves the collective without links: its next call sets up again.
    ///
    /// `before_wait` runs first: it lets the stream's queued work run (a
    /// device runs it while its host sets up links), since a peer's earlier
    /// collective may need it before that peer reaches this setup.
    pub(super) fn link_setup(
        &self,
        words: &[u64],
        agree: &dyn Fn(&[Vec<u64>]) -> SimResult<()>,
        before_wait: &dyn Fn(),
    ) -> SimResult<()> {
        let mut linked = self.linked.lock().unwrap_or_else(|e| e.into_inner());
        if linked.contains(&words[0]) {
            return Ok(());
        }
        before_wait();
        let mut g = self.link.lock().unwrap_or_else(|e| e.into_inner());
        g.publish(words, |_| Ok(()))?;
        g.complete(|round| agree(&round.descs))?;
        linked.push(words[0]);
        Ok(())
    }
}

/// Live communicators.
pub static COMMS: Table<SimComm> = Table::new("HcclComm", 0x5a7);

/// The communicator of handle `h`. A NULL one is HCCL_E_PTR, as HCCL's
/// `CHK_PTR_NULL(comm)` answers in every call that takes one (op_base.cc:
/// HongminTan/ACNC2025-HCCL
/// `src/domain/collective_communication/framework/op_base/src/op_base.cc:1462`
/// in `HcclAllReduce`, `:2726` `HcclGetRankSize`, `:2741` `HcclGetRankId`,
/// `:3490` `HcclGetCommAsyncError`); any other handle that is not a live
/// communicator, which HCCL would dereference, is the simulator's
/// HCCL_E_PARA.
pub fn comm(h: HcclComm) -> SimResult<Arc<SimComm>> {
    if h.is_null() {
        return Err(SimError::new(HCCL_E_PTR, "comm is NULL"));
    }
    COMMS.get(h as usize).ok_or_else(|| SimError::new(HCCL_E_PARA, format!("{h:p} is not a live HcclComm")))
}
